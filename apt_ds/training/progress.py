"""What the training progress bar shows after each step."""

from __future__ import annotations


def progress_fields(record: dict, density: float) -> dict:
    """The task loss (comparable across steps) and, on distillation steps, the distillation loss
    beside it: their weighted mix swings with mu and says little about progress. A skipped step
    (NaN or inf: apt_ds.training.divergence) says so, rather than showing numbers that were not applied."""
    fields = {"task_loss": f"{record['task_loss']:.3f}"}
    if record.get("mu", 0) > 0:
        fields["distill"] = f"{record['distill_loss']:.3f}"
    fields["density"] = f"{density:.2f}"  # also on steps --log-every does not log
    if record.get("skipped"):
        fields["skipped"] = "nan/inf"
    return fields
