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

import functools
from dataclasses import dataclass, field

from apt_ds.models.layer_kind import LayerKind, Stack, UnitCosts, UnitLayer  # noqa: F401  (UnitCosts re-exported)
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
class Family:
    """One model family (a transformers `model_type`)."""

    model_type: str
    names: str  # the models it covers, for messages and docs
    config_class: str  # transformers' names
    causal_lm_class: str  # the model class apt-ds builds (an encoder's: its sequence classifier)
    layer_tensors: tuple[LayerTensor, ...]  # in the order of the layer's state_dict
    refused_config: tuple[tuple[str, str], ...] = ()  # (config attribute, why) refused when truthy
    left_out: tuple[LeftOut, ...] = ()
    # (config flag, norm, model attribute): the config scales the decoder's output by d_model ** -0.5
    # before the LM head (T5 v1.0), the model keeping d_model in the attribute; a smaller hidden size
    # folds the old scale into the norm before it (export)
    output_scale: tuple[str, str, str] | None = None
    # Modules whose weight is the embedding's, tied by transformers (T5's stacks' embed_tokens): a
    # shrink gives them the embedding's new weight
    embedding_aliases: tuple[str, ...] = ()
    # Several kinds of layers (T5's encoder and decoder): the stacks, in unit-layer order; empty:
    # one stack `layers` of `layer_tensors` (apt_ds.models.layer_kind)
    stacks: tuple[Stack, ...] = ()
    # The tensors outside the decoder layers (HF names) and where the layers are
    embedding: str = "model.embed_tokens.weight"
    final_norm: str | None = "model.norm.weight"
    output_embedding: str | None = "lm_head.weight"  # not written when the config ties it to the input embedding
    layers: str = "model.layers"
    rotary: str | None = "model.rotary_emb"  # RoPE's module: its tables are buffers made from the config, never saved
    # "decoder" (a causal LM), "encoder" (a sequence classifier) or "seq2seq" (T5)
    kind: str = "decoder"
    ffn_config: str = "intermediate_size"  # the config's FFN width (T5's d_ff)
    tie_flag: str = "tie_word_embeddings"  # the config attribute saying the LM head is the embedding
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
        if self.kind not in ("decoder", "encoder", "seq2seq") or self.norm not in ("rms", "layer") \
                or self.norm_placement not in ("pre", "post"):
            raise ValueError(f"{self.model_type}: kind, norm or norm_placement is not one of the known values")
        for what, names in (("an outer", [t.name for t in self.outer_tensors]), ("a layer", [t.name for t in self.layer_tensors])):
            if len(set(names)) != len(names):
                raise ValueError(f"{self.model_type}: {what} tensor is listed twice")
        self.kinds  # noqa: B018  (each kind checks its own table: roles, hidden sites)

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
        return self.output_embedding is not None and bool(getattr(config, self.tie_flag, False))

    def left_out_on_purpose(self, name: str, tied_embeddings: bool) -> bool:
        if tied_embeddings and name == self.output_embedding:
            return True
        return any(rule.matches(name) for rule in self.left_out)

    # ---- the layers: unit layers of one or more kinds (apt_ds.models.layer_kind) -------------
    @functools.cached_property
    def kinds(self) -> tuple[LayerKind, ...]:
        """Every kind of unit layer this family has (one, unless `stacks` lists several)."""
        if self.stacks:
            return tuple(dict.fromkeys(stack.kind for stack in self.stacks))
        return (LayerKind(self.layer_tensors, name=self.names, hidden_sites=self.hidden_sites,
                          attention_path=self.attention_path, head_dim_attr=self.head_dim_attr,
                          group_size_attr=self.group_size_attr),)

    @property
    def main_kind(self) -> LayerKind:
        """The one kind of a family whose layers are all alike (asking it of T5 is a bug: its
        encoder and decoder layers differ, so ask a unit layer's kind)."""
        if len(self.kinds) != 1:
            raise TypeError(f"{self.model_type} has {len(self.kinds)} kinds of layers: ask each unit layer's kind")
        return self.kinds[0]

    def stacks_for(self, config) -> tuple[Stack, ...]:
        """The stacks a config's model has, in unit-layer order."""
        if not self.stacks:
            return (Stack(self.layers, self.kinds[0]),)
        return tuple(stack for stack in self.stacks if stack.applies_to(config))

    def unit_kinds(self, config) -> list[int]:
        """The kind (an index into `kinds`) of each unit layer of a config's model, in order."""
        return [self.kinds.index(stack.kind) for stack in self.stacks_for(config) for _ in range(getattr(config, stack.count))]

    def unit_layers(self, model) -> list[UnitLayer]:
        """The model's unit layers in order: each block of each stack, with its kind."""
        return [UnitLayer(block, f"{stack.path}.{i}", stack.kind, self.kinds.index(stack.kind))
                for stack in self.stacks_for(model.config) for i, block in enumerate(model.get_submodule(stack.path))]

    @property
    def layer_paths(self) -> tuple[str, ...]:
        """The ModuleLists that hold the layers (`model.layers`; T5's encoder.block and decoder.block)."""
        return tuple(dict.fromkeys(stack.path for stack in self.stacks)) if self.stacks else (self.layers,)

    def is_layer_tensor(self, name: str) -> bool:
        """A tensor of a unit layer's table (not an outer tensor kept below a block, as T5's relative bias)."""
        return any(name.startswith(path + ".") for path in self.layer_paths) and name not in self.outer_names

    @functools.cached_property
    def outer_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.outer_tensors)

    # A family whose layers are all alike answers its kind's questions itself
    def layer_tensor(self, role: str, kind: str = "weight") -> LayerTensor | None:
        return self.main_kind.layer_tensor(role, kind)

    def module_path(self, role: str) -> str:
        return self.main_kind.module_path(role)

    def layer_module(self, layer, role: str):
        return self.main_kind.layer_module(layer, role)

    def attention_block(self, layer):
        return self.main_kind.attention_block(layer)

    @property
    def projections(self) -> dict[str, LayerTensor]:
        return self.main_kind.projections

    def unit_costs(self, group_size: int, head_dim: int, kind: int = 0) -> UnitCosts:
        return self.kinds[kind].unit_costs(group_size, head_dim)

    def check_adapter_targets(self, targets, config=None) -> None:
        """Refuse in one line a target that no layer of the family, or of `config`'s model, has
        (each unit layer wraps what its own kind has: LayerKind.adapter_paths)."""
        kinds = [stack.kind for stack in self.stacks_for(config)] if config is not None else self.kinds
        unknown = [target for target in targets if not any(k.adapter_paths([target]) for k in kinds)]
        if unknown:
            known = dict.fromkeys(name for k in kinds for name in k.adapter_names)
            raise UnsupportedModelError(f"--adapter-targets {' '.join(unknown)}: {self.names} layers have no such projection "
                                        f"(they have {', '.join(known)})")

    # ---- where things are in a model (transformers' module tree) -----------------------------
    def decoder_layers(self, model):
        """The layers of a family whose layers are all alike (a ModuleList)."""
        return model.get_submodule(self.layers)

    def embedding_module(self, model):
        return model.get_submodule(module_of(self.embedding))

    def final_norm_module(self, model):
        return model.get_submodule(module_of(self.final_norm))

    def output_module(self, model):
        """The LM head (its weight is the embedding's when the config ties them)."""
        return model.get_submodule(module_of(self.output_embedding))

    def tie_embedding(self, model) -> None:
        """Give the LM head (where the config ties it) and the embedding's views (T5's stacks'
        embed_tokens) the embedding's weight, as transformers ties them."""
        weight = self.embedding_module(model).weight
        if self.ties(model.config):
            self.output_module(model).weight = weight
        elif self.output_embedding is not None and self.output_module(model).weight is weight:  # T5's class ties
            from torch import nn  # whatever its config.json said: a checkpoint's own head needs its own parameter

            self.output_module(model).weight = nn.Parameter(weight.new_empty(weight.shape), requires_grad=weight.requires_grad)
        for alias in self.embedding_aliases:
            model.get_submodule(alias).weight = weight

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
        """The checkpoint name prefix of layer `index` (`model.layers.3`) of a family whose layers are alike."""
        self.main_kind  # noqa: B018  (T5's unit layers have their own prefixes: UnitLayer.prefix)
        return f"{self.layers}.{index}"

    def check_config(self, config) -> None:
        for attribute, why in self.refused_config:
            if getattr(config, attribute, False):
                raise UnsupportedModelError(f"{self.model_type} with {attribute}={getattr(config, attribute)!r} is not "
                                            f"supported ({why})")

    def classes(self):
        """(config class, causal LM class) from transformers."""
        import transformers

        return getattr(transformers, self.config_class), getattr(transformers, self.causal_lm_class)
