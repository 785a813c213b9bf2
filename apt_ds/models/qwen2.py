"""Qwen2 and Qwen2.5 (transformers' Qwen2ForCausalLM): LLaMA's layer with biases on the q, k and
v projections (not on o_proj), sliced with their heads' rows. llama.cpp: `qwen2`; per-layer shapes
run as `deci`, whose graph adds q/k/v biases when the file holds them."""

from __future__ import annotations

from apt_ds.models.decoder_layer import MLP_AND_NORMS
from apt_ds.models.family import Family, LayerTensor

QWEN2 = Family(
    model_type="qwen2",
    names="Qwen2/Qwen2.5",
    config_class="Qwen2Config",
    causal_lm_class="Qwen2ForCausalLM",
    layer_tensors=(
        LayerTensor("self_attn.q_proj.weight", ("q", "hidden"), "attn_q"),
        LayerTensor("self_attn.q_proj.bias", ("q",), "attn_q"),
        LayerTensor("self_attn.k_proj.weight", ("kv", "hidden"), "attn_k"),
        LayerTensor("self_attn.k_proj.bias", ("kv",), "attn_k"),
        LayerTensor("self_attn.v_proj.weight", ("kv", "hidden"), "attn_v"),
        LayerTensor("self_attn.v_proj.bias", ("kv",), "attn_v"),
        LayerTensor("self_attn.o_proj.weight", ("hidden", "q"), "attn_output"),
    ) + MLP_AND_NORMS,
    gguf_uniform="qwen2",
    gguf_non_uniform="deci",
)
