"""Seq2seq data (apt_ds.io.seq2seq): input/target rows (and CNN/DailyMail's and XSum's column
names) read from JSON lines, framed by a T5 tokenizer (</s> after each side) or, for one that ends
nothing with EOS (the tiny sentencepiece one), with EOS appended to the target; cut to the limits
and counted; bad rows refused in one line naming the row; labels padded with -100 in batches,
the older example kinds batched as before."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import T5Tokenizer

from apt_ds.io.data import IGNORE_INDEX, collate, load_records
from apt_ds.io.errors import DataError
from apt_ds.io.seq2seq import seq2seq_fields, tokenize_seq2seq

WORDS = ["summarize:", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "park"]


@pytest.fixture(scope="module")
def t5_tokenizer():
    """T5's framing (no BOS, </s> at the end, pad 0) over a small unigram vocabulary: a word a
    piece, then letters for anything else."""
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [("\u2581" + word, -1.0 - index / 100) for index, word in enumerate(WORDS)]
    vocab += [(char, -5.0) for char in "\u2581abcdefghijklmnopqrstuvwxyz.,:"]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def _records(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return load_records(path)


def _words(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_t5s_tokenizer_ends_each_side_with_its_eos(tmp_path, t5_tokenizer):
    ds = _records(tmp_path, [{"input": "summarize: the cat sat on the mat", "target": "a cat sat"}])
    data = tokenize_seq2seq(ds, t5_tokenizer, max_input_len=32, max_target_len=16)
    eos = t5_tokenizer.eos_token_id
    assert data.examples == [{"input_ids": _words(t5_tokenizer, "summarize: the cat sat on the mat") + [eos],
                              "target_ids": _words(t5_tokenizer, "a cat sat") + [eos]}]
    assert (data.cut_inputs, data.cut_targets) == (0, 0)


def test_a_tokenizer_without_eos_in_its_framing_gets_one_after_the_target(tmp_path, tokenizer):
    ds = _records(tmp_path, [{"input": "the quick brown fox", "target": "jumps over"}])
    example = tokenize_seq2seq(ds, tokenizer, max_input_len=32, max_target_len=16).examples[0]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert example["input_ids"] == [bos, *_words(tokenizer, "the quick brown fox")]  # its own framing, as written
    assert example["target_ids"] == [bos, *_words(tokenizer, "jumps over"), eos]


def test_sides_are_cut_to_their_limits_keeping_the_framing_and_counted(tmp_path, t5_tokenizer, tokenizer):
    rows = [{"input": "the cat sat on the mat", "target": "a dog ran to the park"},  # both cut
            {"input": "a cat", "target": "a dog ran to the park"},  # its target cut
            {"input": "a dog", "target": "a cat"}]  # nothing cut
    ds = _records(tmp_path, rows)
    data = tokenize_seq2seq(ds, t5_tokenizer, max_input_len=4, max_target_len=5, source="news.jsonl")
    eos = t5_tokenizer.eos_token_id
    assert data.examples[0] == {"input_ids": _words(t5_tokenizer, "the cat sat") + [eos],
                                "target_ids": _words(t5_tokenizer, "a dog ran to") + [eos]}
    assert data.examples[2]["input_ids"] == _words(t5_tokenizer, "a dog") + [eos]
    assert (data.cut_inputs, data.cut_targets) == (1, 2)
    appended = tokenize_seq2seq(ds, tokenizer, max_input_len=64, max_target_len=4)  # BOS, two tokens, the EOS added here
    assert all(len(example["target_ids"]) <= 4 and example["target_ids"][-1] == tokenizer.eos_token_id
               for example in appended.examples)
    assert appended.cut_inputs == 0 and appended.cut_targets == sum(len(_words(tokenizer, row["target"])) > 2 for row in rows)


@pytest.mark.parametrize("names", [("article", "highlights"), ("document", "summary")])
def test_cnn_dailymail_and_xsum_columns_read_as_input_and_target(tmp_path, t5_tokenizer, names):
    rows = [{names[0]: "the cat sat on the mat", names[1]: "a cat sat"}, {names[0]: "a dog ran", names[1]: "a dog"}]
    named = tokenize_seq2seq(_records(tmp_path, rows), t5_tokenizer, 32, 16)
    plain = tokenize_seq2seq(_records(tmp_path, [{"input": r[names[0]], "target": r[names[1]]} for r in rows], "plain.jsonl"),
                             t5_tokenizer, 32, 16)
    assert named.examples == plain.examples


def test_the_first_pair_a_data_set_has_is_read():
    assert seq2seq_fields(["document", "summary", "input", "target", "id"], "d") == ("input", "target")
    assert seq2seq_fields(["summary", "document", "article", "highlights"], "d") == ("article", "highlights")
    with pytest.raises(DataError, match=r"^d has no seq2seq rows: need 'input'/'target' text fields \(or CNN/DailyMail's "
                                        r"'article'/'highlights', XSum's 'document'/'summary'\); found fields \['input', 'output'\]$"):
        seq2seq_fields(["input", "output"], "d")


@pytest.mark.parametrize("rows, message", [
    ([{"input": "a cat", "target": "a"}, {"input": "a dog"}], r"row 2 has no 'target': every seq2seq row needs both texts"),
    ([{"input": "a cat", "target": "a"}, {"input": "  \n", "target": "a"}], r"row 2 has an empty 'input': nothing for the model to read"),
    ([{"input": "a cat", "target": ""}], r"row 1 has an empty 'target': nothing to learn or to score a generation against"),
    ([{"article": "a cat", "highlights": " "}], r"row 1 has an empty 'highlights'"),
    ([{"input": "a cat", "target": "a"}, {"input": None, "target": "b"}], r"row 2 has no 'input'"),
])
def test_bad_rows_are_refused_in_one_line_naming_the_row(tmp_path, t5_tokenizer, rows, message):
    with pytest.raises(DataError, match=message) as refused:
        tokenize_seq2seq(_records(tmp_path, rows), t5_tokenizer, 32, 16, source="news.jsonl")
    assert str(refused.value).startswith("news.jsonl: row ") and "\n" not in str(refused.value)


def test_fields_that_are_not_text_are_refused(tmp_path, t5_tokenizer):
    """Refused by the row when the rows are read as seq2seq rows (not at load: an LM data set may hold
    a `target` of numbers, test_an_lm_data_set_may_hold_...)."""
    import datasets

    with pytest.raises(DataError, match=r"^rows: row 1 has 'target' 3, which is not text$"):
        tokenize_seq2seq(_records(tmp_path, [{"input": "a cat", "target": 3}]), t5_tokenizer, 32, 16, source="rows")
    rows = datasets.Dataset.from_list([{"input": "a cat", "target": {"text": "a"}}])
    with pytest.raises(DataError, match=r"^rows: row 1 has 'target' \{\"text\": \"a\"\}, which is not text$"):
        tokenize_seq2seq(rows, t5_tokenizer, 32, 16, source="rows")


def test_a_target_the_tokenizer_drops_whole_is_refused(tmp_path, t5_tokenizer, monkeypatch):
    ds = _records(tmp_path, [{"input": "a cat", "target": "a"}, {"input": "a dog", "target": "the"}])
    real = type(t5_tokenizer).__call__

    def dropping_the(self, text, *args, **kwargs):  # a normaliser that removes a target's only word
        texts = [t.replace("the", "") if isinstance(t, str) else t for t in ([text] if isinstance(text, str) else text)]
        return real(self, texts[0] if isinstance(text, str) else texts, *args, **kwargs)

    monkeypatch.setattr(type(t5_tokenizer), "__call__", dropping_the)
    with pytest.raises(DataError, match=r"^news.jsonl: row 2's 'target' gives no tokens but the tokenizer's framing$"):
        tokenize_seq2seq(ds, t5_tokenizer, 32, 16, source="news.jsonl")


def test_limits_without_room_for_text_are_refused(tmp_path, t5_tokenizer, tokenizer):
    ds = _records(tmp_path, [{"input": "a cat", "target": "a"}])
    with pytest.raises(DataError, match=r"--max-seq-len 1 leaves no room for text: the tokenizer's framing takes 1 tokens; "
                                        r"give at least 2$"):
        tokenize_seq2seq(ds, t5_tokenizer, max_input_len=1, max_target_len=16, source="d")
    with pytest.raises(DataError, match=r"--max-target-len 2 leaves no room for text: the tokenizer's framing takes 2 tokens"):
        tokenize_seq2seq(ds, tokenizer, max_input_len=16, max_target_len=2, source="d")  # BOS and the EOS added here
    assert tokenize_seq2seq(ds, tokenizer, max_input_len=2, max_target_len=3).examples[0]["target_ids"][-1] == 2


def test_load_records_takes_seq2seq_rows_and_says_so_when_none_fit(tmp_path):
    for pair in (("input", "target"), ("article", "highlights"), ("document", "summary")):
        assert len(_records(tmp_path, [dict.fromkeys(pair, "x")], f"{pair[0]}.jsonl")) == 1
    with pytest.raises(DataError, match=r"has no usable rows: need .*, or, for ROUGE, 'input'/'target' \(CNN/DailyMail's "
                                        r"'article'/'highlights', XSum's 'document'/'summary'\); found fields \['target'\]$"):
        _records(tmp_path, [{"target": "x"}], "target_only.jsonl")
    assert _records(tmp_path, [{"text": "a", "summary": None}], "text.jsonl")["text"] == ["a"]  # other rows as before


def test_seq2seq_rows_given_to_training_say_what_they_are_for(tmp_path, tokenizer):
    from apt_ds.io.data import tokenize_dataset

    with pytest.raises(DataError, match=r"rows with article/highlights are seq2seq rows: they train a T5 --model, and "
                                        r"launch/evaluate.py scores them with ROUGE\)$"):
        tokenize_dataset(_records(tmp_path, [{"article": "a", "highlights": "b"}]), tokenizer, 32, pack=False, source="cnn")


def test_seq2seq_batches_pad_labels_to_the_longest_target_with_minus_100():
    examples = [{"input_ids": [5, 6, 7, 1], "target_ids": [8, 1]}, {"input_ids": [5, 1], "target_ids": [9, 10, 11, 1]}]
    batch = collate(examples, pad_id=0)
    assert set(batch) == {"input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "labels"}
    assert batch["input_ids"].tolist() == [[5, 6, 7, 1], [5, 1, 0, 0]]
    # the decoder reads each target shifted right behind the decoder start (T5's pad), as T5's _shift_right makes it
    assert batch["decoder_input_ids"].tolist() == [[0, 8, 0, 0], [0, 9, 10, 11]]
    assert batch["decoder_attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[8, 1, IGNORE_INDEX, IGNORE_INDEX], [9, 10, 11, 1]]
    assert collate(examples, pad_id=0, pad_to=6)["labels"].shape == (2, 4)  # pad_to is the inputs' length


def test_the_older_example_kinds_batch_as_before():
    causal = collate([{"input_ids": [5, 2], "labels": [IGNORE_INDEX, 2]}, {"input_ids": [5], "labels": [5]}], pad_id=2)
    assert causal["labels"].tolist() == [[IGNORE_INDEX, 2], [5, IGNORE_INDEX]] and causal["input_ids"].tolist() == [[5, 2], [5, 2]]
    classified = collate([{"input_ids": [1, 5, 2], "token_type_ids": [0, 0, 0], "label": 1}, {"input_ids": [1, 2], "label": 0,
                                                                                              "token_type_ids": [0, 0]}], pad_id=0)
    assert classified["labels"].tolist() == [1, 0] and classified["token_type_ids"].shape == (2, 3)


def test_a_seq2seq_batch_gives_t5_its_loss_over_the_targets(tmp_path, t5_tokenizer):
    """T5ForConditionalGeneration shifts the labels right into its decoder inputs (-100 read as
    pad): the batch's loss is the mean over each row's own target tokens."""
    from transformers import T5Config, T5ForConditionalGeneration

    rows = [{"input": "summarize: the cat sat on the mat", "target": "a cat"}, {"input": "a dog", "target": "a dog ran to park"}]
    examples = tokenize_seq2seq(_records(tmp_path, rows), t5_tokenizer, 32, 16).examples
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=len(t5_tokenizer), d_model=32, num_layers=2, num_heads=2, d_kv=8,
                                                d_ff=64, decoder_start_token_id=t5_tokenizer.pad_token_id)).eval()
    batch = collate(examples, pad_id=t5_tokenizer.pad_token_id)
    real = batch["decoder_attention_mask"].bool()  # as T5 makes them, where the target is (past it: never read)
    torch.testing.assert_close(batch["decoder_input_ids"][real], model._shift_right(batch["labels"])[real])
    with torch.no_grad():
        loss = model(**batch).loss
        one_by_one = [model(**collate([example], pad_id=0)).loss * len(example["target_ids"]) for example in examples]
    torch.testing.assert_close(loss, sum(one_by_one) / sum(len(e["target_ids"]) for e in examples))


def test_an_lm_data_set_may_hold_a_non_text_column_named_as_a_seq2seq_field(tmp_path):
    """Only the fields a causal LM reads are type-checked at load: a `target` of numbers beside `text`
    (a score, an id) is not a seq2seq row's target."""
    ds = _records(tmp_path, [{"text": "hello world", "target": 1}, {"text": "more text", "target": 2}])
    assert ds.column_names == ["text", "target"] and len(ds) == 2
