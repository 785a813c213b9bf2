"""The evaluation's user errors (unknown task, data or harness not installed, bad output path)."""

from __future__ import annotations


class EvaluationError(ValueError):
    """A mistake in what was asked to evaluate, or a missing install; reported as one line."""
