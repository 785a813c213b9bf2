"""Choosing which units to keep under an exact parameter budget, and moving masks there.

Non-uniform (APT's default): every block (a KV group, or `block_size` neurons of a layer or
hidden channels taken in score order) gets density = score / cost at the current shapes; one
sorted list; the longest prefix whose EXACT parameter count fits the budget is kept (then once
more with the hidden size fixed, see `_decide_ranked`). Because block_params = D * (sum of the
kept groups' and neurons' per-channel coefficients + the layers' norms + the outer norms [+ embedding columns])
+ the kept units' constants (biases) depends only on running totals (units.py gives the terms),
the count of every prefix comes from three cumulative sums: a sort per pass decides.
Uniform: all layers keep the same (groups, neurons); search the shapes (G, N, D) that fit
(D a multiple of the kept query heads so that a stock LlamaConfig accepts it), rank them by
kept salience (`candidates`; the trainer measures the loss of the best few and may pin one,
`uniform_shape`), then pick units per layer by salience.
Both modes keep FFN widths and the hidden size at multiples of `block_size` (32 by default,
APTConfig.shape_multiple): aligned sizes run faster and quantize in llama.cpp's 32-wide blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from apt_ds.algorithm.blocks import (
    Blocks,
    BlockSizes,
    PruningError,
    Vector,
    uniform_hidden_step,
)
from apt_ds.algorithm.masks import UnitMasks
from apt_ds.algorithm.position_bias import shared_table_layers
from apt_ds.algorithm.units import ModelShape
from apt_ds.config import APTConfig
from apt_ds.models import UnitCosts, family_for


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
        layers = [l.kept(int(g.sum()), int(n.sum())) for l, g, n in zip(shape.layers, self.groups, self.neurons)]
        return shape.kept(int(self.hidden.sum()), layers)

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
    return shape.outer_columns("embedding")


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

    def scaled(scores: list[torch.Tensor], costs: list[int]) -> list[torch.Tensor]:
        total = float(sum(s.sum() for s in scores))
        params = float(sum(c * s.numel() for s, c in zip(scores, costs)))
        return [s * (params / total) for s in scores] if total > 0 else scores

    groups = scaled(group_scores, [shape.group_cost(l) for l in shape.layers])
    neurons = scaled(neuron_scores, [shape.neuron_cost(l) for l in shape.layers])
    (hidden,) = scaled([hidden_scores], [shape.hidden_cost() + emb])
    return groups, neurons, hidden


def scores_on_host(group_scores, neuron_scores, hidden_scores):
    """Float64 copies on the host of per-layer KV-group and FFN-neuron scores and the hidden scores
    (floating-point tensors on one device, as salience keeps them), through one concatenated copy:
    on a GPU every copy to the host waits for the device, and copying per layer and kind made
    2 x layers + 1 of them (129 for a 7B model, at every decay-window step)."""
    tensors = [hidden_scores, *group_scores, *neuron_scores]
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]).to("cpu", torch.float64)
    hidden, *rest = [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
    layers = len(group_scores)
    return rest[:layers], rest[layers:], hidden


class AdaptivePruner:
    """Decides which units to keep at a pruning event: all units ranked by salience per parameter they
    cost and kept while the event's parameter budget allows; in uniform mode the one (KV groups,
    neurons, hidden) shape for every layer that fits and keeps the most salience, then each layer's
    units by salience. `decide` returns a KeepDecision (docs/APT_SPEC.md, section 5)."""

    def __init__(self, config: APTConfig):
        self.config = config

    def decide(self, shape: ModelShape, group_scores, neuron_scores, hidden_scores, target_params: float,
               original: ModelShape | None = None, uniform_shape: tuple[int, int] | None = None) -> KeepDecision:
        """Decided on the host in float64 (sorting and a binary search over O(units) values: one
        copy of the device scores per decision, never inside a step). `original`: the shape
        before any pruning (default `shape`); block sizes come from it, so a dimension is cut in
        the same blocks at every event and what it keeps stays a multiple of its block.
        `uniform_shape`: (KV groups, hidden size) a uniform decision must keep (its FFN width
        then follows from the budget), e.g. one chosen by measured loss (`uniform_shape_of`)."""
        return self.candidates(shape, group_scores, neuron_scores, hidden_scores, target_params, original, 1,
                               uniform_shape)[0]

    def candidates(self, shape: ModelShape, group_scores, neuron_scores, hidden_scores, target_params: float,
                   original: ModelShape | None = None, count: int = 1,
                   uniform_shape: tuple[int, int] | None = None) -> list[KeepDecision]:
        """Uniform mode: the `count` best uniform shapes by kept salience, best first, each with
        its units chosen by score (for a choice by measured loss, apt_ds.training.shape_trials).
        Non-uniform mode has one decision."""
        original = original or shape
        if len(original.layers) != len(shape.layers):
            raise PruningError(f"original shape has {len(original.layers)} layers, the current one {len(shape.layers)}")
        blocks = BlockSizes.for_shape(original, self.config.shape_multiple)
        group_scores, neuron_scores, hidden_scores = scores_on_host(group_scores, neuron_scores, hidden_scores)
        if self.config.score_normalization == "kind":
            group_scores, neuron_scores, hidden_scores = normalize_by_kind(
                shape, group_scores, neuron_scores, hidden_scores, embedding_columns(shape, self.config.count_embeddings))
        if self.config.uniform:
            return self._decide_uniform(shape, group_scores, neuron_scores, hidden_scores, target_params, blocks,
                                        count, uniform_shape)
        return [self._decide_ranked(shape, group_scores, neuron_scores, hidden_scores, target_params, blocks)]

    # ---- non-uniform: one ranked list of blocks ----------------------------------------------
    def _decide_ranked(self, shape, group_scores, neuron_scores, hidden_scores, target, sizes) -> KeepDecision:
        """Rank blocks (a KV group; `block_size` neurons of a layer or hidden channels, the best-
        scored together) by score per parameter and keep the longest prefix that fits. The
        hidden size is then fixed at what that prefix kept, and groups and neuron blocks are
        ranked again at that size: a hidden block costs ~1/18 of SmolLM2's parameters, and the
        first prefix stops at the first block that does not fit, leaving up to that much of the
        budget unused."""
        cfg = self.config
        emb = embedding_columns(shape, cfg.count_embeddings)
        vectors = []  # in slot order: groups and neurons of each layer, then hidden channels
        # the norms outside the layers (and the embedding columns when they count)
        per_channel, constant = shape.outer_columns("block") + emb, shape.outer_constant("block")
        for layer, groups, neurons, neuron_block in zip(shape.layers, group_scores, neuron_scores, sizes.ffn):
            c = shape.costs(layer)
            vectors.append(Vector(0, groups, shape.group_cost(layer), c.group_per_channel, cfg.prune_heads, 1,
                                  c.group_constant))  # a group is aligned already
            vectors.append(Vector(1, neurons, shape.neuron_cost(layer), c.neuron_per_channel, cfg.prune_neurons,
                                  neuron_block, c.neuron_constant))
            per_channel, constant = per_channel + c.per_channel, constant + c.constant
        vectors.append(Vector(2, hidden_scores, shape.hidden_cost() + emb, 0, cfg.prune_hidden, sizes.hidden))
        blocks = Blocks(vectors, fixed_per_channel=per_channel, fixed_constant=constant)
        hidden = blocks.kinds == 2
        kept_hidden = hidden & blocks.fit(target, blocks.forced)[0]
        # Second pass: the hidden blocks the first pass kept come first, the other ones are out.
        kept, params = blocks.fit(target, blocks.forced | kept_hidden, excluded=hidden & ~kept_hidden)
        units = blocks.unit_flags(kept)  # groups and neurons alternate per layer, hidden channels last
        return KeepDecision(units[0:-1:2], units[1:-1:2], units[-1], params)

    # ---- uniform: one shape for every layer ---------------------------------------------------
    def _decide_uniform(self, shape, group_scores, neuron_scores, hidden_scores, target, sizes, count=1,
                        only: tuple[int, int] | None = None) -> list[KeepDecision]:
        cfg, layers, family = self.config, shape.layers, family_for(shape.family)
        first = layers[0]
        if not shape.uniform:
            raise PruningError("uniform mode needs a model whose layers all have the same shape")
        g, G0, N0, D0 = first.group_size, first.num_kv_groups, shape.config_ffn, shape.hidden
        emb = embedding_columns(shape, cfg.count_embeddings)
        c = UnitCosts.total(shape.costs(layer) for layer in layers)  # every layer's terms (T5: three kinds)
        per_neuron = lambda D: c.neuron_per_channel * D + c.neuron_constant  # noqa: E731 (every layer's)

        def prefix(scores_per_layer):  # best total salience of keeping k units in every layer
            stacked = torch.stack([s.double().sort(descending=True).values for s in scores_per_layer])
            return torch.cat([torch.zeros(1, dtype=torch.float64), stacked.sum(0).cumsum(0)])

        # Layers reading one shared bias table (T5's self-attentions of a stack) keep the same heads:
        # chosen once by their summed salience. Every other layer chooses its own.
        tied = shared_table_layers(shape)
        choosers = [(members, torch.stack([group_scores[i] for i in members]).sum(0)) for members in tied]
        in_tied = {i for members in tied for i in members}
        choosers += [([i], s) for i, s in enumerate(group_scores) if i not in in_tied]
        with_ffn = [i for i, layer in enumerate(layers) if family.kinds[layer.kind].has_ffn]
        group_prefix, neuron_prefix = prefix([s for _, s in choosers]), prefix([neuron_scores[i] for i in with_ffn])
        hidden_prefix = torch.cat([torch.zeros(1, dtype=torch.float64), hidden_scores.double().sort(descending=True).values.cumsum(0)])
        neuron_block = sizes.ffn[with_ffn[0]]
        shapes = []  # (kept salience, params, G, N, D): one per (G, D), its N the most the budget allows
        for G in (range(1, G0 + 1) if cfg.prune_heads else [G0]):
            heads = G * g
            step = uniform_hidden_step(sizes.hidden, heads, sizes.original_hidden)
            d_options = [*range(step, D0, step), D0] if cfg.prune_hidden else [D0]
            if not family.config_head_dim:  # BERT's config: heads are hidden / heads wide
                d_options = [D for D in (heads * first.head_dim,) if D <= D0 and (cfg.prune_hidden or D == D0)]
            for D in d_options:
                if D % heads or (only is not None and (G, D) != tuple(only)):
                    continue
                fixed = (D * (c.group_per_channel * G + c.per_channel + shape.outer_columns("block") + emb)
                         + c.group_constant * G + c.constant + shape.outer_constant("block"))
                if cfg.prune_neurons:
                    N = min(N0, int((target - fixed) // per_neuron(D))) if target >= fixed else 0
                    N = N if N == N0 else N - N % neuron_block
                else:
                    N = N0 if fixed + per_neuron(D) * N0 <= target else 0
                if N >= 1:
                    shapes.append((float(group_prefix[G] + neuron_prefix[N] + hidden_prefix[D]), fixed + per_neuron(D) * N, G, N, D))
        if not shapes:
            wanted = f"the shape of {only[0]} KV groups and hidden {only[1]}" if only is not None else "no uniform shape"
            raise PruningError(
                f"{wanted} fits {int(target):,} parameters (need >= 1 KV group and {neuron_block} neurons per "
                f"layer, and a hidden size that is a multiple of the kept query heads, aligned as far as 16 choices "
                f"allow); raise target_density, or lower shape_multiple"
            )
        # A shape that another one beats in every dimension leaves budget unused: ranked by salience
        # it never wins, but a measured loss could prefer it, and once the FFN is at its current
        # width every smaller hidden size "fits" (a run fell to density 0.03 that way).
        shapes = undominated(shapes)
        top = lambda scores, k: torch.zeros(scores.numel(), dtype=torch.bool).index_fill_(  # noqa: E731
            0, torch.argsort(scores.double(), descending=True, stable=True)[:k], True
        )
        shapes.sort(key=lambda entry: (entry[0], entry[1]), reverse=True)  # stable: ties keep the search order
        # Alternatives must use the budget about as well as salience's choice (within one FFN block
        # in every layer): an FFN already at its current width cannot take up what a dropped KV
        # group frees (a trial kept 2 groups and 608 neurons, density 0.464 for a target of 0.5).
        slack = target - shapes[0][1]
        shapes = shapes[:1] + [e for e in shapes[1:] if target - e[1] <= slack + per_neuron(e[4]) * neuron_block]
        chooser_of = {i: scores for members, scores in choosers for i in members}
        return [KeepDecision([top(chooser_of[i], G) for i in range(len(layers))], [top(s, N) for s in neuron_scores],
                             top(hidden_scores, D), int(params))
                for _, params, G, N, D in shapes[:count]]


def undominated(shapes: list[tuple]) -> list[tuple]:
    """The (salience, params, G, N, D) shapes that no other one matches or beats in KV groups G,
    neurons N and hidden size D at once, in their order. Needs distinct (G, D) pairs and N >= 0
    (as the uniform search makes them). One sweep by G (descending, then D) with a Fenwick tree
    of the largest N seen at each hidden size or above: O(n log n); with the pairwise check a
    uniform single-unit decision on LLaMA-2-7B's ~16k shapes took 6.1 s (docs/BENCHMARKS.md)."""
    sizes = sorted({shape[4] for shape in shapes}, reverse=True)
    rank = {d: i + 1 for i, d in enumerate(sizes)}  # rank 1: the largest hidden size
    tree = [-1] * (len(sizes) + 1)  # prefix maxima over ranks: the largest N at hidden >= D
    dominated = set()
    for index in sorted(range(len(shapes)), key=lambda i: (-shapes[i][2], -shapes[i][4])):
        _, _, _, kept_neurons, hidden = shapes[index]
        best, i = -1, rank[hidden]
        while i > 0:  # every shape seen so far has at least as many KV groups; (G, D) pairs are distinct
            best, i = max(best, tree[i]), i - (i & -i)
        if best >= kept_neurons:
            dominated.add(index)
        i = rank[hidden]
        while i <= len(sizes):
            tree[i], i = max(tree[i], kept_neurons), i + (i & -i)
    return [shape for index, shape in enumerate(shapes) if index not in dominated]


def uniform_shape_of(decision: KeepDecision) -> tuple[int, int]:
    """(KV groups per layer, hidden size) of a uniform decision: what `decide(uniform_shape=)` fixes."""
    return int(decision.groups[0].sum()), int(decision.hidden.sum())


class GradualMasker:
    """Moves masks toward a decision by `step_size` per step, then snaps them at the event."""

    def __init__(self, step_size: float):
        self.step_size = step_size

    def step_toward(self, masks: UnitMasks, decision: KeepDecision) -> None:
        """Every mask one step toward the decision, in one update over all of them (five kernels,
        not five per layer and kind, and one copy of the keep flags to the device). The masks are
        then views of one tensor (see UnitMasks)."""
        current, keeps = masks.tensors(), [decision.hidden, *decision.groups, *decision.neurons]
        sizes = [m.numel() for m in current]
        if sizes != [k.numel() for k in keeps]:  # host metadata: no wait for the device
            raise PruningError(f"decision sizes {[k.numel() for k in keeps]} do not match the masks' {sizes}")
        flat = torch.cat(current)
        keep = torch.cat(keeps).to(flat.device)
        up = (flat + self.step_size).clamp(max=1.0)
        down = (flat - self.step_size).clamp(min=0.0)
        layers = len(masks.kv_group)
        hidden, *rest = torch.where(keep, up, down).split(sizes)
        masks.hidden, masks.kv_group, masks.ffn_neuron = hidden, rest[:layers], rest[layers:]
        masks.refresh()

    @staticmethod
    def snap(masks: UnitMasks, decision: KeepDecision) -> None:
        masks.kv_group = [k.float().to(masks.device) for k in decision.groups]
        masks.ffn_neuron = [k.float().to(masks.device) for k in decision.neurons]
        masks.hidden = decision.hidden.float().to(masks.device)
        masks.refresh()
