"""Real SIGKILLs at the worst moments of a one-process run, then `--resume`: what is left on
disk, and that the resumed run ends exactly like an uninterrupted one (same losses, step by
step, and the same kept units). docs/RELIABILITY.md tabulates these; the 2-rank kill is in
tests/distributed/test_distributed.py, disk-full and stops in tests/cli/test_stops_and_full_disks.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--steps", "12", "--max-seq-len", "32", "--micro-batch-size", "2", "--checkpoint-every", "4", "--data", "data.jsonl"]

# Runs launch/train.py's main with one hook that SIGKILLs the process at the chosen point.
KILLER = r"""
import os, pathlib, signal, sys
point = sys.argv[1]
calls = {"n": 0}

def kill_on(count):
    calls["n"] += 1
    if calls["n"] == count:
        os.kill(os.getpid(), signal.SIGKILL)

if point == "start-up":  # run.json and tokenizer written, the first step not yet taken
    from apt_ds.training import trainer
    step = trainer.APTrainer._train_step
    trainer.APTrainer._train_step = lambda self, b: (kill_on(1), step(self, b))[1]
elif point == "mid-step":  # inside the backward pass of step 6 (after the step-4 checkpoint)
    from apt_ds.distributed import backend
    backward = backend.LocalBackend.backward
    backend.LocalBackend.backward = lambda self, loss: (kill_on(6), backward(self, loss))[1]
elif point == "mid-checkpoint":  # the step-8 checkpoint half written (engine state, no masks yet)
    from apt_ds.io import checkpoint_save as checkpoint
    save = checkpoint.save_file
    def save_file(tensors, path, *a, **k):
        if path.endswith("masks.safetensors"):
            kill_on(2)
        return save(tensors, path, *a, **k)
    checkpoint.save_file = save_file
elif point == "mid-rename":  # step-8 checkpoint complete, the step-4 one renamed to .old, not yet replaced
    rename = pathlib.Path.rename
    def renaming(self, target):
        if self.name == "checkpoint.tmp":
            kill_on(2)
        return rename(self, target)
    pathlib.Path.rename = renaming
from apt_ds.cli.train import main as train_main
sys.exit(train_main(sys.argv[2:]))
"""


def _train(cwd: Path, *argv: str, point: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", KILLER, point or "none", *ARGS, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if not r.get("final")}


def _kept(run: Path) -> dict:
    return json.loads((run / "checkpoint" / "apt_state.json").read_text())["kept"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    rows = [{"text": f"row {i}: the quick brown fox jumps over the lazy dog number {i}."} for i in range(120)]
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = _train(root, "--out", "uninterrupted")
    assert result.returncode == 0, result.stderr[-3000:]
    return root


# point -> (entries left in the run directory, the checkpoint step it resumes from, last logged step)
LEFT = {
    "mid-step": ({"checkpoint", "metrics.jsonl", "run.json", "tokenizer"}, 4, 5),
    "mid-checkpoint": ({"checkpoint", "checkpoint.tmp", "metrics.jsonl", "run.json", "tokenizer"}, 4, 8),
    "mid-rename": ({"checkpoint.old", "checkpoint.tmp", "metrics.jsonl", "run.json", "tokenizer"}, 4, 8),
}


def _logged_steps(run: Path) -> list[int]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if not r.get("final")]


@pytest.mark.parametrize("point", list(LEFT))
def test_killed_run_resumes_exactly(workdir, point):
    out = f"killed-{point}"
    killed = _train(workdir, "--out", out, point=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    entries, resumes_from, last_logged = LEFT[point]
    assert {p.name for p in (workdir / out).iterdir()} == entries
    assert _logged_steps(workdir / out) == list(range(1, last_logged + 1))
    complete = next(workdir / out / name for name in ("checkpoint", "checkpoint.old") if (workdir / out / name).is_dir())
    assert json.loads((complete / "apt_state.json").read_text())["step"] == resumes_from
    resumed = _train(workdir, "--out", out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert {p.name for p in (workdir / out).iterdir()} == {"checkpoint", "metrics.jsonl", "run.json", "tokenizer", "ranks"}
    assert _logged_steps(workdir / out) == list(range(1, 13))  # lines after step 4 dropped, then redone once
    assert _losses(workdir / out) == _losses(workdir / "uninterrupted")  # bit for bit, every step
    assert _kept(workdir / out) == _kept(workdir / "uninterrupted")


def test_killed_at_start_up_leaves_a_run_without_checkpoint(workdir):
    killed = _train(workdir, "--out", "killed-start-up", point="start-up")
    assert killed.returncode == -signal.SIGKILL
    assert {p.name for p in (workdir / "killed-start-up").iterdir()} == {"run.json", "tokenizer"}
    refused = _train(workdir, "--out", "killed-start-up", "--resume")
    assert refused.returncode == 2 and "pass --overwrite instead of --resume" in refused.stderr
    again = _train(workdir, "--out", "killed-start-up", "--overwrite")
    assert again.returncode == 0, again.stderr[-3000:]
    assert _losses(workdir / "killed-start-up") == _losses(workdir / "uninterrupted")
