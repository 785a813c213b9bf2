"""Mistral (transformers' MistralForCausalLM): LLaMA's layer with a sliding attention window,
which lives in the config (`sliding_window`) and so reaches every export with it."""

from __future__ import annotations

from apt_ds.models.family import ATTENTION_WEIGHTS, MLP_AND_NORMS, ROTARY_TABLE, Family

MISTRAL = Family(
    model_type="mistral",
    names="Mistral 7B v0.1-v0.3",
    config_class="MistralConfig",
    causal_lm_class="MistralForCausalLM",
    layer_tensors=ATTENTION_WEIGHTS + MLP_AND_NORMS,
    left_out=(ROTARY_TABLE,),
)
