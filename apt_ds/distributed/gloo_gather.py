"""ZeRO-3's parameter gathers on gloo without a second copy of each gathered tensor.

ZeRO-3 gathers a parameter with one `all_gather_into_tensor` into a buffer the size of the whole
tensor. NCCL writes straight into that buffer; gloo (DeepSpeed's CPU accelerator) does not: its
allgather first receives everything into a flat tensor of its own of the same size, then copies
it out (`newLikeFlat` in ProcessGroupGloo's AsyncAllgatherWork). Gathering LLaMA-3.2-1B's tied
128k x 2048 embedding therefore held 2 GB instead of 1 GB per rank at the step's peak (measured
with benchmarks/zero3_memory.py's profiler, docs/BENCHMARKS.md); at 3B the same copy is 1.5 GB.

On gloo, a gather larger than `PIECE_BYTES` is done here in pieces instead: each piece gathers
the same slice of every rank's partition straight into the output's views, so gloo's own flat
tensor is one piece (`PIECE_BYTES` over all ranks) and the output is byte for byte the same. The
pieces are queued at once (gloo runs them in order on its worker threads, allocating each piece's
flat tensor as it runs it), so the call stays as asynchronous as DeepSpeed asked for.
"""

from __future__ import annotations

import functools

import torch

PIECE_BYTES = 32 * 2**20  # gloo's flat tensor for one piece, all ranks together (measured: 3 in flight at once)


class _AllPieces:
    """One handle for the pieces' works, as DeepSpeed waits on it (`wait`, `is_completed`)."""

    def __init__(self, works: list):
        self.works = works

    def wait(self, *args, **kwargs) -> bool:
        for work in self.works:
            work.wait(*args, **kwargs)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def gather_in_pieces(output: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False,
                     piece_bytes: int | None = None):
    """`all_gather_into_tensor(output, tensor)` over `group` as pieces of at most `piece_bytes`
    (all ranks together; default `PIECE_BYTES`, read at the call) of gloo's temporary; `output`
    and `tensor` contiguous, `output` holding world x tensor's elements in rank order. `tensor`
    may be a view of `output` (DeepSpeed's coalesced gathers): each piece copies a rank's own
    slice onto itself and touches nothing another piece reads."""
    import torch.distributed as dist

    piece_bytes = PIECE_BYTES if piece_bytes is None else piece_bytes
    world = dist.get_world_size(group)
    per_rank = tensor.numel()
    if output.numel() != per_rank * world or not (output.is_contiguous() and tensor.is_contiguous()):
        raise ValueError(f"gather_in_pieces: output of {output.numel()} elements for {world} x {per_rank}, "
                         f"both contiguous, was asked")
    flat_out, flat_in = output.view(-1), tensor.view(-1)
    step = max(1, piece_bytes // (tensor.element_size() * world))
    works = []
    for start in range(0, per_rank, step):
        stop = min(per_rank, start + step)
        views = [flat_out[rank * per_rank + start: rank * per_rank + stop] for rank in range(world)]
        works.append(dist.all_gather(views, flat_in[start:stop], group=group, async_op=True))
    handle = _AllPieces(works)
    if not async_op:
        handle.wait()
        return None
    return handle


def _is_gloo(group) -> bool:
    """Whether `group` (None: the default group) runs on gloo, the backend that copies."""
    import torch.distributed as dist

    try:
        return dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):  # not a group of this process
        return False


def bounded_gloo_gathers(backend) -> bool:
    """Make DeepSpeed's comm backend (`deepspeed.comm.comm.cdb`) gather in pieces on gloo groups
    (see the module docstring); other backends and small gathers are unchanged. True if installed
    now, False if already installed or there is no backend."""
    if backend is None or getattr(backend.all_gather_into_tensor, "apt_ds_in_pieces", False):
        return False
    original = backend.all_gather_into_tensor

    @functools.wraps(original)
    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        large = output_tensor.numel() * output_tensor.element_size() > PIECE_BYTES
        if large and output_tensor.device.type == "cpu" and _is_gloo(group) \
                and output_tensor.is_contiguous() and input_tensor.is_contiguous():
            return gather_in_pieces(output_tensor, input_tensor, group=group, async_op=async_op)
        return original(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)

    all_gather_into_tensor.apt_ds_in_pieces = True
    backend.all_gather_into_tensor = all_gather_into_tensor
    return True
