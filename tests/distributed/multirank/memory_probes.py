"""Memory probes for the rebuild leak check of zero_checks.py: a fixed glibc mmap threshold (so RSS
moves only with live memory) and an allocator-independent count of live tensor bytes."""

from __future__ import annotations

import gc

import torch


def fixed_mmap_threshold(nbytes: int = 128 * 1024) -> None:
    """glibc: serve every allocation >= nbytes by mmap from now on. By default the threshold
    adapts (it rises to the size of the last freed mmapped chunk), after which same-sized
    buffers come from the heap and RSS jumps by a buffer size at random rebuilds (measured:
    +4 MB steps on the ~1M-parameter leak model), which hides or fakes small leaks."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def live_tensor_mb() -> float:
    """Bytes of distinct storages reachable from Python-tracked tensors: an allocator-independent leak probe."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
            except RuntimeError:
                continue
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total / 2**20
