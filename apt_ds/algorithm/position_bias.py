"""T5's relative position bias with heads pruned per layer.

transformers' T5 computes a stack's bias once, in its first self-attention (the only one holding
a `relative_attention_bias` table), as (1, heads, q, k), and hands that tensor to every later
layer of the stack; its cross-attentions add zeros, made by the first with its own head count.
Once a layer keeps other heads than the first, or fewer, that sharing is wrong. `HeadBias` gives
every attention its own: a self-attention the columns of the stack's table (kept whole) of the
original heads it still has, a cross-attention zeros of its own head count. A forward pre-hook
on each attention module passes them as its `position_bias`, so the modules' own code runs as is.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from apt_ds.models import family_for, family_of
from apt_ds.models.tensors import module_of

# A pruned T5 config's record of the original heads each unit layer keeps (what HeadBias reads)
BIAS_HEAD_INDEX = "apt_bias_head_index"
ZERO_BIAS = "zeros"  # a LayerKind's position_bias: its attention adds a zero bias (T5's cross-attention)


def uses_head_bias(model) -> bool:
    """The model's attentions read a shared position bias (T5): HeadBias must route it."""
    return any(kind.position_bias for kind in family_of(model).kinds)


def shared_table_layers(shape) -> list[list[int]]:
    """The unit layers (indices into a ModelShape's layers) reading each shared bias table: T5's
    self-attentions of a stack. A uniform run keeps the same heads in all of them, so that stock
    T5's sharing of the first layer's bias holds in its export (export/shared_bias.py)."""
    kinds, readers = family_for(shape.family).kinds, {}
    for index, layer in enumerate(shape.layers):
        source = kinds[layer.kind].position_bias
        if source and source != ZERO_BIAS:
            readers.setdefault(source, []).append(index)
    return list(readers.values())


class HeadBias:
    """The hooks that give each attention of `model` its heads' bias. `kept_heads()` returns each
    unit layer's original head indices (its KV groups: T5's groups are single heads), read at
    every forward, so a shrink needs no re-install."""

    def __init__(self, model, kept_heads: Callable[[], Sequence[torch.Tensor]]):
        self.kept_heads = kept_heads
        self._handles: list = []
        self._readers: dict[int, tuple] = {}  # a table's owner (by id) -> (the table, the layers reading its columns)
        self._routed: tuple = (None, {})  # (the kept-heads list last seen, {owner id: its stack needs routing})
        for index, unit in enumerate(family_of(model).unit_layers(model)):
            source = unit.kind.position_bias
            if not source:
                continue
            attention = unit.kind.attention_block(unit.module)
            owner = None if source == ZERO_BIAS else model.get_submodule(module_of(source))  # it computes the bias
            if owner is not None:
                self._readers.setdefault(id(owner), (model.get_submodule(source), []))[1].append(index)
            self._handles.append(attention.register_forward_pre_hook(self._hook(index, owner), with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _stack_routed(self, kept: Sequence[torch.Tensor], owner) -> bool:
        """Some layer reading `owner`'s table lost one of its heads; until then the stock sharing
        (one bias from the first layer; at t5-base, 512 tokens, ~300 MB less activation memory) is
        right. Worked out once per kept-heads list: a shrink makes a new one."""
        seen, routed = self._routed
        if seen is not kept:
            routed = {key: any(kept[i].tolist() != list(range(table.embedding_dim)) for i in layers)
                      for key, (table, layers) in self._readers.items()}
            self._routed = (kept, routed)
        return routed[id(owner)]

    def _hook(self, index: int, owner):
        def hook(module, args, kwargs):
            if owner is None:  # the module makes zeros of its own head count
                return args, {**kwargs, "position_bias": None}
            kept = self.kept_heads()
            if not self._stack_routed(kept, owner):
                return None
            hidden_states, cache = args[0] if args else kwargs["hidden_states"], kwargs.get("cache")
            past = cache.get_seq_length(module.layer_idx) if cache is not None else 0
            query = hidden_states.shape[1]
            full = owner.compute_bias(query, query + past, device=hidden_states.device, past_seen_tokens=past)
            return args, {**kwargs, "position_bias": full.index_select(1, kept[index].to(full.device))}

        return hook


def route_recorded_head_bias(model) -> None:
    """Route the bias of a model whose config records the heads each layer keeps (a pruned T5
    loaded from its export): HeadBias over those heads, kept on the model."""
    heads = getattr(model.config, BIAS_HEAD_INDEX, None)
    if heads:
        kept = [torch.tensor(index, dtype=torch.long) for index in heads]
        model.apt_head_bias = HeadBias(model, lambda: kept)


def record_head_bias(config, kept_groups: Sequence[torch.Tensor], heads: int) -> None:
    """Record in `config` the original heads each unit layer keeps, once any layer lost one of its
    `heads` (until then the stock sharing of the bias is right)."""
    if any(kept.tolist() != list(range(heads)) for kept in kept_groups):
        setattr(config, BIAS_HEAD_INDEX, [kept.tolist() for kept in kept_groups])
