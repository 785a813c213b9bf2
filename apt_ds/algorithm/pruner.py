"""Choosing which units to keep under an exact parameter budget, and moving masks there.

Non-uniform (APT's default): every block (a KV group, or `block_size` neurons of a layer or
hidden channels taken in score order) gets density = score / cost at the current shapes; one
sorted list; the longest prefix whose EXACT parameter count fits the budget is kept (then once
more with the hidden size fixed, see `_decide_ranked`). Because block_params = D * (sum of kept
group coefficients + 3 * kept neurons + 2L + 1 [+ embedding columns]) depends only on running
totals, the count of every prefix comes from three cumulative sums: a sort per pass decides.
Uniform: all layers keep the same (groups, neurons); search the shape (G, N, D) that fits
and maximizes kept salience (D a multiple of the kept query heads so that a stock
LlamaConfig accepts it), then pick units per layer by salience.
Both modes keep FFN widths and the hidden size at multiples of `block_size` (32 by default,
APTConfig.shape_multiple): aligned sizes run faster and quantize in llama.cpp's 32-wide blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from apt_ds.algorithm.masks import UnitMasks
from apt_ds.algorithm.units import ModelShape
from apt_ds.config import APTConfig


class PruningError(ValueError):
    """The requested density cannot be reached under the guard rails."""


@dataclass
class KeepDecision:
    """Kept flags at the current shapes, and the exact parameter count they imply."""

    groups: list[torch.Tensor]  # bool per layer
    neurons: list[torch.Tensor]  # bool per layer
    hidden: torch.Tensor  # bool
    params: int  # budget parameters of the kept set (block, + embeddings if counted)

    def indices(self):
        as_index = lambda flags: flags.nonzero().flatten()  # noqa: E731
        return [as_index(g) for g in self.groups], [as_index(n) for n in self.neurons], as_index(self.hidden)

    def kept_shape(self, shape: ModelShape) -> ModelShape:
        layers = tuple(
            type(l)(num_kv_groups=int(g.sum()), group_size=l.group_size, head_dim=l.head_dim, ffn=int(n.sum()))
            for l, g, n in zip(shape.layers, self.groups, self.neurons)
        )
        return ModelShape(int(self.hidden.sum()), layers, shape.vocab, shape.tied_embeddings)

    def removes_anything(self) -> bool:
        return not (all(g.all() for g in self.groups) and all(n.all() for n in self.neurons) and self.hidden.all())

    def fingerprint(self) -> str:
        """Compact text identical on every rank iff the decisions are identical."""
        import hashlib

        h = hashlib.sha256()
        for t in [*self.groups, *self.neurons, self.hidden]:
            h.update(t.to(torch.uint8).numpy().tobytes())
            h.update(b"|")
        return h.hexdigest()


def embedding_columns(shape: ModelShape, count_embeddings: bool) -> int:
    """Parameters per hidden channel spent in embeddings/lm_head when they count in the budget."""
    if not count_embeddings:
        return 0
    return shape.vocab * (1 if shape.tied_embeddings else 2)


def normalize_by_kind(shape: ModelShape, group_scores, neuron_scores, hidden_scores, emb: int = 0):
    """Each kind's scores scaled so that its total equals the parameters it holds.

    A unit's score / cost is then its salience per parameter relative to its kind's average:
    kinds compete on how concentrated their salience is, not on the scale of their scores.
    The scales differ by construction: groups and neurons add the sqrt(kurtosis) outlier term
    (order 1) to a first-order term, hidden channels have the first-order term only (summed
    over 2L sites). Ranked raw, hidden channels went first: on SmolLM2 / SST-2 non-uniform APT
    0.7 cut the residual stream 576 -> 456 and scored 0.57 (LoRA 0.84); uniform cut it to 423
    and kept 94% of every FFN (docs/BENCHMARKS.md, "Salience scales"). Scaling a kind leaves
    the order inside it unchanged; a kind whose scores are all zero is left as it is."""
    D = shape.hidden

    def scaled(scores: list[torch.Tensor], costs: list[int]) -> list[torch.Tensor]:
        total = float(sum(s.sum() for s in scores))
        params = float(sum(c * s.numel() for s, c in zip(scores, costs)))
        return [s * (params / total) for s in scores] if total > 0 else scores

    groups = scaled(group_scores, [l.group_cost(D) for l in shape.layers])
    neurons = scaled(neuron_scores, [3 * D] * len(shape.layers))
    (hidden,) = scaled([hidden_scores], [shape.hidden_cost() + emb])
    return groups, neurons, hidden


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
class _BlockSizes:
    """Units per block of each layer's FFN and of the hidden size, from the unpruned shape."""

    ffn: list[int]
    hidden: int
    original_hidden: int  # the unpruned hidden size (uniform mode's hidden step depends on it)


def _uniform_hidden_step(hidden_block: int, heads: int, hidden: int) -> int:
    """Uniform hidden sizes are multiples of the kept query heads (a stock LlamaConfig); of those,
    the multiples of lcm(heads, block), with the block halved until the unpruned `hidden` holds
    >= MIN_BLOCKS of them (SmolLM2's 9 heads and 576 channels: lcm(9, 32) = 288 would leave 2,
    lcm(9, 4) = 36 leaves 16). From the unpruned size, so the step is the same at every event."""
    block = hidden_block
    while block > 1 and hidden // math.lcm(heads, block) < MIN_BLOCKS:
        block //= 2
    return math.lcm(heads, block)


@dataclass
class _Vector:
    """One score vector of the ranking: a layer's KV groups or FFN neurons, or the hidden channels."""

    kind: int  # 0 group, 1 neuron, 2 hidden channel
    scores: torch.Tensor
    unit_cost: int  # parameters one unit costs at the current shapes
    coefficient: int  # a group's parameters per hidden channel (0 for the other kinds)
    prunable: bool
    block: int  # units per block


class _Blocks:
    """Every vector cut into blocks of its units in score order (block 0: its best `block`
    units), all blocks in one list. The exact parameter count of any set of blocks comes from
    three totals: kept hidden channels D, group coefficients C and neurons N give
    D * (C + 3N + fixed_per_channel)."""

    def __init__(self, vectors: list[_Vector], fixed_per_channel: int):
        self.vectors, self.fixed_per_channel = vectors, fixed_per_channel
        self.block_of: list[torch.Tensor] = []  # per vector: the global block of each unit
        kinds, density, coefficients, neurons, channels, forced = [], [], [], [], [], []
        offset = 0
        for v in vectors:
            n = v.scores.numel()
            scores = v.scores.double()
            order = torch.argsort(scores, descending=True, stable=True)
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
            neurons.append(units if v.kind == 1 else torch.zeros(count, dtype=torch.float64))
            channels.append(units if v.kind == 2 else torch.zeros(count, dtype=torch.float64))
            is_forced = torch.full((count,), not v.prunable, dtype=torch.bool)
            is_forced[:1] = True  # guard rail: the best block of every vector survives
            forced.append(is_forced)
            offset += count
        self.kinds, self.density, self.forced = torch.cat(kinds), torch.cat(density), torch.cat(forced)
        self.coefficients, self.neurons, self.channels = torch.cat(coefficients), torch.cat(neurons), torch.cat(channels)

    def fit(self, target: float, forced: torch.Tensor, excluded: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """Kept blocks: the forced ones, then by score per parameter, the longest prefix whose exact
        parameter count fits `target`; `excluded` blocks are never kept. Returns (flags, params)."""
        candidates = torch.arange(self.density.numel()) if excluded is None else (~excluded).nonzero().flatten()
        key = torch.where(forced, torch.full_like(self.density, float("inf")), self.density)[candidates]
        order = candidates[torch.argsort(key, descending=True, stable=True)]
        channels = torch.cumsum(self.channels[order], 0)
        counts = channels * (torch.cumsum(self.coefficients[order], 0) + 3 * torch.cumsum(self.neurons[order], 0)
                             + self.fixed_per_channel)
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

    def decision(self, kept: tuple[torch.Tensor, int]) -> KeepDecision:
        flags, params = kept
        units = [flags[block_of] for block_of in self.block_of]  # a unit is kept with its block
        return KeepDecision(units[0:-1:2], units[1:-1:2], units[-1], params)


class AdaptivePruner:
    def __init__(self, config: APTConfig):
        self.config = config

    def decide(self, shape: ModelShape, group_scores, neuron_scores, hidden_scores, target_params: float,
               original: ModelShape | None = None) -> KeepDecision:
        """Decided on the host in float64 (sorting and a binary search over O(units) values: one
        copy of the device scores per decision, never inside a step). `original`: the shape
        before any pruning (default `shape`); block sizes come from it, so a dimension is cut in
        the same blocks at every event and what it keeps stays a multiple of its block."""
        original = original or shape
        if len(original.layers) != len(shape.layers):
            raise PruningError(f"original shape has {len(original.layers)} layers, the current one {len(shape.layers)}")
        multiple = self.config.shape_multiple
        blocks = _BlockSizes([block_size(l.ffn, multiple) for l in original.layers], block_size(original.hidden, multiple),
                             original.hidden)
        group_scores = [g.detach().double().cpu() for g in group_scores]
        neuron_scores = [n.detach().double().cpu() for n in neuron_scores]
        hidden_scores = hidden_scores.detach().double().cpu()
        if self.config.score_normalization == "kind":
            group_scores, neuron_scores, hidden_scores = normalize_by_kind(
                shape, group_scores, neuron_scores, hidden_scores, embedding_columns(shape, self.config.count_embeddings))
        if self.config.uniform:
            return self._decide_uniform(shape, group_scores, neuron_scores, hidden_scores, target_params, blocks)
        return self._decide_ranked(shape, group_scores, neuron_scores, hidden_scores, target_params, blocks)

    # ---- non-uniform: one ranked list of blocks ----------------------------------------------
    def _decide_ranked(self, shape, group_scores, neuron_scores, hidden_scores, target, sizes) -> KeepDecision:
        """Rank blocks (a KV group; `block_size` neurons of a layer or hidden channels, the best-
        scored together) by score per parameter and keep the longest prefix that fits. The
        hidden size is then fixed at what that prefix kept, and groups and neuron blocks are
        ranked again at that size: a hidden block costs ~1/18 of SmolLM2's parameters, and the
        first prefix stops at the first block that does not fit, leaving up to that much of the
        budget unused."""
        cfg, L = self.config, len(shape.layers)
        emb = embedding_columns(shape, cfg.count_embeddings)
        vectors = []  # in slot order: groups and neurons of each layer, then hidden channels
        for layer, groups, neurons, neuron_block in zip(shape.layers, group_scores, neuron_scores, sizes.ffn):
            c = (2 * layer.group_size + 2) * layer.head_dim
            vectors.append(_Vector(0, groups, c * shape.hidden, c, cfg.prune_heads, 1))  # a group is aligned already
            vectors.append(_Vector(1, neurons, 3 * shape.hidden, 0, cfg.prune_neurons, neuron_block))
        vectors.append(_Vector(2, hidden_scores, shape.hidden_cost() + emb, 0, cfg.prune_hidden, sizes.hidden))
        blocks = _Blocks(vectors, fixed_per_channel=2 * L + 1 + emb)
        hidden = blocks.kinds == 2
        kept_hidden = hidden & blocks.fit(target, blocks.forced)[0]
        # Second pass: the hidden blocks the first pass kept come first, the other ones are out.
        return blocks.decision(blocks.fit(target, blocks.forced | kept_hidden, excluded=hidden & ~kept_hidden))

    # ---- uniform: one shape for every layer ---------------------------------------------------
    def _decide_uniform(self, shape, group_scores, neuron_scores, hidden_scores, target, sizes) -> KeepDecision:
        cfg, L = self.config, len(shape.layers)
        first = shape.layers[0]
        if not shape.uniform:
            raise PruningError("uniform mode needs a model whose layers all have the same shape")
        g, dh, G0, N0, D0 = first.group_size, first.head_dim, first.num_kv_groups, first.ffn, shape.hidden
        emb = embedding_columns(shape, cfg.count_embeddings)
        c = (2 * g + 2) * dh

        def prefix(scores_per_layer):  # best total salience of keeping k units in every layer
            stacked = torch.stack([s.double().sort(descending=True).values for s in scores_per_layer])
            return torch.cat([torch.zeros(1, dtype=torch.float64), stacked.sum(0).cumsum(0)])

        group_prefix, neuron_prefix = prefix(group_scores), prefix(neuron_scores)
        hidden_prefix = torch.cat([torch.zeros(1, dtype=torch.float64), hidden_scores.double().sort(descending=True).values.cumsum(0)])
        neuron_block = sizes.ffn[0]
        best = None
        for G in (range(1, G0 + 1) if cfg.prune_heads else [G0]):
            heads = G * g
            step = _uniform_hidden_step(sizes.hidden, heads, sizes.original_hidden)
            d_options = [*range(step, D0, step), D0] if cfg.prune_hidden else [D0]
            for D in d_options:
                if D % heads:
                    continue
                fixed = D * (c * G * L + 2 * L + 1 + emb)
                if cfg.prune_neurons:
                    N = min(N0, int((target - fixed) // (3 * L * D))) if target >= fixed else 0
                    N = N if N == N0 else N - N % neuron_block
                else:
                    N = N0 if fixed + 3 * L * D * N0 <= target else 0
                if N < 1:
                    continue
                params = fixed + 3 * L * D * N
                value = float(group_prefix[G] + neuron_prefix[N] + hidden_prefix[D])
                if best is None or (value, params) > (best[0], best[1]):
                    best = (value, params, G, N, D)
        if best is None:
            raise PruningError(
                f"no uniform shape fits {int(target):,} parameters (need >= 1 KV group and {neuron_block} neurons per "
                f"layer, and a hidden size that is a multiple of the kept query heads, aligned as far as 16 choices "
                f"allow); raise target_density, or lower shape_multiple"
            )
        _, params, G, N, D = best
        top = lambda scores, k: torch.zeros(scores.numel(), dtype=torch.bool).index_fill_(  # noqa: E731
            0, torch.argsort(scores.double(), descending=True, stable=True)[:k], True
        )
        return KeepDecision(
            [top(s, G) for s in group_scores], [top(s, N) for s in neuron_scores], top(hidden_scores, D), int(params)
        )


class GradualMasker:
    """Moves masks toward a decision by `step_size` per step, then snaps them at the event."""

    def __init__(self, step_size: float):
        self.step_size = step_size

    def step_toward(self, masks: UnitMasks, decision: KeepDecision) -> None:
        def move(mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            up = (mask + self.step_size).clamp(max=1.0)
            down = (mask - self.step_size).clamp(min=0.0)
            return torch.where(keep.to(mask.device), up, down)

        masks.kv_group = [move(m, k) for m, k in zip(masks.kv_group, decision.groups)]
        masks.ffn_neuron = [move(m, k) for m, k in zip(masks.ffn_neuron, decision.neurons)]
        masks.hidden = move(masks.hidden, decision.hidden)
        masks.refresh()

    @staticmethod
    def snap(masks: UnitMasks, decision: KeepDecision) -> None:
        masks.kv_group = [k.float().to(masks.device) for k in decision.groups]
        masks.ffn_neuron = [k.float().to(masks.device) for k in decision.neurons]
        masks.hidden = decision.hidden.float().to(masks.device)
        masks.refresh()
