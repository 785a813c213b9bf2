"""apt_ds.algorithm.quant: a frozen weight stored in bitsandbytes' 4-bit (NF4/FP4) or int8 form,
its forward pass and input gradient, its storage, and the physical shrink's exact and
re-quantizing routes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from apt_ds.algorithm.quant import (
    BaseQuant,
    QuantizationError,
    dequantize,
    frozen_linear,
    quantize,
    quantize_linear,
    storage_bytes,
    stored_transposed,
)
from apt_ds.algorithm.quant_shrink import REQUANTIZED, keep_quantized

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
def test_single_columns_keep_their_codes_and_blocks_go_when_their_last_column_does(method):
    """Single stored columns (hidden channels of gate/up's input) cut blocks only in part: those
    blocks stay, their codes as they were, and the kept columns are named by their positions,
    so the weight is the slice of the dequantized one bit for bit; a block with no column left is
    dropped, and a later cut composes with the earlier one."""
    weight = quantize(_weight(), BaseQuant(method))
    columns = torch.cat([torch.arange(0, 128, 3), torch.arange(192, 512)])  # block 2 (128..191) wholly cut
    kept, route = keep_quantized(weight, None, columns)
    expected = dequantize(weight)[:, columns]
    assert route == "exact" and torch.equal(dequantize(kept), expected)
    assert kept.apt_shape == (256, 448) and kept.apt_positions is not None  # 7 of 8 blocks stored
    assert storage_bytes(kept) < storage_bytes(weight)
    again = torch.arange(0, len(columns), 2)
    twice, route = keep_quantized(kept, torch.tensor([0, 7, 100]), again)
    assert route == "exact" and torch.equal(dequantize(twice), expected[[0, 7, 100]][:, again])
    x = torch.randn(4, len(again), requires_grad=True)
    y = frozen_linear(x, twice, None)
    torch.testing.assert_close(y, x.detach() @ dequantize(twice).t(), rtol=1e-5, atol=1e-5)
    y.sum().backward()
    torch.testing.assert_close(x.grad, dequantize(twice).sum(0).expand(4, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["nf4", "fp4"])
def test_the_layout_before_pruned_axis_rows_requantizes_single_columns(method):
    """Runs of the layout before 2026-12-07 re-quantized any cut that was not whole blocks (their
    exports still do): close to the dequantized slice, not equal."""
    weight = quantize(_weight(), BaseQuant(method, pruned_axis_rows=False))
    columns = torch.arange(0, 512, 3)
    kept, route = keep_quantized(weight, None, columns)
    expected = dequantize(weight)[:, columns]
    assert route == REQUANTIZED and kept.apt_shape == (256, len(columns)) and kept.apt_positions is None
    gap = (dequantize(kept) - expected).abs().mean() / expected.abs().mean()
    assert 0 < gap < 0.15


def test_the_route_does_not_depend_on_the_sequence_of_shrinks():
    """A stored width that is not whole blocks (200) re-quantizes at every cut, also once a cut
    left it whole blocks wide (192): two shrinks give the weight one shrink to the same units
    gives, so resume and export hold the run's codes."""
    dense = _weight(128, 200)
    quant = BaseQuant("nf4")

    def weight():
        return quantize(dense, quant, source=lambda: dense, dims=("ffn", "hidden"))

    first = torch.arange(8, 200)
    once, route = keep_quantized(weight(), None, first)
    assert route == REQUANTIZED and once.apt_shape == (128, 192)
    second = torch.arange(0, 192, 2)
    twice, route = keep_quantized(once, None, second)
    direct, _ = keep_quantized(weight(), None, first[second])
    assert route == REQUANTIZED and torch.equal(dequantize(twice), dequantize(direct))


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16])
def test_codes_held_in_a_float_dtype_are_the_same_codes(storage):
    """ZeRO-3's quant_storage: the packed codes held in the engine's dtype compute, slice and
    count bytes as the uint8 ones do, bit for bit."""
    dense = _weight(256, 512)
    as_bytes = quantize(dense, BaseQuant("nf4"), dims=("hidden", "ffn"))
    held = quantize(dense, BaseQuant("nf4", storage=storage), dims=("hidden", "ffn"))
    assert held.dtype == storage and storage_bytes(held) == storage_bytes(as_bytes)
    assert torch.equal(held.data.view(torch.uint8).reshape(-1), as_bytes.data.reshape(-1))
    assert torch.equal(dequantize(held), dequantize(as_bytes))
    rows, neurons = torch.arange(0, 256, 3), torch.arange(1, 512, 2)
    kept, route = keep_quantized(held, rows, neurons)
    assert route == "exact" and kept.dtype == storage
    assert torch.equal(dequantize(kept), dequantize(keep_quantized(as_bytes, rows, neurons)[0]))
    x = torch.randn(3, len(neurons))
    torch.testing.assert_close(frozen_linear(x, kept, None), x @ dequantize(kept).t(), rtol=1e-4, atol=1e-4)


def test_int8_codes_cannot_be_held_in_a_float_dtype():
    with pytest.raises(QuantizationError, match="int8 cannot hold its codes in torch.float32"):
        BaseQuant("int8", storage=torch.float32)


def test_stored_orientation_puts_the_finer_cut_axis_on_the_rows():
    """q/k/v (out: heads, in: hidden) and down_proj (out: hidden, in: neurons) are stored as W^T;
    o_proj and gate/up as they are."""
    assert stored_transposed(("q", "hidden")) and stored_transposed(("kv", "hidden"))
    assert stored_transposed(("hidden", "ffn"))
    assert not stored_transposed(("hidden", "q")) and not stored_transposed(("ffn", "hidden"))
    assert not stored_transposed(None)


@pytest.mark.parametrize("method", ["nf4", "fp4"])
def test_a_transposed_weight_computes_and_slices_as_the_weight_it_stands_for(method):
    """A down_proj-like weight (out: 256 hidden, in: 512 neurons) stored as W^T: the forward
    pass, input gradient and dequantized weight are those of W; single neurons (stored rows) and
    64-wide column blocks of the output are kept exactly."""
    dense = _weight(256, 512)
    weight = quantize(dense, BaseQuant(method), dims=("hidden", "ffn"))
    assert weight.apt_transposed and weight.apt_shape == (512, 256)
    assert dequantize(weight).shape == (256, 512) and dequantize(weight).is_contiguous()
    error = (dequantize(weight) - dense).abs().mean() / dense.abs().mean()
    assert 0 < error < 0.15
    x = torch.randn(3, 512, requires_grad=True)
    y = frozen_linear(x, weight, torch.ones(256))
    torch.testing.assert_close(y, x.detach() @ dequantize(weight).t() + 1, rtol=1e-4, atol=1e-4)
    y.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, (2 * y.detach()) @ dequantize(weight), rtol=1e-3, atol=1e-3)
    neurons, rows = torch.arange(1, 512, 2), torch.cat([torch.arange(64), torch.arange(128, 256)])
    kept, route = keep_quantized(weight, rows, neurons)
    assert route == "exact" and torch.equal(dequantize(kept), dequantize(weight)[rows][:, neurons])
    assert kept.apt_positions is None and kept.apt_shape == (256, 192)  # whole blocks dropped, rows kept


def test_int8_keeps_any_column_exactly():
    weight = quantize(_weight(), BaseQuant("int8"))
    columns, rows = torch.arange(0, 512, 3), torch.tensor([1, 5, 9])
    kept, route = keep_quantized(weight, rows, columns)
    assert route == "exact" and torch.equal(dequantize(kept), dequantize(weight)[rows][:, columns])


def test_an_unknown_method_is_one_line():
    with pytest.raises(QuantizationError, match="--base-quant must be one of none, nf4, fp4, int8, got 'q4'"):
        BaseQuant("q4")
