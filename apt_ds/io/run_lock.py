"""One training process per run directory.

Two `launch/train.py` on one --out (a `--resume` or `--overwrite` started while the first still
trains) would interleave their checkpoints and metrics, and an --overwrite would move the live
run aside and delete it. The process that trains a run holds an exclusive lock on a file beside
it (`.NAME.train.lock`, next to --out rather than in it, so that it stays put while --overwrite
renames the run aside; beside the real directory, so a symbolic link or `..` in --out names the
same lock); a second start finds it held and stops in one line, before touching anything.
Export asks the same lock whether a run is still training, and holds one of its own
(`.NAME.export.lock`, kind "export") while it writes an --out: a second export into the same new
--out would otherwise pass the existence check too and remove the first's temporary directory.

flock: released by the kernel when the process dies however it dies (SIGKILL included), so a
crash never leaves a run locked; it works on local file systems and on NFSv4. Where no file can
be made beside --out (a read-only parent holding a writable run directory), the run directory
itself is locked; where the file system has no locks, the run goes on unlocked and says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import sys
import time
from pathlib import Path

_HELD: dict[Path, int] = {}  # the lock's path (file or run directory) -> descriptor, for the life of the run
_PROBE_RETRIES = 5  # a probe (training_now) holds a shared lock for microseconds: retry before refusing
_UNLOCKED = -1  # in _HELD: this process trains unlocked (no locks on that file system), as it said
_DIRECTORY_OWNER = "the run directory is locked; its PID is not recorded"  # the fallback lock holds no line


class RunLockedError(FileExistsError):
    """Another process is training the run in --out."""


KINDS = ("train", "export")  # who holds an --out: a training run, or an export writing it


def lock_path(out: Path, kind: str = "train") -> Path | None:
    """`.NAME.<kind>.lock` beside the real --out (None for `/`, which no run can use)."""
    assert kind in KINDS, kind
    out = Path(out).resolve()
    return out.with_name(f".{out.name}.{kind}.lock") if out.name else None


def acquire(out: Path, kind: str = "train") -> None:
    """Hold the --out's lock of this kind until release() or the end of the process; RunLockedError
    when another process holds it. Holding it already (this process) is fine."""
    path, run = lock_path(out, kind), Path(out).resolve()
    if path is None or path in _HELD or run in _HELD:
        return
    blocked = 0
    while True:
        target, handle, writable = _open_lock(run, path)
        if handle is None:  # nowhere to lock: nothing exists or can be made there, and the run's own checks say so
            return
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(handle)
            blocked += 1
            if blocked < _PROBE_RETRIES:
                time.sleep(0.05)
                continue
            raise _locked(out, _owner(path) if target == path else _DIRECTORY_OWNER, kind) from None
        except OSError as err:  # ENOLCK, EOPNOTSUPP: a file system without locks
            os.close(handle)
            if writable:
                _unlink(path)
            print(f"note: cannot lock {target} ({os.strerror(err.errno)}): a second start on {out} would not be "
                  f"noticed while this one trains", file=sys.stderr)
            _HELD[path] = _UNLOCKED  # said once
            return
        if target != path or _still_at(path, handle):
            break
        os.close(handle)  # the holder released and unlinked it between our open and our lock: try the new one
    if target == path and held_elsewhere(run, os.O_RDONLY | os.O_DIRECTORY):  # a start that could not make the file
        os.close(handle)
        raise _locked(out, _DIRECTORY_OWNER, kind)
    if writable:
        os.ftruncate(handle, 0)
        os.write(handle, f"PID {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
    _HELD[target] = handle


def _locked(out: Path, owner: str, kind: str) -> RunLockedError:
    if kind == "export":
        return RunLockedError(f"--out {out} is being written by another export ({owner}); wait for it to finish, or "
                              f"export to another --out: two exports into one directory would remove each other's files")
    return RunLockedError(f"--out {out} is being trained by another process ({owner}); wait for it to finish or stop it, "
                          f"then run again: two runs in one directory would mix their checkpoints")


def held_elsewhere(path: Path, flags: int = os.O_RDONLY, exclusive: bool = True) -> bool | None:
    """Whether another process holds a lock on `path`, asked without waiting (the probe's own lock
    goes with its descriptor at once; `exclusive=False` probes with a shared one, which another
    probe does not see); None where `path` cannot be opened with `flags`; False on a file system
    without locks."""
    try:
        handle = os.open(path, flags)
    except OSError:
        return None
    try:
        fcntl.flock(handle, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(handle)


def _unlink(path: Path) -> None:
    """Remove the lock file where this process may (a read-only or shared parent may not let it: it then stays, locking nothing)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _open_lock(run: Path, path: Path) -> tuple[Path, int | None, bool]:
    """(what is locked, its descriptor, whether it takes the owner's line): the file beside --out
    (created, or an existing one opened read-only where it cannot be written: flock needs no write
    access), else the run directory."""
    for flags in (os.O_CREAT | os.O_RDWR, os.O_RDONLY):
        try:
            return path, os.open(path, flags, 0o644), flags != os.O_RDONLY
        except OSError:
            continue
    try:
        return run, os.open(run, os.O_RDONLY | os.O_DIRECTORY), False
    except OSError:
        return run, None, False


def _still_at(path: Path, handle: int) -> bool:
    """Only the file still at the path counts: a lock on a name since unlinked locks out nobody."""
    try:
        return os.stat(path).st_ino == os.fstat(handle).st_ino
    except FileNotFoundError:
        return False


def release(out: Path, kind: str = "train") -> None:
    path = lock_path(out, kind)
    for target in (path, Path(out).resolve()) if path is not None else ():
        handle = _HELD.pop(target, None)
        if handle is None or handle == _UNLOCKED:
            continue
        if target == path:
            _unlink(path)  # before the unlock: no other process can hold this name's lock yet
        os.close(handle)


def holds(out: Path, kind: str = "train") -> bool:
    """Whether this process holds the --out's lock of this kind (or runs unlocked, as it said)."""
    return lock_path(out, kind) in _HELD


@contextlib.contextmanager
def held(out: Path, kind: str) -> None:
    """The lock for the block (not taken where --out's parent does not exist yet: whoever creates
    it takes it then); released after it unless it was held before."""
    before = holds(out, kind)
    if Path(out).absolute().parent.is_dir():
        acquire(out, kind)
    try:
        yield
    finally:
        if not before:
            release(out, kind)


def training_now(out: Path) -> str | None:
    """Who trains the run in `out` now ("PID 123 on host, since ..."), or None (asks without waiting,
    with a shared probe: two exports asking at once do not see each other)."""
    path, run = lock_path(out), Path(out).resolve()
    if path is None:
        return None
    if path in _HELD or run in _HELD:
        return f"PID {os.getpid()} (this process)"
    if held_elsewhere(path, exclusive=False):
        return _owner(path)
    if held_elsewhere(run, os.O_RDONLY | os.O_DIRECTORY, exclusive=False):  # a start that could not make the file
        return _DIRECTORY_OWNER
    return None


def _owner(path: Path) -> str:
    """The holder's line. A holder that could open the file only read-only (another user's, left by
    a killed run) could not write its own: a line naming a process of this host that has ended is
    that earlier owner's, and is not passed on."""
    try:
        text = path.read_bytes()[:200].decode(errors="replace").strip()
    except OSError:
        text = ""
    named = re.match(r"PID (\d+) on (\S+),", text)
    if named and named.group(2) == socket.gethostname() and not pid_alive(int(named.group(1))):
        text = ""
    return text or "its PID is not recorded"


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if pid <= 0:  # os.kill(0, ...) would ask about this process group
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no PID is that large
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
