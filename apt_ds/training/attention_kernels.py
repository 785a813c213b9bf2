"""Which kernels `scaled_dot_product_attention` may use while a run trains.

PyTorch picks cuDNN's attention first on recent GPUs. cuDNN builds an execution plan for every
attention shape it meets, and APT gives layers new head counts at each event that prunes KV
groups. An H100 run of 48 steps at 4 x 512 (random LLaMA-2-7B shape, docs/BENCHMARKS.md,
"Fourth lease") trained APT in 18.1 s without cuDNN's kernels against 23.8 s with them, and every
phase of both APT and LoRA had a lower median step time without them. So training turns them off
unless `TrainConfig.cudnn_attention` asks for them; flash or memory-efficient attention runs
instead. The switch only matters on CUDA.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def training_attention_kernels(cudnn_attention: bool) -> Iterator[None]:
    """Inside: cuDNN's attention kernels on or off as asked; after: as they were. The flag is
    process-wide, so the backward passes (autograd's device threads) see it too; the other
    kernels' flags are left as the user set them."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(cudnn_attention)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
