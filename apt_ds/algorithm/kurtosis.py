"""The outlier term's statistics: the excess kurtosis of a unit's output contribution
O = mean_x[j] * W[:, j], from per-column power sums of W (see apt_ds.algorithm.salience)."""

from __future__ import annotations

import torch

# Elements of W taken into float64 at a time. A whole 70B down_proj in float64 with its powers
# would be 7.5 GB at once. On a CPU the temporaries, made in forward hooks between the layers'
# activations, stay behind as free heap that glibc keeps resident: 2 MiB blocks with a new float64
# tensor per power left 23-27 MB of it on SmolLM2-135M's first salience step, the whole of APT's
# peak above LoRA's before its first event (docs/BENCHMARKS.md, "APT beside LoRA"); two reused
# 256 KiB buffers leave none, and were as fast (1.3 ms a 576 x 1536 weight against 2.0). On a GPU
# the caching allocator keeps no heap, but the two buffers add to the step's peak in the last
# layers' hooks (384 MiB at once for a 7B o_proj with one block of 2**24 and a new tensor per
# power): 64 MiB, in about 11 blocks (each a few kernel launches) for a 7B down_proj.
POWER_SUM_BLOCK = 2**15
POWER_SUM_BLOCK_GPU = 2**22


def column_power_sums(weight: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """P[k-1, j] = sum_i W_ij^k for k = 1..4, the kurtosis sufficient statistics. float64: the
    central fourth moment is a difference of raw moments, which cancel badly in fp32; these
    are (4, channels) vectors computed once per shape, in blocks of rows (`block` elements at a
    time; default POWER_SUM_BLOCK or POWER_SUM_BLOCK_GPU) through two float64 buffers made once
    per call: the powers are taken in place, so the call's working memory is two blocks."""
    weight = weight.detach()
    columns = weight.shape[1]
    sums = torch.zeros(4, columns, dtype=torch.float64, device=weight.device)
    block = block or (POWER_SUM_BLOCK if weight.device.type == "cpu" else POWER_SUM_BLOCK_GPU)
    rows = max(1, block // max(1, columns))
    first = torch.empty(min(rows, weight.shape[0]), columns, dtype=torch.float64, device=weight.device)
    second = torch.empty_like(first)
    for part in weight.split(rows):
        w, w2 = first[: len(part)], second[: len(part)]
        w.copy_(part)
        sums[0] += w.sum(0)
        torch.mul(w, w, out=w2)
        sums[1] += w2.sum(0)
        w.mul_(w2)  # w^3
        sums[2] += w.sum(0)
        w2.mul_(w2)  # w^4
        sums[3] += w2.sum(0)
    return sums


def unit_kurtosis(mean_x: torch.Tensor, power_sums: torch.Tensor, rows: int, unit_width: int) -> torch.Tensor:
    """Excess (Fisher) kurtosis of O = mean_x[j] * W[:, j] over each unit's columns.

    Units are consecutive blocks of `unit_width` columns. Uses biased moments (as
    scipy.stats.kurtosis with fisher=True, bias=True)."""
    m = mean_x.double()
    powers = torch.stack([m, m**2, m**3, m**4])  # (4, channels)
    raw = (powers * power_sums).reshape(4, -1, unit_width).sum(-1) / (rows * unit_width)
    m1, m2, m3, m4 = raw
    var = m2 - m1**2
    central4 = m4 - 4 * m1 * m3 + 6 * m1**2 * m2 - 3 * m1**4
    kurt = central4 / var.clamp_min(1e-300) ** 2 - 3.0
    return torch.where(var > 0, kurt, torch.zeros_like(kurt))
