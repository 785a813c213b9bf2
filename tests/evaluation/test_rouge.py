"""ROUGE on seq2seq rows (apt_ds.evaluation.rouge, `launch/evaluate.py MODEL --data FILE`): the
scores of known strings; end to end on a tiny random T5 and a tiny random LLaMA saved with the
tests' tokenizer, whose report must equal the ROUGE of the model's own one-row greedy generations
(batching and padding change nothing; a causal LM is scored on its continuation only); the
classifier / causal-LM mix-ups refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama

from apt_ds.cli.evaluate import main
from apt_ds.evaluation.rouge import ROUGE_TYPES, rouge_scores

ROWS = [{"input": "summarize: the quick brown fox jumps over the lazy dog", "target": "the fox jumps"},
        {"input": "Question: is it? Answer:", "target": "yes it is"},
        {"input": "the lazy dog sleeps", "target": "a dog sleeps\nit is lazy"},
        {"input": "brown fox", "target": "the quick brown fox"},
        {"input": "summarize: a fox and a dog", "target": "two animals"}]


def test_a_perfect_prediction_scores_100_and_a_disjoint_one_0():
    perfect = rouge_scores(["the cat sat on the mat\nit slept"], ["the cat sat on the mat\nit slept"])
    assert perfect == dict.fromkeys(ROUGE_TYPES, 100.0)
    assert rouge_scores(["a dog ran"], ["the cat sat"]) == dict.fromkeys(ROUGE_TYPES, 0.0)
    assert rouge_scores(["", "the cat sat"], ["the cat", "the cat sat"]) == dict.fromkeys(ROUGE_TYPES, 50.0)  # the mean


def test_scores_are_f1_with_the_stemmer_and_rougelsum_splits_at_newlines():
    half = rouge_scores(["the cat"], ["the cat sat on"])  # precision 1, recall 1/2
    assert half["rouge1"] == pytest.approx(100 * 2 / 3) and half["rouge2"] == pytest.approx(100 * 2 / 4)
    assert rouge_scores(["cats running"], ["cat runs"])["rouge1"] == 100.0  # Porter stems: cat, run
    swapped = rouge_scores(["b c d\na x y"], ["a x y\nb c d"])
    assert swapped["rougeLsum"] == 100.0 and swapped["rougeL"] < 100.0  # sentence by sentence vs one sequence


def _save(model, tokenizer, directory):
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """{"t5": a tiny random T5ForConditionalGeneration, "llama": a tiny random LLaMA, "data": ROWS}."""
    from transformers import T5Config, T5ForConditionalGeneration

    root = tmp_path_factory.mktemp("rouge")
    torch.manual_seed(0)
    # initializer_factor 3: at transformers' default scale a random T5 emits only pad tokens (empty texts)
    t5 = T5ForConditionalGeneration(T5Config(
        vocab_size=len(tokenizer), d_model=32, num_layers=2, num_heads=2, d_kv=8, d_ff=64, initializer_factor=3.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id))
    (root / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return {"t5": _save(t5.eval(), tokenizer, root / "t5"), "llama": _save(tiny_llama("gqa", vocab=len(tokenizer)), tokenizer,
                                                                          root / "llama"), "data": str(root / "rows.jsonl")}


def _one_row_generations(directory, tokenizer, new_tokens):
    """Each row alone (no padding), as plainly as transformers generates it: the text after the input."""
    from apt_ds.evaluation.rouge import load_generator

    model = load_generator(directory).eval()
    texts = []
    for row in ROWS:
        ids = torch.tensor([tokenizer(row["input"])["input_ids"]])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
        texts.append(tokenizer.decode(out[0] if model.config.is_encoder_decoder else out[0, ids.shape[1]:],
                                      skip_special_tokens=True))
    return texts


@pytest.mark.parametrize("kind", ["t5", "llama"])
def test_the_evaluate_command_reports_the_rouge_of_the_models_generations(saved, tokenizer, tmp_path, capsys, kind):
    """Targets made of what the model writes for each row alone: random weights would otherwise score
    0 everywhere, and a batch whose padding changed a row's text would go unseen."""
    alone = _one_row_generations(saved[kind], tokenizer, 6)
    targets = [text if text.strip() else row["target"] for text, row in zip(alone, ROWS)]
    data = tmp_path / "own.jsonl"
    data.write_text("".join(json.dumps({"input": row["input"], "target": target}) + "\n" for row, target in zip(ROWS, targets)))
    out = tmp_path / "rouge.json"
    assert main([saved[kind], "--data", str(data), "--max-new-tokens", "6", "--batch-size", "2", "--device", "cpu",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    scores = report["results"]["rouge"]
    assert report["apt_ds"] == {"kind": "ROUGE"} and scores["rows"] == len(ROWS) and scores["data"] == str(data)
    assert all(0.0 <= scores[name] <= 100.0 for name in ROUGE_TYPES)
    assert (scores["generator"], scores["decoding"], scores["max_new_tokens"], scores["num_beams"]) == \
        ("encoder-decoder" if kind == "t5" else "causal LM", "greedy", 6, 1)
    expected = rouge_scores(alone, targets)
    assert expected["rouge1"] > 50.0  # most rows are scored against their own text
    assert {name: scores[name] for name in ROUGE_TYPES} == pytest.approx(expected)
    printed = capsys.readouterr().out
    assert "| rouge1 | rouge2 | rougeL | rougeLsum |" in printed and f"| {len(ROWS)} | {scores['rouge1']:.2f} |" in printed


def test_a_causal_lms_own_input_is_not_scored(saved, tmp_path):
    """Rows whose target is their input: had the prompt been scored with the continuation, ROUGE-1
    recall would be 1 whatever the model writes."""
    echo = tmp_path / "echo.jsonl"
    echo.write_text("".join(json.dumps({"input": row["input"], "target": row["input"]}) + "\n" for row in ROWS))
    assert main([saved["llama"], "--data", str(echo), "--max-new-tokens", "4", "--limit", "2", "--num-beams", "2",
                 "--device", "cpu", "--out", str(tmp_path / "r.json")]) == 0
    scores = json.loads((tmp_path / "r.json").read_text())["results"]["rouge"]
    assert scores["rows"] == 2 and scores["decoding"] == "beam search" and scores["rouge1"] < 50.0


def test_a_causal_lms_input_leaves_room_for_the_generation_within_its_positions(saved, tokenizer, tmp_path, capsys):
    """The tiny LLaMA knows 128 positions: 108 new tokens leave 20 for an input, and 127 none."""
    out = tmp_path / "r.json"
    assert main([saved["llama"], "--data", saved["data"], "--max-new-tokens", "108", "--limit", "2", "--device", "cpu",
                 "--out", str(out)]) == 0
    scores = json.loads(out.read_text())["results"]["rouge"]
    lengths = [len(tokenizer(row["input"])["input_ids"]) for row in ROWS[:2]]
    assert lengths[0] > 20 >= lengths[1]  # the first row's input is cut, the second fits
    assert (scores["max_input_len"], scores["inputs_cut"]) == (20, 1)
    assert "note: 1 of 2 inputs cut to their first 20 tokens" in capsys.readouterr().err
    assert main([saved["llama"], "--data", saved["data"], "--max-new-tokens", "127", "--device", "cpu",
                 "--out", str(tmp_path / "none.json")]) == 2
    assert "--max-new-tokens 127 leaves no room for the input: " in capsys.readouterr().err


def test_classifier_rows_for_a_generator_and_seq2seq_rows_for_a_classifier_are_refused(saved, tmp_path, capsys):
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    labelled = tmp_path / "sst.jsonl"
    labelled.write_text('{"sentence": "a good film", "label": 1}\n{"sentence": "a bad film", "label": 0}\n')
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "film"]) + "\n")
    bert = BertForSequenceClassification(BertConfig(vocab_size=7, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                    intermediate_size=32, num_labels=2))
    classifier = _save(bert, BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")), tmp_path / "bert")
    cases = [([saved["llama"], "--data", str(labelled)], "--data scores a sequence classifier (BERT, RoBERTa); "
              f"{saved['llama']} is not one: give --tasks for a causal LM, or seq2seq rows ('input'/'target')"),
             ([classifier, "--data", saved["data"]], f"--data {saved['data']} holds seq2seq rows (input/target), whose ROUGE "
              f"scores a model that generates (T5, a causal LM); {classifier} is a sequence classifier"),
             (["tiny", "--data", saved["data"]], "--model tiny is a built-in random model without a tokenizer")]
    for args, message in cases:
        capsys.readouterr()
        assert main([*args, "--device", "cpu", "--out", str(tmp_path / "r.json")]) == 2
        errors = capsys.readouterr().err.strip().splitlines()
        assert len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], errors
    assert not (tmp_path / "r.json").exists()


def test_a_bad_seq2seq_row_is_one_line(saved, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "a", "target": "b"}\n{"input": "c", "target": "  "}\n')
    assert main([saved["t5"], "--data", str(bad), "--device", "cpu", "--out", str(tmp_path / "r.json")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [f"error: {bad}: row 2 has an empty 'target': nothing to learn or to score a generation against"]


def test_a_t5_with_a_deeper_decoder_generates_without_the_cache():
    """transformers 5.25 sizes T5's cache for num_layers: generating with it fails (an IndexError)
    for a decoder of another depth, which apt-ds trains and exports; ROUGE's generation then runs
    without the cache, the same tokens as step-by-step greedy decoding."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from test_t5 import tiny_t5

    from apt_ds.evaluation.rouge import RougeRequest, generate

    model = tiny_t5("v1.1", num_layers=2, num_decoder_layers=3)
    decoded = []
    tokenizer = SimpleNamespace(pad_token_id=0, batch_decode=lambda out, skip_special_tokens: decoded.append(out) or [""] * len(out))
    inputs = [[5, 6, 7, 8, 1], [9, 10, 1]]
    generate(model, tokenizer, inputs, RougeRequest(model="t5", data="rows", max_new_tokens=4), torch.device("cpu"))
    with torch.no_grad():  # greedy, one token at a time, for the first row
        ids, tokens = torch.tensor([inputs[0]]), torch.zeros(1, 1, dtype=torch.long)
        for _ in range(4):
            logits = model(input_ids=ids, decoder_input_ids=tokens, use_cache=False).logits
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    generated = decoded[0][0]
    assert generated[: tokens.shape[1]].tolist() == tokens[0, : generated.shape[0]].tolist()


def test_a_run_directory_given_to_evaluate_is_told_to_export_first(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"apt_config": {}, "train_config": {}}))
    with pytest.raises(SystemExit) as exit_:  # an argument error, as argparse exits on them
        main([str(run), "--data", "rows.jsonl", "--out", str(tmp_path / "r.json")])
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and "is an apt-ds run, not a model: export it first (launch/export.py" in errors[0], errors
    assert not (tmp_path / "r.json").exists()
