"""Memory in metrics.jsonl (apt_ds.io.metrics.memory_mb): each record's own peak is exact and
reset at each reading, the process's peak survives those resets, and CUDA's counters are read
the same way (tests/benchmarks/test_bench_gpu_check.py)."""

from __future__ import annotations

import mmap
import sys

import pytest

from apt_ds.io.metrics import memory_mb


def _touch_and_free_64_mib() -> None:
    """64 MiB made resident and given back: an anonymous mapping of its own, so that neither glibc's
    free heap (a long test session has plenty) nor torch's allocator can serve it from pages
    already resident."""
    block = mmap.mmap(-1, 64 * 2**20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    block.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's VmHWM and clear_refs")
def test_a_reading_gives_the_peak_since_the_last_one_and_keeps_the_process_peak():
    memory_mb(interval=True)  # resets the interval
    _touch_and_free_64_mib()
    spike = memory_mb(interval=True)
    assert spike["interval_peak_rss_mb"] >= spike["rss_mb"] + 48  # the freed block's peak is seen
    calm = memory_mb(interval=True)
    assert calm["interval_peak_rss_mb"] < spike["interval_peak_rss_mb"] - 48  # reset by the reading before
    assert calm["peak_rss_mb"] >= spike["interval_peak_rss_mb"]  # the process's peak is kept


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's VmHWM and clear_refs")
def test_a_callers_peak_window_survives_the_records_resets():
    """A benchmark marks a window and reads its peak after training, whose records reset the
    kernel's counter at every step: the peak inside the window is still seen."""
    from apt_ds.io.metrics import mark_rss_peak, rss_peak_since_mark_mb

    assert mark_rss_peak()
    base = memory_mb(interval=True)["rss_mb"]
    _touch_and_free_64_mib()
    memory_mb(interval=True)  # a training step's record with interval peaks: resets the kernel's counter
    memory_mb(interval=True)
    assert rss_peak_since_mark_mb() >= base + 48
    assert mark_rss_peak()
    assert rss_peak_since_mark_mb() < base + 48  # a new window


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's VmHWM")
def test_without_interval_peaks_the_kernels_counter_is_left_alone():
    """Off by default: getrusage and /usr/bin/time still see the whole run's peak."""
    import resource

    _touch_and_free_64_mib()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    record = memory_mb()
    assert "interval_peak_rss_mb" not in record
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >= before
    assert record["peak_rss_mb"] >= before / 1024 - 1


def test_a_run_asked_for_interval_peaks_logs_one_per_record_and_a_default_run_none():
    from conftest import random_batch, tiny_llama

    from apt_ds import APTConfig, APTrainer, TrainConfig

    for asked in (True, False):
        trainer = APTrainer(tiny_llama("gqa"), APTConfig.for_steps(4).as_lora(),
                            TrainConfig(steps=4, interval_memory_peaks=asked), progress=False)
        trainer.train(random_batch(batch=2, length=8, seed=i) for i in range(10**6))
        steps = [r for r in trainer.history if not r.get("final")]
        assert len(steps) == 4 and all(("interval_peak_rss_mb" in r) == asked for r in steps)
        assert all(r["peak_rss_mb"] >= r["rss_mb"] for r in trainer.history)
