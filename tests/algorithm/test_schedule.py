"""SparsityScheduler: cubic density, evenly spaced events, decay windows, mu, tuning budget."""

from __future__ import annotations

import pytest

from apt_ds.algorithm.schedule import SALIENCE_WARMUP_STEPS, SparsityScheduler
from apt_ds.config import APTConfig, ConfigError


def _sched(**kwargs) -> SparsityScheduler:
    base = dict(target_density=0.4, pruning_start_step=10, pruning_end_step=50, num_pruning_events=4,
                mask_decay_window=5, mask_decay_step=0.2)
    base.update(kwargs)
    return SparsityScheduler(APTConfig(**base))


def test_cubic_density_values():
    s = _sched()
    assert s.density(0) == 1.0
    assert s.density(10) == 1.0  # t0
    assert s.density(30) == pytest.approx(0.4 + 0.6 * 0.5**3)  # midpoint: 0.475
    assert s.density(20) == pytest.approx(0.4 + 0.6 * 0.75**3)
    assert s.density(50) == pytest.approx(0.4)  # t1
    assert s.density(1000) == pytest.approx(0.4)
    values = [s.density(t) for t in range(0, 60)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # never increases
    # cubic: falls fast early, slowly late
    assert s.density(11) - s.density(12) > s.density(48) - s.density(49)


def test_no_pruning_means_full_density():
    s = _sched(prune=False)
    assert all(s.density(t) == 1.0 for t in range(0, 80, 7))
    assert s.event_steps and not any(s.is_event(t) for t in range(100))
    assert s.next_event(0) is None and not s.in_decay_window(45)
    assert not s.collects_salience(20) and s.distill_weight(30) == 0.0


@pytest.mark.parametrize("start, end, events", [(10, 50, 4), (0, 7, 7), (3, 100, 16), (5, 6, 1), (100, 1000, 16)])
def test_events_evenly_spaced_last_at_t1(start, end, events):
    s = _sched(pruning_start_step=start, pruning_end_step=end, num_pruning_events=events)
    steps = s.event_steps
    assert len(steps) == events == len(set(steps))
    assert steps[-1] == end
    assert all(start < t <= end for t in steps)
    gaps = [b - a for a, b in zip([start] + steps, steps)]
    assert max(gaps) - min(gaps) <= 1
    assert sum(gaps) == end - start
    assert [t for t in range(end + 5) if s.is_event(t)] == steps


def test_decay_window_and_next_event():
    s = _sched()  # events at 20, 30, 40, 50; window 5
    assert s.event_steps == [20, 30, 40, 50]
    assert s.next_event(0) == 20 and s.next_event(20) == 30 and s.next_event(49) == 50 and s.next_event(50) is None
    windows = [t for t in range(0, 70) if s.in_decay_window(t)]
    assert windows == [15, 16, 17, 18, 19, 25, 26, 27, 28, 29, 35, 36, 37, 38, 39, 45, 46, 47, 48, 49]


def test_decay_window_is_clipped_to_the_previous_event_and_start():
    s = _sched(pruning_start_step=10, pruning_end_step=22, num_pruning_events=3, mask_decay_window=50)
    assert s.event_steps == [14, 18, 22]
    windows = [t for t in range(0, 30) if s.in_decay_window(t)]
    assert windows == list(range(10, 22))  # never before t0, a window restarts at each event
    assert not any(_sched(mask_decay_window=0).in_decay_window(t) for t in range(60))


def test_distill_weight_is_linear():
    s = _sched(distill_every=1)
    assert s.distill_weight(0) == 0.0 and s.distill_weight(10) == 0.0
    assert s.distill_weight(30) == pytest.approx(0.5)
    assert s.distill_weight(20) == pytest.approx(0.25)
    assert s.distill_weight(49) == pytest.approx(39 / 40)
    # documented choice: after the last event the recovery phase trains on the task loss alone
    assert s.distill_weight(50) == 0.0 and s.distill_weight(70) == 0.0
    mids = [s.distill_weight(t) for t in range(10, 50)]
    diffs = {round(b - a, 12) for a, b in zip(mids, mids[1:])}
    assert diffs == {0.025}
    assert _sched(distill=False).distill_weight(30) == 0.0


def test_distill_every_kth_step_of_the_pruning_phase():
    every_step, every_fourth = _sched(distill_every=1), _sched(distill_every=4)
    weights = {t: every_fourth.distill_weight(t) for t in range(0, 70)}
    distilling = [t for t, mu in weights.items() if mu > 0]
    assert distilling == list(range(14, 50, 4))  # t0 = 10 has mu 0; counted from t0, none after t1
    assert all(weights[t] == every_step.distill_weight(t) for t in distilling)  # same mu where it distils
    with pytest.raises(ConfigError, match="distill_every"):
        APTConfig(distill_every=0)


@pytest.mark.parametrize("steps, every", [(8, 1), (40, 4), (48, 4), (288, 4)])
def test_scaled_default_distils_even_in_a_short_pruning_phase(steps, every):
    config = APTConfig.for_steps(steps)
    s = SparsityScheduler(config)
    assert config.distill_every == every
    assert sum(s.distill_weight(t) > 0 for t in range(steps)) >= 2
    assert APTConfig.for_steps(steps, distill_every=3).distill_every == 3


def test_tuning_budget_and_salience_window():
    s = _sched(rank_budget_multiple=4.0)
    assert s.tuning_budget_multiple(0) == 1.0
    assert s.tuning_budget_multiple(30) == pytest.approx(2.5)
    assert s.tuning_budget_multiple(50) == pytest.approx(4.0)
    assert _sched(grow_ranks=False).tuning_budget_multiple(50) == 1.0
    assert s.progress(5) == 0.0 and s.progress(60) == 1.0
    assert s.collects_salience(0) and s.collects_salience(49) and not s.collects_salience(50)
    late = _sched(pruning_start_step=30, pruning_end_step=60)
    first = 30 - SALIENCE_WARMUP_STEPS
    assert not late.collects_salience(first - 1) and late.collects_salience(first)


def test_for_steps_schedule_fits_the_run():
    cfg = APTConfig.for_steps(40, target_density=0.5)
    s = SparsityScheduler(cfg)
    assert s.event_steps[-1] == cfg.pruning_end_step < 40
    assert s.density(40) == 0.5
    gaps = [b - a for a, b in zip(s.event_steps, s.event_steps[1:])]
    assert cfg.mask_decay_window < min(gaps) + 1  # windows do not overlap the previous event
