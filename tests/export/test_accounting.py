"""Every base tensor accounted for (apt_ds.export.accounting): an export writes each tensor of the
base checkpoint or leaves it out on purpose, as the family's description says; otherwise it fails
in one line, before anything is written. Checked end to end on a model whose tensors today's
exports did not know: a Qwen2 (q/k/v biases) exported with a description that forgets them."""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from unittest import mock

import pytest
import torch
from conftest import tiny_family

from apt_ds.cli.export import main as export_main
from apt_ds.cli.train import main as train_main
from apt_ds.export import merge
from apt_ds.export.accounting import (
    UnaccountedTensorError,
    check_every_base_tensor_written,
    check_gguf_reads_every_tensor,
)
from apt_ds.models import FAMILIES, UnsupportedModelError, family_for
from apt_ds.models.llama import LLAMA
from apt_ds.models.qwen2 import QWEN2

TRAIN = ["--steps", "8", "--max-seq-len", "32", "--micro-batch-size", "2", "--target-density", "0.6"]
LAYER = "model.layers.0.self_attn"


def test_a_base_tensor_the_export_would_drop_is_named():
    base = ["model.embed_tokens.weight", f"{LAYER}.q_proj.weight", f"{LAYER}.q_proj.bias", f"{LAYER}.k_proj.bias"]
    with pytest.raises(UnaccountedTensorError, match=rf"holds {LAYER}.k_proj.bias and 1 more, which the llama export would not write"):
        check_every_base_tensor_written(base, base[:2], LLAMA, tied_embeddings=False, base="b")


def test_what_the_description_leaves_out_is_not_a_drop():
    written = ["model.embed_tokens.weight", "model.norm.weight"]
    base = [*written, "lm_head.weight", "model.layers.3.self_attn.rotary_emb.inv_freq"]  # tied; a transformers-4.30 table
    check_every_base_tensor_written(base, written, LLAMA, tied_embeddings=True, base="b")
    with pytest.raises(UnaccountedTensorError, match="holds lm_head.weight"):  # untied, it is the output layer
        check_every_base_tensor_written(base, written, LLAMA, tied_embeddings=False, base="b")


def test_a_written_tensor_the_base_lacks_is_refused():
    with pytest.raises(UnaccountedTensorError, match="would write model.norm.weight"):
        check_every_base_tensor_written(["model.embed_tokens.weight"], ["model.embed_tokens.weight", "model.norm.weight"],
                                        LLAMA, tied_embeddings=False, base="b")


def test_a_gguf_plan_must_read_every_exported_tensor():
    exported = ["model.embed_tokens.weight", f"{LAYER}.q_proj.weight", f"{LAYER}.q_proj.bias"]
    check_gguf_reads_every_tensor(exported, exported[:2], [f"{LAYER}.q_proj.bias"], LLAMA, "deci")  # left out on purpose
    with pytest.raises(UnaccountedTensorError, match=rf"GGUF \(llama\) would not hold {LAYER}.q_proj.bias of this llama model"):
        check_gguf_reads_every_tensor(exported, exported[:2], [], LLAMA, "llama")


def test_other_model_types_are_refused_naming_the_families():
    with pytest.raises(UnsupportedModelError, match=r"^m: model_type 'gemma3' is not supported; apt-ds prunes llama \(LLaMA"):
        family_for("gemma3", where="m")


def test_left_out_patterns_are_checked_when_a_description_is_written():
    from apt_ds.models import LeftOut

    with pytest.raises(Exception):
        LeftOut("model.layers.(", "a typo")


def _one_error(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


@pytest.fixture
def forgetful_qwen2(monkeypatch):
    """Qwen2 described as the code before its description took it: LLaMA's tensors (no q/k/v
    biases) and LLaMA's GGUF architectures. Set after training, for the export alone."""
    return lambda: monkeypatch.setitem(FAMILIES, "qwen2", dataclasses.replace(
        QWEN2, layer_tensors=LLAMA.layer_tensors, gguf_uniform=LLAMA.gguf_uniform, gguf_non_uniform=LLAMA.gguf_non_uniform))


@pytest.mark.parametrize("streaming", [True, False], ids=["streamed", "in-memory"])
def test_todays_qwen2_export_fails_loudly(in_tmp, tmp_path, tokenizer, capsys, monkeypatch, forgetful_qwen2, streaming):
    """The export that silently dropped Qwen2's q/k/v biases (a logit gap of 0.76) refuses."""
    tiny_family("qwen2", vocab=len(tokenizer)).save_pretrained(tmp_path / "qwen2")
    tokenizer.save_pretrained(str(tmp_path / "qwen2"))
    assert train_main([*TRAIN, "--model", "qwen2", "--out", "run"]) == 0
    forgetful_qwen2()
    if not streaming:
        real_export_run = merge.export_run
        monkeypatch.setattr(merge, "export_run", lambda *a, **k: real_export_run(*a, **{**k, "streaming": False}))
    for out, flags in (("hf", []), ("gguf", ["--format", "gguf"])):
        capsys.readouterr()
        assert export_main(["run", "--out", out, *flags]) == 2
        expected = [
            f"error: export refused: the base model {tmp_path / 'qwen2'} holds model.layers.0.self_attn.k_proj.bias and 5 more, "
            "which the qwen2 export would not write, so the exported model would differ from the one trained; nothing was "
            "written (apt-ds's qwen2 description does not say how to export it: please report this)"
        ] if streaming else [  # the rebuilt model itself is refused: its layers hold tensors the description lacks
            "error: layer 0 has self_attn.k_proj.bias, which the qwen2 description (apt_ds/models/qwen2.py) does not list"]
        assert _one_error(capsys) == expected
        assert not (tmp_path / out).exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(f".{out}")]


@pytest.fixture
def base_with_an_unknown_tensor(tmp_path, tokenizer):
    """A LLaMA checkpoint whose files hold one tensor its class does not know: transformers drops
    it without a word when it loads, so only the files tell that an export would not hold it."""
    from safetensors.torch import load_file, save_file

    base = tmp_path / "base"
    tiny_family("llama", vocab=len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(str(base))
    tensors = load_file(str(base / "model.safetensors"))
    tensors["model.layers.1.mlp.gate_scale"] = torch.ones(96)
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    return base


UNKNOWN = "holds model.layers.1.mlp.gate_scale, which the llama export would not write"


@pytest.mark.parametrize("format", ["hf", "gguf"])
def test_a_kept_export_checks_the_base_files_not_the_loaded_model(tmp_path, capsys, base_with_an_unknown_tensor, format):
    """`--model BASE --kept KEPT` checked the loaded model against itself, which cannot fail."""
    kept = {"groups": [[0, 1]] * 2, "neurons": [list(range(0, 96, 2))] * 2, "hidden": list(range(48))}
    (tmp_path / "kept.json").write_text(json.dumps(kept))
    code = export_main(["--model", str(base_with_an_unknown_tensor), "--kept", str(tmp_path / "kept.json"),
                        "--out", str(tmp_path / "out"), "--format", format])
    assert code == 2
    errors = _one_error(capsys)
    assert len(errors) == 1 and UNKNOWN in errors[0]
    assert not (tmp_path / "out").exists()


def test_an_in_memory_run_export_checks_the_base_files(in_tmp, tmp_path, capsys, base_with_an_unknown_tensor):
    assert train_main([*TRAIN, "--model", str(base_with_an_unknown_tensor), "--out", "run"]) == 0
    for streaming in (True, False):
        for out, flags in (("hf", []), ("gguf", ["--format", "gguf"])):
            capsys.readouterr()
            with mock.patch.object(merge, "export_run", partial(merge.export_run, streaming=streaming)):
                assert export_main(["run", "--out", out, *flags]) == 2
            errors = _one_error(capsys)
            assert len(errors) == 1 and UNKNOWN in errors[0], (streaming, out, errors)
            assert not (tmp_path / out).exists()


def test_a_gguf_plan_that_misses_an_exported_tensor_writes_nothing(tmp_path):
    """The GGUF writer's own check: a tensor the exported model holds that its plan does not read
    (here one the model gained outside the layers) fails before the file is written."""
    from apt_ds.algorithm.units import ModelShape
    from apt_ds.export.gguf import ModelTensors, write_gguf

    model = tiny_family("qwen2")
    tensors = ModelTensors(model)
    tensors.params["model.extra_norm.weight"] = torch.ones(64)
    with pytest.raises(UnaccountedTensorError, match=r"GGUF \(qwen2\) would not hold model.extra_norm.weight"):
        write_gguf(tmp_path / "m.gguf", ModelShape.from_model(model), tensors, model.config, None, "fp32")
    assert not (tmp_path / "m.gguf").exists()
