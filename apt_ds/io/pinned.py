"""A checkpoint directory held still while it is read, though the run that owns it trains on.

A training run writes each checkpoint beside the last and renames it into place (checkpoint ->
checkpoint.old, checkpoint.tmp -> checkpoint, then deletes checkpoint.old). An export reading
`RUN/checkpoint` by name at that moment could take apt_state.json from one checkpoint and the
tensors from the next. Reading through an open descriptor of the directory (/proc/self/fd/N on
Linux) reads one checkpoint whatever is renamed: either every file of it, or (once the trainer
has deleted it) a missing file, after which the caller reads the new one (`replaced`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def pinned_directory(directory: Path) -> Iterator[Path]:
    """A path naming `directory` as it is now, through an open descriptor; the path itself where
    the platform has no /proc/self/fd (or the directory cannot be opened: the reader then reports
    that as it would have)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield Path(directory)
        return
    try:
        view = Path(f"/proc/self/fd/{descriptor}")
        yield view if view.is_dir() else Path(directory)
    finally:
        os.close(descriptor)


def replaced(view: Path, directory: Path) -> bool:
    """Whether `directory` is no longer the directory `view` was pinned to (a newer one was renamed
    into its place, or it is gone)."""
    try:
        return not os.path.samestat(os.stat(view), os.stat(directory))
    except OSError:
        return True
