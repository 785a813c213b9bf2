"""Metrics written to disk as JSON lines, and process memory readings."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import psutil
import torch


def memory_mb(interval: bool = False) -> dict:
    """This process's resident set size now (rss_mb) and its peak (peak_rss_mb), in MiB; once CUDA
    is in use, the CUDA caching allocator's allocation on this device now and at its peak (cuda_mb,
    cuda_peak_mb). With `interval` (TrainConfig.interval_memory_peaks) also each one's highest since
    the previous interval reading (interval_peak_rss_mb: a logged step's own peak with its event or
    evaluation; cuda_interval_peak_mb), exact rather than sampled: the kernel's and the allocator's
    peak counters are reset at each such reading (torchtune resets its peaks per log step the same
    way), so the process's peak is kept here, and getrusage and torch.cuda.max_memory_allocated
    see only back to the last reading. Where the kernel's counter cannot be reset (not Linux)
    there is no interval figure."""
    record = {"rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1)}
    since = _take_interval_peak() if interval else None
    if since is not None:
        record["interval_peak_rss_mb"] = round(since, 1)
    record["peak_rss_mb"] = round(process_peak_rss_mb(), 1)
    if torch.cuda.is_initialized():  # never initialise CUDA just to read it
        peak = torch.cuda.max_memory_allocated() / 2**20
        _process_peaks["cuda"] = max(_process_peaks["cuda"], peak)
        record.update(cuda_mb=round(torch.cuda.memory_allocated() / 2**20, 1), cuda_peak_mb=round(_process_peaks["cuda"], 1))
        if interval:
            record["cuda_interval_peak_mb"] = round(peak, 1)
            torch.cuda.reset_peak_memory_stats()
    return record


_process_peaks = {"rss": 0.0, "rss_since_mark": 0.0, "cuda": 0.0}  # MiB, the highest interval peaks read so far


def process_peak_rss_mb() -> float:
    """This process's peak RSS in MiB, across the resets of the kernel's counter made here
    (getrusage reads that counter: after a reset it sees only back to it)."""
    return max(_process_peaks["rss"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # Linux: KiB


def mark_rss_peak() -> bool:
    """Start a window for `rss_peak_since_mark_mb` (a caller timing its own phases, as the
    benchmarks do: with interval peaks on, the kernel's counter is reset at every `memory_mb`, so
    reading VmHWM alone would only see back to the last record). False where the counter cannot
    be reset."""
    if _take_interval_peak() is None:
        return False
    _process_peaks["rss_since_mark"] = 0.0
    return True


def rss_peak_since_mark_mb() -> float:
    """The highest RSS since `mark_rss_peak` (or since the process started), in MiB, across the
    resets `memory_mb` makes; getrusage's peak where the kernel's counter cannot be read."""
    current = _vm_hwm_mb(reset=False)
    if current is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return max(_process_peaks["rss_since_mark"], current)


def _take_interval_peak() -> float | None:
    """The kernel's peak since its last reset, then reset; kept in the process's and the caller's
    window's peaks, which outlive the reset. None where the counter cannot be read and reset."""
    since = _vm_hwm_mb(reset=True)
    if since is not None:
        _process_peaks["rss"] = max(_process_peaks["rss"], since)
        _process_peaks["rss_since_mark"] = max(_process_peaks["rss_since_mark"], since)
    return since


def _vm_hwm_mb(reset: bool) -> float | None:
    """The kernel's high-water mark of RSS (VmHWM) in MiB; with `reset`, then set back to the
    current RSS (writing 5 to /proc/self/clear_refs). None where either is unavailable."""
    try:
        with open("/proc/self/status") as handle:
            peak = next(int(line.split()[1]) for line in handle if line.startswith("VmHWM:"))
        if reset:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
    except (OSError, StopIteration, ValueError):
        return None
    return peak / 1024


class MetricsWriter:
    """Appends one JSON object per line and flushes, so a killed run keeps what it logged."""

    def __init__(self, path: Path | None):
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        with self.path.open("a") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
