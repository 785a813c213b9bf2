"""AdaptiveTuner: adapter importance, growth plans that fill the budget, growth itself."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from apt_ds.algorithm.adapters import APTAdapter
from apt_ds.algorithm.tuner import AdaptiveTuner, RowSums
from apt_ds.config import APTConfig


def _adapters(dims, ranks, seed=0) -> dict[str, APTAdapter]:
    torch.manual_seed(seed)
    out = {}
    for i, ((o, n), r) in enumerate(zip(dims, ranks)):
        out[f"layer{i:02d}.proj"] = APTAdapter.wrap(nn.Linear(n, o, bias=False), r, 2.0 * r,
                                                    torch.Generator().manual_seed(seed + i))
    return out


def _total(adapters) -> int:
    return sum(a.adapter_params() for a in adapters.values())


def _check_plan(tuner, adapters, plan, multiple, cap):
    budget = multiple * tuner.initial_params
    current = {n: a.rank for n, a in adapters.items()}
    uncapped = sorted((n for n in adapters if current[n] < cap), key=lambda n: tuner.importance.get(n, 0.0), reverse=True)
    top = set(uncapped[: math.ceil(len(uncapped) / 2)])
    assert set(plan) <= top  # only the top half (by importance) of adapters below the cap grows
    assert all(current[n] < r <= cap for n, r in plan.items())
    size = {n: adapters[n].in_features + adapters[n].out_features for n in adapters}
    after = _total(adapters) + sum((r - current[n]) * size[n] for n, r in plan.items())
    assert after <= budget  # never over the budget
    final = {n: plan.get(n, current[n]) for n in top}
    growable = [n for n in top if final[n] < cap]
    if growable:  # filled: one more rank for each growable chosen adapter would not fit
        assert budget - after < sum(size[n] for n in growable)
    return after


@pytest.mark.parametrize("seed", range(8))
def test_plan_growth_fills_budget_top_half_and_cap(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    dims = [(rng.choice([16, 32, 48, 96]), rng.choice([16, 32, 64])) for _ in range(n)]
    ranks = [rng.choice([1, 2, 4, 8]) for _ in range(n)]
    cap = rng.choice([8, 12, 64])
    adapters = _adapters(dims, ranks, seed)
    tuner = AdaptiveTuner(APTConfig(adapter_rank=1, rank_cap=cap))
    tuner.importance = {name: rng.random() for name in adapters}
    multiple = rng.uniform(1.2, 4.0)
    plan = tuner.plan_growth(adapters, multiple)
    assert tuner.initial_params == _total(adapters)
    _check_plan(tuner, adapters, plan, multiple, cap)


def test_growth_is_proportional_and_follows_importance():
    adapters = _adapters([(32, 32)] * 6, [4, 4, 4, 8, 8, 8])
    tuner = AdaptiveTuner(APTConfig(adapter_rank=4, rank_cap=64))
    names = sorted(adapters)
    tuner.importance = {names[0]: 5.0, names[3]: 4.0, names[1]: 3.0, names[2]: 0.1, names[4]: 0.2, names[5]: 0.0}
    plan = tuner.plan_growth(adapters, 2.0)
    assert set(plan) == {names[0], names[3], names[1]}
    assert plan[names[0]] == plan[names[1]]  # same rank, same growth
    assert plan[names[3]] / 8 == pytest.approx(plan[names[0]] / 4, rel=0.2)  # proportional to the current rank
    _check_plan(tuner, adapters, plan, 2.0, 64)


def test_cap_and_met_budget_stop_growth():
    adapters = _adapters([(16, 16)] * 4, [4, 4, 4, 4])
    tuner = AdaptiveTuner(APTConfig(adapter_rank=4, rank_cap=6))
    plan = tuner.plan_growth(adapters, 100.0)
    assert set(plan.values()) == {6} and len(plan) == 2  # top half, clipped at the cap
    tuner.grow(adapters, plan, torch.Generator().manual_seed(0))
    for remaining in (1, 1):  # the capped ones no longer compete: top half of the 2, then of the last 1
        plan = tuner.plan_growth(adapters, 100.0)
        assert set(plan.values()) == {6} and len(plan) == remaining
        assert all(adapters[n].rank == 4 for n in plan)
        tuner.grow(adapters, plan, torch.Generator().manual_seed(0))
    assert all(a.rank == 6 for a in adapters.values())
    assert tuner.plan_growth(adapters, 100.0) == {}  # everything at the cap
    fresh = _adapters([(16, 16)] * 4, [4, 4, 4, 4])
    t2 = AdaptiveTuner(APTConfig(adapter_rank=4))
    assert t2.plan_growth(fresh, 1.0) == {}  # budget already met
    assert t2.initial_params == _total(fresh)


def test_successive_events_track_the_initial_budget():
    adapters = _adapters([(32, 16), (16, 48), (24, 24), (40, 8)], [2, 2, 2, 2])
    tuner = AdaptiveTuner(APTConfig(adapter_rank=2, rank_cap=64))
    initial = _total(adapters)
    gen = torch.Generator().manual_seed(0)
    for multiple in (1.5, 2.0, 3.0, 4.0):
        tuner.importance = {n: random.Random(f"{n}{multiple}").random() for n in adapters}
        plan = tuner.plan_growth(adapters, multiple)
        _check_plan(tuner, adapters, plan, multiple, 64)
        tuner.grow(adapters, plan, gen)
        assert _total(adapters) <= multiple * initial
    assert tuner.initial_params == initial
    assert _total(adapters) > 3 * initial


def test_grow_returns_prefixed_edits_and_keeps_outputs():
    adapters = _adapters([(24, 40), (16, 40)], [4, 4])
    x = torch.randn(5, 40)
    with torch.no_grad():
        for a in adapters.values():
            a.lora_B.normal_()
        before = {n: a(x) for n, a in adapters.items()}
    tuner = AdaptiveTuner(APTConfig(adapter_rank=4))
    name = sorted(adapters)[0]
    change = tuner.grow(adapters, {name: 9}, torch.Generator().manual_seed(1))
    assert sorted(change) == [f"{name}.lora_A", f"{name}.lora_B"]
    assert adapters[name].rank == 9 and adapters[sorted(adapters)[1]].rank == 4
    with torch.no_grad():
        for n, a in adapters.items():
            torch.testing.assert_close(a(x), before[n], rtol=1e-6, atol=1e-6)


def test_importance_is_ema_of_mean_abs_row_products():
    adapters = _adapters([(8, 6), (8, 6)], [3, 3])
    tuner = AdaptiveTuner(APTConfig(adapter_rank=3, salience_beta=0.5))
    grads = {}
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        grads[step] = {n: torch.randn(a.lora_A.shape, generator=gen) for n, a in adapters.items()}
        read_grad = lambda name, p: grads[step].get(name.rsplit(".", 1)[0])  # noqa: E731
        tuner.accumulate(adapters, lambda name, p: p.detach(), read_grad)
    for n, a in adapters.items():
        s0, s1 = ((a.lora_A.detach() * grads[s][n]).sum(1).abs().mean().item() for s in (0, 1))
        assert tuner.importance[n] == pytest.approx(0.5 * s0 + 0.5 * s1, rel=1e-6)
    # adapters without a gradient keep their importance
    old = dict(tuner.importance)
    tuner.accumulate(adapters, lambda name, p: p.detach(), lambda name, p: None)
    assert tuner.importance == old
    other = AdaptiveTuner(APTConfig(adapter_rank=3))
    other.load_state_dict(tuner.state_dict())
    assert other.importance == tuner.importance and other.initial_params == tuner.initial_params


def test_the_initial_budget_is_the_size_before_the_first_shrink():
    """The budget multiple applies to the adapters as they were when tuning started: an event
    that shrinks adapters (hidden channels removed) before the first growth plan must not
    shrink the budget with them."""
    before = _adapters([(32, 32), (32, 32)], [4, 4])
    tuner = AdaptiveTuner(APTConfig(adapter_rank=4, rank_cap=64))
    tuner.accumulate(before, lambda name, p: p, lambda name, p: None)  # a training step, no gradients yet
    initial = _total(before)
    shrunk = _adapters([(24, 24), (24, 24)], [4, 4])  # the same adapters after a pruning event
    tuner.importance = {n: 1.0 for n in shrunk}
    plan = tuner.plan_growth(shrunk, 2.0)
    tuner.grow(shrunk, plan, torch.Generator().manual_seed(0))
    assert tuner.initial_params == initial
    assert _total(shrunk) > 2 * (4 * 48 * 2)  # more than twice the shrunk size: the budget kept its start
    assert _total(shrunk) <= 2 * initial


def _reference_scores(adapters, grads) -> dict[str, float]:
    return {n: (a.lora_A.detach() * grads[n]).sum(1).abs().mean().item() for n, a in adapters.items() if n in grads}


@pytest.mark.parametrize("chunk", [RowSums.CHUNK_ELEMENTS, 20])
def test_importance_over_mixed_widths_growth_and_a_checkpoint_is_the_per_adapter_ema(chunk, monkeypatch):
    """The batched update equals the per-adapter EMA (to fp32 rounding) whatever the adapters'
    widths and ranks (grown between steps), however the rows are chunked, after a checkpoint's
    floats are loaded or the importance is assigned, and for an adapter first scored late (it
    starts at its first score)."""
    monkeypatch.setattr(RowSums, "CHUNK_ELEMENTS", chunk)
    adapters = _adapters([(8, 6), (8, 6), (5, 10), (7, 10), (9, 6)], [3, 2, 4, 1, 2])
    late = sorted(adapters)[-1]
    beta = 0.7
    tuner = AdaptiveTuner(APTConfig(adapter_rank=1, salience_beta=beta))
    expected: dict[str, float] = {}
    for step in range(5):
        gen = torch.Generator().manual_seed(100 + step)
        grads = {n: torch.randn(a.lora_A.shape, generator=gen) for n, a in adapters.items() if step >= 3 or n != late}
        tuner.accumulate(adapters, lambda name, p: p.detach(), lambda name, p: grads.get(name.rsplit(".", 1)[0]))
        for n, score in _reference_scores(adapters, grads).items():
            expected[n] = score if n not in expected else beta * expected[n] + (1 - beta) * score
        assert tuner.importance_values() == pytest.approx(expected, rel=1e-5)
        if step == 0:
            tuner.grow(adapters, {sorted(adapters)[0]: 5, sorted(adapters)[2]: 6}, torch.Generator().manual_seed(1))
        if step == 1:  # an assignment replaces the held entries
            tuner.importance = dict(tuner.importance_values())
        if step == 2:  # resume: a fresh tuner from the checkpoint's floats
            state = tuner.state_dict()
            assert all(isinstance(v, float) for v in state["importance"].values())
            tuner = AdaptiveTuner(APTConfig(adapter_rank=1, salience_beta=beta))
            tuner.load_state_dict(state)


def test_importance_update_is_a_few_operations_for_all_adapters():
    """One step's importance update for LLaMA-2-7B's count of q/v adapters (64): at most 16
    computing operations (each a kernel on a GPU) and 2 dispatched per adapter besides (the
    views that hand each adapter its entry); per adapter it took 7 computing ones (448)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from _common import dispatched_operations

    adapters = _adapters([(64, 64)] * 64, [8] * 64)
    grads = {n: torch.randn(a.lora_A.shape) for n, a in adapters.items()}
    tuner = AdaptiveTuner(APTConfig(adapter_rank=8))
    update = lambda: tuner.accumulate(adapters, lambda name, p: p.detach(), lambda name, p: grads[name.rsplit(".", 1)[0]])  # noqa: E731
    update()  # the first step scores; the next ones average
    computing, dispatched = dispatched_operations(update, views=False), dispatched_operations(update, views=True)
    assert 0 < computing <= 16 and dispatched <= 16 + 2 * len(adapters), (computing, dispatched)
