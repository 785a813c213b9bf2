"""Where a pruning event's heap release goes: the wait for the device's queued work, the garbage
collection, and glibc's malloc_trim, timed apart.

The trainer times an event's parts on the host without synchronizing the device, so a part that
happens to wait for the shape change's queued kernels is charged with them. This script runs one
short APT training in this process (`apt_ds.cli.train.main`) with the trainer's
`release_free_heap` wrapped: before it, the device is synchronized (the wait is timed on its own),
then the collection and the trim are timed, each followed by a synchronize. It also records how
many objects the collector tracks and how many are frozen (`apt_ds.training.heap`).

    python benchmarks/event_heap_cost.py --device cuda --scale llama2-7b --work /tmp/ehc --json OUT.json
    python benchmarks/event_heap_cost.py --device cpu --scale small --work /tmp/ehc   # the same on a CPU
    # as on the H200's image, where a few objects were frozen before apt-ds started
    python benchmarks/event_heap_cost.py --device cpu --scale small --work /tmp/ehc --frozen-before
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

if "--frozen-before" in sys.argv:  # before the imports below, as that image froze its few start-up objects
    gc.freeze()
FROZEN_AT_START = gc.get_freeze_count()  # what the record reports, whichever way the script was started

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from apt_ds.training import trainer as trainer_module  # noqa: E402
from apt_ds.training.heap import trim_free_heap  # noqa: E402
from benchmarks._common import cpu_model_name, git_commit, positive_int, write_json  # noqa: E402
from benchmarks.gpu_check import SCALES, scale_data  # noqa: E402
from benchmarks.llama_scale import write_model  # noqa: E402


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_release(device: str, laps: list[dict]):
    """A stand-in for `release_free_heap` that does the same work and records where it went."""
    def release() -> bool:
        tracked, frozen = len(gc.get_objects()), gc.get_freeze_count()  # counted outside the timed parts
        started = time.perf_counter()
        synchronize(device)
        waited = time.perf_counter()
        unreachable = gc.collect()
        synchronize(device)
        collected = time.perf_counter()
        trimmed = trim_free_heap()
        done = time.perf_counter()
        laps.append({"device_wait_s": waited - started, "gc_collect_s": collected - waited,
                     "malloc_trim_s": done - collected, "trimmed": trimmed, "tracked_objects": tracked,
                     "frozen_objects": frozen, "collected_objects": unreachable})
        return trimmed
    return release


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)  # --frozen-before is read from sys.argv as typed
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", choices=sorted(SCALES), default="llama2-7b")
    parser.add_argument("--work", type=Path, required=True, help="the random model and the run")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--micro-batch", type=positive_int, default=4)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--frozen-before", action="store_true",
                        help="freeze the interpreter's objects before importing anything (read when the script starts)")
    args = parser.parse_args(argv)
    if args.steps < 8:
        parser.error("--steps must be at least 8 (the events are at steps 4, 6 and 8)")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device}: not a torch device (cuda, cuda:1, cpu)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here (use --device cpu --scale small)")
    if args.frozen_before and not FROZEN_AT_START:
        parser.error("--frozen-before is read when the script starts: run it as `python benchmarks/event_heap_cost.py ...`")

    from apt_ds.cli.train import main as train_main

    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / f"model-{args.scale}"
    write_model(model, SCALES[args.scale], dtype="bfloat16" if args.device != "cpu" else "float32", device=args.device)
    data = scale_data(SimpleNamespace(work=args.work))  # gpu_check's packed demo text
    laps: list[dict] = []
    original, trainer_module.release_free_heap = trainer_module.release_free_heap, timed_release(args.device, laps)
    try:
        code = train_main(["--device", args.device, "--out", str(args.work / "run"), "--overwrite", "--checkpoint-every", "0",
                           "--model", str(model), "--data", str(data), "--max-seq-len", "512",
                           "--micro-batch-size", str(args.micro_batch), "--grad-accum-steps", "1", "--steps", str(args.steps),
                           "--target-density", "0.7", "--gradient-checkpointing", "--pruning-start-step", "2",
                           "--pruning-end-step", "8", "--num-pruning-events", "3"])
    finally:
        trainer_module.release_free_heap = original
    parts = ("device_wait_s", "gc_collect_s", "malloc_trim_s")
    result = {"device": args.device, "scale": args.scale, "frozen_at_start": FROZEN_AT_START, "exit_code": code,
              "hardware": torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_model_name(),
              "commit": git_commit(), "events": laps,
              "median": {p: round(statistics.median(lap[p] for lap in laps), 4) for p in parts} if laps else {}}
    print(json.dumps(result, indent=1))
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    sys.exit(main()["exit_code"])
