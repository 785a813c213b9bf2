"""Whether the run's target density can be reached at all, checked before the first step."""

from __future__ import annotations

import torch

from apt_ds.algorithm.blocks import PruningError
from apt_ds.algorithm.pruner import AdaptivePruner
from apt_ds.algorithm.units import ModelShape


def check_target_reachable(pruner: AdaptivePruner, shape: ModelShape, target_density: float, budget_params: int) -> None:
    """Before the first step: a target under the smallest model the guard rails allow would fail at
    the first pruning event, after all the training before it. Every unit scored alike (what
    fits does not depend on the scores); the error names the smallest density that fits."""
    if not pruner.config.prune:
        return
    scores = ([torch.ones(layer.num_kv_groups) for layer in shape.layers], [torch.ones(layer.ffn) for layer in shape.layers],
              torch.ones(shape.hidden))

    def fits(density: float) -> bool:
        try:
            pruner.decide(shape, *scores, density * budget_params)
            return True
        except PruningError:
            return False

    if fits(target_density):
        return
    low, high = target_density, 1.0
    for _ in range(20):  # the smallest density that fits, to 1e-6
        low, high = (low, (low + high) / 2) if fits((low + high) / 2) else ((low + high) / 2, high)
    raise PruningError(f"--target-density {target_density} is below what this model can be pruned to: at least "
                       f"{high:.4f} (one KV group and one block of neurons per layer, one block of hidden channels; uniform "
                       f"mode: one shape for every layer); raise --target-density" + (", or lower --shape-multiple"
                                                                                       if pruner.config.shape_multiple > 1 else ""))


def check_model_target(model, config) -> None:
    """check_target_reachable for a LLaMA model as loaded (partitioned under ZeRO-3 or not)."""
    shape = ModelShape.from_model(model)
    check_target_reachable(AdaptivePruner(config), shape, config.target_density, shape.budget_params(config.count_embeddings))
