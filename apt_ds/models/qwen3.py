"""Qwen3 (transformers' Qwen3ForCausalLM): LLaMA's layer with an RMSNorm over each query and key
head (`q_norm`, `k_norm`: head_dim weights shared by the heads, so kept whole when heads go)."""

from __future__ import annotations

from apt_ds.models.family import ATTENTION_WEIGHTS, MLP_AND_NORMS, Family, LayerTensor

QWEN3 = Family(
    model_type="qwen3",
    names="Qwen3",
    config_class="Qwen3Config",
    causal_lm_class="Qwen3ForCausalLM",
    layer_tensors=ATTENTION_WEIGHTS + (
        LayerTensor("self_attn.q_norm.weight", ("head",), "attn_q_norm"),
        LayerTensor("self_attn.k_norm.weight", ("head",), "attn_k_norm"),
    ) + MLP_AND_NORMS,
    refused_config=(("attention_bias", "the published Qwen3 models have no attention biases"),),
    gguf_uniform="qwen3",
    gguf_non_uniform_why="llama.cpp's per-layer graph, deci, has no q/k norms",
    tiny_config={"head_dim": 32},  # Qwen3's default head_dim is 128
)
