"""Choosing uniform mode's shape by measured loss (APTConfig.uniform_shape_trials).

Uniform mode cuts every layer alike, so one (KV groups, FFN width, hidden size) is chosen for
the whole model. Summed salience ranks those shapes by a first-order estimate, which misjudges
hidden channels: a residual-stream channel feeds every layer and every RMSNorm's statistics, so
removing 6% of them is no small perturbation. On SmolLM2-135M at density 0.7 the salience sum
preferred hidden 504 where keeping all 576 channels (with one KV group or some FFN neurons
fewer) lost less of the language-model loss (docs/BENCHMARKS.md, "Uniform shapes by measured loss").
So the best few shapes by salience (only shapes that use the budget: none that another beats in
every dimension) are tried: the masks are set to each shape's kept units, a forward pass without
gradients per micro-batch of the step scores the next-token loss over its real tokens, and the
lowest loss wins. Units inside the chosen shape are still picked by salience.

Every rank tries the same shapes in the same order (ZeRO-3 gathers weights inside forward, a
collective) and the loss sums are reduced over ranks, so all ranks choose alike.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from apt_ds.algorithm.masks import UnitMasks
from apt_ds.algorithm.pruner import GradualMasker, KeepDecision, uniform_shape_of


def language_model_batch(batch: dict, max_positions: int = 256) -> dict:
    """The batch with its real tokens as labels: a shape is judged on the text the model reads,
    not only the few response tokens an instruction or classification row supervises (SST-2
    supervises one token per row, too few to rank shapes). Every k-th position is labelled, k
    chosen so that at most `max_positions` per row are: the trial's (positions x vocabulary)
    logits stay as small as a training step's (2,048-token rows and a 128k vocabulary would
    otherwise need ~4 GB per row in fp32)."""
    ids = batch["input_ids"]
    stride = -(-ids.shape[1] // max_positions)
    labels = torch.full_like(ids, -100)
    labels[:, ::stride] = ids[:, ::stride]
    labels[:, 0] = -100  # not predicted by any position (the loss shifts by one)
    if "attention_mask" in batch:
        labels = labels.masked_fill(batch["attention_mask"] == 0, -100)
    return {**batch, "labels": labels}


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
