"""The outlier term's statistics: the excess kurtosis of a unit's output contribution
O = mean_x[j] * W[:, j], from per-column power sums of W (see apt_ds.algorithm.salience)."""

from __future__ import annotations

import torch


def column_power_sums(weight: torch.Tensor) -> torch.Tensor:
    """P[k-1, j] = sum_i W_ij^k for k = 1..4, the kurtosis sufficient statistics. float64: the
    central fourth moment is a difference of raw moments, which cancel badly in fp32; these
    are (4, channels) vectors computed once per shape, so the cost is nothing even on a GPU."""
    w = weight.detach().double()
    w2 = w * w
    return torch.stack([w.sum(0), w2.sum(0), (w2 * w).sum(0), (w2 * w2).sum(0)])


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
