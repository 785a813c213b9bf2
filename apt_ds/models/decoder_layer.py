"""The tensors every decoder family here shares: LLaMA's decoder layer, and the checkpoint
tensor that older transformers saved beside it."""

from __future__ import annotations

from apt_ds.models.tensors import LayerTensor, LeftOut

ATTENTION_WEIGHTS = (
    LayerTensor("self_attn.q_proj.weight", ("q", "hidden"), "attn_q"),
    LayerTensor("self_attn.k_proj.weight", ("kv", "hidden"), "attn_k"),
    LayerTensor("self_attn.v_proj.weight", ("kv", "hidden"), "attn_v"),
    LayerTensor("self_attn.o_proj.weight", ("hidden", "q"), "attn_output"),
)
MLP_AND_NORMS = (
    LayerTensor("mlp.gate_proj.weight", ("ffn", "hidden"), "ffn_gate"),
    LayerTensor("mlp.up_proj.weight", ("ffn", "hidden"), "ffn_up"),
    LayerTensor("mlp.down_proj.weight", ("hidden", "ffn"), "ffn_down"),
    LayerTensor("input_layernorm.weight", ("hidden",), "attn_norm"),
    LayerTensor("post_attention_layernorm.weight", ("hidden",), "ffn_norm"),
)
# Checkpoints saved by transformers before 4.31 hold each layer's rotary table; it is a function
# of the config (rope_theta, head_dim), rebuilt at load, never a trained weight.
ROTARY_TABLE = LeftOut(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", "the rotary table is rebuilt from the config")
# LLaMA's projection names (PEFT's usual `target_modules`) by role: `--adapter-targets q_proj`
# means the query projection in any family
DECODER_PROJECTION_ROLES = {t.module.rsplit(".", 1)[-1]: t.role for t in ATTENTION_WEIGHTS + MLP_AND_NORMS if len(t.dims) == 2}
