"""DeepSpeed's CPU all-reduce buffers (/dev/shm/deepspeed_allreduce_buffer_*) do not outlive a run,
and buffers that dead runs left behind are removed (apt_ds.distributed.shm)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from test_distributed import COMMON, launch

from apt_ds.distributed.shm import PREFIX, SHM_DIR, remove_stale_buffers


def _buffers() -> set[Path]:
    return set(SHM_DIR.glob(f"{PREFIX}_*"))


def test_a_two_rank_run_leaves_no_buffer_and_removes_dead_runs_ones(tmp_path):
    # as a killed run leaves it; the pid in the port field keeps two suites on one machine apart
    stale = SHM_DIR / f"{PREFIX}_{os.getuid()}_127.0.0.9_{os.getpid()}_0"
    stale.write_bytes(b"\0" * 1024)
    old = time.time() - 600
    os.utime(stale, (old, old))
    before = _buffers() - {stale}
    result = launch(2, ["--deepspeed", str(Path(__file__).resolve().parents[2] / "ds_configs" / "zero2.json"), *COMMON,
                        "--out", str(tmp_path / "run")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert not stale.exists()
    assert _buffers() <= before  # nothing new: each rank unlinked its own once all were mapped


def test_fresh_or_mapped_buffers_are_kept(tmp_path):
    fresh = SHM_DIR / f"{PREFIX}_{os.getuid()}_127.0.0.8_{os.getpid()}_0"  # a job that is starting right now
    fresh.write_bytes(b"\0" * 1024)
    try:
        assert fresh not in remove_stale_buffers()
        assert fresh.exists()
    finally:
        fresh.unlink(missing_ok=True)
