"""The physical shrink of a quantized base weight (apt_ds.algorithm.quant): `keep_quantized`
keeps the codes where the storage allows it and re-quantizes otherwise.

- int8 keeps every slice exactly (one scale per output row: dropping a row drops its scale, a
  dropped column leaves the other codes as they were);
- 4-bit, original stored width a multiple of the block size: kept stored rows keep their codes,
  blocks of columns cut whole are dropped, and blocks cut in part (hidden channels along gate/up's
  input and down's output) stay whole, the kept columns named by their positions, until their last
  column goes; absmax is kept un-nested in fp32, since double quantization's nested blocks would
  be cut;
- 4-bit, any other stored width: the kept rows and columns of the original weight, read from the
  model's files, are quantized again (`REQUANTIZED`, measured in docs/QUANTIZED_BASE.md).
"""

from __future__ import annotations

import torch
from torch import nn

from apt_ds.algorithm.edits import full_or_index
from apt_ds.algorithm.quant import BLOCKSIZE, bitsandbytes, codes_param, dequantize, logical_shape, quantize_stored

REQUANTIZED = "requantized"  # `keep_quantized`'s route when the kept units cut blocks it cannot keep


def keep_quantized(weight, out_index: torch.Tensor | None, in_index: torch.Tensor | None) -> tuple[nn.Parameter, str]:
    """The rows `out_index` and columns `in_index` (None: all) of the weight a quantized one stands
    for (out x in, whatever its stored orientation), and the route taken: "exact" (the kept codes
    as they were) or REQUANTIZED.

    4-bit, stored rows a whole number of blocks: the kept stored rows, and every block that still
    holds a kept stored column, keep their codes; a block whose columns are all cut is dropped, and
    `apt_positions` names the kept columns inside blocks that were cut only in part (hidden
    channels along gate/up's input and down's output: their blocks stay until the last of their
    channels goes, computing exactly what the masked model did). Runs of the layout before
    2026-12-07 (`pruned_axis_rows` False) kept whole blocks only and re-quantized any other cut.

    Re-quantizing starts from the original weight (`source`) at the original rows and columns
    kept, never from codes already quantized, and without nesting the absmax: the result is then
    the same whatever sequence of shrinks led to those units, so a resumed run, which shrinks the
    original model once to the saved units, holds the very codes the uninterrupted run held."""
    quant, (out_count, in_count) = weight.apt_quant, logical_shape(weight)
    device = weight.device
    if full_or_index(out_index, out_count) is None and full_or_index(in_index, in_count) is None:  # as the shrink leaves it
        return weight, "exact"
    out_index = torch.arange(out_count) if out_index is None else out_index.cpu()
    in_index = torch.arange(in_count) if in_index is None else in_index.cpu()
    kept_out = out_index if weight.apt_rows is None else weight.apt_rows[out_index]
    kept_in = in_index if weight.apt_cols is None else weight.apt_cols[in_index]
    row_index, col_index = (in_index, out_index) if weight.apt_transposed else (out_index, in_index)
    if quant.method == "int8":
        codes = weight.data[row_index.to(device)][:, col_index.to(device)].contiguous()
        scales = weight.apt_scales[row_index.to(device)].contiguous()
        param, route = codes_param(codes, quant, codes.shape, weight.apt_transposed, scales=scales), "exact"
    elif weight.apt_keeps_codes or (not quant.pruned_axis_rows and weight.apt_shape[1] % BLOCKSIZE == 0
                                    and _whole_blocks(col_index)):  # the earlier layout: whole blocks only
        param, route = _keep_blocks(weight, row_index, col_index), "exact"
    else:
        if weight.apt_source is not None:
            dense = weight.apt_source().to(device, quant.compute_dtype)[kept_out.to(device)][:, kept_in.to(device)]
        else:  # no file to read again: the kept values as they are now
            dense = dequantize(weight)[out_index.to(device)][:, in_index.to(device)]
        param, route = quantize_stored(dense, quant, nested=False, transposed=weight.apt_transposed), REQUANTIZED
        del dense
    param.apt_source, param.apt_rows, param.apt_cols = weight.apt_source, kept_out, kept_in
    param.apt_keeps_codes = weight.apt_keeps_codes
    return param, route


def _whole_blocks(col_index: torch.Tensor) -> bool:
    """Whether `col_index` keeps only whole 4-bit blocks of a stored row (the layout before
    2026-12-07 kept no partial ones)."""
    if len(col_index) % BLOCKSIZE:
        return False
    starts = col_index.view(-1, BLOCKSIZE)
    return bool((starts == starts[:, :1] + torch.arange(BLOCKSIZE)).all()) and not bool((starts[:, 0] % BLOCKSIZE).any())


def _keep_blocks(weight, row_index: torch.Tensor, col_index: torch.Tensor) -> nn.Parameter:
    """The stored rows `row_index` and columns `col_index` (of those the weight stands for) with
    their codes as they were: the blocks holding a kept column, their absmax un-nested (double
    quantization's nested blocks of 256 absmax would be cut), and the kept columns' positions in
    them where those are not all of them."""
    functional = bitsandbytes().functional
    state, (rows, cols) = weight.apt_state, weight.apt_shape
    per_row = cols // BLOCKSIZE
    device = weight.device
    positions = torch.arange(cols) if weight.apt_positions is None else weight.apt_positions.cpu()
    kept = positions[col_index]  # the stored columns kept
    blocks = torch.unique(kept // BLOCKSIZE)  # sorted
    new_positions = torch.searchsorted(blocks, kept // BLOCKSIZE) * BLOCKSIZE + kept % BLOCKSIZE
    # packed 4-bit codes: two per byte, a block of 64 values is 32 consecutive bytes (in whatever
    # dtype they are held: quant_storage)
    codes = weight.data.view(torch.uint8).reshape(rows, per_row, BLOCKSIZE // 2)
    codes = codes.index_select(0, row_index.to(device)).index_select(1, blocks.to(device))
    absmax = state.absmax
    if state.nested:  # the exact absmax values the codes were scaled by, un-nested
        absmax = functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    absmax = absmax.float().reshape(rows, per_row).index_select(0, row_index.to(device)).index_select(1, blocks.to(device))
    shape = torch.Size((len(row_index), len(blocks) * BLOCKSIZE))
    state = functional.QuantState(absmax=absmax.reshape(-1).contiguous(), shape=shape, code=state.code,
                                  blocksize=BLOCKSIZE, quant_type=state.quant_type, dtype=state.dtype)
    whole = torch.equal(new_positions, torch.arange(shape[1]))
    return codes_param(codes.reshape(-1).contiguous().view(weight.dtype).reshape(-1, 1), weight.apt_quant, shape,
                       weight.apt_transposed, state=state, positions=None if whole else new_positions.to(device))
