"""The tensors a family description lists: a layer's (LayerTensor, with the unit axis of each
dimension and its role), those outside the layers (OuterTensor), and the base tensors an export
leaves out on purpose (LeftOut). apt_ds.models.family puts them together."""

from __future__ import annotations

import re
from dataclasses import dataclass

AXES = ("q", "kv", "ffn", "hidden", "head")
# The axes of a tensor outside the layers: the hidden channels, and sizes pruning never changes
# (`heads`: T5's relative position bias columns, one per original head, read by every layer)
OUTER_AXES = ("hidden", "vocab", "positions", "types", "labels", "buckets", "heads")
# Where an outside tensor counts: `embedding` (in the density budget with --count-embeddings),
# `block` (always in it: a norm over the hidden channels), `head` (a task head: outside it)
OUTER_PARTS = ("embedding", "block", "head")


class UnsupportedModelError(ValueError):
    """The model is not one apt-ds can prune; the message says why in one line."""


@dataclass(frozen=True)
class LeftOut:
    """Base checkpoint tensors an export does not write: `pattern` (a full-match regex over the
    HF name) and why dropping them changes nothing."""

    pattern: str
    why: str

    def __post_init__(self):
        re.compile(self.pattern)  # a typo in a description fails at import, not at export

    def matches(self, name: str) -> bool:
        return re.fullmatch(self.pattern, name) is not None


# What a layer tensor does, in llama.cpp's names for a block's tensors (its GGUF name is
# `blk.{i}.{role}.{weight|bias}`): the code that hooks, slices or writes a tensor asks a family's
# description for a role, never for a module name.
ROLES = {
    "attn_norm": "the RMSNorm before attention",
    "attn_output_norm": "the LayerNorm after attention's residual add (post-LN encoders)",
    "attn_q": "the query projection (rows: the heads of the kept KV groups, rotated by RoPE)",
    "attn_k": "the key projection (rows: one head per kept KV group, rotated by RoPE)",
    "attn_v": "the value projection (rows: one head per kept KV group)",
    "attn_q_norm": "the RMSNorm over each query head",
    "attn_k_norm": "the RMSNorm over each key head",
    "attn_output": "attention's output projection (columns: the query heads; the KV-group mask's site)",
    "ffn_norm": "the RMSNorm before the FFN",
    "ffn_gate": "the FFN's gate projection",
    "ffn_up": "the FFN's up projection",
    "ffn_down": "the FFN's down projection (columns: the neurons; the neuron mask's site)",
    "layer_output_norm": "the LayerNorm after the FFN's residual add (post-LN encoders)",
}


@dataclass(frozen=True)
class LayerTensor:
    """One tensor of a layer: its name below the layer (`model.layers.{i}.`), the unit axis
    of each dimension (rows first) and its role (ROLES)."""

    name: str
    dims: tuple[str, ...]
    role: str

    def __post_init__(self):
        if not self.dims or not set(self.dims) <= set(AXES):
            raise ValueError(f"{self.name}: dims {self.dims} must be some of {AXES}")
        if {"q", "kv"} & set(self.dims) and "ffn" in self.dims:
            raise ValueError(f"{self.name}: a tensor belongs to KV groups or to FFN neurons, not both")
        if self.role not in ROLES:
            raise ValueError(f"{self.name}: role {self.role!r} must be one of {sorted(ROLES)}")
        if self.kind not in ("weight", "bias"):
            raise ValueError(f"{self.name}: a layer tensor is a module's weight or bias")

    @property
    def module(self) -> str:
        """The module path below the layer (`self_attn.q_proj` of `self_attn.q_proj.bias`)."""
        return self.name.rsplit(".", 1)[0]

    @property
    def kind(self) -> str:
        """`weight` or `bias`."""
        return self.name.rsplit(".", 1)[1]

    @property
    def attention(self) -> bool:
        """Part of the attention block (its norm included): a layer without KV groups has none of these."""
        return self.role.startswith("attn_")

    @property
    def gguf_name(self) -> str:
        return f"{self.role}.{self.kind}"


@dataclass(frozen=True)
class OuterTensor:
    """A tensor outside the layers: its HF name, the axis of each dimension (OUTER_AXES) and the
    part of the model it counts in (OUTER_PARTS)."""

    name: str
    dims: tuple[str, ...]
    part: str

    def __post_init__(self):
        if not self.dims or not set(self.dims) <= set(OUTER_AXES):
            raise ValueError(f"{self.name}: dims {self.dims} must be some of {OUTER_AXES}")
        if self.part not in OUTER_PARTS:
            raise ValueError(f"{self.name}: part {self.part!r} must be one of {OUTER_PARTS}")

    @property
    def module(self) -> str:
        return module_of(self.name)

    @property
    def leaf(self) -> str:
        """`weight` or `bias`."""
        return self.name.rsplit(".", 1)[1]

    def numel(self, sizes: dict[str, int]) -> int:
        """Its entries at the axis sizes `sizes`."""
        total = 1
        for axis in self.dims:
            total *= sizes[axis]
        return total


def module_of(name: str) -> str:
    """The module path of a tensor or submodule name (`model.embed_tokens` of `...weight`)."""
    return name.rsplit(".", 1)[0]
