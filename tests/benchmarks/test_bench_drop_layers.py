"""benchmarks/drop_layers.py: a stock-loadable copy of a model without its least influential layers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from apt_ds.io.modeling import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import drop_layers


@pytest.fixture
def model_and_task(tmp_path, tokenizer):
    model_dir, task_dir = tmp_path / "tiny", tmp_path / "task"
    build_tiny_model(vocab_size=len(tokenizer), seed=0).save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    task_dir.mkdir()
    rows = [{"prompt": f"the fox {i} jumps\nAnswer:\n", "completion": "yes" if i % 2 else "no"} for i in range(6)]
    (task_dir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, task_dir


def test_the_copy_runs_the_kept_layers_of_the_original(model_and_task, tmp_path):
    model_dir, task_dir = model_and_task
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = original.config.num_hidden_layers
    out = tmp_path / "dropped"
    result = drop_layers.main(["--model", str(model_dir), "--task", str(task_dir), "--drop", "1", "--out", str(out)])
    (dropped,) = result["dropped"]
    assert dropped == result["least_influential_first"][0]
    assert result["influence"][dropped] == min(result["influence"])
    assert result["target_density"] == pytest.approx(0.7 * layers / (layers - 1), abs=1e-4)

    copy = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()  # stock transformers
    assert copy.config.num_hidden_layers == layers - 1
    # the same network as the original with that layer skipped
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    skipped = torch.nn.ModuleList(layer for i, layer in enumerate(original.model.layers) if i != dropped)
    original.model.layers = skipped
    original.config.num_hidden_layers = layers - 1
    with torch.no_grad():
        torch.testing.assert_close(copy(ids).logits, original(ids).logits)
    assert not out.with_name(out.name + ".partial").exists()


def test_influence_is_one_minus_the_cosine_of_each_layers_input_and_output(model_and_task):
    model_dir, _ = model_and_task
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():  # a trained norm's per-channel weights (a fresh one's are all 1: no turn)
        model.model.norm.weight.copy_(torch.rand(model.config.hidden_size, generator=torch.Generator().manual_seed(0)) + 0.1)
    text = "the fox 3 jumps\nAnswer:\nyes"
    hooks_before = [dict(layer._forward_hooks) for layer in model.model.layers]
    influence = drop_layers.block_influence(model, tokenizer, [text])
    assert [dict(layer._forward_hooks) for layer in model.model.layers] == hooks_before  # its hooks are gone
    with torch.no_grad():
        states = model(**tokenizer(text, return_tensors="pt"), output_hidden_states=True).hidden_states
    cosine = torch.nn.functional.cosine_similarity
    for index in range(len(influence) - 1):  # the hidden states the model reports, before the final norm
        expected = (1 - cosine(states[index][0], states[index + 1][0], dim=-1)).mean().item()
        assert influence[index] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    # the last layer's reported state has the final norm applied; the hooks read the layer's own output
    normed = (1 - cosine(states[-2][0], states[-1][0], dim=-1)).mean().item()
    assert influence[-1] != pytest.approx(normed, rel=1e-3)


@pytest.mark.parametrize("argv, message", [
    ([], "one of --drop"),
    (["--drop", "1", "--layers", "0"], "one of --drop"),
    (["--layers", "0,0"], "distinct"),
    (["--layers", "99"], "distinct"),
    (["--drop", "1", "--density", "0.99"], "already cuts below"),
    (["--drop", "0"], "--drop must be"),
    (["--layers", "1,x"], "comma-separated"),
    (["--drop", "1", "--rows", "0"], "--rows must be"),
    (["--drop", "1", "--density", "1.5"], "--density in"),
])
def test_bad_choices_are_one_line_errors_and_write_nothing(model_and_task, tmp_path, capsys, argv, message):
    model_dir, task_dir = model_and_task
    out = tmp_path / "dropped"
    with pytest.raises(SystemExit) as stop:
        drop_layers.main(["--model", str(model_dir), "--task", str(task_dir), "--out", str(out), *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists() and not out.with_name("dropped.partial").exists()


def test_an_empty_task_or_a_leftover_staging_directory_is_refused(model_and_task, tmp_path, capsys):
    model_dir, task_dir = model_and_task
    out = tmp_path / "dropped"
    (task_dir / "train.jsonl").write_text("\n")
    with pytest.raises(SystemExit):
        drop_layers.main(["--model", str(model_dir), "--task", str(task_dir), "--drop", "1", "--out", str(out)])
    assert "no rows" in capsys.readouterr().err and not out.exists()
    out.with_name("dropped.partial").mkdir()
    with pytest.raises(SystemExit):
        drop_layers.main(["--model", str(model_dir), "--task", str(task_dir), "--drop", "1", "--out", str(out)])
    assert "dropped.partial" in capsys.readouterr().err
