"""LLaMA 1, 2 and 3.x (transformers' LlamaForCausalLM; llama.cpp's `llama`, `deci` when non-uniform)."""

from __future__ import annotations

from apt_ds.models.decoder_layer import ATTENTION_WEIGHTS, MLP_AND_NORMS, ROTARY_TABLE
from apt_ds.models.family import Family

LLAMA = Family(
    model_type="llama",
    names="LLaMA 1/2/3.x",
    config_class="LlamaConfig",
    causal_lm_class="LlamaForCausalLM",
    layer_tensors=ATTENTION_WEIGHTS + MLP_AND_NORMS,
    refused_config=(("attention_bias", "LLaMA checkpoints have no attention biases"),
                    ("mlp_bias", "LLaMA checkpoints have no MLP biases")),
    left_out=(ROTARY_TABLE,),
    gguf_uniform="llama",
    gguf_non_uniform="deci",  # llama.cpp's Nemotron-NAS graph: per-layer head counts and FFN widths
)
