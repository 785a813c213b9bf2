"""A tensor read for a by-tensor load maps its own bytes only (apt_ds.io.tensor_map): the same values
as safetensors gives, no mapping of the whole file per tensor (which made RSS count neighbouring
tensors' pages twice), writes never reaching the file, and what it cannot view read as before."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from apt_ds.io.tensor_map import map_tensor, read_entries
from apt_ds.io.weights import SafetensorsWeights

TENSORS = {"big": torch.randn(64, 1024), "bf16": torch.randn(33).bfloat16(), "flags": torch.tensor([True, False, True]),
           "ids": torch.arange(5), "empty": torch.zeros(0, 4), "half": torch.randn(3, 3).half()}


def _mappings_of(path: Path) -> list[int]:
    """Sizes of this process's mappings of `path`."""
    sizes = []
    with open("/proc/self/maps") as handle:
        for line in handle:
            if line.rstrip().endswith(str(path)):
                low, high = line.split()[0].split("-")
                sizes.append(int(high, 16) - int(low, 16))
    return sizes


def test_every_dtype_reads_as_safetensors_gives_it(tmp_path):
    save_file(TENSORS, str(tmp_path / "model.safetensors"))
    weights = SafetensorsWeights(tmp_path)
    for name, tensor in load_file(str(tmp_path / "model.safetensors")).items():
        read = weights.read(name)
        assert read.dtype == tensor.dtype and read.shape == tensor.shape and torch.equal(read, tensor), name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_each_tensor_maps_its_own_bytes_not_the_whole_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({f"t{i}": torch.randn(256, 256) for i in range(8)}, str(path))  # 256 KiB each, 2 MiB in all
    weights = SafetensorsWeights(tmp_path)  # its handle maps the file once, for shapes and slices
    before = _mappings_of(path)
    held = [weights.read(f"t{i}") for i in range(8)]
    sizes = _mappings_of(path)
    for size in before:
        sizes.remove(size)
    assert len(sizes) == 8
    assert max(sizes) <= 256 * 1024 + 2 * mmap.ALLOCATIONGRANULARITY  # one tensor and its end pages, never the 2 MiB file
    del held
    assert sorted(_mappings_of(path)) == sorted(before)  # released with the tensors


def test_writing_to_a_read_tensor_leaves_the_file_as_it_was(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(TENSORS, str(path))
    tensor = map_tensor(path, read_entries(path)["big"])
    tensor.mul_(0)
    assert torch.equal(load_file(str(path))["big"], TENSORS["big"])
    assert torch.equal(SafetensorsWeights(tmp_path).read("big"), TENSORS["big"])


def test_a_dtype_torch_cannot_view_is_read_through_safetensors(tmp_path):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8")
    fp8 = torch.randn(4, 4).to(torch.float8_e4m3fn)
    save_file({"fp8": fp8, "ids": torch.arange(3)}, str(tmp_path / "model.safetensors"))
    read = SafetensorsWeights(tmp_path).read("fp8")
    assert read.dtype == torch.float8_e4m3fn and torch.equal(read.view(torch.uint8), fp8.view(torch.uint8))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/fd")
def test_a_read_tensor_holds_no_file_descriptor(tmp_path):
    """Python's mmap (before 3.13) keeps a descriptor per mapping: a 70B model's ~720 weights
    against a common limit of 1,024 open files. The mappings here keep none."""
    save_file({f"t{i}": torch.randn(8, 8) for i in range(300)}, str(tmp_path / "model.safetensors"))
    weights = SafetensorsWeights(tmp_path)
    before = len(os.listdir("/proc/self/fd"))
    held = [weights.read(f"t{i}") for i in range(300)]
    assert len(os.listdir("/proc/self/fd")) <= before + 2
    assert all(torch.isfinite(t).all() for t in held)
