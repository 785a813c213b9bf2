"""APT vs LoRA training cost per phase on SmolLM2-135M, paired step by step in one process.

LoRA and one APT trainer per --distill-every value (APT at --density; the same adapters, data,
steps and LR) each hold their own copy of the model; their optimizer steps alternate, so all
see the same machine load. Reported: CPU seconds (process time, one torch thread) of each
trainer per phase — warm-up (before the pruning phase), pruning (events, teacher passes,
salience), recovery (the final shape, no teacher) — and each APT's ratio to LoRA.
Pruning-event time (shrink + optimizer rebuild) is included in the step it follows.

    python benchmarks/prepare_tasks.py
    python benchmarks/phase_cost.py --distill-every 4 1 --json bench_out/phase_cost.json
    python benchmarks/phase_cost.py --task bench_out/tasks/instruct --steps 64 --max-seq-len 128 --shape-multiple 32 1
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import add_model_arguments, command_line, ensure_hf_model, git_commit, hardware, write_json  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--task", default="bench_out/tasks/sst2", help="a task directory made by prepare_tasks.py")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--density", type=float, default=0.7)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=64)
    parser.add_argument("--distill-every", type=int, nargs="+", default=None,
                        help="one APT trainer per value of APTConfig.distill_every (teacher pass every k-th pruning step; "
                             "default: APTConfig.for_steps' value for --steps)")
    parser.add_argument("--pruning-end-step", type=int, default=None,
                        help="APTConfig.pruning_end_step of every APT trainer (default: APTConfig.for_steps' 50%% of --steps)")
    parser.add_argument("--shape-multiple", type=int, nargs="+", default=None,
                        help="one APT trainer per value of APTConfig.shape_multiple (kept FFN widths and hidden size are "
                             "multiples of it; 1: single units) for each --distill-every (default: APTConfig's)")
    parser.add_argument("--json", type=Path, default=Path("bench_out/phase_cost.json"))
    args = parser.parse_args(argv)
    for flag, values in (("--distill-every", args.distill_every), ("--shape-multiple", args.shape_multiple)):
        if any(k < 1 for k in values or []):
            parser.error(f"{flag} values must be >= 1, got {values}")

    import torch
    from tqdm.auto import tqdm

    from apt_ds.config import APTConfig, ConfigError, TrainConfig, check_schedule_fits
    from apt_ds.io.data import batches, load_records, tokenize_dataset
    from apt_ds.io.modeling import load_model
    from apt_ds.io.tokenizer import load_tokenizer
    from apt_ds.training.trainer import APTrainer

    schedule = {} if args.pruning_end_step is None else {"pruning_end_step": args.pruning_end_step}
    try:  # before the model and data are loaded: an end step outside the run, or before the start
        apt = APTConfig.for_steps(args.steps, target_density=args.density, adapter_rank=8, adapter_alpha=16.0, **schedule)
        check_schedule_fits(apt, TrainConfig(steps=args.steps))
    except ConfigError as err:
        parser.error(str(err))
    torch.set_num_threads(1)
    hf_dir = ensure_hf_model(args.model, args.hf_cache)
    tokenizer = load_tokenizer(hf_dir)
    records = load_records(Path(args.task) / "train.jsonl")
    examples = tokenize_dataset(records, tokenizer, args.max_seq_len, pack=False)
    multiples = list(dict.fromkeys(args.shape_multiple or [apt.shape_multiple]))
    apt_configs = {f"apt_every{k}" + (f"_multiple{m}" if len(multiples) > 1 else ""):
                   dataclasses.replace(apt, distill_every=k, shape_multiple=m)
                   for k in dict.fromkeys(args.distill_every or [apt.distill_every]) for m in multiples}
    configs = {"lora": apt.as_lora(), **apt_configs}
    train = TrainConfig(steps=args.steps, micro_batch_size=args.micro_batch_size, lr=2e-3,
                        warmup_steps=max(1, args.steps // 10), max_seq_len=args.max_seq_len, seed=0, log_every=1)
    trainers = {name: APTrainer(load_model(hf_dir, mmap=False), config, train, progress=False) for name, config in configs.items()}
    pad_id = tokenizer.pad_token_id or 0
    streams = {name: batches(examples, args.micro_batch_size, train.seed, pad_id=pad_id) for name in trainers}
    cpu: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in tqdm(range(args.steps), desc="paired steps"):
        for name, trainer in trainers.items():
            started = time.process_time()
            trainer._train_step(streams[name])
            trainer._after_step()
            cpu[name].append(time.process_time() - started)
    phases = {"warm-up": (0, apt.pruning_start_step), "pruning": (apt.pruning_start_step, apt.pruning_end_step),
              "recovery": (apt.pruning_end_step, args.steps), "total": (0, args.steps)}
    result = {"command": command_line(), "git_commit": git_commit(), "hardware": hardware(), "steps": args.steps, "density": args.density,
              "pruning_start_step": apt.pruning_start_step, "pruning_end_step": apt.pruning_end_step,
              "task": args.task, "max_seq_len": args.max_seq_len, "micro_batch_size": args.micro_batch_size,
              "final_density": {name: t.state.density() for name, t in trainers.items()},
              "final_shape": {name: t.state.shape.to_dict() for name, t in trainers.items()},
              "shape_multiple": {name: configs[name].shape_multiple for name in apt_configs}, "cpu_s_per_step": cpu, "phases": {}}
    for phase, (lo, hi) in phases.items():
        lora_s = sum(cpu["lora"][lo:hi])
        result["phases"][phase] = {"steps": hi - lo, "lora_cpu_s": lora_s}
        for name in apt_configs:
            apt_s = sum(cpu[name][lo:hi])
            result["phases"][phase].update({f"{name}_cpu_s": apt_s, f"{name}_over_lora": apt_s / lora_s})
            print(f"[phase_cost] {phase:9s} steps {lo:3d}-{hi:3d}: {name} {apt_s:7.1f} s, LoRA {lora_s:7.1f} s, "
                  f"ratio {apt_s / lora_s:.3f}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
