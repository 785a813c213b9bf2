"""Adaptive tuning: which adapters deserve more rank, and growing them within a budget.

Importance of an adapter = EMA of mean_i |sum_j A_ij * dL/dA_ij| (first-order salience of its
rank rows). At each pruning event the tunable-parameter budget (linear from its initial
value to `rank_budget_multiple` times it) is filled by growing the top half of adapters below
the rank cap, proportionally to their current rank.
"""

from __future__ import annotations

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

    def accumulate(self, adapters: dict[str, APTAdapter], read_param: ReadTensor, read_grad: ReadTensor) -> None:
        """Update importance from the current step's gradients (call between backward and step).
        The first call also fixes the initial tunable budget, before any pruning event has shrunk
        an adapter (read at the first event it would be the already-shrunk size)."""
        if self.initial_params is None:
            self.initial_params = sum(a.adapter_params() for a in adapters.values())
        beta = self.config.salience_beta
        for name in sorted(adapters):
            adapter = adapters[name]
            grad = read_grad(f"{name}.lora_A", adapter.lora_A)
            if grad is None:
                continue
            weight = read_param(f"{name}.lora_A", adapter.lora_A)
            score = (weight.float() * grad.float().to(weight.device)).sum(1).abs().mean()
            old = self.importance.get(name)
            self.importance[name] = score if old is None else beta * old + (1 - beta) * score

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
