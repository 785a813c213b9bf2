"""One tensor of a safetensors file, memory-mapped on its own: only the pages of its own bytes.

safetensors 0.8 maps the WHOLE file for every tensor it hands out. A model read one tensor at a
time (apt_ds.io.by_tensor) then holds one whole-file mapping per tensor, and the kernel's fault-
around (it maps up to 64 KB of cached pages around each page fault, anywhere inside the mapping)
maps the neighbouring tensors' pages into each of them: RSS counted 47 MB of SmolLM2-135M's 540 MB
of weights twice (RSS 954 MB against a Pss of 907), so a pruning run looked larger than a LoRA run
that maps the file once, and RSS-based limits and monitors saw memory that is not there. Mapped
here from the tensor's first page to its last byte, fault-around stays inside the tensor, and at
most one page at each end is shared with a neighbour.

The mapping is private (copy-on-write, as safetensors' own): writing to the tensor never reaches
the file. The file format is safetensors' documented layout: an 8-byte little-endian header
length, a JSON header naming each tensor's dtype, shape and byte range, then the data.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import mmap
import struct
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor's bytes lie in its file: its dtype as safetensors names it, its shape, and
    the absolute byte offsets [start, stop)."""

    dtype: str
    shape: list[int]
    start: int
    stop: int


def read_entries(path: str | Path) -> dict[str, TensorEntry]:
    """Every tensor's entry in `path`'s header, with absolute byte offsets. The caller has opened
    the file with safetensors already, which validated the header."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    data_start = 8 + length
    return {name: TensorEntry(entry["dtype"], list(entry["shape"]), data_start + entry["data_offsets"][0],
                              data_start + entry["data_offsets"][1])
            for name, entry in header.items() if name != "__metadata__"}


def can_map(entry: TensorEntry) -> bool:
    """A dtype torch reads as stored, on a little-endian machine (safetensors' byte order), at an
    offset aligned to its elements (safetensors writes them so; another writer might not)."""
    return sys.byteorder == "little" and entry.dtype in DTYPES and entry.start % DTYPES[entry.dtype].itemsize == 0


def map_tensor(path: str | Path, entry: TensorEntry) -> torch.Tensor:
    """The tensor, its storage a private mapping of its own bytes in `path` (see the module's
    docstring); the mapping is released with the tensor's last reference, and holds no file
    descriptor (a 70B model has ~720 tensors, against a common limit of 1,024 open files)."""
    dtype, count = DTYPES[entry.dtype], math.prod(entry.shape)
    if count == 0:
        return torch.empty(entry.shape, dtype=dtype)
    first = entry.start - entry.start % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as handle:
        mapped = _private_mapping(handle.fileno(), entry.stop - first, first)
    # frombuffer keeps `mapped` alive for as long as the tensor's storage lives
    return torch.frombuffer(mapped, dtype=dtype, count=count, offset=entry.start - first).view(entry.shape)


def _private_mapping(fd: int, length: int, offset: int):
    """A writable copy-on-write mapping of `length` bytes of `fd` from `offset`, as an object with
    the buffer protocol that unmaps at its last reference and keeps no descriptor open.
    Python's mmap keeps a duplicate of the descriptor for the mapping's life (before 3.13, where
    trackfd=False turns that off): one per weight, which ran out at 256 open files in a test."""
    if sys.version_info >= (3, 13):
        return mmap.mmap(fd, length, offset=offset, access=mmap.ACCESS_COPY, trackfd=False)
    libc = _libc()
    if libc is None:  # not a POSIX C library: Python's mapping, descriptor and all
        return mmap.mmap(fd, length, offset=offset, access=mmap.ACCESS_COPY)
    address = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, offset)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of {length} bytes at offset {offset} failed")
    buffer = (ctypes.c_ubyte * length).from_address(address)
    weakref.finalize(buffer, libc.munmap, ctypes.c_void_p(address), ctypes.c_size_t(length))
    return buffer


@functools.cache
def _libc():
    """The C library's mmap and munmap with their argument types; None where there are none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc
