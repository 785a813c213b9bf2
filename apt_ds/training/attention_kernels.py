"""Which kernels `scaled_dot_product_attention` may use while a run trains.

PyTorch picks cuDNN's attention first on recent GPUs. cuDNN builds an execution plan for every
attention shape it meets, and APT gives layers new head counts at each event that prunes KV
groups. On one H100 (docs/BENCHMARKS.md, "Fourth lease"; one run of each) APT's 48 steps at
4 x 512 tokens of a random LLaMA-2-7B shape took 18.1 s with cuDNN's attention turned off for
the whole process and 23.8 s with it, most of the difference in the first steps after events;
LoRA's took 14.7 and 15.4 s. So training turns those kernels off unless
`TrainConfig.cudnn_attention` asks for PyTorch's own choice; flash or memory-efficient attention
runs instead. The switch only matters on CUDA. Not measured yet: 16 x 512 tokens without them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def training_attention_kernels(cudnn_attention: bool) -> Iterator[None]:
    """Inside: cuDNN's attention kernels off, unless `cudnn_attention` (the process's own setting
    then stands); after: as they were, on any exit. The flag is process-wide, so the backward
    passes (autograd's device threads) see it too; the other kernels' flags are not touched."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    if not cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
