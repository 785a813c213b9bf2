"""Tensor-by-tensor reading of a Hugging Face model directory's safetensors weights.

Loading a 7B-70B model whole on every rank is what LLaMA-scale training cannot afford. This
view opens the files lazily (memory-mapped by safetensors) and hands out one tensor, a range
of rows, or a flat range of elements at a time, so a caller holds at most what it asked for:
a ZeRO-3 rank reads only its own partition (`flat_range`), an export one tensor at a time.
Pickled `*.bin` checkpoints are refused (nothing user-supplied is unpickled).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from apt_ds.io.tensor_map import DTYPES, can_map, map_tensor, read_entries

INDEX_FILE = "model.safetensors.index.json"


class WeightsError(ValueError):
    """The directory holds no readable safetensors weights."""


class SafetensorsWeights:
    """Read-only view of `directory`'s `model.safetensors` or sharded `*.safetensors` + index."""

    def __init__(self, directory: str | Path):
        from safetensors import SafetensorError, safe_open

        self.directory = Path(directory)
        files = self._weight_files()
        self._handles = {}
        self._entries: dict[Path, dict] = {}  # each file's tensor byte ranges, read on the first `read`
        self._file_of: dict[str, Path] = {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, RuntimeError, MemoryError) as err:  # mmap refused (ulimit -v)
                raise WeightsError(f"cannot read {path}: {str(err).splitlines()[0]}") from None
            self._handles[path] = handle
            for name in handle.keys():
                self._file_of[name] = path
        if not self._file_of:
            raise WeightsError(f"{self.directory}: its safetensors files hold no tensors")

    def _weight_files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise WeightsError(f"{index}: not a safetensors index ({err})") from None
            files = sorted({self.directory / name for name in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise WeightsError(f"{index} names shards that are missing: {missing[:3]}")
            return files
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            pickled = sorted(p.name for p in self.directory.glob("*.bin"))
            hint = f" (found {pickled[0]}: pickled weights are not loaded; convert them to safetensors)" if pickled else ""
            raise WeightsError(f"{self.directory}: no *.safetensors weights{hint}")
        return files

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def stored(self, name: str) -> str:
        """`name` as the files hold it: itself, or without its first component when only that is
        there (a base model's checkpoint read by its task class: BertModel's `embeddings.` for
        BertForSequenceClassification's `bert.embeddings.`), in either with a LayerNorm's weight
        and bias under their old names, gamma and beta (bert-base-uncased's files)."""
        for candidate in (name, name.partition(".")[2]):
            for form in (candidate, _legacy_norm_name(candidate)):
                if form in self._file_of:
                    return form
        return name

    def _slice(self, name: str):
        if name not in self._file_of:
            raise WeightsError(f"{self.directory}: no tensor named {name}")
        return self._handles[self._file_of[name]].get_slice(name)

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def nbytes(self) -> int:
        """Bytes of every tensor as stored."""
        total = 0
        for name in self._file_of:
            piece = self._slice(name)
            total += math.prod(piece.get_shape()) * _dtype_size(piece.get_dtype())
        return total

    def numel(self) -> int:
        """Elements of every tensor."""
        return sum(math.prod(self._slice(name).get_shape()) for name in self._file_of)

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor (a private copy)."""
        self._slice(name)  # a clear error for an unknown name
        return self._handles[self._file_of[name]].get_tensor(name)

    def read(self, name: str) -> torch.Tensor:
        """`get`, through a mapping of this tensor's own bytes (apt_ds.io.tensor_map), so that
        nothing but the tensor holds its pages, and they leave memory with it; the long-lived
        handles keep every page they read resident (in RSS) for as long as this object lives."""
        from safetensors import safe_open

        self._slice(name)
        path = self._file_of[name]
        if path not in self._entries:
            self._entries[path] = read_entries(path)
        entry = self._entries[path].get(name)
        if entry is not None and can_map(entry):
            return map_tensor(path, entry)
        with safe_open(str(path), framework="pt") as handle:  # a dtype torch cannot view as stored
            return handle.get_tensor(name)

    def flat_range(self, name: str, start: int, length: int) -> torch.Tensor:
        """Elements [start, start + length) of the row-major flattened tensor, clipped to its
        size. Reads only the rows that cover the range (at most two more rows than needed)."""
        piece = self._slice(name)
        shape = piece.get_shape()
        numel = math.prod(shape)
        stop = min(numel, start + length)
        if start >= stop:
            return torch.empty(0, dtype=DTYPES[piece.get_dtype()])
        if len(shape) <= 1:
            return piece[start:stop].reshape(-1)
        row = math.prod(shape[1:])
        first, last = start // row, (stop - 1) // row + 1
        rows = piece[first:last].reshape(-1)
        offset = start - first * row
        return rows[offset : offset + stop - start]


def _legacy_norm_name(name: str) -> str:
    """`...LayerNorm.weight` as TensorFlow-era BERT checkpoints name it (`...LayerNorm.gamma`; bias: beta)."""
    stem, _, leaf = name.rpartition(".")
    return f"{stem}.{ {'weight': 'gamma', 'bias': 'beta'}.get(leaf, leaf)}" if stem.endswith("LayerNorm") else name


def _dtype_size(name: str) -> int:
    return DTYPES[name].itemsize if name in DTYPES else 1
