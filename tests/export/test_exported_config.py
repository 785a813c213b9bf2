"""An export's config.json speaks both transformers dialects of RoPE: 5's `rope_parameters` and
4.x's `rope_theta` / `rope_scaling`, the same values, and transformers reads it back unchanged."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_family

from apt_ds.cli.export import main as export_main
from apt_ds.models import family_for

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("model_type, rope", [("llama", LLAMA3_ROPE), ("llama", None), ("qwen2", None),
                                              ("mistral", None), ("qwen3", None)])
def test_rope_keys_of_both_transformers_dialects(tmp_path, tokenizer, model_type, rope):
    overrides = {"rope_parameters": rope} if rope else {}
    tiny_family(model_type, vocab=len(tokenizer), **overrides).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(str(tmp_path / "base"))
    (tmp_path / "kept.json").write_text(json.dumps({"groups": [[0], [1]], "neurons": [list(range(48))] * 2,
                                                    "hidden": list(range(64))}))
    assert export_main(["--model", str(tmp_path / "base"), "--kept", str(tmp_path / "kept.json"),
                        "--out", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    parameters = config["rope_parameters"]
    assert config["rope_theta"] == parameters["rope_theta"]
    if rope:
        assert config["rope_scaling"] == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
        assert parameters == LLAMA3_ROPE
    else:
        assert parameters["rope_type"] == "default" and config["rope_scaling"] is None
    config_class, _ = family_for(model_type).classes()
    assert config_class.from_pretrained(tmp_path / "hf").rope_parameters == parameters
