"""The learning-rate schedule: linear warm-up, then cosine decay to a floor of 0.1 of the peak.

The curve is transformers' `get_cosine_with_min_lr_schedule_with_warmup` (min_lr_rate = floor).
The backends take a step -> factor function (they build their own `LambdaLR`, and rebuild it
at every shape change and on resume), so its lambda is taken from a scheduler on a throw-away
optimizer. One shift keeps the schedule apt-ds has always had: step s here is transformers'
step s + 1 of a schedule one step longer, with one more warm-up step. transformers' first step
has LR 0 (a wasted update); here the warm-up climbs peak/(warmup+1), 2 peak/(warmup+1), ...
and reaches the peak at step `warmup`, and the cosine ends on the floor at step `total`.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

LR_FLOOR = 0.1  # of the peak LR, reached at the last step


def warmup_cosine(warmup: int, total: int, floor: float = LR_FLOOR) -> Callable[[int], float]:
    """LR factor of optimizer step `step` (0-based): (step + 1) / (warmup + 1) during the warm-up,
    then floor + (1 - floor) * (1 + cos(pi * (step - warmup) / (total - warmup))) / 2."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    throwaway = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule = get_cosine_with_min_lr_schedule_with_warmup(throwaway, num_warmup_steps=warmup + 1,
                                                           num_training_steps=total + 1, min_lr_rate=floor)
    return functools.partial(_one_step_later, schedule.lr_lambdas[0])


def _one_step_later(factor: Callable[[int], float], step: int) -> float:
    return factor(step + 1)
