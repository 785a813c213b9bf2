"""Physically removing pruned units from a model (weights, adapters, norms, config).

Masking saves nothing; slicing does. Given kept indices at the current shapes, every tensor
that touches a removed unit is replaced by a smaller one, `in/out_features` and the config
are updated, and the edits of trainable parameters are returned so the optimizer state can
follow. Attention keeps working unchanged because whole KV groups are removed: the group
size (`num_key_value_groups`) and `head_dim` stay the same, and LLaMA reshapes with -1 heads.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from apt_ds.algorithm.adapters import APTAdapter
from apt_ds.algorithm.edits import Keep, ShapeChange, full_or_index
from apt_ds.algorithm.quant import is_quantized, logical_shape
from apt_ds.algorithm.quant_shrink import keep_quantized
from apt_ds.algorithm.units import BIAS_HEADS, ModelShape
from apt_ds.models import Family, family_for, family_of


@dataclass(frozen=True)
class ParamAccess:
    """How shape-changing code reads and re-homes parameters that may be ZeRO-3 partitions.

    `read(params)`: a context in which the full tensors of `params` can be read on every rank
    (a collective; nothing is written back on exit, so parameters about to be replaced are
    never broadcast). `adopt(module)`: partition the plain parameters just put into `module`
    at once, so a shrink holds about one module in full, never the model. `release(param)`: free
    the storage of a parameter just replaced (a ZeRO-3 partition: DeepSpeed's parameters sit in
    reference cycles, so without it every replaced partition lived until the next garbage
    collection, and an event held old and new partitions side by side)."""

    read: Callable[[Iterable[nn.Parameter]], contextlib.AbstractContextManager]
    adopt: Callable[[nn.Module], None]
    release: Callable[[nn.Parameter], None] = lambda param: None
    reads_copies: bool = False  # what `read` shows are throwaway copies (ZeRO-3 gathers): may be overwritten


LOCAL_ACCESS = ParamAccess(read=lambda params: contextlib.nullcontext(), adopt=lambda module: None)


def replace_module_params(access: ParamAccess, module: nn.Module, edit: Callable[[], object],
                          read: Iterable[nn.Parameter] | None = None):
    """Run `edit` (which replaces parameters of `module`) with `read` (default: the module's own
    parameters) readable, partition the new ones and release the replaced ones; returns what
    `edit` returns."""
    before = dict(module.named_parameters(recurse=False))
    with access.read(list(before.values()) if read is None else list(read)):
        result = edit()
    access.adopt(module)
    now = dict(module.named_parameters(recurse=False))
    for name, old in before.items():
        if now.get(name) is not old:
            access.release(old)
    return result


def slice_linear(module: nn.Linear, out_index, in_index, prefix: str) -> ShapeChange:
    """Keep rows `out_index` and columns `in_index` of a (possibly adapted) Linear."""
    out_index = full_or_index(out_index, module.out_features)
    in_index = full_or_index(in_index, module.in_features)
    if out_index is None and in_index is None:
        return {}
    if module.bias is not None and out_index is not None:
        bias = module.bias.detach()
        module.bias = nn.Parameter(bias.index_select(0, out_index.to(bias.device)).contiguous(), requires_grad=False)
    if module.weight is None:  # an IdentityAdapter: the identity cut to the same units is the identity
        module.out_features = module.out_features if out_index is None else len(out_index)
        module.in_features = module.in_features if in_index is None else len(in_index)
    else:
        if is_quantized(module.weight):  # whole quantization blocks kept as they are where the units allow it
            module.weight, _ = keep_quantized(module.weight, out_index, in_index)
        else:
            weight = module.weight.detach()
            if out_index is not None:
                weight = weight.index_select(0, out_index.to(weight.device))
            if in_index is not None:
                weight = weight.index_select(1, in_index.to(weight.device))
            module.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        module.out_features, module.in_features = logical_shape(module.weight)
    change: ShapeChange = {}
    if isinstance(module, APTAdapter):
        for name, edits in module.keep_adapter_entries(out_index, in_index).items():
            change[f"{prefix}.{name}"] = edits
    return change


def _slice_param(module: nn.Module, attr: str, index, dim: int = 0, in_place: bool = False,
                 trainable: bool = False) -> None:
    """Keep `index` along `dim` of a parameter (a norm weight, an embedding matrix; frozen
    unless `trainable`: a task head trained in full).
    `in_place` (the parameter is a throwaway copy, `ParamAccess.reads_copies`): a matrix's columns
    are kept in its own storage, so that the event does not hold a second full matrix:
    LLaMA-3.2-3B's tied embedding is 1.5 GB in fp32 (docs/BENCHMARKS.md)."""
    if index is None:
        return
    param = getattr(module, attr)
    index = index.to(param.device)
    if in_place and dim == 1 and param.dim() == 2 and param.is_contiguous():
        kept = compact_columns(param.data, index)  # .data: the parameter's version stays (DeepSpeed checks it)
    else:
        kept = param.detach().index_select(dim, index).contiguous()
    setattr(module, attr, nn.Parameter(kept, requires_grad=trainable))


def compact_columns(matrix: torch.Tensor, index: torch.Tensor, rows_per_block: int = 4096) -> torch.Tensor:
    """`matrix[:, index]` written over `matrix`'s own storage and returned as a view of it; the
    only other memory is one block of rows. `matrix` (contiguous, row-major) is overwritten:
    block by block, a copy of the block's kept columns is written at the kept row length, which
    never reaches a row not yet read (the rows after the block start at or after its end)."""
    rows, kept = matrix.shape[0], len(index)
    flat = matrix.view(-1)
    for start in range(0, rows, rows_per_block):
        stop = min(rows, start + rows_per_block)
        flat[start * kept: stop * kept].copy_(matrix[start:stop].index_select(1, index).view(-1))
    return flat[: rows * kept].view(rows, kept)


def group_channels(group_index: torch.Tensor, group_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel indices of kept groups: (query-head channels, KV-head channels).

    Query head h belongs to group h // group_size (repeat_kv repeats each KV head
    `group_size` times consecutively)."""
    dims = torch.arange(head_dim)
    heads = (group_index[:, None] * group_size + torch.arange(group_size)[None, :]).flatten()
    q_channels = (heads[:, None] * head_dim + dims[None, :]).flatten()
    kv_channels = (group_index[:, None] * head_dim + dims[None, :]).flatten()
    return q_channels, kv_channels


def shrink_model(model, shape: ModelShape, group_index, neuron_index, hidden_index,
                 access: ParamAccess = LOCAL_ACCESS) -> tuple[ModelShape, ShapeChange]:
    """Remove every unit not in the kept indices; returns the new shape and trainable edits.
    One module at a time: read it, slice it, partition its new parameters (`access`)."""
    hid = full_or_index(hidden_index, shape.hidden)
    change: ShapeChange = {}
    family = family_of(model)
    for l, (unit, layer_shape) in enumerate(zip(family.unit_layers(model), shape.layers)):
        kind, layer = unit.kind, unit.module
        q_ch, kv_ch = group_channels(group_index[l], layer_shape.group_size, layer_shape.head_dim)
        kept = {"q": q_ch, "kv": kv_ch, "ffn": neuron_index[l], "hidden": hid}
        for tensor in kind.linears:  # a bias is sliced with its Linear's rows
            linear, name = kind.layer_module(layer, tensor.role), f"{unit.prefix}.{tensor.module}"
            out_i, in_i = (kept[axis] for axis in tensor.dims)
            change.update(replace_module_params(access, linear, lambda: slice_linear(linear, out_i, in_i, name)))
        for norm in kind.hidden_norms(layer):
            replace_module_params(access, norm, lambda: _slice_norm(norm, hid))
        # the attention's own head count (T5 makes a zero bias of n_heads; BERT keeps all_head_size)
        kind.set_head_geometry(layer, layer_shape.head_dim, layer_shape.group_size, len(group_index[l]) * layer_shape.group_size)
    if hid is not None:
        change.update(_shrink_outer(family, model, hid, access, shape.tied_embeddings))
    new_shape = _kept_shape(shape, group_index, neuron_index, hidden_index)
    write_shape_to_config(model.config, new_shape)
    return new_shape, change


def _slice_norm(norm: nn.Module, hid) -> None:
    """Keep the hidden channels `hid` of an RMSNorm's weight, or a LayerNorm's weight and bias."""
    if hid is None:
        return
    for leaf in ("weight", "bias"):
        if getattr(norm, leaf, None) is not None:
            _slice_param(norm, leaf, hid)
    if isinstance(norm, nn.LayerNorm):
        norm.normalized_shape = (len(hid),)


def _shrink_outer(family: Family, model, hid: torch.Tensor, access: ParamAccess, tied: bool) -> ShapeChange:
    """Keep the hidden channels `hid` in every tensor outside the layers (the family's
    `outer_tensors`): embedding tables' columns, outer norms, an LM head's columns (tied: the
    embedding's again), a task head's inputs (and a pooler's outputs). A module trained in full
    (an encoder's classifier) stays trainable, and its edits are returned for the optimizer."""
    change: ShapeChange = {}
    output = family.output_module(model) if family.output_embedding is not None else None
    tied = tied or (output is not None and output.weight is family.embedding_module(model).weight)
    by_module: dict[str, list] = {}
    for tensor in family.outer_tensors:
        if "hidden" in tensor.dims and not (tied and tensor.name == family.output_embedding):
            by_module.setdefault(tensor.module, []).append(tensor)
    for path, tensors in by_module.items():
        module = model.get_submodule(path)
        if all(t.part == "block" and t.dims == ("hidden",) for t in tensors):  # a norm outside the layers
            replace_module_params(access, module, lambda: _slice_norm(module, hid))
            continue
        trainable = any(p.requires_grad for p in module.parameters(recurse=False))

        def edit(module=module, tensors=tensors, trainable=trainable):
            for tensor in tensors:
                for dim, axis in enumerate(tensor.dims):
                    if axis == "hidden":  # columns of a matrix kept in place when what is read is a copy
                        _slice_param(module, tensor.leaf, hid, dim, access.reads_copies and dim == 1, trainable)
                if trainable:
                    change[tensor.name] = [Keep(dim, hid) for dim, axis in enumerate(tensor.dims) if axis == "hidden"]

        replace_module_params(access, module, edit)
        if isinstance(module, nn.Embedding):
            module.embedding_dim = len(hid)
        elif isinstance(module, nn.Linear):  # from the description: a ZeRO-3 weight's own shape is its partition's
            dims = next(t.dims for t in tensors if t.leaf == "weight")
            module.out_features = len(hid) if dims[0] == "hidden" else module.out_features
            module.in_features = len(hid) if dims[1] == "hidden" else module.in_features
    if tied:
        output.weight = family.embedding_module(model).weight
        output.in_features = len(hid)
    for alias in family.embedding_aliases:  # views of the embedding (T5's stacks' embed_tokens)
        module = model.get_submodule(alias)
        module.weight, module.embedding_dim = family.embedding_module(model).weight, len(hid)
    return change


def _kept_shape(shape: ModelShape, group_index, neuron_index, hidden_index) -> ModelShape:
    layers = [l.kept(len(g), len(n)) for l, g, n in zip(shape.layers, group_index, neuron_index)]
    return shape.kept(len(hidden_index), layers)


def write_shape_to_config(config, shape: ModelShape) -> None:
    """Record the shapes in the HF config: global fields when uniform, per layer otherwise.

    `head_dim` is written explicitly: it no longer equals hidden_size / heads."""
    family = family_for(shape.family)
    first = shape.layers[0]
    config.hidden_size = shape.hidden  # T5's config maps these names to d_model, num_heads and d_kv
    config.head_dim = first.head_dim
    config.num_attention_heads = first.num_q_heads
    if family.kind != "seq2seq":  # T5's heads are never grouped: its config has no KV head count
        config.num_key_value_heads = first.num_kv_groups
    elif any(layer.num_q_heads != shape.heads for layer in shape.layers):  # its bias tables keep every head
        setattr(config, BIAS_HEADS, shape.heads)
    setattr(config, family.ffn_config, shape.config_ffn)
    if shape.uniform:
        if hasattr(config, "apt_layer_shapes"):
            del config.apt_layer_shapes
    else:
        config.apt_layer_shapes = [layer.to_dict() for layer in shape.layers]
