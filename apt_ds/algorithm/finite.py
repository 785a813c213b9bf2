"""Non-finite numbers (NaN, inf) never pass silently: one error type, and the checks that name
the first offending tensor.

A diverged run (a learning rate far too high) turns gradients, then adapters, then salience into
NaN. Everything downstream would go on as if the numbers were good: a pruning decision taken on
NaN scores, a checkpoint of NaN weights marked finished, an export that "succeeds". Every place
that acts on such numbers calls one of these checks first and raises `NonFiniteError`, which
the command lines print as one line.
"""

from __future__ import annotations

from typing import Iterable

import torch


class NonFiniteError(RuntimeError):
    """A loss, gradient, score or weight is NaN or infinite where a decision, a checkpoint or an
    export would use it; the message names the step or tensor and what to do."""


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite (one host read: call it where a decision is made, not per step)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    return bool(torch.isfinite(tensor).all())


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite, in one host read per device (not one per tensor)."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.is_floating_point() and tensor.numel():
            flags.setdefault(tensor.device, []).append(torch.isfinite(tensor).all())
    return all(bool(torch.stack(device_flags).all()) for device_flags in flags.values())


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor holding a NaN or inf, with how many of its elements are; None if all are finite."""
    named = list(named)
    if all_finite(tensor for _, tensor in named):
        return None
    for name, tensor in named:
        if not is_finite(tensor):
            bad = int((~torch.isfinite(tensor)).sum())
            return f"{name} ({bad:,} of {tensor.numel():,} values NaN or inf)"
    return None


def require_finite(named: Iterable[tuple[str, torch.Tensor]], what: str, advice: str) -> None:
    """Raise NonFiniteError naming the first non-finite tensor of `named`: "`what`: NAME (...) is not finite; `advice`"."""
    bad = first_nonfinite(named)
    if bad is not None:
        raise NonFiniteError(f"{what}: {bad} is not finite; {advice}")
