"""The run directory (--out) and what `--overwrite` may do to it.

`--overwrite` replaces only what apt-ds itself wrote: an empty directory, or a run directory,
recognised by its `run.json` (a JSON object with `apt_config` and `train_config`) and holding
nothing but the entries a run writes. Anything else is refused in one line that names what is
there: a checkout, a home directory or a folder of the user's files is never deleted. The old
run is moved aside (`.NAME.replaced-*` next to it) and deleted only once the new run has written
its first checkpoint; a start that fails before then puts it back.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path

RUN_FILE = "run.json"
# What a run writes into its directory (checkpoint.tmp / .old: the atomic checkpoint rename).
RUN_ENTRIES = frozenset({RUN_FILE, "metrics.jsonl", "checkpoint", "checkpoint.tmp", "checkpoint.old", "tokenizer", "ranks",
                         "eval_probe.safetensors"})


class RunDirError(FileExistsError):
    """--out cannot be used as asked (the message says why and what to do)."""


def is_run_dir(path: Path) -> bool:
    try:
        record = json.loads((path / RUN_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "apt_config" in record and "train_config" in record


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
        raise RunDirError(f"--out {out} is not an apt-ds run directory (it holds {_listing(entries)}); --overwrite only "
                          f"replaces a previous run or an empty directory: choose another --out")
    foreign = [name for name in entries if name not in RUN_ENTRIES]
    if foreign:
        raise RunDirError(f"--out {out} holds a run and also {_listing(foreign)}, which a run does not write; "
                          f"move them away or choose another --out")
    if out.resolve() == Path.cwd().resolve() or os.path.ismount(out):
        raise RunDirError(f"--out {out} is the current directory or a mount point, which --overwrite cannot move "
                          f"aside; give a directory inside it")


def _listing(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def move_aside(out: Path) -> Path | None:
    """Rename a replaceable `out` to a hidden sibling (None when there was nothing to move)."""
    if not out.exists() or not any(out.iterdir()):
        return None
    aside = out.parent / f".{out.name}.replaced-{os.getpid()}"
    shutil.rmtree(aside, ignore_errors=True)
    out.rename(aside)
    return aside


def restore(out: Path, aside: Path | None) -> None:
    """A new run failed before its first checkpoint: give the previous run its place back."""
    if aside is None or not aside.exists():
        return
    if out.exists():
        shutil.rmtree(out)
    aside.rename(out)


def discard(aside: Path | None) -> None:
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def recover_interrupted_overwrite(out: Path) -> str | None:
    """A run started with --overwrite and killed (SIGKILL, power loss) left the previous run
    aside as `.NAME.replaced-PID`. If the new run never wrote a checkpoint the previous one is
    put back, else it is deleted as planned. Returns a line saying what was done, or None."""
    done = None
    for aside in sorted(out.parent.glob(f".{glob.escape(out.name)}.replaced-*")):
        pid = aside.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or _alive(int(pid)) or not is_run_dir(aside):
            continue
        if _holds_checkpoint(out) and is_run_dir(out):
            shutil.rmtree(aside, ignore_errors=True)  # the new run got its checkpoint: as planned
        elif _is_unstarted_run(out):
            restore(out, aside)
            done = f"note: an interrupted --overwrite had set aside the previous run; it is back in {out}"
        else:  # something else took the place since: never delete it, say where the old run is
            done = f"note: the previous run set aside by an interrupted --overwrite is still in {aside}"
    return done


def _holds_checkpoint(path: Path) -> bool:
    return any((path / name / "apt_state.json").is_file() for name in ("checkpoint", "checkpoint.old"))


def _is_unstarted_run(path: Path) -> bool:
    """Missing, empty, or a run with no checkpoint and nothing but what a run writes: what a
    start killed before its first checkpoint leaves, and nothing a user could miss."""
    if not path.exists() and not path.is_symlink():
        return True
    if path.is_symlink() or not path.is_dir():
        return False
    entries = [entry.name for entry in path.iterdir()]
    return not entries or (is_run_dir(path) and not _holds_checkpoint(path) and set(entries) <= RUN_ENTRIES)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
