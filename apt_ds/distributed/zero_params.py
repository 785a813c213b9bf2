"""ZeRO-3 partitioned parameters: where they live, reading them in full, partitioning new ones.

Under ZeRO-3 a parameter holds only this rank's slice (`ds_id` marks it, `ds_shape` is its full
shape); under ZeRO-1/2 and for plain parameters everything here is a no-op or plain PyTorch.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from apt_ds.algorithm.quant import is_quantized
from apt_ds.distributed import deepspeed_private as private


def is_partitioned(param) -> bool:
    return hasattr(param, "ds_id")


def place_model(model: torch.nn.Module, device: torch.device) -> None:
    """Everything that is not a ZeRO-3 partition onto `device` (a model created under zero.Init
    is never moved as a whole: its partitions already live where they belong)."""
    if not any(is_partitioned(p) for p in model.parameters()):
        model.to(device)
        return
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if not is_partitioned(param):
                param.data = param.data.to(device)
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, buffer.to(device))  # nn.Module keeps it a buffer, persistent or not


def gathered(params: Iterable[torch.nn.Parameter], modifier_rank: int | None = 0):
    """Full tensors of ZeRO-3 partitioned `params` inside the block, on every rank (collective:
    every rank must enter with the same list). On exit rank `modifier_rank`'s in-place edits
    are broadcast (None: read only, cheaper). Replacing a module's Parameter by a new one
    inside the block is fine. No-op for params that are not partitioned (ZeRO-1/2)."""
    partitioned = [p for p in params if is_partitioned(p)]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank)


def partition_new_params(model: torch.nn.Module, module: torch.nn.Module, dtype: torch.dtype) -> None:
    """ZeRO-3: partition the plain parameters just put into `module` of `model` (in `dtype`), so a
    shape change never holds more than one module in full. Other stages: nothing."""
    new = [p for p in module.parameters(recurse=False) if not is_partitioned(p)]
    anchor = next((p for p in model.parameters() if is_partitioned(p)), None)
    if not new or anchor is None:  # nothing partitioned yet: deepspeed.initialize will do it
        return
    for param in new:  # not quantized codes held in a float dtype: their bits are codes, not numbers
        if param.is_floating_point() and param.dtype != dtype and not is_quantized(param):
            param.data = param.data.to(dtype)
    private.partition_like(anchor, new)  # through the zero.Init that partitioned the model


def release_replaced(param) -> None:
    """Free the partition of a ZeRO-3 parameter a shape change has just replaced (it is never read
    again); other parameters are left to the garbage collector."""
    if is_partitioned(param) and private.model_partition_tensor(param) is not None:
        private.release_partition(param)


def forget_replaced_external(model: torch.nn.Module) -> None:
    """Unregister, from every module, the external parameters (deepspeed_private.
    forget_external_parameters) a shape change replaced: they are no longer `model`'s and their
    partitions were released. The new ones are registered again on their first forward."""
    live = {id(p) for p in model.parameters()}
    for module in model.modules():
        private.forget_external_parameters(module, keep=lambda param: id(param) in live)


def check_shapes_agree(model: torch.nn.Module) -> None:
    """RuntimeError unless every rank has the same parameter shapes and trainable set (after a
    shape change; a mismatch would hang DeepSpeed's next collective). Collective."""
    from apt_ds.distributed.zero_comm import all_gather_object

    shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()}
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    views = all_gather_object((shapes, trainable))
    for rank, view in enumerate(views):
        if view != views[0]:
            diff = sorted(set(view[0].items()) ^ set(views[0][0].items()))[:4]
            raise RuntimeError(f"after change_fn rank {rank} has other parameter shapes / trainable set than rank 0: {diff}")


def cast_plain_params(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """New fp32 params in a bf16/fp16 model: ZeRO-3 re-init would not cast them (ZeRO-1/2 does)."""
    if dtype == torch.float32:
        return
    for param in model.parameters():
        if not is_partitioned(param) and param.dtype == torch.float32 and not is_quantized(param):
            param.data = param.data.to(dtype)
