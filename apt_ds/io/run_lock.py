"""One training process per run directory.

Two `launch/train.py` on one --out (a `--resume` or `--overwrite` started while the first still
trains) would interleave their checkpoints and metrics, and an --overwrite would move the live
run aside and delete it. The process that trains a run holds an exclusive lock on a file beside
it (`.NAME.train.lock`, next to --out rather than in it, so that it stays put while --overwrite
renames the run aside); a second start finds it held and stops in one line, before touching
anything. Export and plot ask the same lock whether a run is still training.

flock: released by the kernel when the process dies however it dies (SIGKILL included), so a
crash never leaves a run locked; it works on local file systems and on NFSv4.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

_HELD: dict[Path, int] = {}  # lock file -> descriptor, for the life of the training process


class RunLockedError(FileExistsError):
    """Another process is training the run in --out."""


def lock_path(out: Path) -> Path:
    out = Path(os.path.abspath(out))
    return out.with_name(f".{out.name}.train.lock")


def acquire(out: Path) -> None:
    """Hold the run's lock until release() or the end of the process; RunLockedError when another
    process holds it. Holding it already (this process) is fine; where no file can be made beside
    --out (a read-only or missing parent) nothing is locked: no run can write there."""
    path = lock_path(out)
    if path in _HELD:
        return
    while True:
        try:
            handle = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        except OSError:  # nothing can be written beside --out: the run cannot write either, as its checks say
            return
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _owner(handle)
            os.close(handle)
            raise RunLockedError(f"--out {out} is being trained by another process ({owner}); wait for it to finish or "
                                 f"stop it, then run again: two runs in one directory would mix their checkpoints") from None
        # A holder that released between our open and our lock may have unlinked the file: ours
        # would then be a lock on a name nobody else sees. Only the file still at the path counts.
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(handle).st_ino:
            break
        os.close(handle)
    os.ftruncate(handle, 0)
    os.write(handle, f"PID {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
    _HELD[path] = handle


def release(out: Path) -> None:
    path = lock_path(out)
    handle = _HELD.pop(path, None)
    if handle is None:
        return
    path.unlink(missing_ok=True)  # before the unlock: no other process can hold this name's lock yet
    os.close(handle)


def training_now(out: Path) -> str | None:
    """Who trains the run in `out` now ("PID 123 on host, since ..."), or None (asks without waiting)."""
    path = lock_path(out)
    if path in _HELD:
        return f"PID {os.getpid()} (this process)"
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _owner(handle)
    finally:
        os.close(handle)  # drops the probe's lock


def _owner(handle: int) -> str:
    try:
        text = os.pread(handle, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "its PID is not recorded"
