"""The process group of a DeepSpeed run: starting it, collectives on any tensor, ending it.

Launchers: `deepspeed`, `torchrun` and `mpirun`/`srun` all work; `apt_ds.distributed.
launcher_env` maps OpenMPI / Slurm variables (or a plain `python script.py`) to a process group
where DeepSpeed has no mapping of its own, and leaves the rest to `deepspeed.init_distributed`.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from apt_ds.distributed import deepspeed_private as private
from apt_ds.distributed.gloo_gather import bounded_gloo_gathers
from apt_ds.distributed.launcher_env import launcher_env, local_device_index


def import_deepspeed() -> None:
    """Import DeepSpeed ahead of its first use (`apt_ds.training.heap.import_training_libraries`)."""
    import deepspeed  # noqa: F401


def init_process_group() -> None:
    """Start torch.distributed through DeepSpeed unless it runs already; bind the rank to its device."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    if not dist.is_initialized():
        os.environ.update(launcher_env(os.environ))  # OpenMPI / Slurm / plain python -> RANK, WORLD_SIZE
        # Before the process group: NCCL binds each rank to the device current at its first use.
        bind_local_device()
        deepspeed.init_distributed(verbose=False)  # its auto_mpi_discovery maps AzureML / SageMaker / mpi4py
        if get_accelerator().device_name() == "cpu":
            _release_shm_buffers()
    if private.comm_backend() is None:  # a process group started by the caller: DeepSpeed wraps it
        deepspeed.init_distributed(verbose=False)
        if get_accelerator().device_name() == "cpu":
            _release_shm_buffers()
    bounded_gloo_gathers(private.comm_backend())  # gloo's gathers without a second full copy
    # Again after it: DeepSpeed's discovery (AzureML, SageMaker, mpi4py) sets LOCAL_RANK only inside
    # init_distributed, and a caller who started the process group may have chosen no device; either
    # way every rank was left on device 0 while NCCL was bound to cuda:LOCAL_RANK.
    bind_local_device()


def bind_local_device() -> None:
    """Make cuda:LOCAL_RANK (the accelerator's device of this rank's local rank) the current device,
    where the local rank is known (`local_device_index`); on DeepSpeed's CPU accelerator nothing. A
    local rank this process has no device for is refused in one line (DeepSpeed would fail deep
    inside NCCL's start)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return
    visible = getattr(accelerator, "visible_devices_envs", lambda: ["CUDA_VISIBLE_DEVICES"])()  # not in every release
    index = local_device_index(os.environ, accelerator.device_count(), accelerator.device_name(), tuple(visible))
    if index is not None:
        accelerator.set_device(index)


def _release_shm_buffers() -> None:
    """DeepSpeed's CPU all-reduce leaves a 69 MB /dev/shm file per rank: unlink ours once every
    rank has mapped them all, and remove those of dead runs (apt_ds.distributed.shm)."""
    import torch.distributed as dist

    from apt_ds.distributed.shm import remove_stale_buffers, unlink_own_buffer

    dist.barrier()  # every rank is past DeepSpeed's init, which maps every rank's buffer
    unlink_own_buffer(dist.get_rank())
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        remove_stale_buffers()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place on `tensor` (also returned). CPU tensors work on any backend."""
    import torch.distributed as dist

    if tensor.device.type == "cpu" and dist.get_backend() not in ("gloo", "ccl"):
        from deepspeed.accelerator import get_accelerator

        moved = tensor.to(get_accelerator().current_device_name())
        dist.all_reduce(moved, op=dist.ReduceOp.SUM)
        tensor.copy_(moved.cpu())
    else:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_object(obj) -> list:
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def on_all_ranks(check: Callable[[], None]) -> None:
    """Run `check` on every rank; if it fails anywhere, raise on every rank (instead of one
    rank raising while the others wait in the next collective)."""
    try:
        check()
        error = None
    except (OSError, ValueError, KeyError) as err:
        error = (type(err).__name__, str(err))
    errors = [e for e in all_gather_object(error) if e is not None]
    if errors:
        kind, message = errors[0]
        raise {"FileNotFoundError": FileNotFoundError, "KeyError": KeyError}.get(kind, ValueError)(message)


def end_process_group() -> None:
    """Wait for every rank, then destroy the process group. Without it a rank that exits first
    can make another abort in its communication threads' teardown ("terminate called without
    an active exception", seen ~1 in 4 runs)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
