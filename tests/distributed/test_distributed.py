"""launch/train.py under the DeepSpeed launcher: 2 ranks, ZeRO-2/3, world-size invariance,
SIGKILL + resume, and two emulated nodes on 127.0.0.1. Real processes on the CPU accelerator."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import check_against_probe

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")
EVAL_EXAMPLES = 8
EVAL = ["--eval-data", str(REPO / "apt_ds" / "io" / "assets" / "demo.jsonl"), "--eval-examples", str(EVAL_EXAMPLES)]
# pruning until step 8 (not the default 6 = 50%): two events, so decisions are compared more than once
COMMON = ["--steps", "12", "--max-seq-len", "32", "--warmup-steps", "1", "--target-density", "0.5", "--seed", "3",
          "--pruning-end-step", "8"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ds_config(tmp: Path, stage: int, csv_monitor: Path | bool | None = None) -> str:
    """fp32 so that 1-rank and 2-rank runs round identically; `csv_monitor`: DeepSpeed's CSV
    monitor writes there (True: no output_path, so into RUN/monitor)."""
    path = tmp / f"zero{stage}_fp32.json"
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "bf16": {"enabled": False}, "zero_optimization": {"stage": stage}}
    if csv_monitor is not None:
        config["csv_monitor"] = {"enabled": True, "job_name": "apt"}
        if csv_monitor is not True:
            config["csv_monitor"]["output_path"] = str(csv_monitor)
    path.write_text(json.dumps(config))
    return str(path)


def env() -> dict:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def launch(ranks: int, args: list[str], timeout: int = 600, script: str = TRAIN, **popen) -> subprocess.CompletedProcess:
    """`script` (launch/train.py, or a test's wrapper of it) on `ranks` ranks of the DeepSpeed launcher."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", str(free_port()), script, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(), cwd=REPO, **popen)


def rank_records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "ranks").glob("rank*.json"))]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_identical_and_pruned(out: Path, ranks: int, since_step: int = 0, density: float = 0.5) -> dict:
    records = rank_records(out)
    assert len(records) == ranks
    for record in records[1:]:
        assert record["shape_fingerprint"] == records[0]["shape_fingerprint"] and record["ranks"] == records[0]["ranks"]
    final = metrics(out)[-1]
    assert final["final"] and density - 0.1 <= final["density"] <= density + 1e-9  # reached, not overshot
    steps = [m for m in metrics(out) if not m.get("final")]
    assert all(m["world_size"] == ranks for m in steps if m["step"] > since_step)
    assert all(m["loss"] == m["loss"] and m["loss"] < 100 for m in steps)  # finite
    assert max(m["total_rank"] for m in steps) > steps[0]["total_rank"]  # ranks grew
    return records[0]


@pytest.fixture(scope="module")
def two_rank_zero2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("z2")
    out = tmp / "run"
    result = launch(2, ["--deepspeed", ds_config(tmp, 2, csv_monitor=tmp / "csv"), *COMMON, *EVAL, "--save-eval-probe",
                        "--micro-batch-size", "2", "--out", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tmp, out


def test_deepspeed_csv_monitor_gets_the_logged_metrics(two_rank_zero2):
    """The JSON enables DeepSpeed's csv_monitor: every number of every logged record is also in
    <output_path>/<job_name>/apt_<name>.csv (rank 0 only, one header per file across the engine
    rebuilds of the pruning events), and DeepSpeed's own lr events go there too."""
    tmp, out = two_rank_zero2
    folder = tmp / "csv" / "apt"
    records = metrics(out)  # the final record sends only its eval_loss (measured after the last step's line)
    names = ("loss", "task_loss", "density", "total_rank", "lr", "peak_rss_mb", "eval_loss")
    for name in names:
        with (folder / f"apt_{name}.csv").open() as handle:
            rows = list(csv.reader(handle))
        assert rows[0] == ["step", name] and all(row[0] != "step" for row in rows[1:])
        expected = [(m["step"], m[name]) for m in records if name in m and (not m.get("final") or name == "eval_loss")]
        assert [(int(step), float(value)) for step, value in rows[1:]] == [(s, float(v)) for s, v in expected], name
    assert (folder / "Train_Samples_lr.csv").is_file()  # the engine's own events, through the run's monitor


def test_zero2_two_ranks_identical_masks_and_export_matches(two_rank_zero2):
    tmp, out = two_rank_zero2
    check_identical_and_pruned(out, 2)
    events = [m for m in metrics(out) if m.get("event")]
    assert events and all(m["eval_loss"] == m["eval_loss"] for m in events)  # logged (and finite) at every event
    live = metrics(out)[-1]["eval_loss"]
    assert abs(exported_eval_loss(out, tmp / "export") - live) < 1e-4 * max(1.0, abs(live))
    check_against_probe(out, tmp / "export")  # GQA, non-uniform, ZeRO-2: logits and 20 greedy tokens


def exported_eval_loss(out: Path, export_dir: Path, count: int = EVAL_EXAMPLES) -> float:
    """Token-mean loss of the exported model on the run's eval examples (one process, no DeepSpeed)."""
    from apt_ds.export.merge import export_run
    from apt_ds.io.data import collate, demo_data_path, load_records, tokenize_dataset
    from apt_ds.io.modeling import load_pretrained
    from apt_ds.io.tokenizer import load_tokenizer

    export_run(out, export_dir)
    model = load_pretrained(export_dir)
    tokenizer = load_tokenizer(out / "tokenizer")
    examples = tokenize_dataset(load_records(demo_data_path()), tokenizer, 32, pack=False)[:count]
    batch = collate(examples, pad_id=tokenizer.pad_token_id or 0)
    with torch.no_grad():
        loss = model(**batch).loss
    return float(loss)


# uniform cases: shape trials by the task loss (the default) and by the divergence (its reference
# pass and position selection), both under ZeRO-3's gathered forward on two ranks. At density 0.7
# the second event has a single candidate: both ranks must skip its forward passes together.
@pytest.mark.parametrize("model, shape_flags, density", [("tiny", [], 0.5), ("tiny-mha", ["--uniform"], 0.5),
                                                         ("tiny-mha", ["--uniform", "--uniform_shape_metric", "kl"], 0.7)],
                         ids=["gqa-nonuniform", "mha-uniform", "mha-uniform-kl-one-candidate"])
def test_zero3_two_ranks_identical_masks_and_export_matches(tmp_path, model, shape_flags, density):
    """The export's logits and greedy trajectory equal the live ZeRO-3 engine's, whose weights are
    partitioned over 2 ranks (the ZeRO-2 test covers GQA non-uniform)."""
    out = tmp_path / "run"
    odd_eval = [EVAL[0], EVAL[1], "--eval-examples", str(EVAL_EXAMPLES - 1)]  # trimmed to a multiple of 2 ranks
    result = launch(2, ["--deepspeed", ds_config(tmp_path, 3), *COMMON, *odd_eval, "--model", model, *shape_flags,
                        "--target-density", str(density), "--save-eval-probe", "--micro-batch-size", "2", "--out", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check_identical_and_pruned(out, 2, density=density)
    live = metrics(out)[-1]["eval_loss"]  # the masked model inside the ZeRO-3 engine, both ranks
    assert abs(exported_eval_loss(out, tmp_path / "export", EVAL_EXAMPLES - 2) - live) < 1e-4 * max(1.0, abs(live))
    check_against_probe(out, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    if shape_flags:  # uniform MHA: a stock config, its shapes chosen by trials measured on both ranks' batches
        assert "apt_layer_shapes" not in config and config["num_attention_heads"] == config["num_key_value_heads"]
        events = [m["shape_trials"] for m in metrics(out) if "shape_trials" in m]
        trials = [t for event in events for t in event]
        assert trials and all(t["loss"] > 0 for t in trials) and any(t["chosen"] for t in trials)
        if density == 0.7:
            assert [len(event) for event in events] == [4, 0]  # the second: one candidate, no trial forward


def test_one_rank_with_double_batch_decides_the_same(two_rank_zero2, tmp_path):
    tmp, two = two_rank_zero2
    out = tmp_path / "one"
    result = launch(1, ["--deepspeed", ds_config(tmp_path, 2), *COMMON, "--micro-batch-size", "4", "--out", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one_rank = check_identical_and_pruned(out, 1)
    decisions = lambda run: [m["decision"] for m in metrics(run) if m.get("event")]  # noqa: E731
    assert len(decisions(out)) >= 2 and decisions(out) == decisions(two)  # every event, not just the end
    assert one_rank["shape_fingerprint"] == rank_records(two)[0]["shape_fingerprint"]
    assert one_rank["ranks"] == rank_records(two)[0]["ranks"]


def test_sigkill_then_resume_finishes_like_uninterrupted(two_rank_zero2, tmp_path):
    tmp, reference = two_rank_zero2
    out = tmp_path / "killed"
    args = ["--deepspeed", ds_config(tmp_path, 2, csv_monitor=True), *COMMON, "--micro-batch-size", "2", "--checkpoint-every",
            "4", "--out", str(out)]
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()), TRAIN, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env(), cwd=REPO, start_new_session=True)
    _wait_for_checkpoint(proc, out, 4)  # the first checkpoint: 8 steps of margin before the end
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    from apt_ds.training.resume import checkpoint_to_resume as _checkpoint_dir

    killed_at = json.loads((_checkpoint_dir(out) / "apt_state.json").read_text())["step"]
    assert killed_at < 12
    smaller = tmp_path / "killed_resumed_on_one_rank"
    shutil.copytree(out, smaller)
    result = launch(2, [*args, "--resume"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # the same checkpoint resumed on 1 rank with micro 4: the same global batch of 4
    one_rank = [a if a != str(out) else str(smaller) for a in args]
    one_rank[one_rank.index("--micro-batch-size") + 1] = "4"
    result = launch(1, [*one_rank, "--resume"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    expected = rank_records(reference)[0]
    reference_losses = {m["step"]: m["loss"] for m in metrics(reference) if not m.get("final")}
    for run, ranks in ((out, 2), (smaller, 1)):
        resumed = check_identical_and_pruned(run, ranks, since_step=killed_at)
        assert resumed["shape_fingerprint"] == expected["shape_fingerprint"] and resumed["ranks"] == expected["ranks"]
        resumed_losses = {m["step"]: m["loss"] for m in metrics(run) if not m.get("final") and m["step"] > killed_at}
        assert resumed_losses and all(abs(resumed_losses[s] - reference_losses[s]) < 1e-4 for s in resumed_losses)
        # The monitor wrote into the run (no output_path in the JSON); the resume dropped the CSV rows
        # of the steps it redid: one header, each step once, as in metrics.jsonl.
        with (run / "monitor" / "apt" / "apt_loss.csv").open() as handle:
            rows = list(csv.reader(handle))
        assert rows[0] == ["step", "loss"]
        steps = [m["step"] for m in metrics(run) if not m.get("final")]
        assert [(int(step), float(loss)) for step, loss in rows[1:]] == \
            [(m["step"], m["loss"]) for m in metrics(run) if not m.get("final")]
        with (run / "monitor" / "apt" / "Train_Samples_lr.csv").open() as handle:
            samples = [int(row[0]) for row in list(csv.reader(handle))[1:]]  # DeepSpeed's own: at samples seen
        assert samples == [samples[0] * step for step in steps]  # each step's row once, those before the checkpoint kept


def _wait_for_checkpoint(proc, out: Path, step: int) -> None:
    state = out / "checkpoint" / "apt_state.json"
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if json.loads(state.read_text())["step"] >= step:
                return
        except (OSError, ValueError, KeyError):  # not written yet, or being renamed into place
            pass
        if proc.poll() is not None:
            pytest.fail("run ended before the checkpoint to kill after was written")
        time.sleep(0.05)
    pytest.fail("no checkpoint within 600 s")


def test_one_rank_killed_under_zero3_ends_the_run_and_it_resumes(tmp_path):
    """SIGKILL of rank 1 alone, after the first checkpoint of a ZeRO-3 run: the launcher ends
    rank 0 too (no hang), and --resume rebuilds the pruned shapes from the checkpoint one module
    at a time under ZeRO-3 and finishes with the uninterrupted run's decisions and losses; a torn
    export copy in that checkpoint is rewritten from the gathered partitions on the way."""
    import psutil

    # Events at steps 5 and 8: the step-6 checkpoint is a pruned one, so resume rebuilds shapes.
    args = ["--deepspeed", ds_config(tmp_path, 3), *COMMON, "--micro-batch-size", "2", "--checkpoint-every", "6"]
    reference = tmp_path / "reference"
    result = launch(2, [*args, "--out", str(reference)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()), TRAIN,
           *args, "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env(), cwd=REPO, start_new_session=True)
    try:
        _wait_for_checkpoint(proc, out, 6)
        rank1 = [c for c in psutil.Process(proc.pid).children(recursive=True) if "--local_rank=1" in c.cmdline()]
        assert len(rank1) == 1
        rank1[0].send_signal(signal.SIGKILL)
        assert proc.wait(timeout=120) != 0  # the launcher noticed and ended rank 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    from apt_ds.training.resume import checkpoint_to_resume as _checkpoint_dir

    killed_at = json.loads((_checkpoint_dir(out) / "apt_state.json").read_text())["step"]
    assert 6 <= killed_at < 12
    saved = json.loads((_checkpoint_dir(out) / "apt_state.json").read_text())
    assert saved["shape"] != saved["original_shape"]  # the checkpoint resumed from is a pruned one
    export_copy = _checkpoint_dir(out) / "trainable.safetensors"
    export_copy.write_bytes(export_copy.read_bytes()[:-64])  # torn: the resume rewrites it, gathered from both ranks
    result = launch(2, [*args, "--out", str(out), "--resume"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    said = (result.stdout + result.stderr).count("trainable.safetensors was unreadable")
    assert said == 1 and "rewritten from the restored weights" in result.stdout + result.stderr  # once, by rank 0
    resumed = check_identical_and_pruned(out, 2, since_step=killed_at)
    expected = rank_records(reference)[0]
    assert resumed["shape_fingerprint"] == expected["shape_fingerprint"] and resumed["ranks"] == expected["ranks"]
    reference_losses = {m["step"]: m["loss"] for m in metrics(reference) if not m.get("final")}
    resumed_losses = {m["step"]: m["loss"] for m in metrics(out) if not m.get("final") and m["step"] > killed_at}
    assert resumed_losses and all(abs(resumed_losses[s] - reference_losses[s]) < 1e-4 for s in resumed_losses)


def test_two_emulated_nodes(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    out, port = tmp_path / "run", str(free_port())
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
               f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}", TRAIN,
               "--deepspeed", ds_config(tmp_path, 2), *COMMON, "--micro-batch-size", "2", "--out", str(out)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(), cwd=REPO))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outputs)
    check_identical_and_pruned(out, 2)


@pytest.mark.parametrize("problem", ["missing_json", "bad_json", "indivisible_batch", "contradicting_clipping"])
def test_bad_distributed_input(tmp_path, problem):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    clipping = tmp_path / "clip.json"
    clipping.write_text(json.dumps({**json.loads(Path(ds_config(tmp_path, 2)).read_text()), "gradient_clipping": 0.5}))
    extra = {
        "missing_json": ["--deepspeed", str(tmp_path / "nope.json")],
        "bad_json": ["--deepspeed", str(bad)],
        "indivisible_batch": ["--deepspeed", ds_config(tmp_path, 2), "--global-batch-size", "3"],
        "contradicting_clipping": ["--deepspeed", str(clipping), "--max-grad-norm", "1.0"],
    }[problem]
    result = launch(2, [*extra, *COMMON, "--out", str(tmp_path / "run")], timeout=300)
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]
    assert errors, result.stderr[-2000:]
    expected = {"missing_json": "file not found", "bad_json": "invalid JSON", "indivisible_batch": "not divisible",
                "contradicting_clipping": "gradient_clipping=0.5 contradicts the trainer's max_grad_norm=1.0"}[problem]
    assert any(expected in line for line in errors), errors
    assert not (tmp_path / "run").exists()  # refused before anything was written
