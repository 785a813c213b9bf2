"""DeepSpeed's CPU all-reduce buffers in /dev/shm, which DeepSpeed never removes.

On its CPU accelerator every rank creates a 69 MB shared-memory segment
`/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>` when the process
group starts, and every other rank on the node maps it (deepspeed/ops/csrc/cpu/comm/shm.cpp).
Nothing unlinks them, so each run leaves RAM-backed files behind, killed runs included.
A mapped segment stays usable after its name is unlinked, so once every rank has mapped every
buffer (DeepSpeed's init maps them all before returning; a barrier makes sure every rank got
there) each rank unlinks its own: from then on the memory is freed when the last rank exits,
however it exits (normal end, error, SIGTERM or SIGKILL). Buffers left by other runs are removed
when no process maps them any more.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "deepspeed_allreduce_buffer"


def own_buffer(rank: int, environ=os.environ) -> Path:
    """This rank's buffer, named as DeepSpeed names it."""
    return SHM_DIR / f"{PREFIX}_{os.getuid()}_{environ.get('MASTER_ADDR', '')}_{environ.get('MASTER_PORT', '')}_{rank}"


def unlink_own_buffer(rank: int, environ=os.environ) -> bool:
    """Unlink this rank's buffer (call after a barrier that follows the process group's start)."""
    try:
        own_buffer(rank, environ).unlink()
        return True
    except FileNotFoundError:  # no shm all-reduce (ranks on several nodes, GPUs) or already gone
        return False


def mapped_paths() -> set[str]:
    """Files mapped by any process we can inspect (/proc/*/maps)."""
    paths: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            for line in maps.read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith(str(SHM_DIR)):
                    paths.add(parts[5].removesuffix(" (deleted)"))
        except OSError:  # the process ended, or is not ours to read
            continue
    return paths


def remove_stale_buffers(min_age_s: float = 60.0) -> list[Path]:
    """Remove this user's DeepSpeed buffers that no process maps (left by killed or old runs).
    Only buffers older than `min_age_s`: a job starting right now creates its buffer a moment
    before mapping it, and its peers wait forever for a name that was removed."""
    if not SHM_DIR.is_dir():
        return []
    now = time.time()
    mine = [p for p in SHM_DIR.glob(f"{PREFIX}_{os.getuid()}_*") if p.is_file() and now - p.stat().st_mtime > min_age_s]
    if not mine:
        return []
    in_use = mapped_paths()
    removed = []
    for path in mine:
        if str(path) not in in_use:
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed
