"""Memory in metrics.jsonl (apt_ds.io.metrics.memory_mb): each record's own peak is exact and
reset at each reading, the process's peak survives those resets, and CUDA's counters are read
the same way (tests/benchmarks/test_bench_gpu_check.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from apt_ds.io.metrics import memory_mb


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's VmHWM and clear_refs")
def test_a_reading_gives_the_peak_since_the_last_one_and_keeps_the_process_peak():
    memory_mb()  # resets the interval
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched, then freed
    del block
    spike = memory_mb()
    assert spike["interval_peak_rss_mb"] >= spike["rss_mb"] + 48  # the freed block's peak is seen
    calm = memory_mb()
    assert calm["interval_peak_rss_mb"] < spike["interval_peak_rss_mb"] - 48  # reset by the reading before
    assert calm["peak_rss_mb"] >= spike["interval_peak_rss_mb"]  # the process's peak is kept


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's VmHWM and clear_refs")
def test_a_callers_peak_window_survives_the_records_resets():
    """A benchmark marks a window and reads its peak after training, whose records reset the
    kernel's counter at every step: the peak inside the window is still seen."""
    from apt_ds.io.metrics import mark_rss_peak, rss_peak_since_mark_mb

    assert mark_rss_peak()
    base = memory_mb()["rss_mb"]
    block = torch.ones(64 * 2**20 // 4)
    del block
    memory_mb()  # a training step's record: resets the kernel's counter
    memory_mb()
    assert rss_peak_since_mark_mb() >= base + 48
    assert mark_rss_peak()
    assert rss_peak_since_mark_mb() < base + 48  # a new window
