"""A decoder output scale that follows the hidden size (T5 v1.0: the decoder's output times
d_model ** -0.5 before the tied LM head). The run trained at the original d_model; an export whose
config says the pruned one would scale by the new value in stock transformers, so the ratio is
folded into the norm before the head, and the in-memory model scales by its new d_model too."""

from __future__ import annotations

import math

import torch

from apt_ds.models import family_of


def fold_output_scale(model) -> None:
    """Make `model` (compacted, its config at the pruned hidden size) compute what it trained to
    compute when it scales by its config's d_model (a family without such a scale: nothing)."""
    family = family_of(model)
    if family.output_scale is None:
        return
    flag, norm, attribute = family.output_scale
    hidden, scaled_by = model.config.hidden_size, getattr(model, attribute)
    if getattr(model.config, flag, False) and scaled_by != hidden:
        with torch.no_grad():  # hidden ** -0.5 * (w * sqrt(hidden / scaled_by)) == scaled_by ** -0.5 * w
            model.get_submodule(norm).weight.mul_(math.sqrt(hidden / scaled_by))
    setattr(model, attribute, hidden)
