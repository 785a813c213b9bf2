"""A diverged run through the command lines: train stops in one line with exit 2 and keeps its last
good checkpoint (resumable), and export and evaluate refuse NaN weights in one line naming the
tensor, writing nothing (docs/RELIABILITY.md, "A run that diverges")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import RUN_FLAGS, tiny_llama, tree_digest
from safetensors.torch import load_file, save_file

from apt_ds.cli.evaluate import main as evaluate_main
from apt_ds.cli.export import main as export_main
from apt_ds.cli.train import main as train_main

DIVERGING = [*RUN_FLAGS[:-2], "--steps", "12", "--lr", "1e6", "--data", "data.jsonl"]


def _error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines()
            if line.strip() and not line.startswith(("apt:", "Loading weights", "data: "))]  # progress bars, the data line


def _step(run: Path) -> int:
    return json.loads((run / "checkpoint" / "apt_state.json").read_text())["step"]


def test_a_diverging_run_stops_in_one_line_and_its_checkpoint_resumes(in_tmp, capsys):
    assert train_main([*DIVERGING, "--out", "run"]) == 2
    lines = _error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: the run diverged: steps ")
    assert "--lr 1e+06" in lines[0] and "the last good checkpoint, step 4 in run/checkpoint, is kept" in lines[0]
    assert _step(in_tmp / "run") == 4
    records = [json.loads(line) for line in (in_tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(bool(r.get("skipped")) for r in records) == 3 and not any(r.get("final") for r in records)
    kept = sum(bool(r.get("skipped")) for r in records if r["step"] <= 4)  # the resume redoes the steps after 4
    # --resume continues from the kept checkpoint (the same learning rate diverges again, and says so)
    # (its weights, from the update before the first NaN, fit some batches: it may checkpoint again first)
    assert train_main([*DIVERGING, "--out", "run", "--resume"]) == 2
    lines = _error_lines(capsys)
    assert len(lines) == 1 and "the run diverged" in lines[0] and _step(in_tmp / "run") >= 4
    records = [json.loads(line) for line in (in_tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(bool(r.get("skipped")) for r in records) >= kept + 3 and all(r.get("skipped") for r in records[-3:])
    files = sorted((in_tmp / "run" / "checkpoint").rglob("*.safetensors"))
    assert all(torch.isfinite(t).all() for f in files for t in load_file(str(f)).values() if t.is_floating_point())


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tokenizer):
    """A finished run on a safetensors base (the streaming export) and one on the built-in model (in memory)."""
    root = tmp_path_factory.mktemp("diverged")
    base = root / "base"
    tiny_llama("gqa", vocab=len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(str(base))
    flags = ["--steps", "8", "--max-seq-len", "32", "--micro-batch-size", "2", "--target-density", "0.6"]
    assert train_main([*flags, "--model", str(base), "--out", str(root / "streamed")]) == 0
    assert train_main([*flags, "--out", str(root / "in_memory")]) == 0
    return root


def _poisoned(run: Path, tmp_path: Path, value: float) -> tuple[Path, str]:
    """A copy of `run` whose export copy of one adapter holds `value` (an apt-ds run from before NaN
    checkpoints were refused, or a file damaged since)."""
    copy = tmp_path / run.name
    shutil.copytree(run, copy)
    path = copy / "checkpoint" / "trainable.safetensors"
    tensors = load_file(str(path))
    name = sorted(n for n in tensors if n.endswith("q_proj.lora_B"))[0]
    tensors[name] = torch.full_like(tensors[name], value)
    save_file(tensors, str(path))
    return copy, name.removesuffix(".lora_B") + ".weight"


@pytest.mark.parametrize("run", ["streamed", "in_memory"])
@pytest.mark.parametrize("format", ["hf", "gguf"])
def test_export_refuses_a_nan_weight_in_one_line_and_writes_nothing(finished, tmp_path, capsys, run, format):
    copy, tensor = _poisoned(finished / run, tmp_path, float("nan"))
    digest = tree_digest(tmp_path)
    assert export_main([str(copy), "--out", str(tmp_path / "out"), "--format", format]) == 2
    lines = _error_lines(capsys)
    named = tensor if format == "hf" else f"blk.{tensor.split('.')[2]}.attn_q.weight"
    assert len(lines) == 1 and lines[0].startswith(f"error: export refused: {named} (")
    assert "is not finite" in lines[0] and "--lr" in lines[0]
    assert tree_digest(tmp_path) == digest  # nothing created: no out, no temporary left


def test_export_refuses_values_that_overflow_fp16_and_names_the_dtypes_that_fit(finished, tmp_path, capsys):
    copy, tensor = _poisoned(finished / "streamed", tmp_path, 1e7)  # B @ A * scale: far past fp16's 65504, not bf16's range
    assert export_main([str(copy), "--out", str(tmp_path / "out"), "--dtype", "fp16"]) == 2
    lines = _error_lines(capsys)
    assert len(lines) == 1 and f"export refused: {tensor} does not fit --dtype fp16" in lines[0]
    assert "export with --dtype bf16 or fp32" in lines[0] and not (tmp_path / "out").exists()
    assert export_main([str(copy), "--out", str(tmp_path / "out"), "--dtype", "bf16"]) == 0


@pytest.mark.parametrize("model", ["base", "export"])  # the harness's own loader; apt-ds's for a per-layer export
def test_evaluate_refuses_a_model_with_a_nan_weight(finished, tmp_path, capsys, model):
    path = tmp_path / model
    if model == "export":
        assert export_main([str(finished / "streamed"), "--out", str(path)]) == 0
        assert "apt_layer_shapes" in json.loads((path / "config.json").read_text())
        capsys.readouterr()
    else:
        shutil.copytree(finished / "base", path)
    weights = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name][0, 0] = float("inf")
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "results.json"
    assert evaluate_main([str(path), "--tasks", "sst2", "--limit", "2", "--device", "cpu", "--out", str(out)]) == 2
    lines = _error_lines(capsys)
    assert len(lines) == 1 and f"evaluate refused: {path.resolve()}: {name} (1 of " in lines[0]
    assert "cannot be scored" in lines[0] and not out.exists()
