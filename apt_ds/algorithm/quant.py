"""A frozen base weight stored quantized with bitsandbytes: QLoRA's 4-bit NF4/FP4 (blocks of 64
values, each with its absmax, optionally itself quantized: "double quantization") or LLM.int8's
row-wise int8. Adapters, masks and salience see activations and adapter weights, never the
storage: the forward pass (`frozen_linear`) and the kurtosis of a weight's columns
(`dense_weight`) are the only readers, and a physical shrink (`keep_quantized`) the only writer.

`keep_quantized` takes the exact route where the storage allows it and re-quantizes otherwise:
- int8 keeps every slice exactly (one scale per output row: dropping a row drops its scale, a
  dropped column leaves the other codes as they were);
- 4-bit keeps whole blocks exactly (rows of a matrix whose width is a multiple of the block
  size, and columns that are whole blocks of every row: a 128-wide head of o_proj's input); their
  absmax is then kept un-nested in fp32, since double quantization's nested blocks would be cut;
  any other cut (single FFN neurons or hidden channels along the input) quantizes the kept rows
  and columns of the original weight again, read from the model's files (`REQUANTIZED`, measured
  in docs/QUANTIZED_BASE.md).
bitsandbytes is imported only when a quantized weight is made or used.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from apt_ds.algorithm.edits import full_or_index
from apt_ds.config import BASE_QUANTS as QUANT_METHODS
from apt_ds.config import ConfigError

BLOCKSIZE = 64  # QLoRA's and transformers' default 4-bit block


class QuantizationError(ConfigError):
    """bitsandbytes is missing, or a quantized base cannot be built as asked."""


@dataclass(frozen=True)
class BaseQuant:
    """How the frozen projections are stored: `method` one of QUANT_METHODS; `double_quant`
    quantizes the 4-bit absmax too (transformers' bnb_4bit_use_double_quant); `compute_dtype`
    is what the dequantized weight multiplies in (bnb_4bit_compute_dtype: the base dtype)."""

    method: str = "none"
    double_quant: bool = True
    compute_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if self.method not in QUANT_METHODS:
            raise QuantizationError(f"--base-quant must be one of {', '.join(QUANT_METHODS)}, got {self.method!r}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@functools.cache  # frozen_linear asks on every forward pass: set up once
def bitsandbytes():
    """The bitsandbytes module, or a one-line error saying how to install it."""
    # On a CPU with AVX512-BF16 bitsandbytes 0.50 tries to fetch an optional GEMV kernel from the
    # Hub at import and warns when it cannot (offline, untrusted): its own kernels run instead.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise QuantizationError("--base-quant needs bitsandbytes: pip install 'bitsandbytes>=0.45,<1' (or pip install "
                                "-e '.[quant]')") from None
    return bnb


def is_quantized(weight) -> bool:
    return getattr(weight, "apt_quant", None) is not None


def logical_shape(weight) -> tuple[int, int]:
    """(out_features, in_features) of a quantized weight (a 4-bit one is stored packed)."""
    return tuple(weight.apt_shape) if is_quantized(weight) else tuple(weight.shape)


def quantize(weight: torch.Tensor, quant: BaseQuant, source=None) -> nn.Parameter:
    """A frozen parameter holding `weight` (out x in) quantized, on the weight's device.

    `source()`: the original full-precision weight (read again from the checkpoint files, one
    tensor at a time), which a shrink that cuts blocks quantizes afresh."""
    param = _quantized(weight.detach().to(quant.compute_dtype).contiguous(), quant, quant.double_quant)
    param.apt_source, param.apt_rows, param.apt_cols = source, None, None  # original rows/columns kept (None: all)
    return param


def _quantized(dense: torch.Tensor, quant: BaseQuant, nested: bool) -> nn.Parameter:
    functional = bitsandbytes().functional
    if quant.method == "int8":
        codes, scales, _ = functional.int8_vectorwise_quant(dense)
        param = nn.Parameter(codes, requires_grad=False)
        param.apt_scales = scales
    else:
        codes, state = functional.quantize_4bit(dense, blocksize=BLOCKSIZE, quant_type=quant.method,
                                                compress_statistics=nested)
        param = nn.Parameter(codes, requires_grad=False)
        param.apt_state = state
    param.apt_quant, param.apt_shape = quant, tuple(dense.shape)
    return param


def dequantize(weight) -> torch.Tensor:
    """The dense weight a quantized one stands for, in its compute dtype."""
    quant = weight.apt_quant
    if quant.method == "int8":
        return (weight.data.float() * (weight.apt_scales.float()[:, None] / 127.0)).to(quant.compute_dtype)
    return bitsandbytes().functional.dequantize_4bit(weight.data, weight.apt_state).to(quant.compute_dtype)


def dense_weight(weight) -> torch.Tensor:
    return dequantize(weight) if is_quantized(weight) else weight


def frozen_linear(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear with a weight that may be quantized: bitsandbytes' own 4-bit matmul (its fused
    kernels on a GPU), LLM.int8's for int8; gradients flow to `x` only."""
    if not is_quantized(weight):
        return F.linear(x, weight, bias)
    bnb, quant = bitsandbytes(), weight.apt_quant
    x = x.to(quant.compute_dtype)
    bias = None if bias is None else bias.to(x.dtype)
    if quant.method == "int8":
        state = bnb.MatmulLtState()
        state.has_fp16_weights, state.CB, state.SCB, state.is_training = False, weight.data, weight.apt_scales, True
        return bnb.matmul(x, weight.data, bias=bias, state=state)
    return bnb.matmul_4bit(x, weight.data.t(), bias=bias, quant_state=weight.apt_state)


def storage_bytes(weight) -> int:
    """Bytes a weight holds in memory: codes, scales and (nested) absmax included."""
    if not is_quantized(weight):
        return weight.numel() * weight.element_size()
    if weight.apt_quant.method == "int8":
        return weight.data.numel() + weight.apt_scales.numel() * weight.apt_scales.element_size()
    state, total = weight.apt_state, weight.data.numel() * weight.data.element_size()
    total += state.absmax.numel() * state.absmax.element_size()
    if state.nested:
        total += state.state2.absmax.numel() * state.state2.absmax.element_size()
    return total


# ---- physical shrink ---------------------------------------------------------------------------
REQUANTIZED = "requantized"  # `keep_quantized`'s route when the kept units cut quantization blocks


def keep_quantized(weight, out_index: torch.Tensor | None, in_index: torch.Tensor | None) -> tuple[nn.Parameter, str]:
    """The rows `out_index` and columns `in_index` (None: all) of a quantized weight, and the route
    taken: "exact" (the kept codes as they were) or REQUANTIZED.

    Re-quantizing starts from the original weight (`source`) at the original rows and columns
    kept, never from codes already quantized, and without nesting the absmax: the result is then
    the same whatever sequence of shrinks led to those units, so a resumed run, which shrinks the
    original model once to the saved units, holds the very codes the uninterrupted run held."""
    quant, (rows, cols) = weight.apt_quant, weight.apt_shape
    device = weight.device
    if full_or_index(out_index, rows) is None and full_or_index(in_index, cols) is None:  # as the shrink leaves it
        return weight, "exact"
    out_index = torch.arange(rows) if out_index is None else out_index.cpu()
    in_index = torch.arange(cols) if in_index is None else in_index.cpu()
    kept_rows = out_index if weight.apt_rows is None else weight.apt_rows[out_index]
    kept_cols = in_index if weight.apt_cols is None else weight.apt_cols[in_index]
    if quant.method == "int8":
        param = nn.Parameter(weight.data[out_index.to(device)][:, in_index.to(device)].contiguous(), requires_grad=False)
        param.apt_scales = weight.apt_scales[out_index.to(device)].contiguous()
        param.apt_quant, param.apt_shape = quant, (len(out_index), len(in_index))
        route = "exact"
    elif (blocks := _whole_blocks(in_index, cols)) is not None:
        param, route = _keep_blocks(weight, out_index, blocks), "exact"
    else:
        if weight.apt_source is not None:
            dense = weight.apt_source().to(device, quant.compute_dtype)[kept_rows.to(device)][:, kept_cols.to(device)]
        else:  # no file to read again: the kept values as they are now
            dense = dequantize(weight)[out_index.to(device)][:, in_index.to(device)]
        param, route = _quantized(dense.contiguous(), quant, nested=False), REQUANTIZED
        del dense
    param.apt_source, param.apt_rows, param.apt_cols = weight.apt_source, kept_rows, kept_cols
    return param, route


def _whole_blocks(in_index: torch.Tensor, cols: int) -> torch.Tensor | None:
    """The 4-bit blocks of a row that `in_index` keeps when it keeps only whole ones (and rows
    are whole blocks), else None."""
    if cols % BLOCKSIZE or len(in_index) % BLOCKSIZE:
        return None
    starts = in_index.view(-1, BLOCKSIZE)
    if not bool((starts == starts[:, :1] + torch.arange(BLOCKSIZE)).all()) or bool((starts[:, 0] % BLOCKSIZE).any()):
        return None
    return starts[:, 0] // BLOCKSIZE


def _keep_blocks(weight, out_index: torch.Tensor, blocks: torch.Tensor) -> nn.Parameter:
    functional = bitsandbytes().functional
    state, (rows, cols) = weight.apt_state, weight.apt_shape
    per_row = cols // BLOCKSIZE
    device = weight.device
    # packed 4-bit codes: two per byte, a block of 64 values is 32 consecutive bytes
    codes = weight.data.reshape(rows, per_row, BLOCKSIZE // 2)
    codes = codes.index_select(0, out_index.to(device)).index_select(1, blocks.to(device))
    absmax = state.absmax
    if state.nested:  # the exact absmax values the codes were scaled by, un-nested
        absmax = functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    absmax = absmax.float().reshape(rows, per_row).index_select(0, out_index.to(device)).index_select(1, blocks.to(device))
    shape = torch.Size((len(out_index), len(blocks) * BLOCKSIZE))
    kept = functional.QuantState(absmax=absmax.reshape(-1).contiguous(), shape=shape, code=state.code,
                                 blocksize=BLOCKSIZE, quant_type=state.quant_type, dtype=state.dtype)
    param = nn.Parameter(codes.reshape(-1, 1).contiguous(), requires_grad=False)
    param.apt_state, param.apt_quant, param.apt_shape = kept, weight.apt_quant, tuple(shape)
    return param


class QuantizedLinear(nn.Linear):
    """A frozen nn.Linear whose weight is quantized (made in place by `quantize_linear`); the
    adapters wrap it as they wrap a plain Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_linear(x, self.weight, self.bias)


def quantize_linear(linear: nn.Linear, quant: BaseQuant, source=None) -> QuantizedLinear:
    """Quantize `linear`'s weight in place (the bias stays in the base dtype); `source`: as for
    `quantize`."""
    if type(linear) is not nn.Linear:
        raise TypeError(f"can only quantize a plain nn.Linear, got {type(linear).__name__}")
    linear.weight = quantize(linear.weight, quant, source)
    linear.__class__ = QuantizedLinear
    return linear  # type: ignore[return-value]


def dequantize_linears(model) -> None:
    """Turn every QuantizedLinear of `model` back into a plain nn.Linear holding its dequantized
    weight (the trained model as it computed, for `merge_and_compact`)."""
    for module in model.modules():
        if type(module) is QuantizedLinear:
            module.weight = nn.Parameter(dequantize(module.weight), requires_grad=False)
            module.__class__ = nn.Linear
