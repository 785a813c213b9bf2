"""apt_ds.algorithm.quant: a frozen weight stored in bitsandbytes' 4-bit (NF4/FP4) or int8 form,
its forward pass and input gradient, its storage, and the physical shrink's exact and
re-quantizing routes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from apt_ds.algorithm.quant import (
    REQUANTIZED,
    BaseQuant,
    QuantizationError,
    dequantize,
    keep_quantized,
    quantize,
    quantize_linear,
    storage_bytes,
)

METHODS = ["nf4", "fp4", "int8"]


def _weight(rows=256, cols=512, seed=0):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", METHODS)
def test_a_quantized_linear_computes_with_its_dequantized_weight_and_passes_input_gradients(method):
    linear = nn.Linear(512, 256, bias=True)
    dense = linear.weight.detach().clone()
    quantize_linear(linear, BaseQuant(method))
    assert linear.weight.dtype in (torch.uint8, torch.int8) and not linear.weight.requires_grad
    x = torch.randn(3, 512, requires_grad=True)
    y = linear(x)
    expected = nn.functional.linear(x.detach(), dequantize(linear.weight), linear.bias.detach())
    torch.testing.assert_close(y.detach(), expected, rtol=1e-4, atol=1e-4)
    error = (dequantize(linear.weight) - dense).abs().mean() / dense.abs().mean()
    assert 0 < error < (0.02 if method == "int8" else 0.15)  # quantized, and close
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.parametrize("double_quant, expected", [(True, (0.50, 0.53)), (False, (0.55, 0.57))])
def test_nf4_storage_per_parameter(double_quant, expected):
    weight = quantize(_weight(1024, 1024), BaseQuant("nf4", double_quant=double_quant))
    low, high = expected
    assert low <= storage_bytes(weight) / (1024 * 1024) <= high


def test_int8_storage_is_a_byte_per_parameter_and_a_scale_per_row():
    weight = quantize(_weight(256, 512), BaseQuant("int8"))
    assert storage_bytes(weight) == 256 * 512 + 256 * 4


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("double_quant", [True, False], ids=["double", "single"])
def test_whole_rows_and_whole_blocks_are_kept_exactly(method, double_quant):
    """Rows of a 512-wide matrix (8 blocks each), and 128-wide heads of its input: the kept codes
    as they were, so the dequantized slice is the slice of the dequantized weight, bit for bit."""
    weight = quantize(_weight(), BaseQuant(method, double_quant=double_quant))
    rows = torch.tensor([0, 3, 17, 200, 255])
    heads = torch.cat([torch.arange(128), torch.arange(384, 512)])
    for out_index, in_index in ((rows, None), (None, heads), (rows, heads)):
        kept, route = keep_quantized(weight, out_index, in_index)
        expected = dequantize(weight)
        if out_index is not None:
            expected = expected[out_index]
        if in_index is not None:
            expected = expected[:, in_index]
        assert route == "exact" and torch.equal(dequantize(kept), expected)
        assert kept.apt_shape == tuple(expected.shape)


@pytest.mark.parametrize("method", ["nf4", "fp4"])
def test_single_columns_are_requantized_close_to_the_slice(method):
    """Single input channels (FFN neurons of down_proj, hidden channels) cut 4-bit blocks: the
    kept values are quantized again, close to (not equal to) the dequantized slice."""
    weight = quantize(_weight(), BaseQuant(method))
    columns = torch.arange(0, 512, 3)
    kept, route = keep_quantized(weight, None, columns)
    expected = dequantize(weight)[:, columns]
    assert route == REQUANTIZED and kept.apt_shape == (256, len(columns))
    gap = (dequantize(kept) - expected).abs().mean() / expected.abs().mean()
    assert 0 < gap < 0.15


def test_int8_keeps_any_column_exactly():
    weight = quantize(_weight(), BaseQuant("int8"))
    columns, rows = torch.arange(0, 512, 3), torch.tensor([1, 5, 9])
    kept, route = keep_quantized(weight, rows, columns)
    assert route == "exact" and torch.equal(dequantize(kept), dequantize(weight)[rows][:, columns])


def test_an_unknown_method_is_one_line():
    with pytest.raises(QuantizationError, match="--base-quant must be one of none, nf4, fp4, int8, got 'q4'"):
        BaseQuant("q4")
