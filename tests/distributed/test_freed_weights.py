"""Pruned weights leave memory at each event, under DeepSpeed too, while the command line runs
training with its start-up objects frozen for the garbage collector (apt_ds.training.heap)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_distributed import REPO, ds_config, env, free_port

PROBE = Path(__file__).parent / "multirank" / "freed_weights_probe.py"
ARGS = ["--model", "tiny", "--steps", "8", "--max-seq-len", "32", "--warmup-steps", "1", "--target-density", "0.5",
        "--seed", "3", "--micro-batch-size", "2"]


@pytest.mark.parametrize("stage", [None, 2, 3], ids=["local", "zero2", "zero3"])
def test_replaced_weights_and_engines_are_freed_at_events(tmp_path, stage):
    result = tmp_path / "result.json"
    args = [*ARGS, "--out", str(tmp_path / "run")]
    if stage is None:
        cmd = [sys.executable, str(PROBE), str(result), "--", *args]
    else:  # one rank under the launcher: the engine and its parameters' cycles are DeepSpeed's
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(free_port()),
               str(PROBE), str(result), "--", "--deepspeed", ds_config(tmp_path, stage), *args]
    completed = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env(), cwd=REPO)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    probe = json.loads(result.read_text())
    events = probe["events"]
    assert probe["code"] == 0 and events and probe["frozen_after"] == 0
    assert all(event["frozen"] for event in events)  # the collections ran with start-up objects frozen
    assert all(event["replaced"] > 0 for event in events)  # the events did replace weights ...
    assert all(event["replaced_alive"] == 0 for event in events)  # ... and none of those outlived its event
    if stage is not None:
        assert not any(event["first_engine_alive"] for event in events)  # rebuilt: the first engine is gone
