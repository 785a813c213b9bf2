"""Steps whose numbers are not finite: counted, skipped, and a run that keeps producing them
stopped in one line.

The backend skips the update of a step whose gradient norm is NaN or inf (as DeepSpeed's loss
scaler skips an overflowed step); the trainer leaves that step's salience and adapter importance
out too. One such step is survivable (a bad batch); several in a row mean the run has diverged,
and every further step would only spend GPU hours on NaN. A loss or gradient norm that is still
finite but orders of magnitude above the first step's gets a warning once: that is how a
too-high learning rate looks before it reaches NaN.
"""

from __future__ import annotations

import math
import sys

from tqdm.auto import tqdm

from apt_ds.algorithm.finite import NonFiniteError
from apt_ds.config import TrainConfig

GRAD_NORM_WARN_FACTOR = 1e3  # a global norm this far above the first step's is not noise (clipped runs stay within ~10x)
LOSS_WARN_FACTOR = 10.0  # a cross-entropy 10x its first value: far worse than guessing uniformly over the vocabulary


def is_bad_step(record: dict, skipped: bool) -> bool:
    """A step whose update was skipped, or whose loss or gradient norm is NaN or inf."""
    numbers = (record["loss"], record["task_loss"], record["distill_loss"], record["grad_norm"])
    return skipped or not all(math.isfinite(x) for x in numbers if x is not None)


class DivergenceGuard:
    """Counts bad steps (`record["skipped"]`); raises NonFiniteError after `max_skipped_steps` in a
    row, naming the step, the loss and the likely cause; warns once of a finite blow-up."""

    def __init__(self, train: TrainConfig, checkpoint_note=lambda: "", is_main: bool = True):
        """`checkpoint_note()`: what the error says of the last good checkpoint (called when stopping)."""
        self.config, self.checkpoint_note, self.is_main = train, checkpoint_note, is_main
        self.in_row = self.total = 0
        self.first: dict | None = None  # the first good step's task loss and gradient norm
        self.warned = False

    def observe(self, record: dict) -> NonFiniteError | None:
        """Count the step; the error that stops the run (for the caller to raise once the step is
        logged) when it is the `max_skipped_steps`th bad one in a row, else None."""
        if record.get("skipped"):
            self.in_row += 1
            self.total += 1
            return NonFiniteError(self._stop_message(record)) if self.in_row >= self.config.max_skipped_steps else None
        self.in_row = 0
        if self.first is None:
            self.first = {"task_loss": record["task_loss"], "grad_norm": record["grad_norm"]}
        elif not self.warned:
            self._warn_of_blow_up(record)
        return None

    def _stop_message(self, record: dict) -> str:
        cfg, last = self.config, record["step"]
        steps = f"step {last}" if self.in_row == 1 else f"steps {last - self.in_row + 1}-{last}"
        return (f"the run diverged: {steps} ({self.in_row} in a row; --max-skipped-steps {cfg.max_skipped_steps}) had a "
                f"NaN or inf loss or gradient norm, so their updates were skipped (step {last}: loss {record['loss']:.4g}, "
                f"gradient norm {_number(record['grad_norm'])}). The likely cause is the learning rate (--lr {cfg.lr:g}): "
                f"start again with a lower one{self.checkpoint_note()}")

    def _warn_of_blow_up(self, record: dict) -> None:
        first, grad_norm = self.first, record["grad_norm"]
        if grad_norm is not None and first["grad_norm"] and grad_norm > GRAD_NORM_WARN_FACTOR * first["grad_norm"]:
            what = f"gradient norm {grad_norm:.3g} is {grad_norm / first['grad_norm']:.3g}x the first step's ({first['grad_norm']:.3g})"
        elif first["task_loss"] > 0 and record["task_loss"] > LOSS_WARN_FACTOR * first["task_loss"]:
            what = f"task loss {record['task_loss']:.4g} is {record['task_loss'] / first['task_loss']:.3g}x the first step's"
        else:
            return
        self.warned = True
        if self.is_main:
            tqdm.write(f"warning: step {record['step']}: the {what}: the run may be diverging; a lower --lr (now "
                       f"{self.config.lr:g}) usually fixes it", file=sys.stderr)


def _number(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.4g}"


def kept_checkpoint_note(out_dir) -> str:
    """What a stopped run's error says of its last checkpoint, which the stop leaves as it was."""
    from pathlib import Path

    from apt_ds.io.checkpoint import read_meta

    checkpoint = Path(out_dir) / "checkpoint" if out_dir else None
    if checkpoint is None or not (checkpoint / "apt_state.json").is_file():
        return " (no checkpoint was written)"
    return f"; the last good checkpoint, step {read_meta(checkpoint)['step']} in {checkpoint}, is kept (--resume continues from it)"
