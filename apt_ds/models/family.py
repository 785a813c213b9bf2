"""What a model family description says: the tensors of a layer (a decoder's, or an encoder's)
and the unit axis of each of their dimensions, the tensors outside the layers, the config values
it refuses, the transformers classes, and the base tensors an export leaves out on purpose.

Unit axes (the dimensions pruning slices):
    q       the query-head channels of the kept KV groups (group_size * head_dim per group)
    kv      the key/value-head channels of the kept KV groups (head_dim per group)
    ffn     the kept FFN neurons
    hidden  the kept hidden (residual stream) channels
    head    one head's channels, never sliced (a per-head norm's weight)

A layer's exact parameter count, the pruner's budget terms, the export's slicing and the list
of tensors it writes all come from that one table, so a family with a bias or a per-head norm
is counted, sliced and exported the same way everywhere.

Decoders (LLaMA's layer: pre-RMSNorm, RoPE, GQA) and encoders (BERT's: post-LayerNorm with
biases, absolute position embeddings, a sequence-classification head) differ in where the
norms sit and what lies outside the layers, which `norm`, `norm_placement` and `outer` say.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from apt_ds.models.tensors import (  # noqa: F401  (re-exported: where callers import them)
    AXES,
    OUTER_AXES,
    OUTER_PARTS,
    ROLES,
    LayerTensor,
    LeftOut,
    OuterTensor,
    UnsupportedModelError,
    module_of,
)


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

    def layer_params(self, groups: int, neurons: int, hidden: int) -> int:
        return (hidden * (groups * self.group_per_channel + neurons * self.neuron_per_channel + self.per_channel)
                + groups * self.group_constant + neurons * self.neuron_constant + self.constant)


@dataclass(frozen=True)
class Family:
    """One model family (a transformers `model_type`)."""

    model_type: str
    names: str  # the models it covers, for messages and docs
    config_class: str  # transformers' names
    causal_lm_class: str  # the model class apt-ds builds (an encoder's: its sequence classifier)
    layer_tensors: tuple[LayerTensor, ...]  # in the order of the layer's state_dict
    refused_config: tuple[tuple[str, str], ...] = ()  # (config attribute, why) refused when truthy
    left_out: tuple[LeftOut, ...] = ()
    # The tensors outside the decoder layers (HF names) and where the layers are
    embedding: str = "model.embed_tokens.weight"
    final_norm: str | None = "model.norm.weight"
    output_embedding: str | None = "lm_head.weight"  # not written when the config ties it to the input embedding
    layers: str = "model.layers"
    rotary: str | None = "model.rotary_emb"  # RoPE's module: its tables are buffers made from the config, never saved
    # "decoder" (a causal LM) or "encoder" (a sequence classifier)
    kind: str = "decoder"
    # "rms": RMSNorm; "layer": LayerNorm with a bias. "pre": each block's norm before it, the
    # residual stream unnormalised; "post": a norm after each residual add (BERT).
    norm: str = "rms"
    norm_placement: str = "pre"
    # Every tensor outside the layers, in state_dict order (empty: the decoder's embedding, final
    # norm and LM head, from the fields above)
    outer: tuple[OuterTensor, ...] = ()
    # The Linear whose input the hidden mask gates (an encoder's classifier: its pooled input
    # passed through a tanh, where a pruned channel is not zero)
    head_input: str | None = None
    # Modules trained in full beside the adapters, as PEFT's modules_to_save (a new task head)
    modules_to_save: tuple[str, ...] = ()
    # The roles whose outputs are a layer's two hidden-channel salience sites: what a block adds
    # to the residual stream (pre-norm), or the norm that follows the residual add (post-norm)
    hidden_sites: tuple[str, str] = ("attn_output", "ffn_down")
    # Where a layer's head geometry is read: the attention module below the layer (None: the
    # parent of the output projection) and its head_dim and group size attributes (None: 1)
    attention_path: str | None = None
    config_head_dim: bool = True  # False: the config has no head_dim; heads are hidden_size / heads wide (BERT)
    positions_after_padding: bool = False  # position ids start at pad_token_id + 1 (RoBERTa): fewer usable positions
    head_dim_attr: str = "head_dim"
    group_size_attr: str | None = "num_key_value_groups"
    # llama.cpp's architecture for a GGUF export with every layer alike, and for per-layer shapes
    # (None: llama.cpp has no graph that runs them; `gguf_non_uniform_why` says why)
    gguf_uniform: str | None = None
    gguf_non_uniform: str | None = None
    gguf_non_uniform_why: str = ""
    # Non-empty: why a GGUF of `gguf_uniform` cannot be a base model here (transformers misreads it)
    gguf_input_why: str = ""
    # The built-in `tiny-<model_type>` random model: its config values beside io.modeling.TINY_CONFIG
    tiny_config: dict = field(default_factory=dict, compare=False)

    def gguf_architecture(self, uniform: bool) -> str:
        arch = self.gguf_uniform if uniform else self.gguf_non_uniform
        if arch is None and self.gguf_uniform is not None:
            raise UnsupportedModelError(f"a {self.model_type} model pruned per layer has no llama.cpp architecture "
                                        f"({self.gguf_non_uniform_why}): train with --uniform for a GGUF "
                                        f"({self.gguf_uniform}), or export --format hf")
        if arch is None:
            raise UnsupportedModelError(f"the GGUF export of {self.model_type} models is not written yet; export "
                                        f"--format hf (it loads in transformers and vLLM)")
        return arch

    def __post_init__(self):
        if self.kind not in ("decoder", "encoder") or self.norm not in ("rms", "layer") \
                or self.norm_placement not in ("pre", "post"):
            raise ValueError(f"{self.model_type}: kind, norm or norm_placement is not one of the known values")
        for what, names in (("an outer", [t.name for t in self.outer_tensors]), ("a layer", [t.name for t in self.layer_tensors])):
            if len(set(names)) != len(names):
                raise ValueError(f"{self.model_type}: {what} tensor is listed twice")
        roles = [(t.role, t.kind) for t in self.layer_tensors]
        if len(set(roles)) != len(roles):
            raise ValueError(f"{self.model_type}: two layer tensors have the same role")

    @property
    def outer_tensors(self) -> tuple[OuterTensor, ...]:
        """The tensors outside the layers (a decoder's LM head listed even when tied)."""
        if self.outer:
            return self.outer
        return (OuterTensor(self.embedding, ("vocab", "hidden"), "embedding"),
                OuterTensor(self.final_norm, ("hidden",), "block"),
                OuterTensor(self.output_embedding, ("vocab", "hidden"), "embedding"))

    @property
    def head_names(self) -> frozenset[str]:
        """The task head's tensors (a classifier, a pooler): a base checkpoint may lack them."""
        return frozenset(t.name for t in self.outer_tensors if t.part == "head")

    def ties(self, config) -> bool:
        """The config ties an LM head to the input embedding (an encoder has no LM head to tie:
        BERT's config says tie_word_embeddings=True all the same)."""
        return self.output_embedding is not None and bool(getattr(config, "tie_word_embeddings", False))

    def left_out_on_purpose(self, name: str, tied_embeddings: bool) -> bool:
        if tied_embeddings and name == self.output_embedding:
            return True
        return any(rule.matches(name) for rule in self.left_out)

    def has_tensor(self, name: str) -> bool:
        return any(t.name == name for t in self.layer_tensors)

    def layer_tensor(self, role: str, kind: str = "weight") -> LayerTensor | None:
        """The layer's tensor with `role` (None: this family has none, e.g. LLaMA's attn_q_norm)."""
        return next((t for t in self.layer_tensors if t.role == role and t.kind == kind), None)

    def module_path(self, role: str) -> str:
        """The path below a layer of the module with `role` (`self_attn.o_proj` for attn_output)."""
        tensor = self.layer_tensor(role)
        if tensor is None:
            raise KeyError(f"{self.model_type} layers have no {role} ({ROLES.get(role, 'unknown role')})")
        return tensor.module

    def layer_module(self, layer, role: str):
        """The module with `role` in a decoder layer module."""
        return layer.get_submodule(self.module_path(role))

    # ---- where things are in a model (transformers' module tree) -----------------------------
    def decoder_layers(self, model):
        """The causal LM's decoder layers (a ModuleList)."""
        return model.get_submodule(self.layers)

    def embedding_module(self, model):
        return model.get_submodule(module_of(self.embedding))

    def final_norm_module(self, model):
        return model.get_submodule(module_of(self.final_norm))

    def output_module(self, model):
        """The LM head (its weight is the embedding's when the config ties them)."""
        return model.get_submodule(module_of(self.output_embedding))

    def attention_block(self, layer):
        """The layer's attention module: the one holding its head geometry."""
        return layer.get_submodule(self.attention_path or module_of(self.module_path("attn_output")))

    def set_head_geometry(self, layer, head_dim: int, group_size: int, heads: int) -> None:
        """Give a layer's attention module its own head geometry (a per-layer export built from a
        config whose hidden size and head count say otherwise): head_dim and group size, and
        where the module keeps them, its head count, their width and the score scale."""
        attention = self.attention_block(layer)
        setattr(attention, self.head_dim_attr, head_dim)
        if self.group_size_attr:
            setattr(attention, self.group_size_attr, group_size)
        for name, value in {"num_attention_heads": heads, "all_head_size": heads * head_dim, "scaling": head_dim**-0.5}.items():
            if hasattr(attention, name):
                setattr(attention, name, value)

    def head_geometry(self, layer) -> tuple[int, int]:
        """(head_dim, query heads per KV head) of a layer module."""
        attention = self.attention_block(layer)
        group_size = getattr(attention, self.group_size_attr) if self.group_size_attr else 1
        return getattr(attention, self.head_dim_attr), group_size

    def ffn_block(self, layer):
        """The layer's FFN module (the parent of its down projection)."""
        return layer.get_submodule(module_of(self.module_path("ffn_down")))

    def hidden_norms(self, layer) -> list:
        """The layer's norms over the hidden channels (sliced and masked with them), once each."""
        roles = dict.fromkeys(t.role for t in self.layer_tensors if t.dims == ("hidden",) and t.role.endswith("_norm"))
        return [self.layer_module(layer, role) for role in roles]

    def outer_norms(self, model) -> list:
        """The norms over the hidden channels outside the layers (a decoder's final norm, an
        encoder's embedding LayerNorm), once each."""
        modules = dict.fromkeys(t.module for t in self.outer_tensors if t.dims == ("hidden",) and t.part == "block")
        return [model.get_submodule(module) for module in modules]

    def rebuild_rotary(self, model, device=None) -> None:
        """Make RoPE's module again from the config (in fp32, as transformers does), after a build
        on the meta device or under a dtype-forcing context left its tables empty or rounded."""
        if self.rotary is None:
            return
        owner, name = self.rotary.rsplit(".", 1)
        rotary = type(model.get_submodule(self.rotary))(config=model.config)
        setattr(model.get_submodule(owner), name, rotary if device is None else rotary.to(device))

    def layer_prefix(self, index: int) -> str:
        """The checkpoint name prefix of layer `index` (`model.layers.3`)."""
        return f"{self.layers}.{index}"

    def is_layer_tensor(self, name: str) -> bool:
        return name.startswith(self.layers + ".")

    @property
    def linears(self) -> tuple[LayerTensor, ...]:
        """Every Linear weight of the layer (what a shrink slices)."""
        return tuple(t for t in self.layer_tensors if t.kind == "weight" and len(t.dims) == 2)

    @property
    def projections(self) -> dict[str, LayerTensor]:
        """The layer's Linear weights by module name (`q_proj`: PEFT's `target_modules` names);
        a name two Linears share (BERT's `dense`) names neither."""
        leaves = [t.module.rsplit(".", 1)[-1] for t in self.linears]
        return {leaf: t for leaf, t in zip(leaves, self.linears) if leaves.count(leaf) == 1}

    def adapter_paths(self, targets) -> list[str]:
        """The module paths below a layer that adapters `targets` wrap: a name of this family's
        projections (`query`), or of LLaMA's (`q_proj`, `v_proj`: PEFT's usual names), which
        means the projection with the same role here (BERT's `attention.self.query`)."""
        from apt_ds.models.decoder_layer import DECODER_PROJECTION_ROLES

        paths, unknown = [], []
        for target in targets:
            if target in self.projections:
                paths.append(self.projections[target].module)
            elif target in DECODER_PROJECTION_ROLES and self.layer_tensor(DECODER_PROJECTION_ROLES[target]) is not None:
                paths.append(self.module_path(DECODER_PROJECTION_ROLES[target]))
            else:
                unknown.append(target)
        if unknown:
            known = [name for name, role in DECODER_PROJECTION_ROLES.items() if self.layer_tensor(role) is not None]
            raise UnsupportedModelError(f"--adapter-targets {' '.join(unknown)}: {self.names} layers have no such projection "
                                        f"(they have {', '.join(known)})")
        return list(dict.fromkeys(paths))

    def unit_costs(self, group_size: int, head_dim: int) -> UnitCosts:
        """The pruner's terms, summed over the layer's tensors: a unit axis contributes its
        channels per unit (q: group_size * head_dim, kv: head_dim, ffn: 1), `hidden` makes the
        term per hidden channel, `head` multiplies by head_dim."""
        terms = {key: 0 for key in ("group_per_channel", "group_constant", "neuron_per_channel", "neuron_constant",
                                    "per_channel", "constant")}
        per_unit = {"q": group_size * head_dim, "kv": head_dim, "ffn": 1, "head": head_dim, "hidden": 1}
        for tensor in self.layer_tensors:
            size = 1
            for axis in tensor.dims:
                size *= per_unit[axis]
            unit = "group" if {"q", "kv"} & set(tensor.dims) else "neuron" if "ffn" in tensor.dims else None
            key = (f"{unit}_" if unit else "") + ("per_channel" if "hidden" in tensor.dims else "constant")
            terms[key] += size
        return UnitCosts(**terms)

    @staticmethod
    def sliding_window(config) -> int | None:
        """The attention window a config applies in transformers (None: full attention everywhere).
        transformers 5 names each layer's kind in `layer_types` (Qwen2's window is off unless
        use_sliding_window); Mistral's configs apply `sliding_window` whenever it is set."""
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None and "sliding_attention" not in layer_types:
            return None
        if layer_types is None and not getattr(config, "use_sliding_window", True):
            return None
        return int(window) if window else None

    def check_config(self, config) -> None:
        for attribute, why in self.refused_config:
            if getattr(config, attribute, False):
                raise UnsupportedModelError(f"{self.model_type} with {attribute}={getattr(config, attribute)!r} is not "
                                            f"supported ({why})")

    def classes(self):
        """(config class, causal LM class) from transformers."""
        import transformers

        return getattr(transformers, self.config_class), getattr(transformers, self.causal_lm_class)
