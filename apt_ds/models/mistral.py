"""Mistral (transformers' MistralForCausalLM): LLaMA's layer with a sliding attention window,
which lives in the config (`sliding_window`) and so reaches every HF export with it. llama.cpp
runs Mistral as `llama` (its converter writes Mistral's HF checkpoints so) and `deci`, neither of
which applies the window: the GGUF export says past which context length it differs."""

from __future__ import annotations

from apt_ds.models.decoder_layer import ATTENTION_WEIGHTS, MLP_AND_NORMS, ROTARY_TABLE
from apt_ds.models.family import Family

MISTRAL = Family(
    model_type="mistral",
    names="Mistral 7B v0.1-v0.3",
    config_class="MistralConfig",
    causal_lm_class="MistralForCausalLM",
    layer_tensors=ATTENTION_WEIGHTS + MLP_AND_NORMS,
    left_out=(ROTARY_TABLE,),
    gguf_uniform="llama",
    gguf_non_uniform="deci",
    tiny_config={"sliding_window": 128},  # shorter than the demo's sequences: it matters
)
