"""Sequence-classification data (apt_ds.io.classification): SST-2's single sentences and MNLI's
pairs read from JSON lines, framed by a BERT tokenizer ([CLS] A [SEP] B [SEP], token types) or,
for a tokenizer without cls/sep, as BOS A EOS B EOS; labels checked and counted; micro-batches
with (batch,) labels; bad rows refused in one line naming the row."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import BertTokenizerFast

from apt_ds.io.classification import tokenize_classification
from apt_ds.io.data import batches, collate, load_records
from apt_ds.io.errors import DataError

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "good", "bad", "film", "the", "is", "not", "cat", "sat"]


@pytest.fixture(scope="module")
def bert_tokenizer(tmp_path_factory):
    vocab = tmp_path_factory.mktemp("bert") / "vocab.txt"
    vocab.write_text("\n".join(WORDS) + "\n")
    return BertTokenizerFast(vocab_file=str(vocab))


def _records(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return load_records(path)


def _ids(tokenizer, *words):
    return tokenizer.convert_tokens_to_ids(list(words))


def test_single_sentences_frame_as_bert_does(tmp_path, bert_tokenizer):
    ds = _records(tmp_path, [{"sentence": "a good film", "label": 1}, {"sentence": "a bad film", "label": 0}])
    data = tokenize_classification(ds, bert_tokenizer, max_seq_len=16)
    assert data.num_labels == 2 and data.cut == 0
    assert data.examples[0] == {"input_ids": _ids(bert_tokenizer, "[CLS]", "a", "good", "film", "[SEP]"),
                                "token_type_ids": [0] * 5, "label": 1}


def test_sentence_pairs_get_token_types_and_are_cut_longest_first(tmp_path, bert_tokenizer):
    rows = [{"sentence1": "the cat sat", "sentence2": "the cat is not a good cat", "label": 2},
            {"sentence1": "a film", "sentence2": "a film", "label": 0}]
    data = tokenize_classification(_records(tmp_path, rows), bert_tokenizer, max_seq_len=9)
    first = data.examples[0]
    assert first["input_ids"] == _ids(bert_tokenizer, "[CLS]", "the", "cat", "sat", "[SEP]", "the", "cat", "is", "[SEP]")
    assert first["token_type_ids"] == [0] * 5 + [1] * 4
    assert (data.num_labels, data.cut) == (3, 1)


@pytest.mark.parametrize("first, second", [("premise", "hypothesis"), ("question1", "question2"), ("question", "sentence")])
def test_glues_own_pair_columns_read_as_sentence1_and_sentence2(tmp_path, bert_tokenizer, first, second):
    """MNLI, QQP and QNLI as the Hub saves them: their pair columns, QNLI's `sentence` its second text."""
    rows = [{first: "the cat sat", second: "on the mat", "label": 1}, {first: "a film", second: "a bad film", "label": 0}]
    named = tokenize_classification(_records(tmp_path, rows), bert_tokenizer, max_seq_len=16)
    plain = tokenize_classification(_records(tmp_path, [{"sentence1": r[first], "sentence2": r[second], "label": r["label"]}
                                                        for r in rows], "plain.jsonl"), bert_tokenizer, max_seq_len=16)
    assert named.examples == plain.examples and 1 in named.examples[0]["token_type_ids"]


def test_a_pair_field_that_is_not_text_is_refused_naming_its_row(tmp_path, bert_tokenizer):
    rows = [{"premise": "a cat", "hypothesis": "a dog", "label": 0}, {"premise": "a cat", "hypothesis": 5, "label": 1}]
    with pytest.raises(DataError, match=r"^pairs.jsonl: row 2 has 'hypothesis' 5, which is not text$"):
        tokenize_classification(_records(tmp_path, [{**r, "hypothesis": str(r["hypothesis"])} if r["label"] == 0 else r
                                                    for r in rows], "mixed.jsonl"), bert_tokenizer, 16, source="pairs.jsonl")


@pytest.mark.parametrize("rows, message", [
    ([{"sentence": "a good film", "label": 1}, {"sentence": "  ", "label": 0}], "row 2 has an empty 'sentence': nothing to classify"),
    ([{"sentence": "a good film", "label": 1}, {"label": 0}], "row 2 has no 'sentence': every row needs 'sentence'"),
    ([{"sentence1": "a", "sentence2": "b", "label": 1}, {"sentence1": "c", "label": 0}],
     "row 2 has no 'sentence2': every row needs 'sentence1' and 'sentence2'"),
])
def test_a_row_without_its_text_is_refused_naming_it(tmp_path, bert_tokenizer, rows, message):
    """Trained or scored, it would be the framing alone with a label (accuracy 1.0 was seen on one)."""
    with pytest.raises(DataError, match=f"^data.jsonl: {message}"):
        tokenize_classification(_records(tmp_path, rows), bert_tokenizer, max_seq_len=16, source="data.jsonl")


def test_a_tokenizer_without_cls_frames_with_bos_and_eos(tmp_path, tokenizer):
    rows = [{"sentence1": "the quick brown fox", "sentence2": "jumps", "label": 1}, {"text": "x", "label": 0}]
    ds = _records(tmp_path, [{"sentence1": r.get("sentence1", "x"), "sentence2": r.get("sentence2", "y"),
                              "label": r["label"]} for r in rows])
    data = tokenize_classification(ds, tokenizer, max_seq_len=64)
    ids = data.examples[0]["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id and ids.count(tokenizer.eos_token_id) == 2
    assert "token_type_ids" not in data.examples[0]
    short = tokenize_classification(ds, tokenizer, max_seq_len=5).examples[0]["input_ids"]
    assert len(short) == 5 and short.count(tokenizer.eos_token_id) == 2


def test_micro_batches_carry_one_label_a_row(tmp_path, bert_tokenizer):
    ds = _records(tmp_path, [{"sentence": "a good film", "label": 1}, {"sentence": "bad", "label": 0},
                             {"sentence": "the film is not good", "label": 0}])
    examples = tokenize_classification(ds, bert_tokenizer, max_seq_len=16).examples
    batch = collate(examples[:2], pad_id=0)
    assert batch["labels"].tolist() == [1, 0] and batch["input_ids"].shape == (2, 5)
    assert batch["attention_mask"][1].tolist() == [1, 1, 1, 0, 0] and batch["token_type_ids"].shape == (2, 5)
    stream = batches(examples, micro_batch_size=2, seed=0)
    assert all(next(stream)["labels"].shape == (2,) for _ in range(3))


@pytest.mark.parametrize("rows, message", [
    ([{"sentence": "a", "label": -1}, {"sentence": "b", "label": 0}], "row 1 has label -1: a negative label marks an unlabelled row"),
    ([{"sentence": "a", "label": 1.5}, {"sentence": "b", "label": 0}], "row 1 has label 1.5: labels must be integers"),
    # datasets reads the column as decimals because of row 2: the message says why row 1 shows 1.0
    ([{"sentence": "a", "label": 1}, {"sentence": "b", "label": 0.0}], r"row 1 has label 1.0: .* any decimal label, e.g. 0.0"),
    ([{"sentence": "a", "label": 0}, {"sentence": "b", "label": 0}], "every row has label 0"),
])
def test_bad_labels_are_refused_naming_the_row(tmp_path, bert_tokenizer, rows, message):
    with pytest.raises(DataError, match=message):
        tokenize_classification(_records(tmp_path, rows), bert_tokenizer, max_seq_len=16, source="data.jsonl")


def test_held_out_labels_must_fit_the_classifier(tmp_path, bert_tokenizer):
    ds = _records(tmp_path, [{"sentence": "a", "label": 0}, {"sentence": "b", "label": 3}])
    with pytest.raises(DataError, match=r"row 2 has label 3, but the classifier has 2 classes \(labels 0\.\.1\)"):
        tokenize_classification(ds, bert_tokenizer, max_seq_len=16, source="eval", num_labels=2)


def test_a_text_file_without_labels_is_not_classification_data(tmp_path, bert_tokenizer):
    ds = _records(tmp_path, [{"text": "a good film"}])
    with pytest.raises(DataError, match=r"has no 'label' field: a classifier needs a 'sentence' or 'text' field"):
        tokenize_classification(ds, bert_tokenizer, max_seq_len=16, source="data.jsonl")
    with pytest.raises(DataError, match=r"has no usable rows: need .*'sentence' \(or a pair: 'sentence1'/'sentence2', GLUE's 'premise'/'hypothesis', \.\.\.\) with an integer 'label'"):
        _records(tmp_path, [{"sentence2": "x", "label": 1}], name="odd.jsonl")


def test_a_classification_batch_trains_an_encoder_through_the_supervised_forward(tmp_path, bert_tokenizer):
    """The collated batch is what the training forward takes: (batch,) labels give the mean
    cross-entropy over rows, as BertForSequenceClassification computes it."""
    from transformers import BertConfig, BertForSequenceClassification

    from apt_ds.training.forward import supervised_forward, supervised_token_count

    ds = _records(tmp_path, [{"sentence": "a good film", "label": 1}, {"sentence": "the cat", "label": 0},
                             {"sentence": "not good", "label": 2}])
    batch = collate(tokenize_classification(ds, bert_tokenizer, max_seq_len=16).examples, pad_id=0)
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=48, num_labels=3)).eval()
    _, loss, supervised = supervised_forward(model, batch)
    assert supervised.tolist() == [True] * 3 and supervised_token_count(batch) == 3
    torch.testing.assert_close(loss, model(**batch).loss)


def test_a_max_seq_len_without_room_for_the_text_is_refused(tmp_path, bert_tokenizer):
    ds = _records(tmp_path, [{"sentence1": "a", "sentence2": "b", "label": 1}, {"sentence1": "c", "sentence2": "d", "label": 0}])
    with pytest.raises(DataError, match=r"--max-seq-len 4 leaves no room for the text: the classifier's framing takes 3 "
                                        r"tokens; give at least 5"):
        tokenize_classification(ds, bert_tokenizer, max_seq_len=4, source="pairs.jsonl")
    assert len(tokenize_classification(ds, bert_tokenizer, max_seq_len=5).examples[0]["input_ids"]) == 5


def test_classifier_rows_given_to_a_causal_lm_say_what_they_are_for(tmp_path, tokenizer):
    from apt_ds.io.data import tokenize_dataset

    ds = _records(tmp_path, [{"sentence": "a good film", "label": 1}])
    with pytest.raises(DataError, match=r"rows with 'sentence' and 'label' train an encoder's classifier: give a BERT"):
        tokenize_dataset(ds, tokenizer, 32, pack=False, source="sst.jsonl")
