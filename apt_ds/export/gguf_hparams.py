"""A GGUF file's hyperparameters (sizes, head counts, norm eps, RoPE) as llama.cpp reads them,
and LLaMA-3.1's RoPE frequency factors as the tensor llama.cpp applies them from."""

from __future__ import annotations

import math

import torch

from apt_ds.algorithm.units import ModelShape
from apt_ds.config import ConfigError


def add_hparams(writer, arch: str, shape: ModelShape, sizes, config, name: str, dtype: str) -> None:
    import gguf

    layers = shape.layers
    head_dim = layers[0].head_dim
    per_layer = arch == "deci"
    writer.add_name(name)
    writer.add_file_type({"fp32": gguf.LlamaFileType.ALL_F32, "fp16": gguf.LlamaFileType.MOSTLY_F16,
                          "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(sizes.hidden)
    writer.add_block_count(len(layers))
    ffn = sizes.ffn
    heads = [layer.num_q_heads for layer in layers]
    kv_heads = [layer.num_kv_groups for layer in layers]
    writer.add_feed_forward_length(ffn if per_layer else ffn[0])
    writer.add_head_count(heads if per_layer else heads[0])
    writer.add_head_count_kv(kv_heads if per_layer else kv_heads[0])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps) * sizes.norm_scale**2)
    writer.add_vocab_size(shape.vocab)
    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind not in ("default", "llama3"):  # llama3: rope_freqs.weight, see rope_freqs
        raise ConfigError(f"RoPE type {kind!r} is not supported by the GGUF export (default, linear and llama3 are)")


def rope_parameters(config) -> dict:
    """transformers 5 keeps rope_theta and the scaling in `rope_parameters`, 4.x in rope_theta / rope_scaling."""
    values = dict(getattr(config, "rope_parameters", None) or {})
    values.update(getattr(config, "rope_scaling", None) or {})
    if getattr(config, "rope_theta", None) is not None:
        values.setdefault("rope_theta", config.rope_theta)
    return values


def rope_freqs(config, head_dim: int) -> torch.Tensor | None:
    """LLaMA-3.1's frequency-dependent RoPE scaling as llama.cpp applies it: a per-frequency
    divisor tensor (convert_hf_to_gguf's LlamaModel.generate_extra_tensors)."""
    rope = rope_parameters(config)
    if (rope.get("rope_type") or rope.get("type")) != "llama3":
        return None
    base = float(rope.get("rope_theta", 10000.0))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_context = float(rope.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)
