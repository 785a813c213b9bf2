"""Work the ranks split among themselves: each computes its part of a small value and every rank
receives all the parts, or the first rank's error and raises it too (a rank that raised alone
would leave the others waiting in their next collective)."""

from __future__ import annotations

import pickle
from typing import Callable, TypeVar

T = TypeVar("T")


def parts_from_every_rank(backend, compute_part: Callable[[int, int], T]) -> list[T]:
    """`compute_part(rank, world_size)` on every rank; every rank gets the list of all ranks' parts
    through one all_gather_object (the backends' object collective). Every rank enters that
    collective whether or not its own part failed, so when any part fails, all raise together (the
    lowest failing rank's error). One process (LocalBackend): `[compute_part(0, 1)]`."""
    value, error = None, None
    try:
        value = compute_part(backend.rank, backend.world_size)
    except Exception as err:  # any error: it is raised again below, on every rank
        error = err
    gathered = backend.all_gather_object((value, _sendable(error)))
    if error is not None:
        raise error  # this rank's own, with its traceback
    errors = [sent_error for _, sent_error in gathered if sent_error is not None]
    if errors:
        raise errors[0]
    return [sent_value for sent_value, _ in gathered]


def _sendable(error: Exception | None) -> Exception | None:
    """`error` if it survives pickling (the collective pickles it on this rank and unpickles it on
    the others: a failure there would strike one side of the collective only); else a RuntimeError
    that names it. Most errors are plain message-only exceptions and go as they are, so every rank
    raises the type the CLI reports in one line."""
    if error is None:
        return None
    try:
        return pickle.loads(pickle.dumps(error)).with_traceback(None)
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
