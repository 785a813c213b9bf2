"""Qwen3 (transformers' Qwen3ForCausalLM): LLaMA's layer with an RMSNorm over each query and key
head (`q_norm`, `k_norm`: head_dim weights shared by the heads, so kept whole when heads go)."""

from __future__ import annotations

from apt_ds.models.decoder_layer import ATTENTION_WEIGHTS, MLP_AND_NORMS
from apt_ds.models.family import Family, LayerTensor

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
    # transformers' GGUF config map for qwen3 reads no head_dim (attention.key_length): 5.25 builds
    # hidden/heads-wide heads and fails on Qwen3-0.6B/1.7B/4B/32B, whose head_dim is 128
    gguf_input_why="transformers takes its head_dim to be hidden_size / heads",
    tiny_config={"head_dim": 32},  # Qwen3's default head_dim is 128
)
