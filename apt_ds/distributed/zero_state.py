"""The trainable state of a ZeRO engine as full tensors: read it out, write it back in.

A shape change and a checkpoint both move the same state: each trainable parameter's fp32
master and Adam moments as full, unpartitioned fp32 tensors identical on every rank, plus the
Adam step. Reading uses DeepSpeed's public `safe_get_full_*`; writing uses `safe_set_full_*`
on ZeRO-1/2 and, on ZeRO-3, a local copy of this rank's slice (see `set_full_state`). Every
function that gathers or scatters is collective: call it on every rank, in the same order.
"""

from __future__ import annotations

from typing import Iterator

import torch

from apt_ds.algorithm.edits import Grow, ShapeChange, apply_edits
from apt_ds.distributed import deepspeed_private as private
from apt_ds.distributed.backend import carry_adam_moment

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
FullState = dict[str, torch.Tensor]  # "master", "exp_avg", "exp_avg_sq" -> full fp32 CPU tensor


def full_shape(param) -> tuple[int, ...]:
    """A parameter's full shape, ZeRO-3 partitioned or not (`ds_shape`: read as public)."""
    return tuple(getattr(param, "ds_shape", param.shape))


@torch.no_grad()
def copy_rank_slice(partition: torch.Tensor, full: torch.Tensor, rank: int) -> None:
    """partition[:] = flat(full)[rank * n : (rank + 1) * n], zero where DeepSpeed padded."""
    size = partition.numel()
    piece = full.reshape(-1)[size * rank : size * (rank + 1)]
    flat = partition.data.view(-1)
    flat[: piece.numel()].copy_(piece.to(flat.dtype))
    flat[piece.numel():].zero_()


def adam_step(engine) -> torch.Tensor | None:
    """The Adam step of the flat fp32 partitions (None before the first step: state is lazy)."""
    basic = private.basic_optimizer(engine)
    flats = [f for f in private.flat_fp32_partitions(engine.optimizer) if f in basic.state and basic.state[f]]
    return basic.state[flats[0]]["step"].detach().clone() if flats else None


def full_states(trainable: dict[str, torch.nn.Parameter], moments: bool) -> Iterator[tuple[str, torch.nn.Parameter, FullState]]:
    """(name, param, full state) per trainable param; consume the whole iterator on every rank."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    for name, param in trainable.items():
        entry = {"master": safe_get_full_fp32_param(param).detach().cpu().clone()}
        if moments:
            for key in ADAM_MOMENTS:
                entry[key] = safe_get_full_optimizer_state(param, key).detach().cpu().clone()
        yield name, param, entry


def snapshot(engine, trainable: dict[str, torch.nn.Parameter]) -> tuple[dict[str, FullState], torch.Tensor | None]:
    """The full state of every trainable param by name, and the Adam step (collective)."""
    step = adam_step(engine)
    return {name: entry for name, _, entry in full_states(trainable, step is not None)}, step


def init_adam_state(engine, step: torch.Tensor) -> None:
    """Create the (lazy) Adam state of every flat fp32 partition with zero moments at `step`,
    so that full moments have somewhere to be written. Behaves exactly like the lazy state."""
    zero_optimizer, basic = engine.optimizer, private.basic_optimizer(engine)
    for flat in private.flat_fp32_partitions(zero_optimizer):
        basic.state[flat] = {"step": step.clone(), "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
    private.relink_fragment_states(zero_optimizer)


def set_full_state(engine, zero_stage: int, param, master: torch.Tensor, moments: dict[str, torch.Tensor],
                   model_copy: bool = False) -> None:
    """Write full tensors into this rank's partitions (collective under ZeRO-1/2). `model_copy`:
    also set the model's working copy (bf16/fp16 or fp32) from the master, which the optimizer
    otherwise does only at its next step."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if zero_stage == 3:
        _set_zero3_state(engine.optimizer, param, master, moments, model_copy)
        return
    safe_set_full_fp32_param(param, master)
    for key, value in moments.items():
        safe_set_full_optimizer_state(param, value, key)
    if model_copy:
        with torch.no_grad():
            param.data.copy_(master.view(param.shape))


def _set_zero3_state(zero_optimizer, param, master: torch.Tensor, moments: dict[str, torch.Tensor],
                     model_copy: bool) -> None:
    """ZeRO-3: copy this rank's slice of each full tensor into its partitions, locally (DeepSpeed's
    `safe_set_full_*` fails on the last rank for sizes not divisible by the world size)."""
    rank = private.zero3_partition_rank(zero_optimizer, param)
    for key, value in (("master", master), *moments.items()):
        private.zero3_fp32_partition(zero_optimizer, param, None if key == "master" else key,
                                     lambda partition, value=value: copy_rank_slice(partition, value, rank))
    if model_copy:  # the model's own partition (bf16/fp16 or fp32), without a gather
        copy_rank_slice(private.model_partition(param).tensor, master, rank)


def restore_after_change(engine, zero_stage: int, trainable: dict[str, torch.nn.Parameter],
                         snap: dict[str, FullState], step: torch.Tensor | None, change: ShapeChange) -> None:
    """Write the snapshot taken before a shape change into the rebuilt engine: every param that
    existed before gets its master and moments with `change[name]` applied (grown entries take
    the new parameter's values and zero moments); new names keep their values, zero moments."""
    from deepspeed.utils import safe_get_full_fp32_param

    if step is not None:
        init_adam_state(engine, step)
    for name, param in trainable.items():
        if name not in snap:
            continue
        edits = change.get(name, [])
        fill = safe_get_full_fp32_param(param).cpu() if any(isinstance(e, Grow) for e in edits) else None
        master = apply_edits(snap[name]["master"], edits, fill=fill)
        if tuple(master.shape) != full_shape(param):
            raise RuntimeError(f"{name}: edits give shape {tuple(master.shape)} but the new parameter is {full_shape(param)}")
        moments = {key: carry_adam_moment(key, snap[name][key], edits) for key in ADAM_MOMENTS} if step is not None else {}
        set_full_state(engine, zero_stage, param, master, moments)
