"""Records of how a parameter's shape changed, so that optimizer state can follow it.

Shrinking keeps a subset of indices along a dim; rank growth appends entries along a dim.
The code that changes a parameter returns `ShapeChange = {param_name: [Edit, ...]}`; the
training backend applies the same edits to fp32 masters and Adam moments (new entries take the
new parameter's values for masters; for moments, see distributed.backend.carry_adam_moment).
This keeps the algorithm modules
free of any optimizer or DeepSpeed knowledge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Keep:
    """Keep `index` (sorted original positions) along `dim`."""

    dim: int
    index: torch.Tensor


@dataclass(frozen=True)
class Grow:
    """Append entries along `dim` until it has `new_size` entries."""

    dim: int
    new_size: int


Edit = Keep | Grow
ShapeChange = dict[str, list[Edit]]


def apply_edits(tensor: torch.Tensor, edits: list[Edit], fill: torch.Tensor | None = None) -> torch.Tensor:
    """Apply edits in order. Grown entries come from `fill` (same final shape) or are zeros."""
    out = tensor
    for edit in edits:
        if isinstance(edit, Keep):
            out = out.index_select(edit.dim, edit.index.to(out.device))
        else:
            extra = edit.new_size - out.shape[edit.dim]
            if extra < 0:
                raise ValueError(f"Grow to {edit.new_size} along dim {edit.dim} but size is {out.shape[edit.dim]}")
            pad_shape = list(out.shape)
            pad_shape[edit.dim] = extra
            pad = torch.zeros(pad_shape, dtype=out.dtype, device=out.device)
            out = torch.cat([out, pad], dim=edit.dim)
    if fill is not None and any(isinstance(e, Grow) for e in edits):
        # Entries that existed keep the carried values; new ones take the fill's values.
        probe = apply_edits(torch.ones_like(tensor, dtype=torch.float32), edits)
        carried = probe != 0
        out = torch.where(carried, out, fill.to(out.dtype).to(out.device))
    return out


def merge_changes(*changes: ShapeChange) -> ShapeChange:
    """Concatenate edit lists of successive changes made before one optimizer rebuild."""
    merged: ShapeChange = {}
    for change in changes:
        for name, edits in change.items():
            merged.setdefault(name, []).extend(edits)
    return merged


def full_or_index(index: torch.Tensor | None, size: int) -> torch.Tensor | None:
    """None when `index` keeps all `size` entries in order (nothing to slice), else `index`."""
    if index is None or (index.numel() == size and bool((index.cpu() == torch.arange(size)).all())):
        return None
    return index
