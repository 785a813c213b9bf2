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


ONE_PROJECTION_AT_A_TIME = """
import json, torch
from transformers import LlamaConfig, LlamaForCausalLM
from apt_ds.algorithm.quant import BaseQuant, is_quantized
from apt_ds.distributed.zero import DeepSpeedBackend
from apt_ds.distributed.zero_init import build_partitioned_model
from apt_ds.io.quantized import projection_weights

config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64)
backend = DeepSpeedBackend({"zero_optimization": {"stage": 3}}, base_dtype="fp32")
ds_config = backend.resolved_config(config, 1, 1.0)
state = LlamaForCausalLM(config).state_dict()
built, most_held = [], 0

def watch(parent, name, module):  # registered first, so it runs before the build's own hook
    global most_held
    if name.endswith("_proj"):
        most_held = max(most_held, sum(p.ds_tensor.numel() for p in built))  # earlier projections' fp partitions
        built.append(module.weight)

handle = torch.nn.modules.module.register_module_module_registration_hook(watch)
quant = BaseQuant("nf4", storage=torch.float32)
model = build_partitioned_model(config, state, ds_config, torch.float32, backend.device, quant)
handle.remove()
print(json.dumps({"built": len(built), "most_held": most_held,
                  "quantized": sum(is_quantized(l.weight) for l, _ in projection_weights(model).values())}))
backend.shutdown()
"""


def test_a_zero3_quantized_build_holds_one_projection_in_full_precision_at_a_time(tmp_path):
    """zero.Init gives every Linear a full-precision partition; each projection's is freed as soon as
    it is built, so the load never holds the model's projections in full precision (before: a
    3B-shaped run's load peaked above the fp32 run's)."""
    import os
    import subprocess

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run([sys.executable, "-c", ONE_PROJECTION_AT_A_TIME], capture_output=True, text=True,
                            timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"built": 14, "most_held": 0, "quantized": 14}
