"""Prune-then-tune: the standard baseline APT is compared with.

1. One-shot structured pruning of the pretrained model: score every unit (KV group, FFN
   neuron, hidden channel) by first-order salience on a few calibration batches — per
   channel the product of summed magnitudes (sum |X|) * (sum |dL/dX|), the activation form of
   the weight salience |W * dL/dW| (not Molchanov's |sum X * dL/dX|) — keep the best units under the exact parameter budget (the same
   `AdaptivePruner` ranking APT uses, uniform or not; a uniform shape is chosen among the best
   few by the task loss on the first calibration batch, as APT's events choose theirs,
   `training/shape_trials.py`), and physically remove the rest.
2. Plain LoRA fine-tuning of the shrunk model (`APTConfig.as_lora()`: the same adapters as
   APT, no pruning, no rank growth, no distillation).

The scores come from `SalienceCollector` hooks (the exact quantity APT uses, minus its
kurtosis outlier term, which is APT's addition, not part of the standard criterion). Its
hooks only see gradients when the activations require grad; the base model is frozen, so
the adapters of a temporary `APTModel` (B = 0: the function is the pretrained one) provide
the upstream `requires_grad`. The temporary adapters and hooks are removed afterwards and
the returned model is the family's plain causal LM (layers possibly of different shapes).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from apt_ds.algorithm.adapters import merge_adapters
from apt_ds.algorithm.pruner import AdaptivePruner, KeepDecision
from apt_ds.algorithm.state import APTModel
from apt_ds.algorithm.units import ModelShape
from apt_ds.config import APTConfig, TrainConfig
from apt_ds.training.forward import supervised_forward
from apt_ds.training.heap import release_free_heap
from apt_ds.training.shape_trials import choose_by_loss, metric_measure
from apt_ds.training.trainer import APTrainer


@dataclass
class OneShotResult:
    original_shape: ModelShape
    shape: ModelShape
    decision: KeepDecision
    calibration_tokens: int
    calibration_loss: float
    shape_trials: list[dict] = dataclasses.field(default_factory=list)  # uniform mode: the shapes measured

    @property
    def density(self) -> float:
        """Kept fraction of block parameters (the density APT reports)."""
        return self.shape.block_params() / self.original_shape.block_params()


def _scoring_config(config: APTConfig, target_density: float) -> APTConfig:
    """The scoring APTModel: adapters only for requires_grad; no transform, no kurtosis."""
    return dataclasses.replace(
        config, target_density=target_density, prune=True, distill=False, grow_ranks=False, use_kurtosis=False,
    )


@contextlib.contextmanager
def scoring_state(model, config: APTConfig):
    """An `APTModel` over `model` for scoring and cutting it once; afterwards `model` is a plain
    frozen causal LM of its family again, at whatever shape the block left it: hooks removed, the
    temporary adapters merged (B = 0: the frozen weights exactly), no gradients, its training
    mode restored. It scores in eval mode: dropout off, as apt-ds trains every model (a BERT
    checkpoint's dropout of 0.1 made the calibration's scores, and so prune-then-tune's choice,
    differ from process to process)."""
    was_training = model.training
    model.eval()
    state = APTModel(model, config, seed=0)
    try:
        yield state
    finally:
        state.masks.remove()
        state.salience.remove()
        merge_adapters(model)  # B == 0: merging restores the frozen weights exactly
        for param in model.parameters():
            param.grad = None
            param.requires_grad_(False)
        model.train(was_training)


def one_shot_prune(model, calibration_batches: Iterable[dict], target_density: float, config: APTConfig | None = None) -> OneShotResult:
    """Score units by first-order Taylor salience on `calibration_batches`, shrink `model`
    in place to `target_density` of its block parameters, and return what was kept.

    `config` supplies the unit kinds (prune_heads/neurons/hidden), `uniform` and
    `count_embeddings`; its schedule fields are irrelevant here. Scores are the product of
    the SUMMED factors over all calibration batches (one salience "step"), as APT sums
    them over gradient-accumulation micro-batches."""
    config = _scoring_config(config or APTConfig(), target_density)
    tokens, loss_sum, batches_seen, first = 0, 0.0, 0, None
    with scoring_state(model, config) as state:
        state.salience.enabled = True
        for batch in calibration_batches:
            # logits only where a label is supervised: the same loss and gradient as
            # model(**batch).loss without the (positions x vocabulary) tensor LoRA runs never build
            _, loss, _ = supervised_forward(model, batch)
            loss.backward()
            loss_sum += float(loss.detach())
            batches_seen += 1
            first = first or batch  # uniform shape trials measure on it
            tokens += int(batch.get("attention_mask", batch["input_ids"]).bool().sum()) if "attention_mask" in batch else batch["input_ids"].numel()
        if batches_seen == 0:
            raise ValueError("one_shot_prune needs at least one calibration batch")
        state.salience.end_step()
        state.salience.require_finite_scores("the one-shot pruning decision")  # an order over NaN is arbitrary
        s = state.salience
        target = target_density * state.original_shape.budget_params(config.count_embeddings)
        args = (state.shape, s.group_scores, s.neuron_scores, s.hidden_scores, target, state.original_shape)
        pruner = AdaptivePruner(config)
        if config.uniform and config.uniform_shape_trials > 1:  # as APT chooses its uniform shapes (shape_trials)
            state.salience.enabled = False
            # the divergence is taken from the unpruned model (its adapters are still zero)
            make_measure = metric_measure(config.uniform_shape_metric, lambda: float(supervised_forward(model, first, use_cache=False)[1]),
                                          model, [first], reduce_sum=lambda totals: totals)
            with torch.no_grad():
                decision, trials = choose_by_loss(pruner.candidates(*args, count=config.uniform_shape_trials), state.masks, make_measure)
        else:
            decision, trials = pruner.decide(*args), []
        if decision.removes_anything():
            state.shrink(decision)
            release_free_heap()  # as APT does after its events (apt_ds.training.heap)
    return OneShotResult(state.original_shape, state.shape, decision, tokens, loss_sum / batches_seen, trials)


def prune_then_tune(
    model,
    calibration_batches: Iterable[dict],
    train_batches: Iterator[dict],
    target_density: float,
    apt_config: APTConfig,
    train_config: TrainConfig,
    out_dir: str | Path | None = None,
    eval_batches: list[dict] | None = None,
    progress: bool = False,
    run_info: dict | None = None,
) -> tuple[APTrainer, OneShotResult]:
    """One-shot prune `model` to `target_density`, then LoRA-tune it with `apt_config`'s
    adapters (as_lora) for `train_config.steps`. Returns the finished trainer (its `state`
    describes the shrunk model, for export) and the pruning result."""
    pruned = one_shot_prune(model, calibration_batches, target_density, apt_config)
    lora = apt_config.as_lora()
    trainer = APTrainer(model, lora, train_config, out_dir=out_dir, eval_batches=eval_batches, progress=progress,
                        run_info={**(run_info or {}), "method": "prune_then_tune", "target_density": target_density,
                                  "one_shot_density": pruned.density})
    trainer.train(train_batches)
    return trainer, pruned
