"""What a trainer reads from and leaves in its `out_dir` besides checkpoints and metrics: each
rank's final decisions (and what it holds of a quantized base), the check that a new trainer
does not write over another run, and the micro-batches of a step (an iterator that runs dry is
named, not a bare StopIteration)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from apt_ds.algorithm.quant import is_quantized, logical_shape, storage_bytes
from apt_ds.config import ConfigError


def quantized_base(model) -> dict | None:
    """What this rank holds of a quantized base (its partitions under ZeRO-3, with the quantization
    state every rank keeps whole) in bytes, and the parameters it stands for; None: not quantized."""
    quantized = [p for p in model.parameters() if is_quantized(p)]
    if not quantized:
        return None
    return {"bytes": sum(storage_bytes(p) for p in quantized), "params": sum(math.prod(logical_shape(p)) for p in quantized)}


def write_rank_record(trainer) -> None:
    """What each rank ended at, so identical decisions can be verified: a digest of its kept units and
    adapter ranks (`shape_fingerprint`: the kept units themselves, ~14 MB at 70B, are in the
    checkpoint once), its adapter ranks and its shape (each layer's kept counts)."""
    directory = trainer.out_dir / "ranks"
    directory.mkdir(parents=True, exist_ok=True)
    record = {"rank": trainer.backend.rank, "world_size": trainer.backend.world_size,
              "shape_fingerprint": trainer.state.shape_fingerprint(), "ranks": trainer.state.ranks(),
              "shape": trainer.state.shape.to_dict()}
    if trainer.quantized_base_at_start is not None:
        record["quantized_base"] = {"at_start": trainer.quantized_base_at_start, "at_end": quantized_base(trainer.model)}
    (directory / f"rank{trainer.backend.rank}.json").write_text(json.dumps(record))


def check_unused_out_dir(out_dir: Path, backend) -> None:
    """A trainer that starts from step 0 must not write into another run's directory: its checkpoint
    would be replaced and its metrics.jsonl would mix two runs (launch/train.py checks --out before
    this; a library caller gets the same protection here). Rank 0, which writes the run, looks and
    tells the others: on another node a file system's cache may still show what rank 0 just moved
    aside (--overwrite), and a refusal on that rank alone would leave the rest waiting."""
    try:
        held = backend.is_main() and ((out_dir / "checkpoint").exists() or (out_dir / "metrics.jsonl").exists())
    except OSError as err:  # said on every rank, not only on rank 0 while the others wait
        held = f"out_dir {out_dir} cannot be read: {err}"
    rank0_saw = backend.all_gather_object(held)[0]  # True, False, or why out_dir cannot be read
    if isinstance(rank0_saw, str):
        raise ConfigError(rank0_saw)
    if rank0_saw:
        raise ConfigError(f"out_dir {out_dir} holds a run (checkpoint/ or metrics.jsonl): continue it with "
                          f"trainer.resume({out_dir / 'checkpoint'}) before train(), or train a fresh model and "
                          f"APTrainer into an empty out_dir")


def next_micro_batches(batches, count: int, step: int, steps: int) -> list[dict]:
    try:
        return [next(batches) for _ in range(count)]
    except StopIteration:
        raise ValueError(f"the batches ran out at step {step + 1} of {steps}: give at least steps x grad_accum_steps "
                         f"micro-batches (an iterator that repeats, e.g. apt_ds.io.data.batches)") from None
