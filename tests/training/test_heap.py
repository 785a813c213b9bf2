"""glibc's mmap threshold fixed on CPU runs (apt_ds.training.heap.large_allocations_returned): a
freed gathered weight goes back to the OS instead of staying in the heap."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from apt_ds.training.heap import large_allocations_returned, malloc_counts

# In a fresh process (the setting is process-wide): free a 24 MiB tensor, which by default raises
# glibc's threshold to 24 MiB, then count how much of a new 16 MiB tensor is mmapped.
PROBE = '''
import sys, torch
from apt_ds.training.heap import large_allocations_returned, malloc_counts

fixed = large_allocations_returned("cpu") if sys.argv[1] == "fixed" else False
big = torch.ones(6 * 2**20)  # 24 MiB
del big
before = malloc_counts()["hblkhd"]
weight = torch.ones(4 * 2**20)  # 16 MiB
print(fixed, (malloc_counts()["hblkhd"] - before) // 2**20)
'''


def _mmapped_mib(mode: str) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    result = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, env=env)
    fixed, mib = result.stdout.split()
    return fixed, int(mib)


@pytest.mark.skipif(malloc_counts() is None, reason="glibc >= 2.33's mallopt/mallinfo2")
def test_fixed_threshold_serves_a_freed_size_by_mmap_again():
    assert _mmapped_mib("default") == ("False", 0)  # glibc's default: from the heap, kept there when freed
    assert _mmapped_mib("fixed") == ("True", 16)


def test_left_alone_on_gpus_and_where_the_user_chose():
    assert large_allocations_returned("cuda") is False
    assert large_allocations_returned("cpu", environ={"MALLOC_MMAP_THRESHOLD_": "65536"}) is False
    assert large_allocations_returned("cpu", environ={"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}) is False
