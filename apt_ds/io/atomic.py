"""Small files written whole or not at all: a temporary file in the same directory, then a rename.

A crash, a kill or a full disk never leaves a truncated file under the final name (run.json,
an evaluation's results.json), and a reader never sees half of one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomic(path: str | Path, text: str, temporary: str | None = None) -> None:
    """`temporary`: a fixed name for the temporary file, for a directory whose entries are checked
    (a run's: what a kill leaves must still look like the run's own); it gets the umask's mode.
    Without it the name is unique and the mode 0644."""
    path = Path(path)
    if temporary is not None:
        tmp = path.with_name(temporary)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # a killed writer's leftover is reused
    else:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        tmp = Path(name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        if temporary is None:
            os.chmod(tmp, 0o644)  # mkstemp makes it private; these files are for whoever can read the folder
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
