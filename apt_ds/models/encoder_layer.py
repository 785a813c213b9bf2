"""The tensors BERT and RoBERTa share: a post-LayerNorm encoder layer with biases everywhere
(transformers' BertLayer, which RobertaLayer is), and the embeddings' tensors. Every head is its
own KV group (group size 1)."""

from __future__ import annotations

from apt_ds.models.tensors import LayerTensor, OuterTensor

ENCODER_LAYER = (
    LayerTensor("attention.self.query.weight", ("q", "hidden"), "attn_q"),
    LayerTensor("attention.self.query.bias", ("q",), "attn_q"),
    LayerTensor("attention.self.key.weight", ("kv", "hidden"), "attn_k"),
    LayerTensor("attention.self.key.bias", ("kv",), "attn_k"),
    LayerTensor("attention.self.value.weight", ("kv", "hidden"), "attn_v"),
    LayerTensor("attention.self.value.bias", ("kv",), "attn_v"),
    LayerTensor("attention.output.dense.weight", ("hidden", "q"), "attn_output"),
    LayerTensor("attention.output.dense.bias", ("hidden",), "attn_output"),
    LayerTensor("attention.output.LayerNorm.weight", ("hidden",), "attn_output_norm"),
    LayerTensor("attention.output.LayerNorm.bias", ("hidden",), "attn_output_norm"),
    LayerTensor("intermediate.dense.weight", ("ffn", "hidden"), "ffn_up"),
    LayerTensor("intermediate.dense.bias", ("ffn",), "ffn_up"),
    LayerTensor("output.dense.weight", ("hidden", "ffn"), "ffn_down"),
    LayerTensor("output.dense.bias", ("hidden",), "ffn_down"),
    LayerTensor("output.LayerNorm.weight", ("hidden",), "layer_output_norm"),
    LayerTensor("output.LayerNorm.bias", ("hidden",), "layer_output_norm"),
)


def embedding_tensors(prefix: str, positions_last: bool = False) -> tuple[OuterTensor, ...]:
    """`prefix.embeddings`' tensors in state_dict order (RoBERTa's lists the position table after
    the LayerNorm): word, position and token-type tables, and the LayerNorm over their sum."""
    word = OuterTensor(f"{prefix}.embeddings.word_embeddings.weight", ("vocab", "hidden"), "embedding")
    positions = OuterTensor(f"{prefix}.embeddings.position_embeddings.weight", ("positions", "hidden"), "embedding")
    types = OuterTensor(f"{prefix}.embeddings.token_type_embeddings.weight", ("types", "hidden"), "embedding")
    norm = (OuterTensor(f"{prefix}.embeddings.LayerNorm.weight", ("hidden",), "block"),
            OuterTensor(f"{prefix}.embeddings.LayerNorm.bias", ("hidden",), "block"))
    return (word, types, *norm, positions) if positions_last else (word, positions, types, *norm)


# The encoder family's fields beside its names and outer tensors (bert.py, roberta.py)
ENCODER_FIELDS = dict(
    kind="encoder",
    norm="layer",
    norm_placement="post",
    hidden_sites=("attn_output_norm", "layer_output_norm"),
    layer_tensors=ENCODER_LAYER,
    final_norm=None,
    output_embedding=None,
    rotary=None,
    attention_path="attention.self",
    head_dim_attr="attention_head_size",
    group_size_attr=None,
    config_head_dim=False,
    modules_to_save=("classifier",),
)
