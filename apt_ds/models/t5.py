"""T5 v1.0 and v1.1 (transformers' T5ForConditionalGeneration): an encoder stack and a decoder
stack of pre-norm blocks (T5LayerNorm: an RMSNorm without a mean), no biases, heads of d_kv
channels whose scores are not scaled, and a relative position bias table in each stack's first
self-attention that every layer of the stack adds to its scores (kept whole here, each layer
reading its own heads' columns: apt_ds.algorithm.position_bias). One embedding, `shared`, feeds
both stacks and is the LM head; v1.0 scales the decoder's output by d_model ** -0.5 before it
(`scale_decoder_outputs`). v1.0's FFN is ReLU (wi, wo), v1.1's gated GELU (wi_0, wi_1, wo).

A decoder block is two unit layers on the same module, its self-attention, then its
cross-attention with the FFN, so that each unit layer has one set of heads (the pruner's KV
groups: a head each) and at most one FFN. Unit layers: the encoder's, the decoder's
self-attentions, the decoder's cross-attentions."""

from __future__ import annotations

from apt_ds.models.family import Family, LeftOut, OuterTensor
from apt_ds.models.layer_kind import LayerKind, Stack
from apt_ds.models.tensors import LayerTensor


def _attention(sublayer: str, module: str) -> tuple[LayerTensor, ...]:
    path = f"layer.{sublayer}.{module}"
    return (LayerTensor(f"{path}.q.weight", ("q", "hidden"), "attn_q"),
            LayerTensor(f"{path}.k.weight", ("kv", "hidden"), "attn_k"),
            LayerTensor(f"{path}.v.weight", ("kv", "hidden"), "attn_v"),
            LayerTensor(f"{path}.o.weight", ("hidden", "q"), "attn_output"),
            LayerTensor(f"layer.{sublayer}.layer_norm.weight", ("hidden",), "attn_norm"))


def _ffn(sublayer: str, gated: bool) -> tuple[LayerTensor, ...]:
    path = f"layer.{sublayer}.DenseReluDense"
    rows = ((LayerTensor(f"{path}.wi_0.weight", ("ffn", "hidden"), "ffn_gate"),
             LayerTensor(f"{path}.wi_1.weight", ("ffn", "hidden"), "ffn_up")) if gated
            else (LayerTensor(f"{path}.wi.weight", ("ffn", "hidden"), "ffn_up"),))
    return rows + (LayerTensor(f"{path}.wo.weight", ("hidden", "ffn"), "ffn_down"),
                   LayerTensor(f"layer.{sublayer}.layer_norm.weight", ("hidden",), "ffn_norm"))


# Each stack's first self-attention holds the relative position bias table every layer of the stack reads
BIAS_TABLE = {stack: f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias" for stack in ("encoder", "decoder")}
RELATIVE_BIAS = {stack: f"{table}.weight" for stack, table in BIAS_TABLE.items()}

# T5Attention keeps its head geometry as key_value_proj_dim, n_heads and inner_dim; its scores are never scaled
_T5_HEADS = dict(head_dim_attr="key_value_proj_dim", group_size_attr=None,
                 head_attributes=(("n_heads", "heads"), ("inner_dim", "width")))


def _encoder_layer(gated: bool) -> LayerKind:
    return LayerKind(_attention("0", "SelfAttention") + _ffn("1", gated), name=f"T5 encoder ({'gated' if gated else 'ReLU'} FFN)",
                     attention_path="layer.0.SelfAttention", position_bias=BIAS_TABLE["encoder"], **_T5_HEADS)


def _decoder_cross_layer(gated: bool) -> LayerKind:
    return LayerKind(_attention("1", "EncDecAttention") + _ffn("2", gated),
                     name=f"T5 decoder cross-attention ({'gated' if gated else 'ReLU'} FFN)", side="target",
                     position_bias="zeros",
                     attention_path="layer.1.EncDecAttention", **_T5_HEADS)


DECODER_SELF_ATTENTION = LayerKind(_attention("0", "SelfAttention"), name="T5 decoder self-attention",
                                   hidden_sites=("attn_output",), attention_path="layer.0.SelfAttention", side="target",
                                   position_bias=BIAS_TABLE["decoder"], **_T5_HEADS)

T5 = Family(
    model_type="t5",
    names="T5 (v1.0, v1.1)",
    config_class="T5Config",
    causal_lm_class="T5ForConditionalGeneration",
    layer_tensors=(),
    stacks=(Stack("encoder.block", _encoder_layer(False), "num_layers", ("is_gated_act", False)),
            Stack("encoder.block", _encoder_layer(True), "num_layers", ("is_gated_act", True)),
            Stack("decoder.block", DECODER_SELF_ATTENTION, "num_decoder_layers"),
            Stack("decoder.block", _decoder_cross_layer(False), "num_decoder_layers", ("is_gated_act", False)),
            Stack("decoder.block", _decoder_cross_layer(True), "num_decoder_layers", ("is_gated_act", True))),
    kind="seq2seq",
    embedding="shared.weight",
    final_norm=None,
    output_embedding="lm_head.weight",
    # transformers 5's T5Config sets tie_word_embeddings true whatever config.json says, and keeps
    # what it said as scale_decoder_outputs: v1.0 ties and scales; v1.1 / FLAN-T5 have their own head
    tie_flag="scale_decoder_outputs",
    layers="encoder.block",
    rotary=None,
    outer=(OuterTensor("shared.weight", ("vocab", "hidden"), "embedding"),
           OuterTensor(RELATIVE_BIAS["encoder"], ("buckets", "heads"), "block"),
           OuterTensor("encoder.final_layer_norm.weight", ("hidden",), "block"),
           OuterTensor(RELATIVE_BIAS["decoder"], ("buckets", "heads"), "block"),
           OuterTensor("decoder.final_layer_norm.weight", ("hidden",), "block"),
           OuterTensor("lm_head.weight", ("vocab", "hidden"), "embedding")),
    embedding_aliases=("encoder.embed_tokens", "decoder.embed_tokens"),
    left_out=(LeftOut(r"(encoder|decoder)\.embed_tokens\.weight", "the stacks' views of `shared`, written once as "
                                                                  "shared.weight"),),
    ffn_config="d_ff",
    output_scale=("scale_decoder_outputs", "decoder.final_layer_norm", "model_dim"),
)
