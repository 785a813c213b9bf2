"""Choosing uniform mode's shape by measurement (APTConfig.uniform_shape_trials / uniform_shape_metric).

Uniform mode cuts every layer alike, so one (KV groups, FFN width, hidden size) is chosen for
the whole model, by summed salience: a first-order estimate, and after a short warm-up a noisy
one (on SmolLM2 SST-2 after 5 warm-up steps it cut the hidden size to 504 of 576; after 14 it
kept all 576 and cut only FFN neurons). So the best few shapes by salience (only shapes that use
the budget: none that another beats in every dimension, none that leaves more than one FFN block
per layer unused beyond salience's choice) are tried: the masks are set to each shape's kept
units, forward passes without gradients over the step's micro-batches score it, and the lowest
score wins. Units inside the chosen shape are still picked by salience.

The default score is the task loss on the supervised tokens (`Trainer.evaluate`).
`uniform_shape_metric="kl"` scores KL(shape || current model) of the next-token distributions at
every token of the step instead (`divergence_measure`), for steps without labels; on SmolLM2 it
chose as the task loss did at 144 steps and on instruction data, and scored lower at 48 steps
(docs/BENCHMARKS.md, "Uniform shapes by measured loss"). A language-model loss over all text was
tried too and is not offered: once the task is being learned it no longer tracks it.

Every rank tries the same shapes in the same order (ZeRO-3 gathers weights inside forward, a
collective) and the sums are reduced over ranks, so all ranks choose alike.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from apt_ds.algorithm.kl import kl_divergence_sum
from apt_ds.algorithm.masks import UnitMasks
from apt_ds.algorithm.pruner import GradualMasker, KeepDecision, uniform_shape_of
from apt_ds.distributed.placement import move_batch
from apt_ds.training.forward import supervised_token_count, valid_token_count

Measure = Callable[[], float]  # the loss of the model with the masks as they are set


def choose_by_loss(candidates: list[KeepDecision], masks: UnitMasks,
                   make_measure: Callable[[], Measure]) -> tuple[KeepDecision, list[dict]]:
    """The candidate with the lowest measure (the loss of the masked model, identical on every
    rank), and one record per trial. `make_measure()` is called once, only when there is a choice
    (a single candidate is taken without a forward pass) and before any candidate's masks are set
    (the divergence takes its reference then). The masks are set to each candidate's kept units in
    turn and restored afterwards, so partly decayed masks carry on unchanged. Ties go to the
    earlier candidate (better by salience)."""
    if len(candidates) == 1:  # nothing to choose (every rank has the same candidates)
        return candidates[0], []
    measure = make_measure()
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


# Real tokens per rank and step at which divergence_measure compares distributions: it keeps the
# reference's (tokens x vocabulary) log-probabilities, 1024 x 128k x 4 bytes = 512 MB for a LLaMA-3
# vocabulary (128 MB for LLaMA-2's 32k). Every row keeps at least one position, so a rank with more
# than 1024 rows per step exceeds it. Steps with fewer tokens use every one (SmolLM2: an SST-2 step
# has about 140, an instruction step at most 512).
TRIAL_TOKENS = 1024


def trial_positions(attention_mask: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(1D positions, (batch, positions) bool of the real tokens there): every position some row
    has a token at, or `limit` of them evenly spaced (the same every time: the trials compare alike)."""
    columns = attention_mask.bool().any(0).nonzero().flatten()
    if len(columns) > limit:
        columns = columns[torch.linspace(0, len(columns) - 1, limit, device=columns.device).round().long()]
    return columns, attention_mask.bool()[:, columns]


def divergence_measure(forward_no_grad, batches: list[dict], reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                       token_budget: int = TRIAL_TOKENS) -> Callable[[], float]:
    """A `measure` for choose_by_loss: the mean over tokens (all ranks) of KL(masked || reference)
    between next-token distributions, the reference being the model as it is when this is called
    (its current masks and adapters; computed here, so before any candidate's masks are set).
    `batches` are on the model's device; `forward_no_grad` runs the model without gradients (which
    also keeps salience from counting these passes). Each micro-batch's rows share
    `token_budget` / micro-batches / rows positions."""
    prepared = []
    for batch in batches:
        mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
        limit = max(1, token_budget // (len(batches) * mask.shape[0]))
        positions, real = trial_positions(mask, limit)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        prepared.append((inputs, positions, real))

    def log_probs(inputs, positions, real) -> torch.Tensor:
        logits = forward_no_grad(**inputs, logits_to_keep=positions, use_cache=False).logits
        return F.log_softmax(logits[real].float(), -1)

    reference = [log_probs(*entry) for entry in prepared]

    def measure() -> float:
        totals = torch.zeros(2, dtype=torch.float64)
        for entry, ref in zip(prepared, reference):
            candidate = log_probs(*entry)
            kl = kl_divergence_sum(candidate, ref)  # KL(candidate || reference): the spec's distillation direction
            totals += torch.tensor([float(kl), float(candidate.shape[0])], dtype=torch.float64)
        totals = reduce_sum(totals)
        return float(totals[0] / totals[1].clamp_min(1))

    return measure


def metric_measure(metric: str, task_loss: Measure, forward_no_grad, batches: list[dict],
                   reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], Measure]:
    """choose_by_loss's `make_measure` for APTConfig.uniform_shape_metric: `task_loss` as given,
    or the divergence on `batches` (on the model's device)."""
    if metric == "task":
        return lambda: task_loss
    return lambda: divergence_measure(forward_no_grad, batches, reduce_sum)


def measure_uniform_shape(trainer, candidates: Callable[[], list[KeepDecision]], event_step: int):
    """Uniform mode's (KV groups, hidden) for the event at `event_step`, measured on the trainer's
    current step (`trainer.trial_batches`, the whole step: the choice does not depend on how it is
    split into micro-batches) by `uniform_shape_metric`: ((groups, hidden), trial records,
    seconds), or None when no rank has a token to measure (the task metric on a step without
    supervised tokens). Checked identical on every rank."""
    started = time.perf_counter()
    batches = trainer.trial_batches
    count = supervised_token_count if trainer.apt_config.uniform_shape_metric == "task" else valid_token_count
    tokens = trainer.backend.all_reduce_sum(torch.tensor([float(sum(count(b) for b in batches))], dtype=torch.float64))
    if float(tokens[0]) == 0:
        return None
    options = candidates()
    counts = trainer.backend.all_gather_object(len(options))  # whether forwards run must agree: ZeRO-3's are collective
    if len(set(counts)) != 1:
        raise RuntimeError(f"uniform shape candidates for the event at step {event_step} differ across ranks: {counts}")
    make_measure = metric_measure(trainer.apt_config.uniform_shape_metric, lambda: trainer.evaluate(batches),
                                  trainer.backend.forward_no_grad, [move_batch(b, trainer.device) for b in batches],
                                  trainer.backend.all_reduce_sum)
    chosen, trials = choose_by_loss(options, trainer.state.masks, make_measure)
    shapes = trainer.backend.all_gather_object(uniform_shape_of(chosen))
    if len(set(shapes)) != 1:
        raise RuntimeError(f"uniform shapes measured for the event at step {event_step} differ across ranks: {shapes}")
    return shapes[0], trials, time.perf_counter() - started
