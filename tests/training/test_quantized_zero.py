"""A quantized base (--base-quant nf4) under DeepSpeed ZeRO-2 and ZeRO-3 on 2 real ranks (CPU
accelerator): under ZeRO-2 each rank quantizes the frozen base identically from the files and holds
it whole (ZeRO-2 partitions only the adapters' optimizer state); under ZeRO-3 the codes are
partitioned as they load. Both ranks take the same decisions, the run reaches its density through
engine rebuilds whose shrinks keep the codes, and the export merged into the dequantized weights
gives the live model's logits; under ZeRO-3, killed after a pruned checkpoint, the run resumes to
the uninterrupted run's decisions and losses. int8 under ZeRO-3 is refused before the model loads
(tests/training/test_quantized_base.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import check_against_probe, tiny_family

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from test_distributed import COMMON, EVAL, check_identical_and_pruned, ds_config, launch, rank_records  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_families_zero import _killed_then_resumed_as_uninterrupted  # noqa: E402

from apt_ds.cli.export import main as export_main  # noqa: E402

pytest.importorskip("bitsandbytes")

# widths that are whole 4-bit blocks of 64, so every cut keeps its codes (algorithm/quant.py)
BLOCK_SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_two_rank_zero_run_on_an_nf4_base_prunes_and_exports(tmp_path, tokenizer, stage):
    """Under ZeRO-2 each rank holds the whole nf4 base (about half a byte per parameter with double
    quantization); under ZeRO-3 each holds half of its codes (bitsandbytes' quant_storage in the
    engine's dtype, partitioned tensor by tensor as they load) plus the quantization state."""
    base = tmp_path / "qwen2"
    tiny_family("qwen2", vocab=len(tokenizer), **BLOCK_SHAPES).save_pretrained(base)
    tokenizer.save_pretrained(str(base))
    out = tmp_path / "run"
    config = Path(ds_config(tmp_path, stage))
    settings = json.loads(config.read_text())  # nothing kept whole after a gather: the codes come and go
    settings["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    config.write_text(json.dumps(settings))
    args = ["--deepspeed", str(config), *COMMON, "--micro-batch-size", "2", "--model", str(base),
            "--base-quant", "nf4", "--checkpoint-every", "6"]
    result = launch(2, [*args, *EVAL, "--save-eval-probe", "--out", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check_identical_and_pruned(out, 2)
    meta = json.loads((out / "checkpoint" / "apt_state.json").read_text())
    assert meta["train_config"]["base_quant"] == "nf4" and meta["run_info"]["quant_layout"] == "pruned-axis-rows"
    for record in rank_records(out):
        held = record["quantized_base"]["at_start"]
        per_param = held["bytes"] / held["params"]
        assert (0.5 <= per_param <= 0.53) if stage == 2 else (0.25 <= per_param <= 0.27), (stage, per_param)
        end = record["quantized_base"]["at_end"]
        assert end["params"] < held["params"] and end["bytes"] < held["bytes"]
    assert export_main([str(out), "--out", str(tmp_path / "hf")]) == 0
    check_against_probe(out, tmp_path / "hf")
    if stage == 3:  # killed after a pruned checkpoint: the base quantized and shrunk again, partitioned, as it was
        _killed_then_resumed_as_uninterrupted(tmp_path / "killed", args, reference=out)
