"""A base whose LM head disagrees with its config.json: transformers loads a tied config whose
files hold another head as an untied model, and an untied config without a head with a random
one (warnings only). Training and every export would read such a model differently, so it is
refused in one line before any weight is read; a tied checkpoint that also stores the same head
is a normal one."""

from __future__ import annotations

import json

import pytest
from conftest import TRAIN_FAST, tiny_family
from safetensors.torch import load_file, save_file

from apt_ds.cli.export import main as export_main
from apt_ds.cli.train import main as train_main


def _base(tmp_path, tokenizer, tied: bool, edit) -> str:
    base = tmp_path / "base"
    tiny_family("llama", vocab=len(tokenizer), tied=tied).save_pretrained(base)
    tokenizer.save_pretrained(str(base))
    tensors = load_file(str(base / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    return str(base)


def _another_head(tensors):
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 0.5


def _the_same_head(tensors):
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()


def _no_head(tensors):
    del tensors["lm_head.weight"]


@pytest.mark.parametrize("tied, edit, message", [
    (True, _another_head, "ties the LM head to the embedding (tie_word_embeddings true) but its weights hold a different"),
    (False, _no_head, "does not tie the LM head to the embedding (tie_word_embeddings false) but its weights hold no"),
], ids=["tied-with-another-head", "untied-without-a-head"])
def test_a_head_that_contradicts_the_config_is_one_line(in_tmp, tmp_path, tokenizer, capsys, tied, edit, message):
    base = _base(tmp_path, tokenizer, tied, edit)
    (tmp_path / "kept.json").write_text(json.dumps({"groups": [[0, 1]] * 2, "neurons": [list(range(96))] * 2,
                                                    "hidden": list(range(64))}))
    for command, out in ((lambda o: train_main([*TRAIN_FAST, "--model", base, "--out", o]), "run"),
                         (lambda o: export_main(["--model", base, "--kept", str(tmp_path / "kept.json"), "--out", o]), "hf")):
        capsys.readouterr()
        assert command(str(tmp_path / out)) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and message in errors[0], errors
        assert not (tmp_path / out).exists()


def test_a_tied_checkpoint_that_also_stores_the_head_trains(in_tmp, tmp_path, tokenizer):
    base = _base(tmp_path, tokenizer, True, _the_same_head)
    assert train_main([*TRAIN_FAST, "--model", base, "--out", str(tmp_path / "run")]) == 0
    assert export_main([str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is True
