"""APT vs LoRA training time over whole runs, as a user runs them: `launch/train.py`, one run at a time.

Each repeat runs the LoRA command and the APT command once, alone on the machine, one after the
other (the order alternates between repeats, so drift in the machine's speed falls on both);
reported per run: the training loop's wall time (`train_time_s` of the run's final metrics
record: every step, pruning event, teacher pass and periodic checkpoint), the whole process's
wall time (imports, model load, final checkpoint included) and its CPU time; per repeat the
APT/LoRA ratios, and their medians. Unlike `quality.py` (two runs share the machine, and the
longer run's tail has it alone) no run here shares the machine with another.

    python benchmarks/prepare_instructions.py --out bench_out/tasks
    python benchmarks/train_time.py --task bench_out/tasks/instruct --steps 64 --max-seq-len 128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_model_arguments, command_line, ensure_hf_model, git_commit, hardware, write_json  # noqa: E402

from apt_ds.models import DEFAULT_ADAPTER_TARGETS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def train_command(method: str, args, hf_dir: Path, out: Path) -> list[str]:
    """The launch/train.py command of one run: quality.py's settings (q/v adapters at rank 8, LR
    2e-3, 10% LR warm-up, unpacked rows, the schedule of APTConfig.for_steps)."""
    command = [sys.executable, str(ROOT / "launch" / "train.py"), "--model", str(hf_dir),
               "--data", str(Path(args.task) / "train.jsonl"), "--out", str(out), "--method", method,
               "--steps", str(args.steps), "--micro_batch_size", str(args.micro_batch_size), "--lr", "2e-3",
               "--warmup_steps", str(max(1, args.steps // 10)), "--max_seq_len", str(args.max_seq_len), "--no_pack",
               "--adapter_targets", *DEFAULT_ADAPTER_TARGETS, "--adapter_rank", "8", "--adapter_alpha", "16",
               "--seed", str(args.seed), "--log_every", str(args.steps)]
    return command + (["--target_density", str(args.density)] if method == "apt" else [])


def run_once(command: list[str], out: Path, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    completed = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if completed.returncode != 0:
        raise SystemExit(f"error: a training run failed ({' '.join(command)}):\n{completed.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    final = next(r for r in reversed(records) if r.get("final"))
    return {"train_time_s": final["train_time_s"], "process_wall_s": wall,
            "process_cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "density": final["density"], "rss_mb": final.get("rss_mb"), "peak_rss_mb": final.get("peak_rss_mb")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--task", default="bench_out/tasks/instruct", help="a task directory (prepare_instructions.py, prepare_tasks.py)")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--density", type=float, default=0.7, help="APT's target density")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (quality.py and phase_cost.py use 1)")
    parser.add_argument("--json", type=Path, default=Path("bench_out/train_time.json"))
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 2 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1 and --steps >= 2")
    if not (Path(args.task) / "train.jsonl").is_file():
        parser.error(f"{args.task}/train.jsonl not found: run benchmarks/prepare_instructions.py or prepare_tasks.py first")
    hf_dir = ensure_hf_model(args.model, args.hf_cache).resolve()
    runs: dict[str, list[dict]] = {"lora": [], "apt": []}
    scratch = Path(tempfile.mkdtemp(prefix="apt_train_time_"))
    try:
        for repeat in range(args.repeats):
            for method in ("lora", "apt") if repeat % 2 == 0 else ("apt", "lora"):
                out = scratch / f"{method}{repeat}"
                result = run_once(train_command(method, args, hf_dir, out), out, args.threads)
                runs[method].append(result)
                shutil.rmtree(out)  # checkpoints of a 135M model: ~0.5 GB a run
                print(f"[train_time] repeat {repeat} {method}: loop {result['train_time_s']:.1f} s, process "
                      f"{result['process_wall_s']:.1f} s wall / {result['process_cpu_s']:.1f} s CPU, density {result['density']:.3f}",
                      flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ratios = {key: [a[key] / l[key] for a, l in zip(runs["apt"], runs["lora"])]
              for key in ("train_time_s", "process_wall_s", "process_cpu_s")}
    summary = {key: statistics.median(values) for key, values in ratios.items()}
    write_json(args.json, {"command": command_line(), "git_commit": git_commit(), "hardware": hardware(),
                           "settings": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                           "apt_over_lora": ratios, "apt_over_lora_median": summary})
    print("[train_time] APT / LoRA, median over repeats: " +
          ", ".join(f"{key} {value:.3f}" for key, value in summary.items()))


if __name__ == "__main__":
    main()
