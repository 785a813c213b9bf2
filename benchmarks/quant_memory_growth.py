"""Does memory grow step over step on a quantized base (`--base-quant nf4`) once pruning is over?

Each arm trains SmolLM2-135M (APT to density 0.7) through `launch/train.py`'s own entry point
in a fresh process, one arm after the other, and records after every step, beside the trainer's
own rss_mb: RssAnon (/proc/self/status), glibc's heap in use and free inside the allocator
(`mallinfo2`: uordblks, fordblks; hblkhd: mmapped chunks) and the tensors alive (gc.get_objects,
deduplicated by storage). The default schedule ends pruning at 50% of the steps, so the second
half has fixed shapes: an object or tensor leak shows as live tensors or heap in use that grow
there, allocator retention as free heap (fordblks) that grows while the tensors do not.

    python benchmarks/quant_memory_growth.py --out bench_out/quant_memory_growth   # 4 arms, ~25 min on 2 cores
    python benchmarks/quant_memory_growth.py --report-only --out bench_out/quant_memory_growth

Arms (`--arms`): nf4, fp32 (glibc's defaults); nf4_arena2 (MALLOC_ARENA_MAX=2); nf4_trim
(malloc_trim(0) after every step, read before and after the trim).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _common import ROOT, hardware, write_json

ARMS = {  # name -> (base quant, environment, trim after every step)
    "nf4": ("nf4", {}, False),
    "fp32": ("none", {}, False),
    "nf4_arena2": ("nf4", {"MALLOC_ARENA_MAX": "2"}, False),
    "nf4_trim": ("nf4", {}, True),
    "nf4_mmap1m": ("nf4", {"MALLOC_MMAP_THRESHOLD_": str(2**20)}, False),  # a fixed threshold: blocks >= 1 MiB mmapped
    "fp32_mmap1m": ("none", {"MALLOC_MMAP_THRESHOLD_": str(2**20)}, False),
}


def status_mb(field: str) -> float:
    from _common import proc_status_mb

    return proc_status_mb(field).get(field, float("nan"))


def live_tensors() -> tuple[int, float]:
    """(tensors the collector sees, MiB of their distinct storages)."""
    import torch

    count, storages = 0, {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            count += 1
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # meta, sparse
                pass
    return count, sum(storages.values()) / 2**20


def step_peak_mb() -> float:
    """The peak RSS since the last call (or process start), then a new window (apt_ds.io.metrics)."""
    from apt_ds.io.metrics import mark_rss_peak, rss_peak_since_mark_mb

    peak = rss_peak_since_mark_mb()
    mark_rss_peak()
    return round(peak, 1)


def worker(args) -> None:
    """One arm: the CLI's training in this process, with every step's record extended."""
    sys.path.insert(0, str(ROOT))
    import apt_ds.training.trainer as trainer_module
    from apt_ds.cli.train import main
    from apt_ds.training.heap import malloc_counts, trim_free_heap

    original = trainer_module.memory_mb

    def memory_mb() -> dict:
        record = original()
        info = malloc_counts()
        tensors, tensor_mb = live_tensors()
        record.update(step_peak_mb=step_peak_mb(), rss_anon_mb=round(status_mb("RssAnon"), 1), heap_used_mb=round(info["uordblks"] / 2**20, 1),
                      heap_free_mb=round(info["fordblks"] / 2**20, 1), mmapped_mb=round(info["hblkhd"] / 2**20, 1),
                      live_tensors=tensors, live_tensor_mb=round(tensor_mb, 1), gc_objects=len(gc.get_objects()))
        if args.trim_each_step:
            trim_free_heap()
            record["rss_after_trim_mb"] = round(status_mb("VmRSS"), 1)
        return record

    trainer_module.memory_mb = memory_mb
    train = trainer_module.APTrainer.train

    def train_and_record_start(self, *a, **k):  # what loading left: its peak, RSS and heap as training starts
        info = malloc_counts()
        args.run_dir.joinpath("start.json").write_text(json.dumps({
            "load_peak_mb": step_peak_mb(), "rss_mb": round(status_mb("VmRSS"), 1),
            "heap_used_mb": round(info["uordblks"] / 2**20, 1), "heap_free_mb": round(info["fordblks"] / 2**20, 1)}))
        return train(self, *a, **k)

    trainer_module.APTrainer.train = train_and_record_start
    if args.stop_after:  # the phase before the first events is enough: end the process once it is logged
        log = trainer_module.APTrainer._log

        def log_then_stop(self, record):
            log(self, record)
            if self.step >= args.stop_after:
                os._exit(0)

        trainer_module.APTrainer._log = log_then_stop
    sys.exit(main(["--model", str(args.model), "--data", str(args.data), "--out", str(args.run_dir), "--overwrite",
                   "--target-density", "0.7", "--steps", str(args.steps), "--micro-batch-size", "4",
                   "--max-seq-len", str(args.max_seq_len), "--log-every", "1", "--checkpoint-every", "0", "--seed", "0",
                   "--base-quant", args.base_quant]))


def summarize(rows: list[dict], steps: int) -> dict:
    """The steps after the last pruning event: first and last values, and the median growth per step."""
    steps_rows = [r for r in rows if "step" in r and not r.get("final")]
    last_event = max((r["step"] for r in steps_rows if r.get("event")), default=0)
    after = [r for r in steps_rows if r["step"] > last_event]
    out = {"last_event_step": last_event, "steps_after": len(after), "peak_rss_mb": max(r["peak_rss_mb"] for r in steps_rows)}
    if "step_peak_mb" in steps_rows[0]:  # ru_maxrss no longer holds once VmHWM is reset: the steps' own peaks
        first_event = min((r["step"] for r in steps_rows if r.get("event")), default=last_event)
        out["peak_rss_mb"] = max(r["step_peak_mb"] for r in steps_rows)
        out["step_peak_before_first_event_mb"] = max(r["step_peak_mb"] for r in steps_rows if r["step"] < first_event)
        out["step_peak_after_last_event_mb"] = max((r["step_peak_mb"] for r in after), default=None)
    for key in ("step_peak_mb", "rss_mb", "rss_anon_mb", "heap_used_mb", "heap_free_mb", "mmapped_mb", "live_tensors", "live_tensor_mb",
                "gc_objects", "rss_after_trim_mb"):
        if after and key in after[0]:
            values = [r[key] for r in after]
            out[key] = {"first": values[0], "last": values[-1], "max": max(values),
                        "median_step_growth": statistics.median(b - a for a, b in zip(values, values[1:])) if len(values) > 1 else 0}
    out["step_time_s"] = statistics.median(r["step_time_s"] for r in steps_rows)
    return out


def report(out: Path) -> dict:
    result = json.loads((out / "result.json").read_text()) if (out / "result.json").exists() else {}
    for arm, entry in result.get("arms", {}).items():
        s = entry["summary"]
        cols = [f"{k} {s[k]['first']}->{s[k]['last']} (max {s[k]['max']})" for k in
                ("rss_mb", "rss_anon_mb", "heap_used_mb", "heap_free_mb", "live_tensors", "live_tensor_mb", "rss_after_trim_mb") if k in s]
        print(f"{arm:11s} at start {entry.get('start')}")
        print(f"{arm:11s} last event {s['last_event_step']}, peak {s['peak_rss_mb']:.0f} MB, step {s['step_time_s']:.2f} s: " + "; ".join(cols))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "bench_out/smollm2-135m-hf")
    parser.add_argument("--data", type=Path, default=ROOT / "bench_out/tasks/sst2/train.jsonl")
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, help="torch threads (OMP_NUM_THREADS); default: torch's own")
    parser.add_argument("--stop-after", type=int, default=0, help="end each arm after this step (0: run all steps)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=["nf4", "fp32", "nf4_arena2", "nf4_trim"])
    parser.add_argument("--out", type=Path, default=ROOT / "bench_out/quant_memory_growth")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--base-quant", help=argparse.SUPPRESS)
    parser.add_argument("--trim-each-step", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if not args.report_only:
        result_path = args.out / "result.json"
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
        result.update(hardware=hardware(), steps=args.steps, model=str(args.model), data=str(args.data),
                      max_seq_len=args.max_seq_len, threads=args.threads, stop_after=args.stop_after)
        result.setdefault("arms", {})
        for arm in args.arms:
            quant, env, trim = ARMS[arm]
            run_dir = args.out / arm
            command = [sys.executable, __file__, "--worker", "--model", str(args.model), "--data", str(args.data),
                       "--steps", str(args.steps), "--run-dir", str(run_dir), "--base-quant", quant,
                       "--max-seq-len", str(args.max_seq_len), "--stop-after", str(args.stop_after)]
            threads = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
            subprocess.run(command + (["--trim-each-step"] if trim else []), check=True, env={**os.environ, **env, **threads})
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            start = json.loads((run_dir / "start.json").read_text())
            result["arms"][arm] = {"start": start, "env": env, "trim_each_step": trim, "base_quant": quant,
                                   "summary": summarize(rows, args.steps), "steps": rows}
            write_json(result_path, result)
    report(args.out)


if __name__ == "__main__":
    main()
