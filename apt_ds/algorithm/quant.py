"""A frozen base weight stored quantized with bitsandbytes: QLoRA's 4-bit NF4/FP4 (blocks of 64
values, each with its absmax, optionally itself quantized: "double quantization") or LLM.int8's
row-wise int8. Adapters, masks and salience see activations and adapter weights, never the
storage: the forward pass (`frozen_linear`) and the kurtosis of a weight's columns
(`dense_weight`) are the only readers, and a physical shrink (`quant_shrink.keep_quantized`) the
only writer.

In a run that prunes, a 4-bit matrix is stored in the orientation whose rows are the axis a
shrink cuts one unit at a time (`stored_transposed`): whole rows of blocks are then kept exactly.
q/k/v and down_proj are stored transposed (hidden channels, FFN neurons as rows), o_proj and
gate/up as they are (hidden channels, FFN neurons as rows); heads of 64 or 128 channels are whole
blocks along the columns. A run that does not prune (plain QLoRA) stores every matrix as the
checkpoint holds it, as transformers does, and computes with bitsandbytes' own kernels.

A physical shrink keeps the codes where the storage allows it (`apt_ds.algorithm.quant_shrink`).
bitsandbytes is imported only when a quantized weight is made or used.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from apt_ds.config import BASE_QUANTS as QUANT_METHODS
from apt_ds.config import ConfigError

BLOCKSIZE = 64  # QLoRA's and transformers' default 4-bit block


class QuantizationError(ConfigError):
    """bitsandbytes is missing, or a quantized base cannot be built as asked."""


@dataclass(frozen=True)
class BaseQuant:
    """How the frozen projections are stored: `method` one of QUANT_METHODS; `double_quant`
    quantizes the 4-bit absmax too (transformers' bnb_4bit_use_double_quant); `compute_dtype`
    is what the dequantized weight multiplies in (bnb_4bit_compute_dtype: the base dtype);
    `pruned_axis_rows` stores each 4-bit matrix with the axis a shrink cuts unit by unit as its
    rows (`stored_transposed`) and keeps the codes at every shrink; False: as the checkpoint holds
    it (runs that do not prune; runs before 2026-12-07, whose shrinks re-quantized cut blocks)."""

    method: str = "none"
    double_quant: bool = True
    compute_dtype: torch.dtype = torch.float32
    pruned_axis_rows: bool = True
    # bitsandbytes' quant_storage: the dtype the packed 4-bit codes are held in. ZeRO-3 partitions
    # them as it partitions every parameter, in the engine's dtype (as transformers and PEFT do for
    # QLoRA under ZeRO-3); the bits are the same codes either way.
    storage: torch.dtype = torch.uint8

    def __post_init__(self):
        if self.method not in QUANT_METHODS:
            raise QuantizationError(f"--base-quant must be one of {', '.join(QUANT_METHODS)}, got {self.method!r}")
        if self.storage != torch.uint8 and (self.method == "int8" or not self.storage.is_floating_point):
            raise QuantizationError(f"--base-quant {self.method} cannot hold its codes in {self.storage} "
                                    f"(4-bit codes: uint8 or a float dtype; int8: int8 only)")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def transposes(self, dims: tuple[str, str] | None) -> bool:
        """Whether a projection with these (out, in) unit axes is stored as W^T (4-bit, pruned axis as rows)."""
        return self.method != "int8" and self.pruned_axis_rows and stored_transposed(dims)

    def stored_width(self, dims: tuple[str, str] | None, out_features: int, in_features: int) -> int:
        """The length of a stored row of an (out x in) projection: the axis its 4-bit blocks run along."""
        return out_features if self.transposes(dims) else in_features


@functools.cache  # frozen_linear asks on every forward pass: set up once
def bitsandbytes():
    """The bitsandbytes module, or a one-line error saying how to install it."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise QuantizationError("--base-quant needs bitsandbytes: pip install 'bitsandbytes>=0.50,<1' (or pip install "
                                "-e '.[quant]')") from None
    return bnb


# The unit axes (apt_ds.models.family.AXES) by how much a shrink wants them as whole stored rows:
# FFN neurons and hidden channels are cut one at a time, so a cut along the columns would break
# blocks; a KV group's q/kv channels are 64 or 128 at a time, whole blocks along the columns too.
ROW_AXIS_PREFERENCE = ("ffn", "hidden", "q", "kv", "head")


def stored_transposed(dims: tuple[str, str] | None) -> bool:
    """Whether a projection whose (out, in) unit axes are `dims` is stored as W^T: when its input
    axis is the one a shrink cuts finer (q/k/v: hidden channels; down_proj: FFN neurons)."""
    if dims is None:
        return False
    out_axis, in_axis = dims
    return ROW_AXIS_PREFERENCE.index(in_axis) < ROW_AXIS_PREFERENCE.index(out_axis)


def is_quantized(weight) -> bool:
    return getattr(weight, "apt_quant", None) is not None


def logical_shape(weight) -> tuple[int, int]:
    """(out_features, in_features) of a quantized weight (a 4-bit one is stored packed, maybe as W^T)."""
    if not is_quantized(weight):
        return tuple(weight.shape)
    rows, cols = weight.apt_shape
    if weight.apt_positions is not None:  # stored columns kept inside blocks that hold cut ones too
        cols = len(weight.apt_positions)
    return (cols, rows) if weight.apt_transposed else (rows, cols)


def quantize(weight: torch.Tensor, quant: BaseQuant, source=None, dims: tuple[str, str] | None = None) -> nn.Parameter:
    """A frozen parameter holding `weight` (out x in) quantized, on the weight's device.

    `source()`: the original full-precision weight (read again from the checkpoint files, one
    tensor at a time), which a shrink that cuts blocks quantizes afresh. `dims`: the projection's
    (out, in) unit axes, which choose the stored orientation of a 4-bit weight (None: as given)."""
    param = quantize_stored(weight.detach().to(quant.compute_dtype), quant, quant.double_quant, quant.transposes(dims))
    param.apt_source, param.apt_rows, param.apt_cols = source, None, None  # original out/in units kept (None: all)
    # Whether a shrink keeps the codes: decided once, by the original stored width, so that the route
    # (and so the codes) never depends on the sequence of shrinks that led to the kept units.
    param.apt_keeps_codes = quant.pruned_axis_rows and param.apt_shape[1] % BLOCKSIZE == 0
    return param


def quantize_stored(dense: torch.Tensor, quant: BaseQuant, nested: bool, transposed: bool) -> nn.Parameter:
    """`dense` (out x in) quantized, stored as dense^T when `transposed`."""
    functional = bitsandbytes().functional
    stored = (dense.t() if transposed else dense).contiguous()
    if quant.method == "int8":
        codes, scales, _ = functional.int8_vectorwise_quant(stored)
        return codes_param(codes, quant, stored.shape, transposed, scales=scales)
    codes, state = functional.quantize_4bit(stored, blocksize=BLOCKSIZE, quant_type=quant.method,
                                            compress_statistics=nested, quant_storage=quant.storage)
    return codes_param(codes, quant, stored.shape, transposed, state=state)


def codes_param(codes: torch.Tensor, quant: BaseQuant, stored_shape, transposed: bool, *, state=None, scales=None,
                positions: torch.Tensor | None = None) -> nn.Parameter:
    """The frozen parameter holding `codes`: a stored_shape (rows x cols) matrix, W^T where
    `transposed`, with its 4-bit `state` or int8 row `scales`, and `positions`: the stored column
    of each column the weight stands for (None: all, in order)."""
    param = nn.Parameter(codes, requires_grad=False)
    if state is not None:
        param.apt_state = state
    if scales is not None:
        param.apt_scales = scales
    param.apt_quant, param.apt_shape, param.apt_transposed = quant, tuple(stored_shape), transposed
    param.apt_positions = positions
    return param


def _dequantized_storage(weight) -> torch.Tensor:
    """The stored matrix (rows x cols as `apt_shape`) in the compute dtype."""
    quant = weight.apt_quant
    if quant.method == "int8":
        return (weight.data.float() * (weight.apt_scales.float()[:, None] / 127.0)).to(quant.compute_dtype)
    return bitsandbytes().functional.dequantize_4bit(weight.data, weight.apt_state).to(quant.compute_dtype)


def _dense(weight) -> torch.Tensor:
    """The weight (out x in) a quantized one stands for: the stored matrix's kept columns, transposed
    back where it is stored as W^T (a view: not necessarily contiguous)."""
    stored = _dequantized_storage(weight)
    if weight.apt_positions is not None:
        stored = stored.index_select(1, weight.apt_positions.to(stored.device))
    return stored.t() if weight.apt_transposed else stored


def dequantize(weight) -> torch.Tensor:
    """The dense weight (out x in) a quantized one stands for, in its compute dtype."""
    return _dense(weight).contiguous()


def follow_codes(model) -> None:
    """Move each quantized weight's state (absmax, scales, kept positions: plain attributes, which
    `module.to(device)` does not see) onto its codes' device, after the model was placed."""
    for weight in model.parameters():
        if not is_quantized(weight):
            continue
        if weight.apt_quant.method == "int8":
            weight.apt_scales = weight.apt_scales.to(weight.device)
        else:
            weight.apt_state.to(weight.device)  # QuantState.to moves absmax and the nested state in place
        if weight.apt_positions is not None:
            weight.apt_positions = weight.apt_positions.to(weight.device)


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
    # ZeRO-3 gathers a partitioned weight for its module's forward and again for its backward, and
    # frees it in between: only a function that reads the weight again in backward is safe there
    if weight.apt_transposed or weight.apt_positions is not None or hasattr(weight, "ds_id"):
        return _DequantizedMatmul.apply(x, weight, bias)
    if quant.method == "int8":
        state = bnb.MatmulLtState()
        state.has_fp16_weights, state.CB, state.SCB, state.is_training = False, weight.data, weight.apt_scales, True
        return bnb.matmul(x, weight.data, bias=bias, state=state)
    return bnb.matmul_4bit(x, weight.data.t(), bias=bias, quant_state=weight.apt_state)


class _DequantizedMatmul(torch.autograd.Function):
    """x @ W^T + b for a 4-bit weight stored as W^T or with kept columns inside partly cut blocks.
    bitsandbytes' matmul_4bit takes a whole [out, in] matrix only (its kernels, and its shape
    guess, which cannot tell a square W^T), so this dequantizes as its MatMul4Bit does on the
    training path: once in forward, once again in backward, holding only the codes in between.
    Gradients flow to x only."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.weight = weight
        return F.linear(x, _dense(weight).to(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output @ _dense(ctx.weight).to(grad_output.dtype), None, None


def storage_bytes(weight) -> int:
    """Bytes a weight holds in this process's memory: codes (their ZeRO-3 partition where they are
    partitioned), scales and (nested) absmax included."""
    codes = getattr(weight, "ds_tensor", None)  # this rank's ZeRO-3 partition
    codes = weight.data if codes is None else codes
    if not is_quantized(weight):
        return codes.numel() * codes.element_size()
    total = codes.numel() * codes.element_size()
    if weight.apt_positions is not None:
        total += weight.apt_positions.numel() * weight.apt_positions.element_size()
    if weight.apt_quant.method == "int8":
        return total + weight.apt_scales.numel() * weight.apt_scales.element_size()
    state = weight.apt_state
    total += state.absmax.numel() * state.absmax.element_size()
    if state.nested:
        total += state.state2.absmax.numel() * state.state2.absmax.element_size()
    return total


class QuantizedLinear(nn.Linear):
    """A frozen nn.Linear whose weight is quantized (made in place by `quantize_linear`); the
    adapters wrap it as they wrap a plain Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_linear(x, self.weight, self.bias)


def quantize_linear(linear: nn.Linear, quant: BaseQuant, source=None, dims: tuple[str, str] | None = None) -> QuantizedLinear:
    """Quantize `linear`'s weight in place (the bias stays in the base dtype); `source`, `dims`:
    as for `quantize`."""
    if type(linear) is not nn.Linear:
        raise TypeError(f"can only quantize a plain nn.Linear, got {type(linear).__name__}")
    linear.weight = quantize(linear.weight, quant, source, dims)
    linear.__class__ = QuantizedLinear
    return linear  # type: ignore[return-value]


def dequantize_linears(model) -> None:
    """Turn every QuantizedLinear of `model` back into a plain nn.Linear holding its dequantized
    weight (the trained model as it computed, for `merge_and_compact`)."""
    for module in model.modules():
        if type(module) is QuantizedLinear:
            module.weight = nn.Parameter(dequantize(module.weight), requires_grad=False)
            module.__class__ = nn.Linear
