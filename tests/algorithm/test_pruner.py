"""AdaptivePruner.decide: exact budget, within one unit of it, guard rails, uniform mode."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import TINY_CONFIGS, tiny_llama

from apt_ds.algorithm.pruner import (
    AdaptivePruner,
    KeepDecision,
    PruningError,
    block_size,
    embedding_columns,
    normalize_by_kind,
)
from apt_ds.algorithm.units import LayerShape, ModelShape
from apt_ds.config import APTConfig

SHAPES = {kind: ModelShape.from_model(tiny_llama(kind)) for kind in TINY_CONFIGS}
# an already-shrunk, non-uniform shape (layers differ) with mixed group sizes
SHAPES["ragged"] = ModelShape(
    40, (LayerShape(3, 2, 8, 50), LayerShape(1, 2, 8, 7), LayerShape(4, 1, 8, 90), LayerShape(2, 3, 4, 33)), 61, False,
)


def _scores(shape: ModelShape, rng: random.Random):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    style = rng.choice(["uniform", "heavy", "ties", "zeros"])

    def draw(n):
        if style == "uniform":
            return torch.rand(n, generator=gen, dtype=torch.float64)
        if style == "heavy":
            return torch.rand(n, generator=gen, dtype=torch.float64).pow(8) * 1e4
        if style == "ties":
            return torch.randint(0, 3, (n,), generator=gen).double()
        s = torch.rand(n, generator=gen, dtype=torch.float64)
        s[torch.rand(n, generator=gen) < 0.5] = 0.0
        return s

    scale_g, scale_h = 10 ** rng.uniform(-2, 4), 10 ** rng.uniform(-2, 4)
    return ([draw(l.num_kv_groups) * scale_g for l in shape.layers], [draw(l.ffn) for l in shape.layers],
            draw(shape.hidden) * scale_h)


def _max_block_cost(shape: ModelShape, count_embeddings: bool, multiple: int) -> int:
    group = max(l.group_cost(shape.hidden) for l in shape.layers)
    neurons = max(3 * shape.hidden * block_size(l.ffn, multiple) for l in shape.layers)
    channels = block_size(shape.hidden, multiple) * (shape.hidden_cost() + embedding_columns(shape, count_embeddings))
    return max(group, neurons, channels)


def _minimum_params(shape: ModelShape, count_embeddings: bool, multiple: int = 1) -> int:
    """Smallest model the guard rails allow: the cheapest group, one block of neurons per layer and of channels."""
    layers = tuple(LayerShape(1, l.group_size, l.head_dim, block_size(l.ffn, multiple)) for l in shape.layers)
    hidden = block_size(shape.hidden, multiple)
    return ModelShape(hidden, layers, shape.vocab, shape.tied_embeddings).budget_params(count_embeddings)


def _check_guard_rails(decision: KeepDecision, shape: ModelShape) -> None:
    assert len(decision.groups) == len(decision.neurons) == len(shape.layers)
    for flags, layer in zip(decision.groups, shape.layers):
        assert flags.dtype == torch.bool and flags.numel() == layer.num_kv_groups and bool(flags.any())
    for flags, layer in zip(decision.neurons, shape.layers):
        assert flags.dtype == torch.bool and flags.numel() == layer.ffn and bool(flags.any())
    assert decision.hidden.numel() == shape.hidden and bool(decision.hidden.any())


@pytest.mark.parametrize("multiple", [1, 32])
@pytest.mark.parametrize("count_embeddings", [False, True])
@pytest.mark.parametrize("name", list(SHAPES))
def test_random_budgets_are_met_within_one_block(name, count_embeddings, multiple):
    shape = SHAPES[name]
    pruner = AdaptivePruner(APTConfig(count_embeddings=count_embeddings, shape_multiple=multiple))
    full = shape.budget_params(count_embeddings)
    floor = _minimum_params(shape, count_embeddings, multiple)
    max_cost = _max_block_cost(shape, count_embeddings, multiple)
    rng = random.Random(f"{name}-{count_embeddings}")
    checked = 0
    for _ in range(60):
        groups, neurons, hidden = _scores(shape, rng)
        target = rng.uniform(0.05, 0.999) * full
        if target < floor + max_cost:  # near the floor the guard rails, not the budget, decide
            continue
        decision = pruner.decide(shape, groups, neurons, hidden, target)
        _check_guard_rails(decision, shape)
        kept = decision.kept_shape(shape)
        assert decision.params == kept.budget_params(count_embeddings)
        assert decision.params <= target, (decision.params, target)
        assert target - decision.params < max_cost, (target - decision.params, max_cost)
        assert decision.removes_anything()
        checked += 1
    assert checked >= 30


@pytest.mark.parametrize("multiple", [1, 32])
@pytest.mark.parametrize("name", ["gqa", "ragged"])
def test_neurons_are_kept_by_score_in_blocks(name, multiple):
    """Each layer keeps its best-scored neurons, a multiple of its block (or all of them). With
    single units (multiple 1) every neuron costs 3*D, so a kept (unforced) neuron never scores
    below a pruned one anywhere; with blocks that holds for the blocks' means."""
    shape = SHAPES[name]
    pruner = AdaptivePruner(APTConfig(shape_multiple=multiple))
    rng = random.Random(3)
    for _ in range(10):
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        groups = [torch.rand(l.num_kv_groups, generator=gen, dtype=torch.float64) for l in shape.layers]
        neurons = [torch.rand(l.ffn, generator=gen, dtype=torch.float64) for l in shape.layers]
        hidden = torch.rand(shape.hidden, generator=gen, dtype=torch.float64)
        decision = pruner.decide(shape, groups, neurons, hidden, 0.6 * shape.block_params())
        kept_hidden = int(decision.hidden.sum())
        assert kept_hidden == shape.hidden or kept_hidden % block_size(shape.hidden, multiple) == 0
        kept, pruned = [], []
        for scores, flags, layer in zip(neurons, decision.neurons, shape.layers):
            count = int(flags.sum())
            assert count == layer.ffn or count % block_size(layer.ffn, multiple) == 0, (count, layer.ffn)
            if not bool(flags.all()):
                assert float(scores[flags].min()) >= float(scores[~flags].max())
            forced = int(torch.argmax(scores))
            mask = flags.clone()
            mask[forced] = False
            kept.append(scores[mask])
            pruned.append(scores[~flags])
        kept, pruned = torch.cat(kept), torch.cat(pruned)
        assert pruned.numel() > 0
        if kept.numel() and multiple == 1:
            assert float(kept.min()) >= float(pruned.max())


@pytest.mark.parametrize("uniform", [False, True])
def test_smollm2_sized_decisions_keep_aligned_widths(uniform):
    """At SmolLM2-135M's shapes every kept FFN width and the hidden size are multiples of 32
    (single units would leave widths like 1,519 and a hidden size of 575), the budget is still
    met within one block, and shape_multiple=1 reproduces the unaligned decision."""
    shape = ModelShape(576, tuple(LayerShape(3, 3, 64, 1536) for _ in range(30)), 49152, True)
    gen = torch.Generator().manual_seed(0)
    depth = torch.linspace(1.0, 0.2, 30, dtype=torch.float64)  # later layers matter less, as measured
    groups = [torch.rand(3, generator=gen, dtype=torch.float64) * d for d in depth]
    neurons = [torch.rand(1536, generator=gen, dtype=torch.float64) * d for d in depth]
    hidden = torch.rand(576, generator=gen, dtype=torch.float64)
    target = 0.7 * shape.block_params()
    aligned = AdaptivePruner(APTConfig(uniform=uniform)).decide(shape, groups, neurons, hidden, target)
    single = AdaptivePruner(APTConfig(uniform=uniform, shape_multiple=1)).decide(shape, groups, neurons, hidden, target)
    widths = [int(n.sum()) for n in aligned.neurons] + [int(aligned.hidden.sum())]
    assert all(w % 32 == 0 for w in widths), widths
    assert any(int(n.sum()) % 32 for n in single.neurons) or int(single.hidden.sum()) % 32
    assert aligned.params <= target and target - aligned.params < _max_block_cost(shape, False, 32)
    assert aligned.params == aligned.kept_shape(shape).block_params()


def test_full_budget_keeps_everything_and_impossible_target_raises():
    shape = SHAPES["gqa"]
    gen = torch.Generator().manual_seed(0)
    scores = ([torch.rand(l.num_kv_groups, generator=gen) for l in shape.layers],
              [torch.rand(l.ffn, generator=gen) for l in shape.layers], torch.rand(shape.hidden, generator=gen))
    for uniform in (False, True):
        pruner = AdaptivePruner(APTConfig(uniform=uniform))
        decision = pruner.decide(shape, *scores, shape.block_params())
        assert not decision.removes_anything()
        assert decision.params == shape.block_params()
        for target in (0, 1, _minimum_params(shape, False) - 1):
            with pytest.raises(PruningError):
                pruner.decide(shape, *scores, target)


def test_disabled_kinds_are_never_pruned():
    shape = SHAPES["mha"]
    gen = torch.Generator().manual_seed(1)
    scores = ([torch.rand(l.num_kv_groups, generator=gen) for l in shape.layers],
              [torch.rand(l.ffn, generator=gen) for l in shape.layers], torch.rand(shape.hidden, generator=gen))
    target = 0.6 * shape.block_params()
    d = AdaptivePruner(APTConfig(prune_heads=False)).decide(shape, *scores, target)
    assert all(bool(g.all()) for g in d.groups) and d.params <= target
    d = AdaptivePruner(APTConfig(prune_hidden=False)).decide(shape, *scores, target)
    assert bool(d.hidden.all()) and d.params <= target
    d = AdaptivePruner(APTConfig(prune_neurons=False)).decide(shape, *scores, target)
    assert all(bool(n.all()) for n in d.neurons) and d.params <= target


def test_decision_indices_and_fingerprint():
    shape = SHAPES["gqa_tied"]
    gen = torch.Generator().manual_seed(2)
    scores = ([torch.rand(l.num_kv_groups, generator=gen) for l in shape.layers],
              [torch.rand(l.ffn, generator=gen) for l in shape.layers], torch.rand(shape.hidden, generator=gen))
    pruner = AdaptivePruner(APTConfig())
    a = pruner.decide(shape, *scores, 0.5 * shape.block_params())
    b = pruner.decide(shape, *[[s.clone() for s in x] if isinstance(x, list) else x.clone() for x in scores],
                      0.5 * shape.block_params())
    c = pruner.decide(shape, *scores, 0.4 * shape.block_params())
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    groups, neurons, hidden = a.indices()
    assert all(torch.equal(g, f.nonzero().flatten()) for g, f in zip(groups, a.groups))
    assert all(bool((n[1:] > n[:-1]).all()) for n in neurons)  # sorted
    assert hidden.numel() == int(a.hidden.sum())


# ---- uniform mode ----------------------------------------------------------------------------------

@pytest.mark.parametrize("count_embeddings", [False, True])
@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_uniform_mode_shapes_fit_and_are_exportable(name, count_embeddings):
    shape = SHAPES[name]
    pruner = AdaptivePruner(APTConfig(uniform=True, count_embeddings=count_embeddings))
    full = shape.budget_params(count_embeddings)
    rng = random.Random(name)
    decided = 0
    for _ in range(25):
        groups, neurons, hidden = _scores(shape, rng)
        target = rng.uniform(0.1, 0.95) * full
        try:
            decision = pruner.decide(shape, groups, neurons, hidden, target)
        except PruningError:
            assert target < 0.5 * full  # only small targets can be infeasible on these shapes
            continue
        decided += 1
        kept = decision.kept_shape(shape)
        _check_guard_rails(decision, shape)
        assert kept.uniform
        assert len({l.num_kv_groups for l in kept.layers}) == 1 and len({l.ffn for l in kept.layers}) == 1
        assert kept.hidden % kept.layers[0].num_q_heads == 0
        assert decision.params == kept.budget_params(count_embeddings) <= target
        # per layer, the kept units are the best-scored ones
        for scores, flags in zip(neurons, decision.neurons):
            if not bool(flags.all()):
                assert float(scores[flags].min()) >= float(scores[~flags].max())
    assert decided >= 10


def test_uniform_mode_refuses_ragged_shapes():
    shape = SHAPES["ragged"]
    scores = ([torch.rand(l.num_kv_groups) for l in shape.layers], [torch.rand(l.ffn) for l in shape.layers],
              torch.rand(shape.hidden))
    with pytest.raises(PruningError):
        AdaptivePruner(APTConfig(uniform=True)).decide(shape, *scores, 0.7 * shape.block_params())


@pytest.mark.parametrize("uniform", [False, True])
def test_decision_does_not_depend_on_the_scale_of_one_kind(uniform):
    """Groups and neurons carry an outlier term that hidden channels lack, so the kinds' scores
    live on different scales. With score_normalization='kind' multiplying one kind's scores by a
    constant changes nothing; ranked raw ('none'), it decides which kind is pruned (on SmolLM2
    the residual stream went first: docs/BENCHMARKS.md)."""
    shape = SHAPES["gqa"]
    gen = torch.Generator().manual_seed(3)
    groups = [torch.rand(l.num_kv_groups, generator=gen, dtype=torch.float64) for l in shape.layers]
    neurons = [torch.rand(l.ffn, generator=gen, dtype=torch.float64) for l in shape.layers]
    hidden = torch.rand(shape.hidden, generator=gen, dtype=torch.float64)
    target = 0.7 * shape.block_params()

    def decide(normalization, group_scale, hidden_scale):
        pruner = AdaptivePruner(APTConfig(uniform=uniform, score_normalization=normalization))
        return pruner.decide(shape, [g * group_scale for g in groups], neurons, hidden * hidden_scale, target).fingerprint()

    for normalization, invariant in (("kind", True), ("none", False)):
        reference = decide(normalization, 1.0, 1.0)
        scaled = {decide(normalization, g, h) for g, h in ((1e3, 1.0), (1.0, 1e-3), (1e-3, 1e3))}
        assert (scaled == {reference}) is invariant, normalization


def test_normalize_by_kind_gives_each_kind_its_parameters():
    shape = SHAPES["ragged"]
    gen = torch.Generator().manual_seed(0)
    groups = [torch.rand(l.num_kv_groups, generator=gen, dtype=torch.float64) * 1e4 for l in shape.layers]
    neurons = [torch.rand(l.ffn, generator=gen, dtype=torch.float64) for l in shape.layers]
    hidden = torch.zeros(shape.hidden, dtype=torch.float64)
    g, n, h = normalize_by_kind(shape, groups, neurons, hidden)
    assert float(sum(x.sum() for x in g)) == pytest.approx(sum(l.group_cost(shape.hidden) * l.num_kv_groups for l in shape.layers))
    assert float(sum(x.sum() for x in n)) == pytest.approx(3 * shape.hidden * sum(l.ffn for l in shape.layers))
    assert torch.equal(h, hidden)  # all zero: left as it is
    for before, after in zip(groups, g):  # order inside a kind unchanged
        assert torch.equal(torch.argsort(before), torch.argsort(after))
