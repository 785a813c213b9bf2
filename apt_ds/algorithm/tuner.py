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
from apt_ds.algorithm.finite import NonFiniteError
from apt_ds.config import APTConfig

ReadTensor = Callable[[str, torch.nn.Parameter], "torch.Tensor | None"]


class AdaptiveTuner:
    """Adaptive rank growth: accumulates each adapter's salience while pruning runs and, at an event,
    grows the most important adapters' ranks to fill the trainable-parameter budget of the
    schedule (docs/APT_SPEC.md, section 7)."""

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

        All adapters in a few operations (`RowSums`), not ~7 per adapter: on a GPU
        each is a kernel the host launches, and LLaMA-2-7B's q/v adapters are 64 of them on every
        step of the pruning phase. Adapters without a gradient keep their importance."""
        if self.initial_params is None:
            self.initial_params = sum(a.adapter_params() for a in adapters.values())
        names, row_sums = [], RowSums()
        for name in sorted(adapters):
            adapter = adapters[name]
            grad = read_grad(f"{name}.lora_A", adapter.lora_A)
            if grad is None:
                continue
            weight = read_param(f"{name}.lora_A", adapter.lora_A)
            row_sums.add(weight, grad.to(weight.device))
            names.append(name)
        if not names:
            return
        scores = row_sums.means()
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
        held = self._held_vector()
        if held is not None and held[0] == tuple(names):
            return held[1].to(device), None
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
        bad = sorted(n for n, v in importance.items() if not math.isfinite(v))
        if bad:  # an order over NaN is arbitrary: growth would pick adapters at random
            raise NonFiniteError(f"rank growth refused: the importance of {len(bad)} adapter(s), {bad[0]} first, is NaN "
                                 f"or inf; the run is diverging (a lower learning rate, --lr, usually fixes it)")
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

    def held(self) -> tuple:
        """What `accumulate` changes, for `restore` when the step whose gradients it read is skipped."""
        return dict(self.importance), self._last, self.initial_params

    def restore(self, held: tuple) -> None:
        importance, self._last, self.initial_params = held
        self.importance = dict(importance)

    def grow(self, adapters: dict[str, APTAdapter], new_ranks: dict[str, int], generator: torch.Generator) -> ShapeChange:
        change: ShapeChange = {}
        for name in sorted(new_ranks):
            for param, edits in adapters[name].grow_rank(new_ranks[name], generator).items():
                change[f"{name}.{param}"] = edits
        return change

    def importance_values(self) -> dict[str, float]:
        """Importance as Python floats: the last update's vector in one host read (on a GPU each
        read waits for the device), entries held otherwise (a checkpoint's floats) as they are."""
        values = {}
        held = self._held_vector()
        if held is not None:
            values.update(zip(held[0], held[1].double().tolist()))
        for name, value in self.importance.items():
            if name not in values:
                values[name] = float(value)
        return dict(sorted(values.items()))

    def _held_vector(self) -> tuple[tuple[str, ...], torch.Tensor] | None:
        """(names, the last update's vector) while `importance` still holds that update's entries
        for all of them (an assignment or a loaded checkpoint replaces them); else None."""
        if self._last is None:
            return None
        names, views, vector = self._last
        return (names, vector) if all(self.importance.get(n) is view for n, view in zip(names, views)) else None

    def state_dict(self) -> dict:
        return {"importance": self.importance_values(), "initial_params": self.initial_params}

    def load_state_dict(self, state: dict) -> None:
        self.importance = dict(state.get("importance", {}))
        self.initial_params = state.get("initial_params")


class RowSums:
    """|sum_j W_ij * G_ij| for every row i of the (W, G) pairs added, then each pair's mean.

    Consecutive pairs of one width are concatenated and multiplied at once (all of a model's q/v
    adapters: one product), holding at most CHUNK_ELEMENTS of each operand: under ZeRO-3 every
    pair is a gathered copy, so a chunk is reduced to its row sums and let go before the next
    one fills. The means are one gather over the row sums: no scatter, whose atomic adds on a
    GPU may order differently on each rank (the ranks' growth decisions must agree)."""

    CHUNK_ELEMENTS = 1 << 24  # 64 MiB of fp32 per operand

    def __init__(self):
        self._reduced: list[torch.Tensor] = []
        self._shapes: list[tuple[int, int]] = []  # every pair's (rows, width), in order
        self._weights: list[torch.Tensor] = []
        self._grads: list[torch.Tensor] = []
        self._held = 0

    def add(self, weight: torch.Tensor, grad: torch.Tensor) -> None:
        if self._weights and (weight.shape[1] != self._weights[0].shape[1] or self._held + weight.numel() > self.CHUNK_ELEMENTS):
            self._reduce()
        self._weights.append(weight)
        self._grads.append(grad)
        self._shapes.append(tuple(weight.shape))
        self._held += weight.numel()

    def _reduce(self) -> None:
        product = torch.cat(self._weights).float()  # a copy (cat), multiplied in place
        self._reduced.append(product.mul_(torch.cat(self._grads)).sum(1))
        self._weights, self._grads, self._held = [], [], 0

    def means(self) -> torch.Tensor:
        """mean_i |row sum i| of each pair added, in order, fp32."""
        if self._weights:
            self._reduce()
        rows = (self._reduced[0] if len(self._reduced) == 1 else torch.cat(self._reduced)).abs()
        index, counts = _mean_layout(tuple(self._shapes), str(rows.device))
        return torch.cat([rows, rows.new_zeros(1)])[index].sum(1) / counts


@functools.lru_cache(maxsize=2)  # the current layout, and one to spare
def _mean_layout(shapes: tuple[tuple[int, int], ...], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs x largest rank) positions of each pair's rows among all rows, padded with the
    position of an appended zero; each pair's row count. Cached: it changes only when ranks do
    (pruning events), so a step uploads nothing."""
    ranks = [rows for rows, _ in shapes]
    padding = sum(ranks)
    index = torch.full((len(ranks), max(ranks)), padding, dtype=torch.long)
    start = 0
    for pair, rank in enumerate(ranks):
        index[pair, :rank] = torch.arange(start, start + rank)
        start += rank
    return index.to(device), torch.tensor(ranks, dtype=torch.float32, device=device)
