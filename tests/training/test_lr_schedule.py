"""apt_ds.training.lr_schedule: transformers' cosine-with-floor schedule, one step later, gives the
LR values apt-ds always had (the closed form below), at every step and after a resume."""

from __future__ import annotations

import math

import pytest
import torch

from apt_ds.training.lr_schedule import warmup_cosine

LR_FLOOR = 0.1  # the schedule's contract, written out: the module's own constant could change unnoticed


def closed_form(warmup: int, total: int, floor: float = LR_FLOOR):
    """The hand-written schedule the library replaced: warm-up (s + 1) / (warmup + 1), then cosine to the floor."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


@pytest.mark.parametrize("warmup,total", [(0, 1), (0, 40), (5, 60), (5, 6), (10, 5), (3, 1000)])
def test_the_same_lr_factor_at_every_step(warmup, total):
    factor, reference = warmup_cosine(warmup, total), closed_form(warmup, total)
    for step in range(total + 1):
        assert factor(step) == pytest.approx(reference(step), rel=1e-12, abs=0), step


def test_warm_up_starts_above_zero_unlike_transformers_first_step():
    """The one-step shift: transformers' own step 0 has LR 0; here the first step already learns."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    factor = warmup_cosine(4, 20)
    assert [factor(s) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert factor(20) == pytest.approx(LR_FLOOR)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    library = get_cosine_with_min_lr_schedule_with_warmup(optimizer, 4, 20, min_lr_rate=LR_FLOOR).lr_lambdas[0]
    assert library(0) == 0.0 and factor(0) > 0


def test_a_scheduler_rebuilt_at_a_step_continues_with_the_same_lr():
    """What the backends do on resume and at every shape change: LambdaLR(last_epoch=step - 1)."""
    factor = warmup_cosine(5, 30)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2e-3)
    running = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    for _ in range(12):
        optimizer.step()
        running.step()
    fresh = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2e-3)
    for group in fresh.param_groups:
        group["initial_lr"] = 2e-3
    resumed = torch.optim.lr_scheduler.LambdaLR(fresh, factor, last_epoch=11)
    assert fresh.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 * factor(12))
    assert resumed.last_epoch == running.last_epoch == 12
