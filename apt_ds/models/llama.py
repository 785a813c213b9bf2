"""LLaMA 1, 2 and 3.x (transformers' LlamaForCausalLM; llama.cpp's `llama`, `deci` when non-uniform)."""

from __future__ import annotations

from apt_ds.models import Family, LeftOut

LLAMA = Family(
    model_type="llama",
    names="LLaMA 1/2/3.x",
    left_out=(
        # Checkpoints saved by transformers before 4.31 hold each layer's rotary table; it is a
        # function of the config (rope_theta, head_dim), rebuilt at load, never a trained weight.
        LeftOut(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", "the rotary table is rebuilt from the config"),
    ),
)
