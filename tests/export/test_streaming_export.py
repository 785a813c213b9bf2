"""Streaming export (apt_ds.export.streaming): a run on a safetensors base model is exported tensor
by tensor, into exactly the files the in-memory export writes, without building the model."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from safetensors.torch import load_file, save_file

from apt_ds.cli.train import main as train_main
from apt_ds.export import streaming as streaming_export
from apt_ds.export.merge import export_run
from apt_ds.io.checkpoint import CheckpointError
from apt_ds.io.fingerprint import file_fingerprint, model_fingerprint
from apt_ds.io.modeling import load_model

FAST = ["--steps", "12", "--max-seq-len", "32", "--target-density", "0.5", "--micro-batch-size", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer):
    """Runs on safetensors base models: GQA untied (non-uniform and uniform), tied embeddings."""
    root = tmp_path_factory.mktemp("stream")
    made = {}
    for name, kind, extra in (("gqa", "gqa", []), ("uniform", "gqa", ["--uniform"]), ("tied", "gqa_tied", [])):
        base = root / f"base_{kind}"
        if not base.exists():
            tiny_llama(kind, vocab=len(tokenizer)).save_pretrained(base)
            tokenizer.save_pretrained(str(base))
        assert train_main([*FAST, "--model", str(base), *extra, "--out", str(root / name)]) == 0
        made[name] = root / name
    return made


def _same_export(a: Path, b: Path) -> None:
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        if name.endswith(".safetensors"):
            left, right = load_file(str(a / name)), load_file(str(b / name))
            assert left.keys() == right.keys()
            for key in left:
                assert left[key].dtype == right[key].dtype and torch.equal(left[key], right[key]), (name, key)
        else:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("run", ["gqa", "uniform", "tied"])
@pytest.mark.parametrize("dtype, shard", [("fp32", "5GB"), ("bf16", "60KB")])
def test_streaming_export_writes_the_in_memory_export(runs, tmp_path, run, dtype, shard):
    streamed = export_run(runs[run], tmp_path / "streamed", dtype=dtype, max_shard_size=shard)
    in_memory = export_run(runs[run], tmp_path / "memory", dtype=dtype, max_shard_size=shard, streaming=False)
    assert streamed == {**in_memory}
    assert streamed["final"]["block_params"] < streamed["original"]["block_params"]
    _same_export(tmp_path / "streamed", tmp_path / "memory")
    sharded = (tmp_path / "streamed" / "model.safetensors.index.json").is_file()
    assert sharded == (shard == "60KB")


def test_fractional_masks_are_folded_as_in_memory(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["gqa"], run)
    masks_path = run / "checkpoint" / "masks.safetensors"
    masks = load_file(str(masks_path))
    masks["kv_group.0"][0] = 0.5  # a checkpoint taken while masks decay
    masks["ffn_neuron.1"][:3] = torch.tensor([0.25, 0.0, 0.75])
    save_file(masks, str(masks_path))
    export_run(run, tmp_path / "streamed")
    export_run(run, tmp_path / "memory", streaming=False)
    _same_export(tmp_path / "streamed", tmp_path / "memory")


def test_uniform_sharded_export_loads_in_stock_transformers(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    export_run(runs["uniform"], tmp_path / "e", max_shard_size="60KB")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "e"))
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_no_model_is_built_and_one_shard_is_held(runs, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the streaming export built or loaded a whole model")

    monkeypatch.setattr("apt_ds.export.merge.load_model", refuse)
    monkeypatch.setattr("transformers.LlamaForCausalLM.__init__", refuse)
    held = []
    add = streaming_export.ShardWriter.add

    def recording_add(self, name, tensor):
        add(self, name, tensor)
        held.append(self.current_size)

    monkeypatch.setattr(streaming_export.ShardWriter, "add", recording_add)
    export_run(runs["gqa"], tmp_path / "e", max_shard_size="60KB")
    assert held and max(held) <= 60_000  # never more than one shard's tensors in memory


def test_fingerprint_read_from_files_equals_the_loaded_models(runs):
    for kind in ("gqa", "gqa_tied"):
        base = runs["gqa"].parent / f"base_{kind}"
        assert file_fingerprint(base) == model_fingerprint(load_model(base))


def test_fingerprint_reads_chunks_and_keeps_its_values(runs, monkeypatch):
    """Read in chunks (no whole tensor, no float64 copy of one), the fingerprint is the one that
    whole-tensor sums gave, so runs recorded before still resume."""
    import hashlib

    from apt_ds.io import fingerprint as fingerprints
    from apt_ds.io.weights import SafetensorsWeights

    base = runs["gqa"].parent / "base_gqa"
    model = load_model(base)
    sums = []
    for name, param in sorted(model.named_parameters()):
        flat = param.detach().reshape(-1)
        sums.append(f"{name}:{float(flat[:: max(1, flat.numel() // 4096)].double().abs().sum()):.6e}")
    whole_tensor_sums = {"weights_sha": hashlib.sha256("|".join(sums).encode()).hexdigest()[:16],
                         "embedding_sum": round(float(model.get_input_embeddings().weight.detach().double().abs().sum()), 3)}
    monkeypatch.setattr(fingerprints, "FINGERPRINT_CHUNK", 1000)  # many chunks per tensor, ragged ends
    monkeypatch.setattr(SafetensorsWeights, "get", lambda *a: pytest.fail("a whole tensor was read"))
    for fingerprint in (file_fingerprint(base), model_fingerprint(model)):
        assert fingerprints.same_model(whole_tensor_sums, fingerprint)
        assert fingerprint["weights_sha"] == whole_tensor_sums["weights_sha"]
    moved = {**whole_tensor_sums, "embedding_sum": whole_tensor_sums["embedding_sum"] + 0.01}
    assert not fingerprints.same_model(moved, file_fingerprint(base))


def test_a_base_model_missing_a_tensor_is_named(runs, tmp_path, capsys):
    from apt_ds.cli.export import main as export_main

    base = tmp_path / "base"
    shutil.copytree(runs["gqa"].parent / "base_gqa", base)
    weights = load_file(str(base / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    assert export_main([str(runs["gqa"]), "--model", str(base), "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert not (tmp_path / "e").exists()


def test_another_base_model_is_refused(runs, tmp_path):
    with pytest.raises(CheckpointError, match="not the base model this run was trained from"):
        export_run(runs["gqa"], tmp_path / "e", model_path=runs["gqa"].parent / "base_gqa_tied")
    meta = json.loads((runs["gqa"] / "checkpoint" / "apt_state.json").read_text())
    assert meta["run_info"]["model_fingerprint"] == file_fingerprint(runs["gqa"].parent / "base_gqa")


def test_a_model_that_cannot_be_mapped_is_one_line(tmp_path):
    """Under an address-space limit (ulimit -v) safetensors cannot map a big file: one line, not
    a MemoryError traceback. The 16 GiB file is sparse: it takes no disk."""
    directory = tmp_path / "big"
    directory.mkdir()
    rows, cols = 1 << 20, 4096  # 16 GiB of fp32
    header = json.dumps({"w": {"dtype": "F32", "shape": [rows, cols], "data_offsets": [0, rows * cols * 4]}}).encode()
    with open(directory / "model.safetensors", "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.truncate(8 + len(header) + rows * cols * 4)
    script = (
        "import resource, sys\n"
        "from apt_ds.io.weights import SafetensorsWeights, WeightsError\n"
        "resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))\n"
        "try:\n"
        "    SafetensorsWeights(sys.argv[1])\n"
        "except WeightsError as err:\n"
        "    print('refused:', err)\n"
        "else:\n"
        "    print('mapped')\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", script, str(directory)], capture_output=True, text=True, timeout=300,
                            cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("refused: cannot read") and "model.safetensors" in result.stdout, result.stdout
