"""The run directory (--out): what may be written there, and what `--overwrite` may do to it.

`check_out_dir` refuses, before anything loads, an --out that is a file, holds what is not a run, cannot be written or
has no checkpoint to --resume; once every input is valid `prepare_out_dir` locks it (apt_ds.io.run_lock) and creates it.

`--overwrite` replaces only what apt-ds itself wrote: an empty directory, or a run directory (its `run.json`
holds `apt_config` and `train_config`) with nothing but what a run writes; anything else is refused in one
line that names it. The old run is moved aside (`.NAME.replaced-*` next to it) and deleted only once the
new run has written its first checkpoint; a start that fails before then puts it back.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

from apt_ds.io import run_lock
from apt_ds.io.run_record import RUN_FILE, is_run_dir
from apt_ds.io.tokenizer import is_tokenizer_file

# What a run writes into its directory (checkpoint.tmp / .old and run.json.tmp: atomic writes;
# plots: apt-ds-plot's default output, drawn from the run and replaced with it).
RUN_ENTRIES = frozenset({RUN_FILE, "metrics.jsonl", "checkpoint", "checkpoint.tmp", "checkpoint.old", "tokenizer", "ranks",
                         "eval_probe.safetensors", "plots", "monitor", RUN_FILE + ".tmp"})


class RunDirError(FileExistsError):
    """--out cannot be used as asked (the message says why and what to do)."""


def has_checkpoint(path: Path) -> bool:
    """A complete checkpoint, or the previous one that a crash mid-rename left as checkpoint.old."""
    return any((path / name / "apt_state.json").is_file() for name in ("checkpoint", "checkpoint.old"))


def replaced_folder(out: Path, runs: tuple[Path, ...] = (), keep: frozenset[str] = frozenset()) -> Path | None:
    """The folder of a run that `out` is or is inside and that the run replaces whole (its
    checkpoint/ at the next checkpoint, tokenizer/, ...; `keep` names entries the caller may write
    in), among `runs` and every run directory above `out`; None when there is none."""
    resolved = Path(out).resolve()
    candidates = {Path(run).resolve() for run in runs} | {parent for parent in resolved.parents if is_run_dir(parent)}
    for folder in [run / name for run in sorted(candidates) for name in sorted(RUN_ENTRIES - keep)]:
        if folder == resolved or folder in resolved.parents:
            return folder
    return None


def check_replaceable(out: Path) -> None:
    """Raise RunDirError unless `--overwrite` may replace `out` (missing, empty, or a run)."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink():
        raise RunDirError(f"--out {out} is a symbolic link; --overwrite replaces only a real directory: give its target")
    if not out.is_dir():
        raise RunDirError(f"--out {out} exists and is not a directory; remove it or choose another --out")
    entries = sorted(entry.name for entry in out.iterdir())
    if not entries:
        return
    if not is_run_dir(out):
        raise RunDirError(f"--out {out} is not an apt-ds run directory (it holds {listing(entries)}); --overwrite only "
                          f"replaces a previous run or an empty directory: choose another --out")
    foreign = [name for name in entries if name not in RUN_ENTRIES] + _foreign_inside(out)
    if foreign:
        raise RunDirError(f"--out {out} holds a run and also {listing(foreign)}, which a run does not write; "
                          f"move them away or choose another --out")
    if Path.cwd().resolve().is_relative_to(out.resolve()) or os.path.ismount(out):
        raise RunDirError(f"--out {out} is (or holds) the current directory, or is a mount point, which --overwrite "
                          f"cannot move aside; run from elsewhere or give a directory inside it")


# What a run's own folders hold, for the folders a user opens and may add to (checkpoint* are
# written and replaced whole by the trainer). A figure or note saved into plots/ is not the run's.
_FOLDER_FILES = {
    "plots": lambda name: name in ("curves.png", "shape.png") or (name.startswith(".") and name.endswith(".tmp")),
    "ranks": lambda name: name.startswith("rank") and name.endswith(".json") and name[4:-5].isdigit(),
    "tokenizer": is_tokenizer_file,
}


def _monitor_file(name: str) -> bool:
    """What the monitors write: csvMonitor's apt/<name> and engine Train/Samples/<name> files, TensorBoard's
    event files, and the resume's CSV rewrite's temporary."""
    csv = name.endswith(".csv") and name.lstrip(".").startswith(("apt_", "Train_Samples_"))
    return csv or name.startswith("events.out.tfevents.") or (name.startswith(".") and name.endswith(".csv.tmp"))


def _foreign_inside(out: Path) -> list[str]:
    """Entries of the run's own folders that the run did not write, as FOLDER/NAME."""
    foreign = []
    for folder, written in _FOLDER_FILES.items():
        if (out / folder).is_dir() and not (out / folder).is_symlink():
            foreign += [f"{folder}/{item.name}" for item in sorted((out / folder).iterdir())
                        if not (item.is_file() and not item.is_symlink() and written(item.name))]
    monitor = out / "monitor"  # the monitors' job folders (RUN/monitor/<job_name>/...), any depth
    if monitor.is_dir() and not monitor.is_symlink():
        foreign += [str(item.relative_to(out)) for item in sorted(monitor.rglob("*")) if item.is_symlink()
                    or not (item.is_dir() or (item.is_file() and _monitor_file(item.name)))]
    return foreign


def listing(names: list[str], most: int = 4) -> str:  # the first `most` names and how many more, for one line
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


# Locks held for the life of the process that set a run aside: a PID alone cannot tell a dead
# owner from a new process that got the same PID (PID 1 in every container restart).
_HELD_LOCKS: dict[Path, int] = {}


def _lock_path(aside: Path) -> Path:
    return aside.with_name(aside.name + ".lock")


def move_aside(out: Path) -> Path | None:
    """Rename a replaceable `out` to a hidden sibling of a name no other attempt uses, beside a
    lock file this process holds while the copy is its to restore or delete (None when there
    was nothing to move)."""
    if not out.exists() or not any(out.iterdir()):
        return None
    aside = out.parent / f".{out.name}.replaced-{os.getpid()}-{secrets.token_hex(4)}"
    lock = os.open(_lock_path(aside), os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)
    _HELD_LOCKS[aside] = lock
    out.rename(aside)  # never over an existing copy: the name is new
    return aside


def _release(aside: Path) -> None:
    lock = _HELD_LOCKS.pop(aside, None)
    _lock_path(aside).unlink(missing_ok=True)
    if lock is not None:
        os.close(lock)


def restore(out: Path, aside: Path | None) -> None:
    """A new run failed before its first checkpoint: give the previous run its place back."""
    if aside is None or not aside.exists():
        return
    if out.exists():
        shutil.rmtree(out)
    aside.rename(out)
    _release(aside)


def discard(aside: Path | None) -> None:
    """Delete a set-aside run once the new run has its checkpoint, renamed first to a name nothing restores: a
    deletion stopped halfway leaves a `.NAME.discarding-*` remnant (the next recovery removes it), not half a run."""
    if aside is not None:
        doomed = aside.with_name(aside.name.replace(".replaced-", ".discarding-", 1))
        try:
            aside.rename(doomed)
        except OSError:
            doomed = aside
        shutil.rmtree(doomed, ignore_errors=True)
        _release(aside)


def _owner_is_gone(aside: Path) -> bool:
    """True when no live process holds the copy's lock (or, for a copy made before locks, when
    the PID in its name is dead)."""
    lock_path = _lock_path(aside)
    if lock_path.exists():
        return run_lock.held_elsewhere(lock_path, os.O_WRONLY) is False  # None: not ours to judge
    pid = aside.name.split(".replaced-", 1)[-1].split("-", 1)[0]
    return pid.isdigit() and not run_lock.pid_alive(int(pid))


def set_aside_note(out: Path) -> str | None:
    """Where a killed --overwrite start left the previous run (export and plot move nothing: a lock may not span hosts)."""
    copies = [p for p in sorted(out.parent.glob(f".{glob.escape(out.name)}.replaced-*")) if p.is_dir() and is_run_dir(p)]
    if not copies or has_checkpoint(out):
        return None
    return (f"note: the previous run in {out} was set aside by an --overwrite start that wrote no checkpoint; it is in "
            f"{copies[-1]}, and the next `launch/train.py --out {out} --resume` puts it back once that start is gone")


def recover_interrupted_overwrite(out: Path) -> str | None:
    """A run started with --overwrite and killed (SIGKILL, power loss) left the previous run
    aside as `.NAME.replaced-PID`. If the new run never wrote a checkpoint the previous one is
    put back, else it is deleted as planned. Returns a line saying what was done, or None."""
    done = None
    for remnant in out.parent.glob(f".{glob.escape(out.name)}.discarding-*"):  # a deletion stopped halfway
        if remnant.is_dir() and not remnant.is_symlink():
            shutil.rmtree(remnant, ignore_errors=True)
    for aside in sorted(out.parent.glob(f".{glob.escape(out.name)}.replaced-*")):
        if not aside.is_dir() or not is_run_dir(aside) or not _owner_is_gone(aside):
            continue
        if has_checkpoint(out) and is_run_dir(out):
            discard(aside)  # the new run got its checkpoint: as planned
        elif _is_unstarted_run(out):
            restore(out, aside)
            done = f"note: an interrupted --overwrite had set aside the previous run; it is back in {out}"
        else:  # something else took the place since: never delete it, say where the old run is
            done = f"note: the previous run set aside by an interrupted --overwrite is still in {aside}"
    return done


def _is_unstarted_run(path: Path) -> bool:
    """Missing, empty, or a run with no checkpoint and nothing but what a run writes: what a
    start killed before its first checkpoint leaves, and nothing a user could miss."""
    if not path.exists() and not path.is_symlink():
        return True
    if path.is_symlink() or not path.is_dir():
        return False
    entries = [entry.name for entry in path.iterdir()]
    return not entries or (is_run_dir(path) and not has_checkpoint(path) and set(entries) <= RUN_ENTRIES)


def check_out_dir(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to clobber a previous run unless asked to, and an --out that cannot be written
    (checks only; nothing is left behind)."""
    folder = replaced_folder(out)
    if folder is not None:  # a run inside another run's checkpoint/ would go at that run's next checkpoint
        raise RunDirError(f"--out {out} is or is inside {folder}, which that run replaces whole; choose a directory outside it")
    if resume:
        if not has_checkpoint(out):
            if is_run_dir(out):
                raise RunDirError(f"--resume: the run in {out} stopped before its first checkpoint, so there is "
                                      f"nothing to resume; pass --overwrite instead of --resume to start it again")
            raise RunDirError(f"--resume: {out} holds no checkpoint (expected {out / 'checkpoint' / 'apt_state.json'})")
        check_writable(out)
        return
    if overwrite:
        check_replaceable(out)  # only a previous run or an empty directory (apt_ds.io.run_dir)
        if out.exists():
            check_writable(out.parent, out)  # the previous run is renamed aside there
    elif out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} exists and is not a directory; remove it or choose another --out")
    elif out.exists() and any(out.iterdir()):
        if has_checkpoint(out):
            raise RunDirError(f"--out {out} already holds a run; pass --resume to continue it or --overwrite to replace it")
        if is_run_dir(out):
            raise RunDirError(f"--out {out} holds a run that stopped before its first checkpoint (nothing to resume); "
                                  f"pass --overwrite to start it again")
        raise RunDirError(f"--out {out} is not empty and holds no apt-ds run; choose another --out")
    check_writable(out)


def check_writable(path: Path, out: Path | None = None) -> None:
    """Try to create a file where the run will write (`path`, or the nearest existing parent it
    will be created in): root ignores permission bits, read-only mounts do not. `out`: the
    --out the message names (default `path`)."""
    out = out or path
    existing = path
    while not existing.exists():
        if existing.is_symlink():
            raise RunDirError(f"--out {out}: {existing} is a broken symbolic link")
        existing = existing.parent
    if not existing.is_dir():
        raise RunDirError(f"--out {out}: {existing} is a file, not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".apt-ds-write-test-"):
            pass
    except OSError as err:
        raise RunDirError(f"--out {out}: cannot write in {existing} ({err.strerror or err}); choose another --out") from None


def prepare_out_dir(out: Path, resume: bool, overwrite: bool, is_main: bool) -> Path | None:
    """After every input has been validated: lock and create the run directory (--overwrite: the previous run is
    moved aside, its new place returned), or recover a checkpoint that a crash left renamed to checkpoint.old."""
    if not is_main:  # every rank ran check_out_dir before anything was written
        return None
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    run_lock.acquire(out)  # held already where the parent existed at the start; before anything is checked or moved
    check_out_dir(out, resume, overwrite)
    if resume:
        current, old = out / "checkpoint", out / "checkpoint.old"
        if not (current / "apt_state.json").is_file() and (old / "apt_state.json").is_file():
            shutil.rmtree(current, ignore_errors=True)
            old.rename(current)
        return None
    aside = move_aside(out) if overwrite else None
    out.mkdir(exist_ok=True)
    return aside


@contextlib.contextmanager
def previous_run_back_on_failure(out: Path, replaced: Path | None):
    """--overwrite: until the new run's first checkpoint, any failure puts the previous run back.
    A user error keeps its one line, which then also says so."""
    try:
        yield
    except BaseException as err:
        if replaced is None or not replaced.exists():
            raise
        if has_checkpoint(out):  # stopped between the first checkpoint and its hook: the new run stays
            discard(replaced)
            raise
        restore(out, replaced)
        back = f"the new run wrote no checkpoint; the previous run is back in {out}"
        if isinstance(err, (ValueError, FileExistsError)):  # the CLI's one-line errors
            raise type(err)(f"{err} ({back})") from None
        if isinstance(err, KeyboardInterrupt):  # the CLI says it; --resume would continue the previous run
            err.previous_run_restored = True
            raise
        print(f"note: {back}", file=sys.stderr)
        raise
