"""Where a rank's memory goes during training: the per-rank breakdown of issue 47.

    python benchmarks/zero3_memory.py --shape llama-3.2-1b --model-dir /tmp/apt_llama1b --ranks 2 --out bench_out/mem1b
    python benchmarks/zero3_memory.py --shape llama-3.2-3b --model-dir /tmp/apt_llama3b --ranks 2 --out bench_out/mem3b
    python benchmarks/zero3_memory.py ... --method lora           # the same run without pruning
    python benchmarks/zero3_memory.py --shape given --model-dir SMOLLM2 --method both --ds-config ds_configs/zero2.json \
        --steps 150 --apt-args "--target-density 0.7" --profile-steps "" --resident   # APT beside LoRA (Pss)

Runs launch/train.py (APT or LoRA, ZeRO-3 unless --ds-config says otherwise) with a random model
of a published LLaMA shape (written once by benchmarks/llama_scale.py's writer), and in each rank:
- at the start of each profiled step, what the rank holds by owner (`_memory_trace.held_breakdown`:
  its partitions, whole parameters, optimizer, APT state, ...), with RssAnon and malloc's count;
- during the profiled steps and events, torch's profiler records every allocation: the replay
  gives the peak above the step's start and what was live at that moment, by the frame that
  allocated it;
- RssAnon sampled every 0.2 s by this driver, split into phases as llama_scale.py does.
Nothing is asserted; OUT/memory.json holds everything, docs/BENCHMARKS.md the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for entry in (str(ROOT), str(ROOT / "benchmarks")):
    if entry not in sys.path:
        sys.path.insert(0, entry)

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0)


def worker(trace_out: Path, profile_steps: set[int], baseline: bool, train_argv: list[str]) -> int:
    """A training rank: launch/train.py's main with the steps (and what follows each: decisions,
    events) in `profile_steps` traced. `baseline`: as before issue 47's fixes (gloo's gathers in
    one piece, glibc's mmap threshold left to adapt)."""
    import _memory_trace as trace
    import torch.distributed as dist

    import apt_ds.distributed.gloo_gather as gloo_gather
    import apt_ds.training.run as run
    from apt_ds.cli.train import main
    from apt_ds.training import trainer as trainer_module

    if baseline:
        gloo_gather.PIECE_BYTES = 2**62
    if baseline or os.environ.get("APT_BENCH_ADAPTIVE_MMAP") == "1":  # --adaptive-mmap
        run.large_allocations_returned = lambda device: False

    records: list[dict] = []
    train_step, after_step = trainer_module.APTrainer._train_step, trainer_module.APTrainer._after_step

    def traced(kind, original):
        def traced_call(self, *args):
            step = self.step
            if step not in profile_steps:
                return original(self, *args)
            entry = {"kind": kind, "step": step, "start": trace.now(), "rss_at_start": trace.rss_mb(),
                     "malloc_at_start": trace.mallinfo_mb(), "held_at_start_mb": trace.held_breakdown(self)}
            with trace.allocations_recorded() as prof:
                result = original(self, *args)
            entry.update(end=trace.now(), rss_at_end=trace.rss_mb(), malloc_at_end=trace.mallinfo_mb(), **trace.replay(prof))
            del prof
            entry["large_tensors_after"] = trace.large_tensors()
            records.append(entry)
            return result
        return traced_call

    trainer_module.APTrainer._train_step = traced("step", train_step)
    trainer_module.APTrainer._after_step = traced("after the step (decision, event)", after_step)
    try:
        return main(train_argv)
    finally:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))
        path = trace_out.with_name(f"{trace_out.stem}_rank{rank}.json")
        path.write_text(json.dumps(records, indent=1))


def driver() -> None:
    import llama_scale
    from _common import git_commit, hardware

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["llama-3.2-1b", "llama-3.2-3b", "given"], default="llama-3.2-1b",
                        help="the random model written to --model-dir once; given: --model-dir is a model already")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/apt_llama1b"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--method", choices=["apt", "lora", "both"], default="apt",
                        help="both: LoRA then APT, the same batches, side by side in OUT/memory.json")
    parser.add_argument("--ds-config", type=Path, default=None,
                        help="default: ds_configs/zero3.json with gathered weights released after use")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile-steps", default="1,3,4,8",
                        help="steps (and what follows each: decisions, events) traced by the profiler")
    parser.add_argument("--apt-args", default="--target-density 0.7 --pruning-start-step 2 --pruning-end-step 6 "
                                              "--num-pruning-events 2", help="train.py flags of the APT run")
    parser.add_argument("--train-args", default="", help="more train.py flags, for both methods (e.g. --data)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench_out" / "zero3_memory")
    parser.add_argument("--baseline", action="store_true",
                        help="as before issue 47's fixes: gloo gathers in one piece, glibc's mmap threshold adapting")
    parser.add_argument("--one-process", action="store_true", help="no DeepSpeed: launch/train.py in one process")
    parser.add_argument("--adaptive-mmap", action="store_true",
                        help="leave glibc's mmap threshold adapting (the fix's other half still on): its cost alone")
    parser.add_argument("--resident", action="store_true",
                        help="sample Pss (file-backed pages too, each once: a one-process or ZeRO-2 model may stay "
                             "mapped), not RssAnon")
    args = parser.parse_args()
    resident = args.resident
    if resident:
        llama_scale.rss_anon_mb = _resident_mb
    args.out.mkdir(parents=True, exist_ok=True)
    if args.adaptive_mmap:
        os.environ["APT_BENCH_ADAPTIVE_MMAP"] = "1"
    if args.shape != "given":
        llama_scale.write_model(args.model_dir, LLAMA_1B if args.shape == "llama-3.2-1b" else llama_scale.LLAMA_3B)
    if args.ds_config is None:
        ds = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
        ds["zero_optimization"].update(stage3_max_live_parameters=0, stage3_max_reuse_distance=0)
        args.ds_config = args.out / "ds_config.json"
        args.ds_config.write_text(json.dumps(ds, indent=1))
    methods = ["lora", "apt"] if args.method == "both" else [args.method]
    results = {method: measure(args, method, args.out / method if len(methods) > 1 else args.out) for method in methods}
    result = {"command": " ".join([sys.executable, *sys.argv]), "shape": args.shape, "ranks": args.ranks,
              "baseline": args.baseline, "adaptive_mmap": args.adaptive_mmap,
              "rss": "Pss (anonymous + file-backed)" if resident else "RssAnon", "hardware": hardware(), "commit": git_commit(),
              "ds_config": json.loads(args.ds_config.read_text())["zero_optimization"],
              **(results[methods[0]] if len(methods) == 1 else {"by_method": results})}
    (args.out / "memory.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1)[:4000])


def measure(args, method: str, out: Path) -> dict:
    """One run of `method` with per-rank RSS phases and the profiled steps' traces."""
    import shlex

    import llama_scale

    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    run_dir = out / "run"
    train_argv = ["--deepspeed", str(args.ds_config), "--model", str(args.model_dir), "--micro-batch-size", "1",
                  "--max-seq-len", "64", "--steps", str(args.steps), "--method", method,
                  "--checkpoint-every", "0", "--out", str(run_dir), "--overwrite", "--interval-memory-peaks", "true",
                  *shlex.split(args.train_args)]
    if method == "apt":
        train_argv += shlex.split(args.apt_args)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.ranks),
           "--master_port", str(llama_scale.free_port()), str(Path(__file__).resolve()), "--worker",
           str(out / "trace.json"), args.profile_steps, str(int(args.baseline)), "@@train", *train_argv]
    if args.one_process:  # launch/train.py itself, no DeepSpeed, no profiler: RSS phases only
        cmd = [sys.executable, str(ROOT / "launch" / "train.py"), *train_argv[2:]]
    started = time.time()
    samples = llama_scale.run_sampled(cmd, env, out / "train.log", rank_processes=not args.one_process)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    traces = {path.stem: json.loads(path.read_text()) for path in sorted(out.glob("trace_rank*.json"))}
    return {"method": method, "rss_anon_peak_mb_by_rank": llama_scale.phases(samples, metrics, started),
            "rank0_exact_peak_mb": exact_phases(metrics),
            "traces": traces, "step_time_s": [round(m["step_time_s"], 1) for m in metrics if not m.get("final")],
            "final_density": metrics[-1].get("density")}


def exact_phases(metrics: list[dict]) -> dict:
    """Rank 0's exact RSS peaks by phase, from its records' own peaks (`interval_peak_rss_mb`: the
    kernel's high-water mark, reset at each record; each record covers its step and the event
    after it, the first one the load too)."""
    steps = [m for m in metrics if not m.get("final") and "interval_peak_rss_mb" in m]
    if not steps:
        return {}
    events = [m["step"] for m in steps if m.get("event")]
    first, last = (min(events), max(events)) if events else (None, None)

    def peak(rows):
        return max((m["interval_peak_rss_mb"] for m in rows), default=None)

    return {"first_step_with_load": steps[0]["interval_peak_rss_mb"],
            "steps_before_the_first_event": peak(m for m in steps[1:] if first is None or m["step"] < first),
            "event_steps": peak(m for m in steps if m.get("event")),
            "steps_after_the_last_event": peak(m for m in steps if last is not None and m["step"] > last),
            "whole_run": max(m["peak_rss_mb"] for m in metrics if "peak_rss_mb" in m),
            "per_step": {m["step"]: m["interval_peak_rss_mb"] for m in steps}}


def _resident_mb(pid: int) -> float | None:
    """Pss of `pid` in MiB: file-backed pages count (weights read through mmap), each once."""
    from _common import proportional_set_mb

    return proportional_set_mb(pid)


def _is_rank(cmdline: list[str]) -> bool:
    return "zero3_memory.py" in " ".join(cmdline) and "deepspeed.launcher" not in " ".join(cmdline)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        at = sys.argv.index("--worker")
        rest = [a for a in sys.argv[at + 1:] if not a.startswith("--local_rank")]
        trace_out, steps, separator = Path(rest[0]), {int(s) for s in rest[1].split(",") if s}, rest.index("@@train")
        sys.exit(worker(trace_out, steps, rest[2] == "1", rest[separator + 1:]))
    import llama_scale

    llama_scale._is_rank = _is_rank  # the ranks run this script, not launch/train.py
    driver()
