"""Under DeepSpeed ZeRO-2 and ZeRO-3 a NaN step is skipped by the engine itself (its overflow
check covers fp32 and bf16 as well as fp16) and the trainer sees it: the run stops after
--max-skipped-steps bad steps in a row with every trainable tensor still finite, and the LR
schedule stays tied to the step count. One rank, no launcher (a 2-rank run compares the same
flags, which come from all-reduced numbers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, math, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from apt_ds.algorithm.finite import NonFiniteError
from apt_ds.config import APTConfig, TrainConfig
from apt_ds.distributed.zero import DeepSpeedBackend
from apt_ds.training.trainer import APTrainer

torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64)
model = LlamaForCausalLM(config)
backend = DeepSpeedBackend({"zero_optimization": {"stage": int(sys.argv[1])}}, micro_batch_size=4, base_dtype="fp32")
train = TrainConfig(steps=12, lr=1e6, warmup_steps=1)
trainer = APTrainer(model, APTConfig.for_steps(12, target_density=0.6), train, backend=backend, progress=False)
lrs = []
def batches():
    g = torch.Generator().manual_seed(1)
    while True:
        ids = torch.randint(0, 64, (4, 12), generator=g)
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
try:
    trainer.train(batches())
    error = None
except NonFiniteError as err:
    error = str(err)
finite = all(bool(torch.isfinite(backend.full_param(n, p)).all()) for n, p in model.named_parameters() if p.requires_grad)
print(json.dumps({"error": error, "step": trainer.step, "finite": finite,
                  "skipped": [r["step"] for r in trainer.history if r.get("skipped")],
                  "lr_steps": backend._scheduler.last_epoch, "moments_finite": backend.optimizer_state_finite()}))
backend.shutdown()
"""


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_skips_nan_steps_and_the_run_stops_with_finite_weights(tmp_path, stage):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(stage)], capture_output=True, text=True, timeout=600,
                            env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["error"] and "the run diverged" in out["error"] and "(3 in a row" in out["error"]
    assert len(out["skipped"]) == 3 and out["skipped"][-1] == out["step"] < 12
    assert out["finite"] and out["moments_finite"]
    assert out["lr_steps"] == out["step"]  # DeepSpeed holds its schedule back on a skipped step; the backend does not
