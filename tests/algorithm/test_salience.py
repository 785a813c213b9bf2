"""Salience scores: definition, invariance to micro-batching and data-parallel splits, kurtosis."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from conftest import random_batch, tiny_llama

import apt_ds.algorithm.salience as salience_module
from apt_ds.algorithm.adapters import add_adapters
from apt_ds.algorithm.salience import SalienceCollector, column_power_sums, unit_kurtosis
from apt_ds.algorithm.shrink import shrink_model
from apt_ds.algorithm.units import ModelShape


def _model(kind="gqa", seed=0):
    model = tiny_llama(kind, seed=seed)
    adapters = add_adapters(model, ("q_proj", "v_proj", "o_proj"), rank=4, alpha=8.0, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.lora_B.copy_(0.05 * torch.randn(adapter.lora_B.shape, generator=gen))
    return model


def _halves(batch):
    return [{k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}]


def _collect(model, collector, micro_batches, scale):
    collector.install(model)
    try:
        for mb in micro_batches:
            (model(**mb).loss * scale).backward()
    finally:
        collector.remove()


def _assert_scores_close(a: SalienceCollector, b: SalienceCollector, rtol=1e-5):
    for x, y in zip(a.group_scores, b.group_scores):
        torch.testing.assert_close(x, y, rtol=rtol, atol=0)
    for x, y in zip(a.neuron_scores, b.neuron_scores):
        torch.testing.assert_close(x, y, rtol=rtol, atol=1e-12)
    torch.testing.assert_close(a.hidden_scores, b.hidden_scores, rtol=rtol, atol=0)


def test_scores_follow_the_definition():
    """S_j = (mean |X_j|) (sum |dL/dX_j|) over the step's tokens, summed per group / over hidden sites."""
    model = _model("gqa")
    shape = ModelShape.from_model(model)
    batch = random_batch(batch=4)
    captured = {}

    def keep_input(name):
        def hook(module, args):
            args[0].retain_grad()
            captured[name] = args[0]
        return hook

    def keep_output(name):
        def hook(module, args, output):
            output.retain_grad()
            captured[name] = output
        return hook

    handles = []
    for l, layer in enumerate(model.model.layers):
        handles += [layer.self_attn.o_proj.register_forward_pre_hook(keep_input(f"o_in{l}")),
                    layer.self_attn.o_proj.register_forward_hook(keep_output(f"o_out{l}")),
                    layer.mlp.down_proj.register_forward_pre_hook(keep_input(f"d_in{l}")),
                    layer.mlp.down_proj.register_forward_hook(keep_output(f"d_out{l}"))]
    collector = SalienceCollector(shape, beta=0.85, use_kurtosis=False)
    _collect(model, collector, [batch], 1.0)
    for h in handles:
        h.remove()
    collector.end_step()

    def channel(t):
        tokens = t.shape[0] * t.shape[1]
        return (t.detach().abs().sum((0, 1)) / tokens * t.grad.abs().sum((0, 1))).float()  # fp32 on the model device

    hidden = 0
    for l, layer in enumerate(shape.layers):
        groups = channel(captured[f"o_in{l}"]).reshape(-1, layer.group_size * layer.head_dim).sum(-1)
        torch.testing.assert_close(collector.group_scores[l], groups, rtol=1e-5, atol=0)
        torch.testing.assert_close(collector.neuron_scores[l], channel(captured[f"d_in{l}"]), rtol=1e-5, atol=1e-12)
        hidden = hidden + channel(captured[f"o_out{l}"]) + channel(captured[f"d_out{l}"])
        assert collector.group_scores[l].shape == (layer.num_kv_groups,)
        assert bool((collector.group_scores[l] > 0).all())
    torch.testing.assert_close(collector.hidden_scores, hidden, rtol=1e-5, atol=0)


@pytest.mark.parametrize("use_kurtosis", [False, True])
def test_gradient_accumulation_gives_the_same_scores(use_kurtosis):
    model = _model("gqa")
    shape = ModelShape.from_model(model)
    batch = random_batch(batch=8, seed=3)
    whole = SalienceCollector(shape, beta=0.85, use_kurtosis=use_kurtosis)
    _collect(model, whole, [batch], 1.0)
    whole.end_step()
    accumulated = SalienceCollector(shape, beta=0.85, use_kurtosis=use_kurtosis)
    _collect(model, accumulated, _halves(batch), 0.5)  # what 2-step gradient accumulation does
    accumulated.end_step()
    _assert_scores_close(whole, accumulated)
    # and a single half alone is different: the test can tell the two apart
    half = SalienceCollector(shape, beta=0.85, use_kurtosis=use_kurtosis)
    _collect(model, half, _halves(batch)[:1], 1.0)
    half.end_step()
    assert not torch.allclose(half.hidden_scores, whole.hidden_scores, rtol=1e-3)


class _ThreadAllReduce:
    """An all-reduce(sum) between threads that play the ranks (summation order is fixed)."""

    def __init__(self, world_size: int):
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.calls = 0

    def for_rank(self, rank: int):
        def reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            total = self.slots[0].clone()
            for other in self.slots[1:]:
                total += other
            self.barrier.wait()
            if rank == 0:
                self.calls += 1
            return total

        return reduce_sum


@pytest.mark.parametrize("use_kurtosis", [False, True])
def test_two_ranks_with_half_batches_match_one_rank(use_kurtosis):
    model = _model("gqa_tied")
    shape = ModelShape.from_model(model)
    batch = random_batch(batch=8, seed=5)
    single = SalienceCollector(shape, beta=0.85, use_kurtosis=use_kurtosis)
    _collect(model, single, [batch], 1.0)
    single.end_step()

    comm = _ThreadAllReduce(2)
    ranks = [SalienceCollector(shape, 0.85, use_kurtosis, reduce_sum=comm.for_rank(r), world_size=2) for r in range(2)]
    for rank, half in zip(ranks, _halves(batch)):
        _collect(model, rank, [half], 1.0)  # each rank: loss = mean over its own half (DDP averages grads)
    errors = []

    def run(collector):
        try:
            collector.end_step()
        except Exception as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(c,)) for c in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and comm.calls >= 1
    for t in threads:
        assert not t.is_alive()
    _assert_scores_close(ranks[0], ranks[1], rtol=0)  # identical on every rank
    _assert_scores_close(single, ranks[0])


# ---- kurtosis -------------------------------------------------------------------------------------

def numpy_kurtosis(entries: np.ndarray) -> float:
    """Fisher (excess) kurtosis with biased moments, computed directly (= scipy.stats.kurtosis defaults)."""
    centered = entries - entries.mean()
    return float((centered**4).mean() / (centered**2).mean() ** 2 - 3.0)


def _numpy_unit_kurtosis(mean_x: np.ndarray, weight: np.ndarray, width: int) -> np.ndarray:
    out = []
    for unit in range(weight.shape[1] // width):
        cols = slice(unit * width, (unit + 1) * width)
        entries = (mean_x[None, cols] * weight[:, cols]).ravel()
        out.append(numpy_kurtosis(entries))
    return np.array(out)


@pytest.mark.parametrize("width", [1, 8, 32])
def test_unit_kurtosis_matches_numpy(width):
    torch.manual_seed(width)
    gen = torch.Generator().manual_seed(width)
    rows, units = 48, 6
    weight = torch.randn(rows, units * width, generator=gen, dtype=torch.float64)
    weight[:, : 2 * width] = torch.distributions.StudentT(3.0).sample((rows, 2 * width)).double()  # heavy tails
    weight[:, 2 * width : 3 * width] = torch.rand(rows, width, generator=gen, dtype=torch.float64)  # negative kurtosis
    mean_x = torch.randn(units * width, generator=gen, dtype=torch.float64)
    mean_x[2 * width : 3 * width] = 0.7  # O of that unit stays uniform: negative excess kurtosis
    ours = unit_kurtosis(mean_x, column_power_sums(weight), rows=rows, unit_width=width)
    expected = _numpy_unit_kurtosis(mean_x.numpy(), weight.numpy(), width)
    np.testing.assert_allclose(ours.numpy(), expected, rtol=1e-8, atol=1e-8)
    assert (expected < 0).any() and (expected > 0.5).any()


def test_unit_kurtosis_uses_only_the_units_own_entries():
    """Changing one unit's columns changes only that unit's kurtosis (no mixing across units)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 4 * 16, generator=gen, dtype=torch.float64)
    mean_x = torch.randn(64, generator=gen, dtype=torch.float64)
    before = unit_kurtosis(mean_x, column_power_sums(weight), 32, 16)
    weight[3, 16 + 5] = 40.0  # an outlier in unit 1
    after = unit_kurtosis(mean_x, column_power_sums(weight), 32, 16)
    changed = (after - before).abs() > 1e-9
    assert changed.tolist() == [False, True, False, False]
    assert float(after[1]) > float(before[1]) + 5


def test_collector_kurtosis_term_matches_direct_computation():
    torch.manual_seed(0)
    model = _model("gqa", seed=2)
    shape = ModelShape.from_model(model)
    layer0 = shape.layers[0]
    width = layer0.group_size * layer0.head_dim
    with torch.no_grad():  # give group 0 and some neurons heavy-tailed weights so the term is not zero
        o_proj = model.model.layers[0].self_attn.o_proj
        o_proj.weight[:, :width] = 0.02 * torch.distributions.StudentT(2.5).sample((shape.hidden, width))
        down = model.model.layers[1].mlp.down_proj
        down.weight[:, :10] = 0.02 * torch.distributions.StudentT(2.5).sample((shape.hidden, 10))
    means = {}

    def mean_input(name):
        def hook(module, args):
            x = args[0].detach().double()
            means[name] = x.reshape(-1, x.shape[-1]).mean(0)
        return hook

    handles = [model.model.layers[l].self_attn.o_proj.register_forward_pre_hook(mean_input(f"o{l}")) for l in range(2)]
    handles += [model.model.layers[l].mlp.down_proj.register_forward_pre_hook(mean_input(f"d{l}")) for l in range(2)]
    with_k = SalienceCollector(shape, beta=0.85, use_kurtosis=True)
    without = SalienceCollector(shape, beta=0.85, use_kurtosis=False)
    with_k.install(model)
    without.install(model)
    model(**random_batch(batch=4, seed=9)).loss.backward()
    for h in handles:
        h.remove()
    with_k.end_step()
    without.end_step()
    positive = 0
    for l in range(2):
        o_weight = model.model.layers[l].self_attn.o_proj.merged_weight().double().numpy()  # o_proj has an adapter
        d_weight = model.model.layers[l].mlp.down_proj.weight.detach().double().numpy()
        for kind, got, base, mean_x, weight, w in (
            ("group", with_k.group_scores[l], without.group_scores[l], means[f"o{l}"], o_weight, width),
            ("neuron", with_k.neuron_scores[l], without.neuron_scores[l], means[f"d{l}"], d_weight, 1),
        ):
            kurt = _numpy_unit_kurtosis(mean_x.numpy(), weight, w)
            outlier = np.sqrt(np.maximum(kurt, 0.0))
            # the term is in the layer's first-order units: weight x mean first-order score x k / mean k
            expected = with_k.kurtosis_weight * base.double().numpy().mean() * outlier / outlier.mean()
            np.testing.assert_allclose((got - base).double().numpy(), expected, rtol=1e-4, atol=1e-12,
                                       err_msg=f"{kind} layer {l}")
            positive += int((outlier > 0.5).sum())
    assert positive >= 10


@pytest.mark.parametrize("kind", ["group", "neuron"])
def test_outlier_term_scales_with_the_first_order_term(kind):
    """Scaling the loss by c scales every score by c, outlier term included: the term is in the
    same units as the loss change, so how much it counts does not depend on the loss scale, the
    batch size or the tokens per step (the spec's raw sqrt(kurtosis) term dominated the scores
    once the first-order term became a per-token mean, defect 1 of issue 16)."""
    model = _model("gqa", seed=2)
    shape = ModelShape.from_model(model)
    with torch.no_grad():
        for layer in model.model.layers:  # heavy tails so the outlier term is not zero
            layer.mlp.down_proj.weight.copy_(0.02 * torch.distributions.StudentT(2.5).sample(layer.mlp.down_proj.weight.shape))
            layer.self_attn.o_proj.weight.copy_(0.02 * torch.distributions.StudentT(2.5).sample(layer.self_attn.o_proj.weight.shape))
    batch = random_batch(batch=4, seed=9)
    scores = []
    for scale in (1.0, 1000.0):
        collector = SalienceCollector(shape, beta=0.85, use_kurtosis=True)
        collector.install(model)
        model.zero_grad()
        (scale * model(**batch).loss).backward()
        collector.end_step()
        collector.remove()
        scores.append(collector.group_scores if kind == "group" else collector.neuron_scores)
    for small, large in zip(*scores):
        torch.testing.assert_close(large, 1000.0 * small, rtol=1e-4, atol=0.0)


def test_power_sums_are_recomputed_only_for_weights_that_change():
    """Frozen o_proj/down_proj: power sums computed once per shape; an adapted o_proj: every step,
    from the weight as updated by the optimizer."""
    model = _model("gqa", seed=3)  # o_proj carries an adapter, down_proj is frozen
    shape = ModelShape.from_model(model)
    collector = SalienceCollector(shape, beta=0.85, use_kurtosis=True)
    collector.install(model)
    model(**random_batch(batch=2, seed=4)).loss.backward()
    collector.end_step()
    frozen_sums, adapted_sums = collector.ffn_sites[0].power_sums, collector.attn_sites[0].power_sums
    o_proj = model.model.layers[0].self_attn.o_proj
    with torch.no_grad():
        o_proj.lora_B.add_(0.5)  # what an optimizer step does to the effective weight
    model(**random_batch(batch=2, seed=5)).loss.backward()
    collector.end_step()
    assert collector.ffn_sites[0].power_sums is frozen_sums  # not recomputed
    torch.testing.assert_close(collector.attn_sites[0].power_sums, column_power_sums(o_proj.merged_weight()))
    assert not torch.allclose(collector.attn_sites[0].power_sums, adapted_sums)


@pytest.mark.parametrize("prune_hidden, adapted", [(False, False), (True, False), (False, True)],
                         ids=["hidden-kept", "hidden-pruned", "adapted-sites"])
def test_power_sums_after_a_shrink_match_the_shrunk_weights(prune_hidden, adapted, monkeypatch):
    """A shrink that keeps every hidden channel removes columns only: the kept columns' power sums
    are carried over, not recomputed; one that prunes hidden channels changes every column's sum;
    a site whose module carries an adapter is recomputed at every step whatever the shrink."""
    model = tiny_llama("gqa", seed=5)
    targets = ("q_proj", "v_proj", "o_proj", "down_proj") if adapted else ("q_proj", "v_proj")  # else o/down frozen
    add_adapters(model, targets, rank=4, alpha=8.0, seed=5)
    shape = ModelShape.from_model(model)
    collector = SalienceCollector(shape, beta=0.85, use_kurtosis=True)
    collector.install(model)
    model(**random_batch(batch=2, seed=6)).loss.backward()
    collector.end_step()
    groups = [torch.tensor([1]), torch.tensor([0, 1])]
    neurons = [torch.arange(0, shape.layers[0].ffn, 3), torch.arange(5, 40)]
    hidden = torch.arange(1, shape.hidden, 2) if prune_hidden else torch.arange(shape.hidden)
    new_shape, _ = shrink_model(model, shape, groups, neurons, hidden)
    collector.keep(new_shape, groups, neurons, hidden)
    if adapted:
        with torch.no_grad():  # what an optimizer step does to the effective weights
            for layer in model.model.layers:
                layer.self_attn.o_proj.lora_B.add_(0.3)
                layer.mlp.down_proj.lora_B.add_(0.3)
    computed = []
    monkeypatch.setattr(salience_module, "column_power_sums", lambda w: computed.append(w) or column_power_sums(w))
    model(**random_batch(batch=2, seed=7)).loss.backward()
    collector.end_step()
    assert len(computed) == (2 * len(new_shape.layers) if prune_hidden or adapted else 0)
    for layer, attn, ffn in zip(model.model.layers, collector.attn_sites, collector.ffn_sites):
        o_proj, down = layer.self_attn.o_proj, layer.mlp.down_proj
        expected = [column_power_sums(m.merged_weight() if adapted else m.weight) for m in (o_proj, down)]
        torch.testing.assert_close(attn.power_sums, expected[0], rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(ffn.power_sums, expected[1], rtol=1e-12, atol=1e-15)
    collector.remove()


# ---- EMA, masks of state ---------------------------------------------------------------------------

def test_ema_disabled_collection_and_keep():
    model = _model("mha")
    shape = ModelShape.from_model(model)
    collector = SalienceCollector(shape, beta=0.85, use_kurtosis=False)
    collector.install(model)
    model(**random_batch(seed=1)).loss.backward()
    collector.end_step()
    first = [s.clone() for s in collector.neuron_scores]
    probe = SalienceCollector(shape, beta=0.85, use_kurtosis=False)
    probe.install(model)
    model(**random_batch(seed=2)).loss.backward()
    collector.end_step()
    probe.end_step()
    for old, new, ema in zip(first, probe.neuron_scores, collector.neuron_scores):
        torch.testing.assert_close(ema, 0.85 * old + 0.15 * new, rtol=1e-12, atol=0)
    probe.remove()

    # no collection while disabled or under no_grad
    before = collector.hidden_scores.clone()
    collector.enabled = False
    model(**random_batch(seed=3)).loss.backward()
    collector.enabled = True
    with torch.no_grad():
        model(**random_batch(seed=4))
    assert all(bool((s.act_abs == 0).all()) for s in collector.hidden_sites)
    assert float(collector.tokens) == 0

    # after a shrink, removed units drop out of the EMA vectors
    groups = [torch.tensor([0, 2, 3]), torch.tensor([1])]
    neurons = [torch.arange(0, 96, 2), torch.arange(10)]
    hidden = torch.arange(1, 64, 3)
    new_shape = ModelShape(len(hidden), tuple(
        type(l)(len(g), l.group_size, l.head_dim, len(n)) for l, g, n in zip(shape.layers, groups, neurons)),
        shape.vocab, shape.tied_embeddings)
    old_groups = [s.clone() for s in collector.group_scores]
    collector.keep(new_shape, groups, neurons, hidden)
    assert torch.equal(collector.hidden_scores, before[hidden])
    assert all(torch.equal(s, o[g]) for s, o, g in zip(collector.group_scores, old_groups, groups))
    assert [s.numel() for s in collector.neuron_scores] == [48, 10]
    assert collector.attn_sites[1].act_abs.numel() == new_shape.layers[1].num_q_heads * new_shape.layers[1].head_dim
    state = collector.state_dict()
    other = SalienceCollector(new_shape, beta=0.85, use_kurtosis=False)
    other.load_state_dict(state)
    assert torch.equal(other.hidden_scores, collector.hidden_scores)


def _scores_of(model, batch, use_kurtosis=True):
    collector = SalienceCollector(ModelShape.from_model(model), beta=0.85, use_kurtosis=use_kurtosis)
    _collect(model, collector, [batch], 1.0)
    collector.end_step()
    return collector


def test_scores_do_not_grow_with_the_tokens_per_step():
    """The same rows twice in one step (twice the tokens, the same mean loss) give the same
    scores: the first-order term keeps its balance with the kurtosis term at any batch size."""
    model = _model("gqa")
    batch = random_batch(batch=4)
    doubled = {k: torch.cat([v, v]) for k, v in batch.items()}
    _assert_scores_close(_scores_of(model, batch), _scores_of(model, doubled), rtol=1e-4)


def test_padding_is_not_counted():
    """Rows right-padded with tokens the attention mask hides (labels -100) score exactly as
    the unpadded rows: padding adds nothing to |X|, the kurtosis mean, or the token count."""
    model = _model("mha")
    batch = random_batch(batch=4, length=10)
    pad = 6
    padded = {
        "input_ids": torch.cat([batch["input_ids"], torch.zeros(4, pad, dtype=torch.long)], 1),
        "attention_mask": torch.cat([batch["attention_mask"], torch.zeros(4, pad, dtype=torch.long)], 1),
        "labels": torch.cat([batch["labels"], torch.full((4, pad), -100)], 1),
    }
    _assert_scores_close(_scores_of(model, batch), _scores_of(model, padded), rtol=1e-4)


def test_column_power_sums_over_row_blocks_are_the_whole_weights_sums(monkeypatch):
    """Taken in blocks of rows (a bounded float64 temporary), the sums are those of the whole
    weight at once, to float64 rounding; a block smaller than one row still takes whole rows."""
    import apt_ds.algorithm.kurtosis as kurtosis

    weight = torch.randn(37, 50, generator=torch.Generator().manual_seed(3))
    w = weight.double()
    whole = torch.stack([w.sum(0), (w**2).sum(0), (w**3).sum(0), (w**4).sum(0)])
    for block in (10 * 50, 7 * 50 + 3, 1):  # 4 blocks, 6 blocks of 7 rows, a row at a time
        monkeypatch.setattr(kurtosis, "POWER_SUM_BLOCK", block)
        torch.testing.assert_close(column_power_sums(weight), whole, rtol=1e-12, atol=1e-12)
