"""Give freed heap memory back to the operating system after a pruning event.

PyTorch's CPU allocator sits on malloc. A shape change frees the old, larger weight and
optimizer tensors, but glibc keeps most of those pages in the process (they count in RSS)
until the heap is trimmed, so physical pruning would not lower the memory a job holds.
Measured on SmolLM2-135M/BoolQ (docs/BENCHMARKS.md): untrimmed, APT 0.7's RSS after its last
pruning event was 1.05x dense LoRA's (1,715 vs 1,634 MB); trimmed after each event, 0.90x."""

from __future__ import annotations

import ctypes
import gc
import sys


def release_free_heap() -> bool:
    """Collect garbage and return free heap pages to the OS (glibc `malloc_trim(0)`).
    A no-op returning False on other C libraries and platforms."""
    gc.collect()
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return False
