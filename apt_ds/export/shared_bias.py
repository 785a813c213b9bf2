"""A uniform T5 export's relative position bias as stock transformers computes it.

In training every attention reads its own original heads' columns of its stack's bias table
(apt_ds.algorithm.position_bias.HeadBias). Stock T5 computes a stack's bias once, from its first
layer's table, and hands it to every layer. The two agree when every unit layer keeps as many
heads and the self-attentions of each stack keep the same ones (what a uniform run's pruner
chooses): each table is then cut to those heads' columns, the routing goes, and the export is a
stock `T5ForConditionalGeneration`. Otherwise the export records the heads each layer keeps and
`apt_ds.load_pretrained` routes them again."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from apt_ds.algorithm.position_bias import BIAS_HEAD_INDEX, shared_table_layers
from apt_ds.algorithm.units import BIAS_HEADS
from apt_ds.models import family_of


def share_bias_tables(model, state) -> None:
    """Cut `model`'s shared bias tables to the heads its layers keep (a compacted model and its
    APTModel `state`, whose shape then records the tables' new width), when that is exact."""
    shape, readers = state.shape, shared_table_layers(state.shape)
    if state.head_bias is None or not readers or not shape.uniform:
        return
    heads = [[state.kept_groups[i].tolist() for i in members] for members in readers]
    if any(any(kept != stack[0] for kept in stack) for stack in heads):
        return  # a stack's layers keep different heads: only routing computes their bias
    if all(stack[0] == list(range(shape.heads)) for stack in heads):
        return  # every head kept: the stock sharing is already exact
    kinds = family_of(model).kinds
    with torch.no_grad():
        for members, stack in zip(readers, heads):
            path = kinds[shape.layers[members[0]].kind].position_bias
            owner, name = path.rsplit(".", 1)
            table = model.get_submodule(path)
            cut = nn.Embedding(table.num_embeddings, len(stack[0]), dtype=table.weight.dtype, device=table.weight.device)
            cut.weight.copy_(table.weight[:, stack[0]])
            setattr(model.get_submodule(owner), name, cut)
    state.head_bias.remove()
    state.head_bias = None
    for key in (BIAS_HEAD_INDEX, BIAS_HEADS):
        if hasattr(model.config, key):
            delattr(model.config, key)
    state.shape = replace(shape, heads=shape.layers[0].num_q_heads)
