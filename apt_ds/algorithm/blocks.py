"""Pruning blocks: units of one dimension pruned together so that kept sizes stay aligned.

`block_size` says how many units of a dimension (a layer's FFN, the hidden size) form a block;
`Blocks` cuts score vectors into blocks of their best-scored units and finds the longest
prefix of a ranking whose exact parameter count fits a budget (used by AdaptivePruner).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence


class PruningError(ValueError):
    """The requested density cannot be reached under the guard rails."""


MIN_BLOCKS = 16  # a dimension is never cut into fewer blocks than this (see block_size)


def block_size(size: int, multiple: int) -> int:
    """How many units of a dimension of `size` are pruned together, so that what is kept stays a
    multiple of it: `multiple`, or where that leaves fewer than MIN_BLOCKS blocks the largest
    power of two that leaves MIN_BLOCKS (a small late-layer FFN, a test-sized model), down to 1.

    Why blocks: matmul kernels run best on aligned sizes (this repo's CPU ran matmuls at widths such
    as 1,519 and 575 slower than at multiples of 32, and an APT 0.7 run with single units took
    longer than one with blocks: docs/BENCHMARKS.md, "Aligned widths"; GPU tensor cores want
    multiples of 8 or more), and llama.cpp quantizes rows in 32-wide blocks."""
    if multiple <= 1 or size < 2 * MIN_BLOCKS:
        return 1
    if size >= MIN_BLOCKS * multiple:
        return multiple
    return 1 << ((size // MIN_BLOCKS).bit_length() - 1)


@dataclass(frozen=True)
class BlockSizes:
    """Units per block of each layer's FFN and of the hidden size, from the unpruned shape."""

    ffn: list[int]
    hidden: int
    original_hidden: int  # the unpruned hidden size (uniform mode's hidden step depends on it)

    @classmethod
    def for_shape(cls, original, multiple: int) -> "BlockSizes":
        """Block sizes of an unpruned ModelShape at `APTConfig.shape_multiple`."""
        return cls([block_size(l.ffn, multiple) for l in original.layers], block_size(original.hidden, multiple),
                   original.hidden)


def uniform_hidden_step(hidden_block: int, heads: int, hidden: int) -> int:
    """Uniform hidden sizes are multiples of the kept query heads (a stock LlamaConfig); of those,
    the multiples of lcm(heads, block), with the block halved until the unpruned `hidden` holds
    >= MIN_BLOCKS of them (SmolLM2's 9 heads and 576 channels: lcm(9, 32) = 288 would leave 2,
    lcm(9, 4) = 36 leaves 16). From the unpruned size, so the step is the same at every event."""
    block = hidden_block
    while block > 1 and hidden // math.lcm(heads, block) < MIN_BLOCKS:
        block //= 2
    return math.lcm(heads, block)


def descending_orders(vectors: list[torch.Tensor], kinds: list[int]) -> list[torch.Tensor]:
    """`torch.argsort(v, descending=True, stable=True)` of every vector. With several torch
    threads the vectors of one kind are sorted in one call, padded at the end to the longest with
    -inf: a 2D sort spreads its rows over the threads, where a 7B model's 65 1D sorts ran one
    after another (a decision at LLaMA-2-7B's shape took 0.7x the time on 2 threads,
    benchmarks/decision_cost.py; a GPU's host decides at every decay-window step). Stable, so a
    padded row's first n entries are the 1D sort's. One thread sorts each vector alone (the
    padding would only add work)."""
    if torch.get_num_threads() == 1:
        return [torch.argsort(v, descending=True, stable=True) for v in vectors]
    orders: dict[int, torch.Tensor] = {}
    for kind in set(kinds):
        members = [i for i, k in enumerate(kinds) if k == kind]
        rows = pad_sequence([vectors[i] for i in members], batch_first=True, padding_value=float("-inf"))
        for i, row in zip(members, torch.argsort(rows, dim=1, descending=True, stable=True)):
            orders[i] = row[: vectors[i].numel()]
    return [orders[i] for i in range(len(vectors))]


@dataclass
class Vector:
    """One score vector of the ranking: a layer's KV groups or FFN neurons, or the hidden channels."""

    kind: int  # 0 group, 1 neuron, 2 hidden channel
    scores: torch.Tensor
    unit_cost: int  # parameters one unit costs at the current shapes
    coefficient: int  # a group's or neuron's parameters per hidden channel (0 for hidden channels)
    prunable: bool
    block: int  # units per block
    constant: int = 0  # a unit's parameters that do not scale with the hidden size (a bias)


class Blocks:
    """Every vector cut into blocks of its units in score order (block 0: its best `block`
    units), all blocks in one list. The exact parameter count of any set of blocks comes from
    three totals: kept hidden channels D, the per-channel coefficients C of the kept groups and
    neurons, and their constants K give D * (C + fixed_per_channel) + K + fixed_constant."""

    def __init__(self, vectors: list[Vector], fixed_per_channel: int, fixed_constant: int = 0):
        self.fixed_per_channel, self.fixed_constant = fixed_per_channel, fixed_constant
        self.block_of: list[torch.Tensor] = []  # per vector: the global block of each unit
        kinds, density, coefficients, constants, channels, forced = [], [], [], [], [], []
        offset = 0
        scores_of = [v.scores.double() for v in vectors]
        for v, scores, order in zip(vectors, scores_of, descending_orders(scores_of, [v.kind for v in vectors])):
            n = v.scores.numel()
            rank_block = torch.arange(n) // v.block  # the block of the i-th best unit
            count = -(-n // v.block)
            block_of = torch.empty(n, dtype=torch.int64)
            block_of[order] = rank_block + offset
            self.block_of.append(block_of)
            units = torch.bincount(rank_block, minlength=count).double()
            block_scores = torch.zeros(count, dtype=torch.float64).index_add_(0, rank_block, scores[order])
            kinds.append(torch.full((count,), v.kind, dtype=torch.int8))
            # Non-increasing along the vector: its blocks hold units in score order, but float sums of
            # equal scores (a short last block) could otherwise rank a later block first.
            density.append(torch.cummin(block_scores / (units * v.unit_cost), 0).values if count else block_scores)
            coefficients.append(units * v.coefficient)
            constants.append(units * v.constant)
            channels.append(units if v.kind == 2 else torch.zeros(count, dtype=torch.float64))
            is_forced = torch.full((count,), not v.prunable, dtype=torch.bool)
            is_forced[:1] = True  # guard rail: the best block of every vector survives
            forced.append(is_forced)
            offset += count
        self.kinds, self.density, self.forced = torch.cat(kinds), torch.cat(density), torch.cat(forced)
        self.coefficients, self.constants, self.channels = torch.cat(coefficients), torch.cat(constants), torch.cat(channels)

    def fit(self, target: float, forced: torch.Tensor, excluded: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """Kept blocks: the forced ones, then by score per parameter, the longest prefix whose exact
        parameter count fits `target`; `excluded` blocks are never kept. Returns (flags, params)."""
        candidates = torch.arange(self.density.numel()) if excluded is None else (~excluded).nonzero().flatten()
        key = torch.where(forced, torch.full_like(self.density, float("inf")), self.density)[candidates]
        order = candidates[torch.argsort(key, descending=True, stable=True)]
        channels = torch.cumsum(self.channels[order], 0)
        counts = (channels * (torch.cumsum(self.coefficients[order], 0) + self.fixed_per_channel)
                  + torch.cumsum(self.constants[order], 0) + self.fixed_constant)
        n_forced = int(forced[order].sum())
        n_keep = int(torch.searchsorted(counts, torch.tensor([float(target)], dtype=torch.float64), right=True))
        if n_keep < n_forced:
            raise PruningError(
                f"target of {int(target):,} parameters is below the smallest model the guard rails allow "
                f"({int(counts[n_forced - 1]):,}: one KV group and one block of neurons per layer, one block of hidden "
                f"channels); raise target_density"
            )
        kept = torch.zeros(self.density.numel(), dtype=torch.bool)
        kept[order[:n_keep]] = True
        return kept, int(counts[n_keep - 1])

    def unit_flags(self, kept: torch.Tensor) -> list[torch.Tensor]:
        """Kept flags per unit of every vector, in the order given: a unit is kept with its block."""
        return [kept[block_of] for block_of in self.block_of]
