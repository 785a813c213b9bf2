"""Adaptive tuning: which adapters deserve more rank, and growing them within a budget.

Importance of an adapter = EMA of mean_i |sum_j A_ij * dL/dA_ij| (first-order salience of its
rank rows). At each pruning event the tunable-parameter budget (linear from its initial
value to `rank_budget_multiple` times it) is filled by growing the top half of adapters below
the rank cap, proportionally to their current rank.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from apt_ds.algorithm.adapters import APTAdapter
from apt_ds.algorithm.edits import ShapeChange
from apt_ds.config import APTConfig

ReadTensor = Callable[[str, torch.nn.Parameter], "torch.Tensor | None"]


class AdaptiveTuner:
    def __init__(self, config: APTConfig):
        self.config = config
        # Tensors on the adapters' device while training (no host sync per step); plain floats
        # once read for a decision or a checkpoint.
        self.importance: dict[str, torch.Tensor | float] = {}
        self.initial_params: int | None = None
        # the last update: (names, their entries in `importance`, the vector those are views of)
        self._last: tuple[tuple[str, ...], tuple[torch.Tensor, ...], torch.Tensor] | None = None

    def accumulate(self, adapters: dict[str, APTAdapter], read_param: ReadTensor, read_grad: ReadTensor) -> None:
        """Update importance from the current step's gradients (call between backward and step).
        The first call also fixes the initial tunable budget, before any pruning event has shrunk
        an adapter (read at the first event it would be the already-shrunk size).

        All adapters in a few operations (`mean_abs_row_products`), not ~7 per adapter: on a GPU
        each is a kernel the host launches, and LLaMA-2-7B's q/v adapters are 64 of them on every
        step of the pruning phase. Adapters without a gradient keep their importance."""
        if self.initial_params is None:
            self.initial_params = sum(a.adapter_params() for a in adapters.values())
        names, weights, grads = [], [], []
        for name in sorted(adapters):
            adapter = adapters[name]
            grad = read_grad(f"{name}.lora_A", adapter.lora_A)
            if grad is None:
                continue
            weight = read_param(f"{name}.lora_A", adapter.lora_A)
            names.append(name)
            weights.append(weight)
            grads.append(grad.to(weight.device))
        if not names:
            return
        scores = mean_abs_row_products(weights, grads)
        beta = self.config.salience_beta
        old, unscored = self._previous(names, scores.device)
        updated = scores if old is None else beta * old + (1 - beta) * scores
        if unscored is not None:  # a name never scored starts at its first score
            updated = torch.where(unscored, scores, updated)
        views = updated.unbind()
        self._last = (tuple(names), views, updated)
        self.importance.update(zip(names, views))

    def _previous(self, names: list[str], device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the importance of `names` as one vector, which of them were never scored (None: all
        were)). The last update's vector when the importance still holds its entries (no
        operation); else gathered from what is held (a checkpoint's floats, an assignment). (None,
        None) when none was ever scored."""
        if self._last is not None and self._last[0] == tuple(names):
            _, views, vector = self._last
            if all(self.importance.get(n) is view for n, view in zip(names, views)):
                return vector, None
        if not any(n in self.importance for n in names):
            return None, None
        held = [self.importance.get(n, 0.0) for n in names]
        old = torch.stack([torch.as_tensor(v, dtype=torch.float32).to(device) for v in held])
        missing = [n not in self.importance for n in names]
        return old, (torch.tensor(missing, device=device) if any(missing) else None)

    def plan_growth(self, adapters: dict[str, APTAdapter], budget_multiple: float) -> dict[str, int]:
        """New ranks for the adapters that grow (empty when the budget is already met)."""
        current = sum(a.adapter_params() for a in adapters.values())
        if self.initial_params is None:
            self.initial_params = current
        deficit = budget_multiple * self.initial_params - current
        cap = self.config.rank_cap
        candidates = [n for n in sorted(adapters) if adapters[n].rank < cap]
        if deficit <= 0 or not candidates:
            return {}
        importance = self.importance_values()
        candidates.sort(key=lambda n: importance.get(n, 0.0), reverse=True)
        chosen = candidates[: math.ceil(len(candidates) / 2)]

        def ranks_for(factor: float) -> dict[str, int]:
            return {n: min(cap, int(adapters[n].rank * (1 + factor))) for n in chosen}

        def cost(ranks: dict[str, int]) -> int:
            return sum((r - adapters[n].rank) * (adapters[n].in_features + adapters[n].out_features) for n, r in ranks.items())

        low, high = 0.0, float(cap)  # growth factor: rank * (1 + f) >= cap once f >= cap
        for _ in range(60):
            mid = (low + high) / 2
            if cost(ranks_for(mid)) <= deficit:
                low = mid
            else:
                high = mid
        return {n: r for n, r in ranks_for(low).items() if r > adapters[n].rank}

    def grow(self, adapters: dict[str, APTAdapter], new_ranks: dict[str, int], generator: torch.Generator) -> ShapeChange:
        change: ShapeChange = {}
        for name in sorted(new_ranks):
            for param, edits in adapters[name].grow_rank(new_ranks[name], generator).items():
                change[f"{name}.{param}"] = edits
        return change

    def importance_values(self) -> dict[str, float]:
        """Importance as Python floats (one host read of the device EMA values)."""
        if not self.importance:
            return {}
        names = sorted(self.importance)
        values = torch.stack([torch.as_tensor(self.importance[n], dtype=torch.float64).cpu() for n in names]).tolist()
        return dict(zip(names, values))

    def state_dict(self) -> dict:
        return {"importance": self.importance_values(), "initial_params": self.initial_params}

    def load_state_dict(self, state: dict) -> None:
        self.importance = dict(state.get("importance", {}))
        self.initial_params = state.get("initial_params")


def mean_abs_row_products(weights: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
    """[mean_i |sum_j W_ij * G_ij| for each (W, G)], fp32, in a few operations: the rows of all
    pairs with the same width are concatenated, multiplied and summed at once, and each pair's
    rows averaged by one product with an averaging matrix, in float64. Not a scatter
    (`index_add_`): its atomic adds on a GPU may order differently on each rank, and the ranks'
    growth decisions must agree to the bit."""
    device = weights[0].device
    means = []
    groups, order = _row_layout(tuple(tuple(w.shape) for w in weights), str(device))
    for indices, averaging in groups:
        products = torch.cat([weights[i].float() for i in indices]) * torch.cat([grads[i].float() for i in indices])
        means.append(averaging @ products.sum(1).abs().double())
    out = (means[0] if len(means) == 1 else torch.cat(means)).float()
    return out if order is None else out[order]


@functools.lru_cache(maxsize=2)  # the current layout, and one to spare
def _row_layout(shapes: tuple[tuple[int, int], ...], device: str):
    """For the (rank, width) `shapes`: ([(positions of one width, the (pairs x rows) float64
    matrix averaging each pair's rows)], the permutation from that grouped order back to
    `shapes`' order, None when it is the same). Cached: it changes only when ranks or widths do
    (pruning events), so a step uploads nothing."""
    by_width: dict[int, list[int]] = {}
    for index, (_, width) in enumerate(shapes):
        by_width.setdefault(width, []).append(index)
    groups, grouped = [], []
    for indices in by_width.values():
        rows = torch.tensor([shapes[i][0] for i in indices])
        owner = torch.repeat_interleave(torch.arange(len(indices)), rows)
        averaging = (owner.unsqueeze(0) == torch.arange(len(indices)).unsqueeze(1)).double() / rows.unsqueeze(1)
        groups.append((indices, averaging.to(device)))
        grouped += indices
    identity = grouped == list(range(len(shapes)))
    order = None if identity else torch.tensor(grouped).argsort().to(device)
    return groups, order
