"""The outlier term's statistics: the excess kurtosis of a unit's output contribution
O = mean_x[j] * W[:, j], from per-column power sums of W (see apt_ds.algorithm.salience)."""

from __future__ import annotations

import torch

# Elements of W taken into float64 at a time (2 MiB): a whole 70B down_proj in float64 with its
# powers would be 7.5 GB at once, and on a CPU the few MB-sized temporaries of even a small
# model's first salience step raised glibc's mmap threshold and stayed behind as ~150 MB of free
# heap (SmolLM2-135M, one process: what put APT's peak above LoRA's, docs/BENCHMARKS.md).
POWER_SUM_BLOCK = 2**18
POWER_SUM_BLOCK_GPU = 2**24  # on a GPU the caching allocator keeps no heap, and each block costs kernel launches


def column_power_sums(weight: torch.Tensor) -> torch.Tensor:
    """P[k-1, j] = sum_i W_ij^k for k = 1..4, the kurtosis sufficient statistics. float64: the
    central fourth moment is a difference of raw moments, which cancel badly in fp32; these
    are (4, channels) vectors computed once per shape, in blocks of rows (POWER_SUM_BLOCK)."""
    weight = weight.detach()
    sums = torch.zeros(4, weight.shape[1], dtype=torch.float64, device=weight.device)
    elements = POWER_SUM_BLOCK if weight.device.type == "cpu" else POWER_SUM_BLOCK_GPU
    for block in weight.split(max(1, elements // max(1, weight.shape[1]))):
        w = block.double()
        w2 = w * w
        sums[0] += w.sum(0)
        sums[1] += w2.sum(0)
        sums[2] += (w2 * w).sum(0)
        sums[3] += (w2 * w2).sum(0)
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
