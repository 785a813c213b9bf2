"""Files as readable as the user's umask allows.

safetensors writes its files 0600 and `tempfile.mkdtemp` makes 0700 directories: a checkpoint
or an export written through either would be private to the user who trained, where every
other file of a run follows the umask (0644 / 0755 under the usual 022), and a serving or
evaluating user other than the trainer could not read it.
"""

from __future__ import annotations

import os
from pathlib import Path


def _current_umask() -> int:
    umask = os.umask(0)  # the only way to read it; done once, at import, before any thread writes files
    os.umask(umask)
    return umask


_UMASK = _current_umask()


def make_readable(path: Path) -> None:
    """Give `path` (a file, or a directory and everything in it) the modes a plain `open` or
    `mkdir` would have given it under the process's umask. Links are left alone. Best effort: a
    file system that refuses chmod leaves the modes as they were, not a failed checkpoint."""
    path = Path(path)
    if path.is_symlink():
        return
    if path.is_file():
        _chmod(path, 0o666)
        return
    _chmod(path, 0o777)
    for root, directories, files in os.walk(path):
        for names, mode in ((directories, 0o777), (files, 0o666)):
            for name in names:
                if not os.path.islink(os.path.join(root, name)):
                    _chmod(os.path.join(root, name), mode)


def _chmod(path, mode: int) -> None:
    try:
        os.chmod(path, mode & ~_UMASK)
    except OSError:
        pass
