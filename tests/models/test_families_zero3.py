"""Each new family under ZeRO-3 on 2 real ranks (CPU accelerator) from the partitioned build:
the family's own class is built partitioned (Qwen2's config has no attention_bias, which a
LlamaForCausalLM build read), both ranks take the same decisions, the run reaches its density,
and its export gives the live model's logits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import check_against_probe, tiny_family

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from test_distributed import COMMON, EVAL, check_identical_and_pruned, ds_config, launch  # noqa: E402

from apt_ds.cli.export import main as export_main  # noqa: E402


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3"])
def test_a_two_rank_zero3_run_prunes_and_exports(tmp_path, tokenizer, model_type):
    base = tmp_path / model_type
    tiny_family(model_type, vocab=len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(str(base))
    out = tmp_path / "run"
    result = launch(2, ["--deepspeed", ds_config(tmp_path, 3), *COMMON, *EVAL, "--save-eval-probe", "--micro-batch-size", "2",
                        "--model", str(base), "--out", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check_identical_and_pruned(out, 2)
    assert export_main([str(out), "--out", str(tmp_path / "hf")]) == 0
    check_against_probe(out, tmp_path / "hf")
