"""Physically removing pruned units from a LLaMA model (weights, adapters, norms, config).

Masking saves nothing; slicing does. Given kept indices at the current shapes, every tensor
that touches a removed unit is replaced by a smaller one, `in/out_features` and the config
are updated, and the edits of trainable parameters are returned so the optimizer state can
follow. Attention keeps working unchanged because whole KV groups are removed: the group
size (`num_key_value_groups`) and `head_dim` stay the same, and LLaMA reshapes with -1 heads.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
from torch import nn

from .adapters import APTAdapter
from .edits import ShapeChange
from .units import ModelShape

Gather = Callable[[Iterable[nn.Parameter]], contextlib.AbstractContextManager]


def _no_gather(params):
    return contextlib.nullcontext()


def _full_or_index(index: torch.Tensor | None, size: int) -> torch.Tensor | None:
    """None when the index keeps everything (nothing to slice)."""
    if index is None or (index.numel() == size and bool((index == torch.arange(size)).all())):
        return None
    return index


def slice_linear(module: nn.Linear, out_index, in_index, prefix: str) -> ShapeChange:
    """Keep rows `out_index` and columns `in_index` of a (possibly adapted) Linear."""
    out_index = _full_or_index(out_index, module.out_features)
    in_index = _full_or_index(in_index, module.in_features)
    if out_index is None and in_index is None:
        return {}
    weight = module.weight.detach()
    if out_index is not None:
        weight = weight.index_select(0, out_index)
    if in_index is not None:
        weight = weight.index_select(1, in_index)
    module.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if module.bias is not None and out_index is not None:
        module.bias = nn.Parameter(module.bias.detach().index_select(0, out_index).contiguous(), requires_grad=False)
    module.out_features, module.in_features = weight.shape
    change: ShapeChange = {}
    if isinstance(module, APTAdapter):
        for name, edits in module.keep_adapter_entries(out_index, in_index).items():
            change[f"{prefix}.{name}"] = edits
    return change


def _slice_vector(module: nn.Module, attr: str, index) -> None:
    if index is None:
        return
    old = getattr(module, attr)
    setattr(module, attr, nn.Parameter(old.detach().index_select(0, index).contiguous(), requires_grad=False))


def group_channels(group_index: torch.Tensor, group_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel indices of kept groups: (query-head channels, KV-head channels).

    Query head h belongs to group h // group_size (repeat_kv repeats each KV head
    `group_size` times consecutively)."""
    dims = torch.arange(head_dim)
    heads = (group_index[:, None] * group_size + torch.arange(group_size)[None, :]).flatten()
    q_channels = (heads[:, None] * head_dim + dims[None, :]).flatten()
    kv_channels = (group_index[:, None] * head_dim + dims[None, :]).flatten()
    return q_channels, kv_channels


def shrink_model(model, shape: ModelShape, group_index, neuron_index, hidden_index, gather: Gather = _no_gather) -> tuple[ModelShape, ShapeChange]:
    """Remove every unit not in the kept indices; returns the new shape and trainable edits."""
    hid = _full_or_index(hidden_index, shape.hidden)
    change: ShapeChange = {}
    inner = model.model
    for l, (layer, layer_shape) in enumerate(zip(inner.layers, shape.layers)):
        attn, mlp = layer.self_attn, layer.mlp
        q_ch, kv_ch = group_channels(group_index[l], layer_shape.group_size, layer_shape.head_dim)
        neurons = neuron_index[l]
        prefix = f"model.layers.{l}"
        with gather(list(layer.parameters())):
            for name, out_i, in_i in (("q_proj", q_ch, hid), ("k_proj", kv_ch, hid), ("v_proj", kv_ch, hid), ("o_proj", hid, q_ch)):
                change.update(slice_linear(getattr(attn, name), out_i, in_i, f"{prefix}.self_attn.{name}"))
            for name, out_i, in_i in (("gate_proj", neurons, hid), ("up_proj", neurons, hid), ("down_proj", hid, neurons)):
                change.update(slice_linear(getattr(mlp, name), out_i, in_i, f"{prefix}.mlp.{name}"))
            _slice_vector(layer.input_layernorm, "weight", hid)
            _slice_vector(layer.post_attention_layernorm, "weight", hid)
    if hid is not None:
        tied = model.lm_head.weight is inner.embed_tokens.weight or shape.tied_embeddings
        with gather([inner.embed_tokens.weight, inner.norm.weight, model.lm_head.weight]):
            embed = inner.embed_tokens.weight.detach().index_select(1, hid).contiguous()
            inner.embed_tokens.weight = nn.Parameter(embed, requires_grad=False)
            inner.embed_tokens.embedding_dim = embed.shape[1]
            _slice_vector(inner.norm, "weight", hid)
            if tied:
                model.lm_head.weight = inner.embed_tokens.weight
            else:
                head = model.lm_head.weight.detach().index_select(1, hid).contiguous()
                model.lm_head.weight = nn.Parameter(head, requires_grad=False)
            model.lm_head.in_features = embed.shape[1]
    new_shape = _kept_shape(shape, group_index, neuron_index, hidden_index)
    write_shape_to_config(model.config, new_shape)
    return new_shape, change


def _kept_shape(shape: ModelShape, group_index, neuron_index, hidden_index) -> ModelShape:
    layers = tuple(
        type(l)(num_kv_groups=len(g), group_size=l.group_size, head_dim=l.head_dim, ffn=len(n))
        for l, g, n in zip(shape.layers, group_index, neuron_index)
    )
    return ModelShape(len(hidden_index), layers, shape.vocab, shape.tied_embeddings)


def write_shape_to_config(config, shape: ModelShape) -> None:
    """Record the shapes in the HF config: global fields when uniform, per layer otherwise.

    `head_dim` is written explicitly: it no longer equals hidden_size / heads."""
    first = shape.layers[0]
    config.hidden_size = shape.hidden
    config.head_dim = first.head_dim
    config.num_attention_heads = first.num_q_heads
    config.num_key_value_heads = first.num_kv_groups
    config.intermediate_size = first.ffn
    if shape.uniform:
        if hasattr(config, "apt_layer_shapes"):
            del config.apt_layer_shapes
    else:
        config.apt_layer_shapes = [dict(layer.__dict__) for layer in shape.layers]
