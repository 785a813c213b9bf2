"""Where a run computes and in what precision: device, base-weight dtype, CPU threads.

Decisions:
- One process without DeepSpeed trains on `cuda` when one is visible (`--device` chooses);
  under DeepSpeed each rank uses its accelerator's current device (`rank_device`).
- Frozen base weights are bf16 on GPUs and fp32 on CPU by default: on a CPU without native
  bf16 a bf16 input-gradient matmul was ~9x slower than fp32 (measured here: 512x1536 @
  1536x576, one thread, 1.21 s vs 0.14 s). fp16 is refused on CPU. Adapters keep fp32 masters.
- On CPU, a rank whose OMP_NUM_THREADS is unset uses cores / local ranks threads: the
  DeepSpeed launcher does not set it, and oversubscribed OpenMP threads made steps ~100x
  slower on this project's 2-core machine. GPU ranks that share a node and may each run on all
  of its cores get the same share (`configure_host_threads`): their host work (a pruning decision
  sorts every unit, at the same moment on every rank) would otherwise use every core in each.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from apt_ds.config import ConfigError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# Variables launchers set to the number of ranks on this node, in order of preference.
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def resolve_device(name: str) -> torch.device:
    """The device of a one-process run for `--device` (auto, cpu, cuda, cuda:N)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: no CUDA device is visible to torch; use --device cpu (or auto)")
        device = torch.device(name)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
        return device
    return torch.device(name)


def rank_device() -> torch.device:
    """This rank's accelerator device under DeepSpeed (cpu on its CPU accelerator)."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def resolve_base_dtype(name: str, device: torch.device) -> torch.dtype:
    """`--base-dtype` on `device`: auto is bf16 on accelerators and fp32 on CPU."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name == "fp16" and device.type == "cpu":
        raise ConfigError("--base-dtype fp16 is not supported on CPU (no fp16 kernels); use fp32 (default) or bf16")
    if name not in DTYPES:
        raise ConfigError(f"--base-dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def local_ranks(environ: Mapping[str, str] = os.environ) -> int:
    for key in LOCAL_SIZE_VARS:
        value = environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def cpu_threads_per_rank(environ: Mapping[str, str] = os.environ, cores: int | None = None) -> int | None:
    """Threads a CPU rank should use: None when OMP_NUM_THREADS is set (the user decided),
    else the cores this process may run on divided by the ranks on this node."""
    if environ.get("OMP_NUM_THREADS"):
        return None
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, cores // local_ranks(environ))


def configure_cpu_threads(environ: Mapping[str, str] = os.environ) -> int | None:
    """Apply `cpu_threads_per_rank` to torch (call before heavy work); returns what was set."""
    threads = cpu_threads_per_rank(environ)
    if threads is not None:
        torch.set_num_threads(threads)
    return threads


def configure_host_threads(device: torch.device, environ: Mapping[str, str] = os.environ) -> int | None:
    """`configure_cpu_threads` for a rank on `device`: always on CPU; on an accelerator only when
    several ranks share the node and each may run on all of its cores. One process on a GPU, or
    ranks the launcher already gave cores of their own (Slurm's --cpus-per-task, mpirun's
    binding), keep torch's own default."""
    launcher_split_cores = len(os.sched_getaffinity(0)) < (os.cpu_count() or 0)
    if device.type != "cpu" and (local_ranks(environ) == 1 or launcher_split_cores):
        return None
    return configure_cpu_threads(environ)


def available_bytes(device: torch.device, environ: Mapping[str, str] = os.environ) -> int:
    """Memory this rank can expect to use on `device`: the GPU's free memory, or the host's
    available memory shared among the ranks of this node (they all load at once)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available) // local_ranks(environ)


def check_fits(weight_bytes: int, device: torch.device, what: str, hint: str, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse a load that cannot fit before the OOM killer ends it: `weight_bytes` is what this
    rank will hold of the weights alone (activations and optimizer state come on top)."""
    available = available_bytes(device, environ)
    if weight_bytes > available:
        raise ConfigError(f"{what} needs {_size(weight_bytes)} per rank for its weights alone, but only "
                          f"{_size(available)} is available on {device.type}; {hint}")


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def move_batch(batch: dict, device: torch.device) -> dict:
    """The batch's tensors on `device` (asynchronous from pinned host memory on GPUs)."""
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
