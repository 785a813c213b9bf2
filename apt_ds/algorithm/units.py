"""The prunable units of a LLaMA model and their exact parameter counts.

A layer is described by how many KV groups it keeps (each group = 1 KV head + `group_size`
query heads), its FFN width and the shared hidden size. Block parameters (attention, MLP,
norms, final norm) are linear in the hidden size once the kept groups and neurons are known:

    block_params = D * (sum_l [(2g + 2) * d_h * G_l + 3 * N_l + 2] + 1)

which is what lets the pruner count any candidate set exactly in O(1) from running totals.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from apt_ds.models import UnsupportedModelError as UnsupportedModelError  # where callers have always imported it
from apt_ds.models import family_for


@dataclass(frozen=True)
class LayerShape:
    num_kv_groups: int  # kept KV heads
    group_size: int  # query heads per KV head (constant within a layer)
    head_dim: int
    ffn: int  # kept FFN neurons (intermediate size)

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_groups * self.group_size

    def params(self, hidden: int) -> int:
        attn = (2 * self.group_size + 2) * self.head_dim * self.num_kv_groups * hidden
        return attn + 3 * self.ffn * hidden + 2 * hidden

    def group_cost(self, hidden: int) -> int:
        return (2 * self.group_size + 2) * self.head_dim * hidden


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: tuple[LayerShape, ...]
    vocab: int
    tied_embeddings: bool

    # ---- counts -------------------------------------------------------------------------
    def block_params(self) -> int:
        """Attention + MLP + all RMSNorms (incl. the final one): the density denominator."""
        return sum(layer.params(self.hidden) for layer in self.layers) + self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def total_params(self) -> int:
        return self.block_params() + self.embedding_params()

    def budget_params(self, count_embeddings: bool) -> int:
        return self.total_params() if count_embeddings else self.block_params()

    def hidden_cost(self) -> int:
        """Parameters one hidden channel costs at the current shapes."""
        per_channel = sum(layer.params(1) for layer in self.layers) + 1
        return per_channel

    @property
    def uniform(self) -> bool:
        return len({(l.num_kv_groups, l.ffn) for l in self.layers}) == 1

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "hidden": self.hidden,
            "vocab": self.vocab,
            "tied_embeddings": self.tied_embeddings,
            "layers": [asdict(layer) for layer in self.layers],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "ModelShape":
        return cls(
            hidden=int(data["hidden"]),
            layers=tuple(LayerShape(**layer) for layer in data["layers"]),
            vocab=int(data["vocab"]),
            tied_embeddings=bool(data["tied_embeddings"]),
        )

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        """Shapes of an unpruned (or apt-exported) LLaMA config, validated."""
        check_llama_config(config)
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        per_layer = getattr(config, "apt_layer_shapes", None)
        if per_layer:
            layers = tuple(LayerShape(**layer) for layer in per_layer)
        else:
            layers = tuple(
                LayerShape(num_kv_groups=kv, group_size=heads // kv, head_dim=head_dim, ffn=config.intermediate_size)
                for _ in range(config.num_hidden_layers)
            )
        return cls(
            hidden=config.hidden_size,
            layers=layers,
            vocab=config.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @classmethod
    def from_model(cls, model) -> "ModelShape":
        """Shapes read off the live modules (works on ZeRO-3 partitioned params via ds_shape)."""
        check_llama_model(model)
        config = model.config
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            head_dim = attn.head_dim
            kv_rows = _full_shape(attn.k_proj.weight)[0]
            layers.append(
                LayerShape(
                    num_kv_groups=kv_rows // head_dim,
                    group_size=attn.num_key_value_groups,
                    head_dim=head_dim,
                    ffn=_full_shape(mlp.gate_proj.weight)[0],
                )
            )
        hidden = _full_shape(model.model.embed_tokens.weight)[1]
        return cls(
            hidden=hidden,
            layers=tuple(layers),
            vocab=_full_shape(model.model.embed_tokens.weight)[0],
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


def _full_shape(param: torch.Tensor) -> tuple[int, ...]:
    ds_shape = getattr(param, "ds_shape", None)  # ZeRO-3 partitioned parameter
    return tuple(ds_shape) if ds_shape is not None else tuple(param.shape)


def check_llama_config(config) -> None:
    """Raise UnsupportedModelError with one line naming what is not LLaMA-shaped."""
    family_for(getattr(config, "model_type", None))
    for name in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
        if not isinstance(getattr(config, name, None), int):
            raise UnsupportedModelError(f"config has no integer {name}: not a LLaMA-shaped model")
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if config.num_attention_heads % kv:
        raise UnsupportedModelError(
            f"num_attention_heads ({config.num_attention_heads}) is not a multiple of num_key_value_heads ({kv})"
        )
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise UnsupportedModelError("models with attention_bias/mlp_bias are not supported (LLaMA has no biases)")


def check_llama_model(model) -> None:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "embed_tokens") or not hasattr(model, "lm_head"):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a LLaMA-shaped causal LM (need model.model.layers, embed_tokens, lm_head)"
        )
    check_llama_config(model.config)
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        needed = [(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        needed += [(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        missing = [n for owner, n in needed if owner is None or not hasattr(owner, n)]
        if missing or not hasattr(layer, "input_layernorm") or not hasattr(layer, "post_attention_layernorm"):
            raise UnsupportedModelError(f"layer {i} is not a LLaMA decoder layer (missing {missing or 'norms'})")
        if getattr(attn, "q_norm", None) is not None or getattr(attn, "k_norm", None) is not None:
            raise UnsupportedModelError(f"layer {i} has q/k norms (Qwen3-style); not LLaMA-shaped")
