"""When APT does what: cubic density schedule, pruning events, decay windows, budgets.

Steps count completed optimizer steps. An event "at step s" runs right after the s-th
optimizer step. Pure arithmetic: no torch, so it can be tested and reasoned about alone.
"""

from __future__ import annotations

from apt_ds.config import APTConfig

SALIENCE_WARMUP_STEPS = 10  # EMA(beta=0.85) needs ~10 steps to forget its start


class SparsityScheduler:
    """When things happen in a run: the pruning events between pruning_start_step and
    pruning_end_step, the density each targets (cubic, down to target_density), the mask-decay
    windows before them, the distillation weight and the tuning budget over the phase."""

    def __init__(self, config: APTConfig):
        self.config = config
        self.start, self.end = config.pruning_start_step, config.pruning_end_step
        span, events = self.end - self.start, config.num_pruning_events
        self.event_steps = [self.start + round((k + 1) * span / events) for k in range(events)]

    def density(self, step: int) -> float:
        """rho_t = rho_T + (1 - rho_T) (1 - (t - t0) / (t1 - t0))^3, clamped outside [t0, t1]."""
        target = self.config.target_density
        if not self.config.prune or step <= self.start:
            return 1.0
        if step >= self.end:
            return target
        remaining = 1.0 - (step - self.start) / (self.end - self.start)
        return target + (1.0 - target) * remaining**3

    def progress(self, step: int) -> float:
        """Fraction of the pruning phase completed, in [0, 1]."""
        return min(1.0, max(0.0, (step - self.start) / (self.end - self.start)))

    def is_event(self, step: int) -> bool:
        return self.config.prune and step in self.event_steps

    def next_event(self, step: int) -> int | None:
        """The first event strictly after `step` (None when all have happened)."""
        if not self.config.prune:
            return None
        upcoming = [s for s in self.event_steps if s > step]
        return upcoming[0] if upcoming else None

    def in_decay_window(self, step: int) -> bool:
        """True for the steps whose end lies inside the window before the next event."""
        upcoming = self.next_event(step)
        if upcoming is None:
            return False
        previous = max([self.start] + [s for s in self.event_steps if s <= step])
        window_start = max(previous, upcoming - self.config.mask_decay_window)
        return window_start <= step < upcoming

    def collects_salience(self, step: int) -> bool:
        """Salience hooks run from shortly before t0 up to the last event."""
        if not self.config.prune:
            return False
        return max(0, self.start - SALIENCE_WARMUP_STEPS) <= step < self.end

    def distill_weight(self, step: int) -> float:
        """mu rises linearly 0 -> 1 over the pruning phase and is 0 after the last event.

        After t1 the teacher would have the student's own shapes, so distilling from it only
        holds the student back; the recovery phase trains on the task loss alone. Only every
        `distill_every`-th step of the phase distils (mu 0 on the others): with a teacher pass on
        every step, SmolLM2's pruning phase cost 1.38x LoRA's CPU time, 1.05x with one on every
        4th step (benchmarks/phase_cost.py, docs/BENCHMARKS.md)."""
        if not (self.config.distill and self.config.prune) or step >= self.end:
            return 0.0
        if (step - self.start) % self.config.distill_every:
            return 0.0
        return self.progress(step)

    def tuning_budget_multiple(self, step: int) -> float:
        """Tunable-parameter budget / initial, linear 1 -> rank_budget_multiple over the phase."""
        if not self.config.grow_ranks:
            return 1.0
        return 1.0 + (self.config.rank_budget_multiple - 1.0) * self.progress(step)
