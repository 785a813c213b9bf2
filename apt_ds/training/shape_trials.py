"""Choosing uniform mode's shape by measured loss (APTConfig.uniform_shape_trials).

Uniform mode cuts every layer alike, so one (KV groups, FFN width, hidden size) is chosen for
the whole model, by summed salience: a first-order estimate, and after a short warm-up a noisy
one (on SmolLM2 SST-2 after 5 warm-up steps it cut the hidden size to 504 of 576; after 14 it
kept all 576 and cut only FFN neurons). So the best few shapes by salience (only shapes that use
the budget: none that another beats in every dimension, none that leaves more than one FFN block
per layer unused beyond salience's choice) are tried: the masks are set to each
shape's kept units, a forward pass without gradients per micro-batch of the step scores the
training objective's loss on it, and the lowest loss wins. Units inside the chosen shape are
still picked by salience. The loss is the task's (the supervised tokens), not a language-model
loss over all text: once a task is being learned the latter no longer tracks it (on SST-2 it
preferred dropping KV groups, and accuracy fell; docs/BENCHMARKS.md, "Uniform shapes by
measured loss").

Every rank tries the same shapes in the same order (ZeRO-3 gathers weights inside forward, a
collective) and the loss sums are reduced over ranks, so all ranks choose alike.
"""

from __future__ import annotations

import math
from typing import Callable

from apt_ds.algorithm.masks import UnitMasks
from apt_ds.algorithm.pruner import GradualMasker, KeepDecision, uniform_shape_of


def choose_by_loss(candidates: list[KeepDecision], masks: UnitMasks,
                   measure: Callable[[], float]) -> tuple[KeepDecision, list[dict]]:
    """The candidate with the lowest `measure()` (the loss of the masked model, identical on every
    rank), and one record per trial. The masks are set to each candidate's kept units in turn and
    restored afterwards, so partly decayed masks carry on unchanged. Ties go to the earlier
    candidate (better by salience)."""
    if len(candidates) == 1:  # nothing to choose (every rank has the same candidates)
        return candidates[0], []
    saved = masks.state_dict()
    losses = []
    try:
        for decision in candidates:
            GradualMasker.snap(masks, decision)
            losses.append(float(measure()))
    finally:
        masks.load_state_dict(saved)
    finite = [loss if math.isfinite(loss) else math.inf for loss in losses]  # a NaN must not win
    best = min(range(len(candidates)), key=lambda i: (finite[i], i))
    trials = []
    for i, (decision, loss) in enumerate(zip(candidates, losses)):
        groups, hidden = uniform_shape_of(decision)
        trials.append({"kv_groups": groups, "ffn": int(decision.neurons[0].sum()), "hidden": hidden,
                       "salience_rank": i, "loss": loss if math.isfinite(loss) else None, "chosen": i == best})
    return candidates[best], trials
