"""One kind of layer: its tensors (a LayerTensor table) and where its attention keeps its head
geometry. A decoder-only or encoder-only family has one kind; an encoder-decoder (T5) has an
encoder layer, and a decoder block seen as two unit layers on the same module (its
self-attention, then its cross-attention with the FFN), so that every unit layer holds at most
one set of heads and one FFN: the pruner, masks and salience count (groups, neurons) per unit
layer, whatever the family.

A stack (`Stack`) is a ModuleList of blocks read as unit layers of one kind; a model's unit
layers are its stacks' in order (`UnitLayer`: the block module, its checkpoint prefix, its kind).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from apt_ds.models.tensors import ROLES, LayerTensor, module_of

# How set_head_geometry updates an attention module's head bookkeeping: attribute -> what it holds
# ("heads": the head count, "width": heads x head_dim, "scale": head_dim ** -0.5)
BERT_AND_LLAMA_HEAD_ATTRIBUTES = (("num_attention_heads", "heads"), ("all_head_size", "width"), ("scaling", "scale"))


@dataclass(frozen=True)
class UnitCosts:
    """A layer's parameters as the pruner counts them, at one (group_size, head_dim):
    D * (G * group_per_channel + N * neuron_per_channel + per_channel)
      + G * group_constant + N * neuron_constant + constant."""

    group_per_channel: int
    group_constant: int
    neuron_per_channel: int
    neuron_constant: int
    per_channel: int
    constant: int

    @classmethod
    def total(cls, costs) -> "UnitCosts":
        """The terms of several layers together (a uniform shape's, every layer at once)."""
        costs = list(costs)
        return cls(*(sum(getattr(c, name) for c in costs) for name in cls.__dataclass_fields__))

    def layer_params(self, groups: int, neurons: int, hidden: int) -> int:
        return (hidden * (groups * self.group_per_channel + neurons * self.neuron_per_channel + self.per_channel)
                + groups * self.group_constant + neurons * self.neuron_constant + self.constant)


@dataclass(frozen=True)
class LayerKind:
    """The tensors of one kind of layer (in the order of its state_dict) and its head geometry."""

    tensors: tuple[LayerTensor, ...]
    name: str = "layer"
    # The roles whose outputs are the layer's hidden-channel salience sites: what a block adds to
    # the residual stream (pre-norm), or the norm that follows the residual add (post-norm)
    hidden_sites: tuple[str, ...] = ("attn_output", "ffn_down")
    # The attention module below the layer (None: the parent of the output projection), its
    # head_dim and group size attributes (None: 1), and its head bookkeeping attributes
    attention_path: str | None = None
    head_dim_attr: str = "head_dim"
    group_size_attr: str | None = "num_key_value_groups"
    head_attributes: tuple[tuple[str, str], ...] = field(default=BERT_AND_LLAMA_HEAD_ATTRIBUTES)
    # The sequence its activations run over: the model's input, or (a T5 decoder's) the target
    side: str = "input"
    # A position bias its attention adds that its stack shares (T5): the model path of the table (an
    # Embedding of buckets x heads, inside the attention that computes the bias from it) whose columns
    # its heads read, or "zeros" (a zero bias of its own head count)
    position_bias: str | None = None

    def __post_init__(self):
        roles = [(t.role, t.kind) for t in self.tensors]
        if len(set(roles)) != len(roles):
            raise ValueError(f"{self.name}: two layer tensors have the same role")
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError(f"{self.name}: a layer tensor is listed twice")
        if self.side not in ("input", "target"):
            raise ValueError(f"{self.name}: side must be input or target")
        missing = [site for site in self.hidden_sites if self.layer_tensor(site) is None]
        if missing:
            raise ValueError(f"{self.name}: hidden site {missing[0]} is none of its tensors' roles")

    # ---- the table -----------------------------------------------------------------------------
    def has_tensor(self, name: str) -> bool:
        return any(t.name == name for t in self.tensors)

    def layer_tensor(self, role: str, kind: str = "weight") -> LayerTensor | None:
        """The tensor with `role` (None: this kind has none, e.g. LLaMA's attn_q_norm)."""
        return next((t for t in self.tensors if t.role == role and t.kind == kind), None)

    @property
    def has_attention(self) -> bool:
        return self.layer_tensor("attn_output") is not None

    @property
    def has_ffn(self) -> bool:
        return self.layer_tensor("ffn_down") is not None

    @property
    def ffn_rows_role(self) -> str | None:
        """The FFN tensor whose rows are the neurons (gate or up)."""
        return next((t.role for t in self.tensors if t.dims[0] == "ffn"), None)

    def module_path(self, role: str) -> str:
        """The path below a layer of the module with `role` (`self_attn.o_proj` for attn_output)."""
        tensor = self.layer_tensor(role)
        if tensor is None:
            raise KeyError(f"{self.name} layers have no {role} ({ROLES.get(role, 'unknown role')})")
        return tensor.module

    def layer_module(self, layer, role: str):
        """The module with `role` in a layer module."""
        return layer.get_submodule(self.module_path(role))

    @property
    def linears(self) -> tuple[LayerTensor, ...]:
        """Every Linear weight of the layer (what a shrink slices)."""
        return tuple(t for t in self.tensors if t.kind == "weight" and len(t.dims) == 2)

    def hidden_norms(self, layer) -> list:
        """The layer's norms over the hidden channels (sliced and masked with them), once each."""
        roles = dict.fromkeys(t.role for t in self.tensors if t.dims == ("hidden",) and t.role.endswith("_norm"))
        return [self.layer_module(layer, role) for role in roles]

    @property
    def projections(self) -> dict[str, LayerTensor]:
        """The layer's Linear weights by module name (`q_proj`: PEFT's `target_modules` names);
        a name two Linears share (BERT's `dense`) names neither."""
        leaves = [t.module.rsplit(".", 1)[-1] for t in self.linears]
        return {leaf: t for leaf, t in zip(leaves, self.linears) if leaves.count(leaf) == 1}

    @property
    def adapter_names(self) -> list[str]:
        """LLaMA's names of the projections this kind has (what --adapter-targets takes)."""
        from apt_ds.models.decoder_layer import DECODER_PROJECTION_ROLES

        return [name for name, role in DECODER_PROJECTION_ROLES.items() if self.layer_tensor(role) is not None]

    def adapter_paths(self, targets) -> list[str]:
        """The module paths below a layer that adapters `targets` wrap: a name of this kind's
        projections (`query`), or of LLaMA's (`q_proj`, `v_proj`: PEFT's usual names), which
        means the projection with the same role here (BERT's `attention.self.query`); a target
        this kind has not (a T5 decoder self-attention layer's `up_proj`) wraps nothing."""
        from apt_ds.models.decoder_layer import DECODER_PROJECTION_ROLES

        paths = []
        for target in targets:
            if target in self.projections:
                paths.append(self.projections[target].module)
            elif target in DECODER_PROJECTION_ROLES and self.layer_tensor(DECODER_PROJECTION_ROLES[target]) is not None:
                paths.append(self.module_path(DECODER_PROJECTION_ROLES[target]))
        return list(dict.fromkeys(paths))

    def unit_costs(self, group_size: int, head_dim: int) -> UnitCosts:
        """The pruner's terms, summed over the layer's tensors: a unit axis contributes its
        channels per unit (q: group_size * head_dim, kv: head_dim, ffn: 1), `hidden` makes the
        term per hidden channel, `head` multiplies by head_dim."""
        terms = {key: 0 for key in ("group_per_channel", "group_constant", "neuron_per_channel", "neuron_constant",
                                    "per_channel", "constant")}
        per_unit = {"q": group_size * head_dim, "kv": head_dim, "ffn": 1, "head": head_dim, "hidden": 1}
        for tensor in self.tensors:
            size = 1
            for axis in tensor.dims:
                size *= per_unit[axis]
            unit = "group" if {"q", "kv"} & set(tensor.dims) else "neuron" if "ffn" in tensor.dims else None
            key = (f"{unit}_" if unit else "") + ("per_channel" if "hidden" in tensor.dims else "constant")
            terms[key] += size
        return UnitCosts(**terms)

    # ---- heads -------------------------------------------------------------------------------
    def attention_block(self, layer):
        """The layer's attention module: the one holding its head geometry."""
        return layer.get_submodule(self.attention_path or module_of(self.module_path("attn_output")))

    def head_geometry(self, layer) -> tuple[int, int]:
        """(head_dim, query heads per KV head) of a layer module."""
        attention = self.attention_block(layer)
        group_size = getattr(attention, self.group_size_attr) if self.group_size_attr else 1
        return getattr(attention, self.head_dim_attr), group_size

    def set_head_geometry(self, layer, head_dim: int, group_size: int, heads: int) -> None:
        """Give a layer's attention module its own head geometry (a per-layer export built from a
        config whose sizes say otherwise, or a shrink): head_dim and group size, and where the
        module keeps them, its head count, their width and the score scale."""
        attention = self.attention_block(layer)
        setattr(attention, self.head_dim_attr, head_dim)
        if self.group_size_attr:
            setattr(attention, self.group_size_attr, group_size)
        values = {"heads": heads, "width": heads * head_dim, "scale": head_dim**-0.5}
        for name, what in self.head_attributes:
            if hasattr(attention, name):
                setattr(attention, name, values[what])

    def ffn_block(self, layer):
        """The layer's FFN module (the parent of its down projection)."""
        return layer.get_submodule(module_of(self.module_path("ffn_down")))


@dataclass(frozen=True)
class Stack:
    """A ModuleList of blocks (`path`) read as unit layers of `kind`, as many as the config's
    `count` attribute; `when` = (config attribute, value): the stack of the configs with that value
    (T5's gated FFN of v1.1 or ReLU FFN of v1.0)."""

    path: str
    kind: LayerKind
    count: str = "num_hidden_layers"
    when: tuple[str, object] | None = None

    def applies_to(self, config) -> bool:
        return self.when is None or getattr(config, self.when[0], None) == self.when[1]


@dataclass(frozen=True)
class UnitLayer:
    """One unit layer of a model: its block module, the block's checkpoint prefix
    (`model.layers.3`) and its kind (and that kind's index in its family's `kinds`)."""

    module: object
    prefix: str
    kind: LayerKind
    kind_index: int


