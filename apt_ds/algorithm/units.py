"""The prunable units of a decoder (or encoder) model and their exact parameter counts.

A layer is described by how many KV groups it keeps (each group = 1 KV head + `group_size`
query heads), its FFN width and the shared hidden size. Block parameters (attention, MLP,
norms, final norm) are linear in the hidden size D and in the kept groups G_l and neurons N_l:

    block_params = D * (sum_l [c_g * G_l + c_n * N_l + c_l] + 1) + sum_l [b_g * G_l + b_l]

with the terms from the family's tensor table (apt_ds.models: LLaMA's c_g = (2g + 2) * d_h,
c_n = 3, c_l = 2 and no constants; Qwen2's q/k/v biases give b_g = (g + 2) * d_h, Qwen3's
per-head norms b_l = 2 * d_h), which is what lets the pruner count any candidate set exactly
in O(1) from running totals. The `+ 1` is the final norm: in general the norms outside the
layers (an encoder's embedding LayerNorm: + 2). An encoder's task head (BERT's pooler and
classifier) is counted in the total but not in the budget: the pooler's D^2 is not linear in D.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from apt_ds.algorithm.quant import is_quantized, logical_shape
from apt_ds.models import UnitCosts, family_for
from apt_ds.models import UnsupportedModelError as UnsupportedModelError  # where callers have always imported it

# A pruned T5 config's record of its relative position bias tables' columns (its original heads)
BIAS_HEADS = "apt_bias_heads"
# ModelShape's sizes of tensors outside the layers besides hidden and vocab (recorded when nonzero)
OUTER_SIZES = ("positions", "types", "labels", "buckets", "heads")


@dataclass(frozen=True)
class LayerShape:
    num_kv_groups: int  # kept KV heads
    group_size: int  # query heads per KV head (constant within a layer)
    head_dim: int
    ffn: int  # kept FFN neurons (intermediate size)
    kind: int = 0  # which of its family's kinds of layer (T5: encoder, decoder self-attention, ...)

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_groups * self.group_size

    def kept(self, groups: int, ffn: int) -> "LayerShape":
        return replace(self, num_kv_groups=groups, ffn=ffn)

    def axis_sizes(self, hidden: int) -> dict[str, int]:
        """The length of each unit axis of the layer (apt_ds.models.tensors.AXES) at `hidden`."""
        return {"q": self.num_q_heads * self.head_dim, "kv": self.num_kv_groups * self.head_dim, "ffn": self.ffn,
                "hidden": hidden, "head": self.head_dim}

    def to_dict(self) -> dict:
        """Its record (`kind` only where it is not the family's first: a decoder's is as it always was)."""
        return {key: value for key, value in asdict(self).items() if key != "kind" or value}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: tuple[LayerShape, ...]
    vocab: int
    tied_embeddings: bool
    family: str = "llama"  # the model_type whose tensor table counts the parameters
    # An encoder's position and token-type tables and its classifier's labels (0 for decoders);
    # T5's relative position buckets and the heads its bias tables hold (every original head)
    positions: int = 0
    types: int = 0
    labels: int = 0
    buckets: int = 0
    heads: int = 0

    # ---- counts -------------------------------------------------------------------------
    def costs(self, layer: LayerShape) -> UnitCosts:
        return family_for(self.family).unit_costs(layer.group_size, layer.head_dim, layer.kind)

    def layer_params(self, layer: LayerShape, hidden: int | None = None) -> int:
        hidden = self.hidden if hidden is None else hidden
        return self.costs(layer).layer_params(layer.num_kv_groups, layer.ffn, hidden)

    def group_cost(self, layer: LayerShape) -> int:
        """Parameters one KV group of `layer` costs at the current hidden size."""
        costs = self.costs(layer)
        return costs.group_per_channel * self.hidden + costs.group_constant

    def neuron_cost(self, layer: LayerShape) -> int:
        costs = self.costs(layer)
        return costs.neuron_per_channel * self.hidden + costs.neuron_constant

    def kept(self, hidden: int, layers: tuple[LayerShape, ...]) -> "ModelShape":
        return replace(self, hidden=hidden, layers=tuple(layers))

    def _outer_params(self, part: str, hidden: int | None = None) -> int:
        sizes = {"hidden": self.hidden if hidden is None else hidden, "vocab": self.vocab, "positions": self.positions,
                 "types": self.types, "labels": self.labels, "buckets": self.buckets, "heads": self.heads}
        family = family_for(self.family)
        return sum(t.numel(sizes) for t in family.outer_tensors
                   if t.part == part and not (self.tied_embeddings and t.name == family.output_embedding))

    def outer_columns(self, part: str) -> int:
        """Parameters one hidden channel costs outside the layers in `part` ("block": the norms;
        "embedding": the tables' columns)."""
        return self._outer_params(part, 1) - self._outer_params(part, 0)

    def outer_constant(self, part: str) -> int:
        """Parameters outside the layers in `part` that no hidden channel changes (T5's bias tables)."""
        return self._outer_params(part, 0)

    def block_params(self) -> int:
        """Attention + MLP + all norms (incl. those outside the layers): the density denominator."""
        return sum(self.layer_params(layer) for layer in self.layers) + self._outer_params("block")

    def embedding_params(self) -> int:
        return self._outer_params("embedding")

    def head_params(self) -> int:
        """An encoder's task head (pooler, classifier): counted, never in the density budget."""
        return self._outer_params("head")

    def total_params(self) -> int:
        return self.block_params() + self.embedding_params() + self.head_params()

    def budget_params(self, count_embeddings: bool) -> int:
        """The density's denominator: blocks, and the embeddings where they count (a task head never)."""
        return self.block_params() + (self.embedding_params() if count_embeddings else 0)

    def hidden_cost(self) -> int:
        """Parameters one hidden channel costs at the current shapes."""
        per_channel = sum(self.layer_params(layer, 1) - self.layer_params(layer, 0) for layer in self.layers)
        return per_channel + self.outer_columns("block")

    @property
    def uniform(self) -> bool:
        """Every layer alike, as one config describes them: one head count, and one FFN width over
        the layers that have an FFN (a T5 decoder block's self-attention unit layer has none)."""
        kinds = family_for(self.family).kinds
        return (len({l.num_kv_groups for l in self.layers}) == 1
                and len({l.ffn for l in self.layers if kinds[l.kind].has_ffn}) <= 1)

    @property
    def config_ffn(self) -> int:
        """The FFN width a config states: the first layer's that has an FFN (not T5's decoder
        self-attention unit layers)."""
        kinds = family_for(self.family).kinds
        return next((l.ffn for l in self.layers if kinds[l.kind].has_ffn), 0)

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict:
        encoder = {key: getattr(self, key) for key in OUTER_SIZES if getattr(self, key)}
        return {
            "hidden": self.hidden,
            "vocab": self.vocab,
            "tied_embeddings": self.tied_embeddings,
            "family": self.family,
            **encoder,  # a decoder's record is as it always was
            "layers": [layer.to_dict() for layer in self.layers],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "ModelShape":
        return cls(
            hidden=int(data["hidden"]),
            layers=tuple(LayerShape(**layer) for layer in data["layers"]),
            vocab=int(data["vocab"]),
            tied_embeddings=bool(data["tied_embeddings"]),
            family=str(data.get("family", "llama")),  # runs before families were recorded were LLaMA's
            **{key: int(data.get(key, 0)) for key in OUTER_SIZES},
        )

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        """Shapes of an unpruned (or apt-exported) LLaMA config, validated."""
        check_supported_config(config)
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads  # encoders: a KV group a head
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        per_layer = getattr(config, "apt_layer_shapes", None)
        if per_layer:
            layers = tuple(LayerShape(**layer) for layer in per_layer)
        else:
            family = family_for(config.model_type)
            ffn = getattr(config, family.ffn_config)
            layers = tuple(LayerShape(num_kv_groups=kv, group_size=heads // kv, head_dim=head_dim,
                                      ffn=ffn if family.kinds[kind].has_ffn else 0, kind=kind)
                           for kind in family.unit_kinds(config))
        return cls(hidden=config.hidden_size, layers=layers, vocab=config.vocab_size, **_outer_sizes(config))

    @classmethod
    def from_model(cls, model) -> "ModelShape":
        """Shapes read off the live modules (works on ZeRO-3 partitioned params via ds_shape)."""
        check_supported_model(model)
        config = model.config
        layers, family = [], family_for(config.model_type)
        for unit in family.unit_layers(model):
            kind = unit.kind
            head_dim, group_size = kind.head_geometry(unit.module)
            kv_rows = _full_shape(kind.layer_module(unit.module, "attn_k").weight)[0]
            neurons = _full_shape(kind.layer_module(unit.module, kind.ffn_rows_role).weight)[0] if kind.has_ffn else 0
            layers.append(LayerShape(num_kv_groups=kv_rows // head_dim, group_size=group_size, head_dim=head_dim,
                                     ffn=neurons, kind=unit.kind_index))
        vocab, hidden = _full_shape(family.embedding_module(model).weight)
        return cls(hidden=hidden, layers=tuple(layers), vocab=vocab, **_outer_sizes(config))


def _outer_sizes(config) -> dict:
    """ModelShape's fields besides the layers, hidden size and vocabulary, from a config."""
    family = family_for(config.model_type)
    encoder, seq2seq = family.kind == "encoder", family.kind == "seq2seq"
    return dict(tied_embeddings=family.ties(config), family=config.model_type,
                positions=config.max_position_embeddings if encoder else 0,
                types=config.type_vocab_size if encoder else 0, labels=config.num_labels if encoder else 0,
                buckets=config.relative_attention_num_buckets if seq2seq else 0,
                # the bias tables' columns: every original head (num_heads says the kept ones once pruned)
                heads=(getattr(config, BIAS_HEADS, None) or config.num_heads) if seq2seq else 0)


def _full_shape(param: torch.Tensor) -> tuple[int, ...]:
    if is_quantized(param):  # a quantized base weight is stored packed, maybe transposed (algorithm/quant.py)
        return logical_shape(param)
    ds_shape = getattr(param, "ds_shape", None)  # ZeRO-3 partitioned parameter
    return tuple(ds_shape if ds_shape is not None else param.shape)


ADAPTER_PARAMETERS = ("lora_A", "lora_B")  # APTAdapter's own (algorithm/adapters.py), not the base model's


def check_supported_config(config) -> None:
    """Raise UnsupportedModelError with one line naming what this family's description does not cover."""
    family = family_for(getattr(config, "model_type", None))
    counts = dict.fromkeys(stack.count for stack in family.stacks_for(config))
    for name in ("hidden_size", "num_attention_heads", *counts, family.ffn_config, "vocab_size"):
        if not isinstance(getattr(config, name, None), int):
            raise UnsupportedModelError(f"config has no integer {name}: not a {family.names} model apt-ds can prune")
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if config.num_attention_heads % kv:
        raise UnsupportedModelError(
            f"num_attention_heads ({config.num_attention_heads}) is not a multiple of num_key_value_heads ({kv})"
        )
    family.check_config(config)


def check_supported_config_file(config: dict) -> None:
    """`check_supported_config` of a config.json's values, before any weight is read: its own keys
    (a default the config class would fill in hides a missing one), under the names the family's
    config class maps them to (T5's d_model is hidden_size); a family whose stacks read what its
    config class derives (T5's is_gated_act) is checked on that class's config."""
    from types import SimpleNamespace

    family = family_for(config.get("model_type"))
    config_class = family.classes()[0]
    if family.stacks:
        try:
            check_supported_config(config_class.from_dict(config))
        except (TypeError, ValueError) as err:
            raise UnsupportedModelError(f"config.json is not a valid {family.model_type} config "
                                        f"({str(err).splitlines()[0]})") from None
        return
    aliases = {name: config[source] for name, source in getattr(config_class, "attribute_map", {}).items()
               if source in config and name not in config}
    check_supported_config(SimpleNamespace(**config, **aliases))


def check_supported_model(model) -> None:
    """The model's layers hold exactly the tensors its family's description lists (an extra one
    would be left unpruned and unexported, a missing one means another architecture)."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no transformers config: not a causal LM apt-ds knows")
    check_supported_config(config)
    family = family_for(config.model_type)
    try:
        units = family.unit_layers(model)
        for tensor in family.outer_tensors:
            model.get_submodule(tensor.module)
    except AttributeError as error:
        raise UnsupportedModelError(f"{type(model).__name__} is not the {family.model_type} model its config "
                                    f"names ({error})") from None
    expected, blocks = {}, {}  # by block prefix: what its unit layers list, and the block
    for unit in units:
        expected.setdefault(unit.prefix, set()).update(t.name for t in unit.kind.tensors)
        blocks[unit.prefix] = unit.module
    for prefix, names in expected.items():  # an outer tensor kept below a block (T5's relative bias)
        names.update(name[len(prefix) + 1:] for name in family.outer_names if name.startswith(prefix + "."))
    for prefix, block in blocks.items():
        held = {name for name, _ in block.named_parameters() if name.rsplit(".", 1)[-1] not in ADAPTER_PARAMETERS}
        if held != expected[prefix]:
            extra, missing = sorted(held - expected[prefix]), sorted(expected[prefix] - held)
            what = f"has {extra[0]}" if extra else f"lacks {missing[0]}"
            where = prefix if family.stacks else f"layer {prefix.rsplit('.', 1)[1]}"
            raise UnsupportedModelError(f"{where} {what}, which the {family.model_type} description "
                                        f"(apt_ds/models/{family.model_type}.py) does not list")
