"""Metrics written to disk as JSON lines, and process memory readings."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import psutil
import torch


def memory_mb() -> dict:
    """Current and peak resident set size of this process, in MiB, plus the CUDA caching
    allocator's current and peak allocation on this process's device once CUDA is in use."""
    rss = psutil.Process().memory_info().rss / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    record = {"rss_mb": round(rss, 1), "peak_rss_mb": round(peak, 1)}
    if torch.cuda.is_initialized():  # never initialise CUDA just to read it
        record["cuda_mb"] = round(torch.cuda.memory_allocated() / 2**20, 1)
        record["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return record


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
