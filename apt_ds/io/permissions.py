"""Files as readable as the user's umask allows.

safetensors writes its files 0600 and `tempfile.mkdtemp` makes 0700 directories: a checkpoint
or an export written through either would be private to the user who trained, where every
other file of a run follows the umask (0644 / 0755 under the usual 022), and a serving or
evaluating user other than the trainer could not read it.
"""

from __future__ import annotations

import os
from pathlib import Path


def make_readable(path: Path) -> None:
    """Give `path` (a file, or a directory and everything in it) the modes a plain `open` or
    `mkdir` would have given it under the current umask. Links are left alone."""
    umask = os.umask(0)
    os.umask(umask)
    path = Path(path)
    if path.is_symlink():
        return
    if path.is_file():
        path.chmod(0o666 & ~umask)
        return
    path.chmod(0o777 & ~umask)
    for root, directories, files in os.walk(path):
        for name in directories:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o666 & ~umask)
