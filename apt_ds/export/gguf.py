"""A pruned model as one GGUF file that stock llama.cpp runs, written tensor by tensor.

Architecture: the family description's (apt_ds/models): every layer alike -> its own (`llama`,
`qwen2`, `qwen3`); per-layer KV groups or FFN widths -> `deci` (llama.cpp's Nemotron-NAS graph,
src/models/deci.cpp), the only one that reads per-layer `attention.head_count`, `head_count_kv`
and `feed_forward_length` arrays, and that adds q/k/v biases when the file holds them (Qwen2's).
Tensors are named by their role (`blk.N.{role}.weight`), so every family's tensors, biases and
per-head norms included, are written by one plan. All get
`key_length == value_length == rope.dimension_count == head_dim`, so hidden may differ from
heads x head_dim. deci skips the attention of a layer with 0 heads (it then has no attention
tensors) and, with FFN width 0, skips the FFN *and drops that layer's attention output*: a
layer without neurons is written with one zero neuron instead (its FFN adds exactly 0).

For `llama` and `deci`, which rotate adjacent pairs, Q and K rows (and their biases) are permuted
per layer with that layer's head counts, as llama.cpp's converter (LlamaModel.permute) does; HF
rotates the two halves of a head, as llama.cpp's `qwen2` and `qwen3` (NEOX RoPE) do, so theirs
are written as they are.
Norms stay F32 (as the converter writes them). q8_0 quantizes rows in 32-wide blocks; APT keeps
widths at multiples of 32 by default (APTConfig.shape_multiple), but single-unit pruning, small
dimensions and other tools leave hidden sizes and FFN widths that are not; rather than fall back to F16 for
those matrices (llama.cpp's converter does, and a pruned Q8_0 file came out larger than the dense
one), the q8_0 export pads them with exactly-zero units. A zero neuron adds nothing (its gate and
up rows are 0). A zero hidden channel is 0 in the embedding and in every o_proj/down_proj output,
so it stays 0; RMSNorm then averages over D' = D + padding channels instead of D, which is undone
exactly by scaling the norm weights by sqrt(D / D') and writing eps x D / D' as the model's eps.
o_proj's rows (kept heads x head_dim) cannot be padded; when they do not fill whole blocks (e.g.
head_dim 100 with an odd number of heads kept) that matrix is written as F16.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from apt_ds.algorithm.units import ModelShape
from apt_ds.config import ConfigError
from apt_ds.export.accounting import check_every_base_tensor_written, check_gguf_reads_every_tensor
from apt_ds.export.checks import check_export_tensor
from apt_ds.export.gguf_hparams import add_hparams, rope_freqs
from apt_ds.models import family_for

GGUF_DTYPES = ("fp32", "fp16", "bf16", "q8_0")
BLOCK = {"q8_0": 32}  # row block of the quantized dtypes: hidden and FFN widths are padded to it
# llama.cpp architectures whose RoPE rotates adjacent pairs (llama_model_rope_type's NORM): HF's
# rotate-half Q/K rows are permuted for them; the others (NEOX) rotate halves, as HF does.
INTERLEAVED_ROPE = {"llama", "deci"}
ROPED = ("attn_q", "attn_k")  # the roles whose rows RoPE rotates


# llama.cpp loaders that size Q and attention's output by the hidden size rather than by heads x
# head_dim (llama-model.cpp's qwen2): once hidden is pruned apart from the heads, only the per-layer
# graph loads the shape.
Q_WIDTH_IS_HIDDEN = {"qwen2"}


def gguf_architecture(shape: ModelShape) -> str:
    """The family's own architecture when every layer is alike (it reads layer 0's head counts and
    FFN width for all) and its loader takes the shape; its per-layer one (`deci`) otherwise."""
    family, first = family_for(shape.family), shape.layers[0]
    alike = shape.uniform and first.num_kv_groups > 0
    if alike and family.gguf_uniform in Q_WIDTH_IS_HIDDEN and first.num_q_heads * first.head_dim != shape.hidden:
        alike = family.gguf_non_uniform is None  # no per-layer graph: the family's own refuses in its words
    return family.gguf_architecture(alike)


def llama_cpp_differences(config, arch: str) -> list[str]:
    """Where llama.cpp runs the file otherwise than transformers runs the HF export: none of the
    architectures written here applies a sliding attention window (Mistral v0.1's 4096), so past
    that many tokens of context the outputs differ."""
    window = sliding_window(config)
    if window is None or window >= int(config.max_position_embeddings):
        return []
    return [f"llama.cpp's {arch} attends to the whole context, not to this model's {window}-token sliding window: "
            f"with more than {window} tokens of context its outputs differ from transformers'"]


def gguf_package():
    try:
        import gguf
    except ImportError:
        raise ConfigError("--format gguf needs the gguf package: pip install 'apt-ds[gguf]' (or pip install gguf)") from None
    return gguf


class ModelTensors:
    """An in-memory compact model's tensors, as `streaming.RunTensors` gives a run's; every one of
    `base_names` (the base checkpoint's; default: the model's own) exported or left out on purpose."""

    def __init__(self, model, base_names: list[str] | None = None, base: str = "the model"):
        state, family = model.state_dict(), family_for(model.config.model_type)
        tied = bool(model.config.tie_word_embeddings)
        self.params = {name: p for name, p in state.items() if not family.left_out_on_purpose(name, tied)}
        check_every_base_tensor_written(state if base_names is None else base_names, self.params, family, tied, base)

    def names(self) -> list[str]:
        return list(self.params)

    def tensor(self, name: str) -> torch.Tensor:
        return self.params[name].detach().float()


def write_gguf(path: Path, shape: ModelShape, tensors, config, tokenizer_dir: Path | None, dtype: str) -> int:
    """Write `path`; `tensors.tensor(hf_name)` gives each exported fp32 tensor (HF names, HF
    layout), `config` is the exported model's transformers config. Returns the parameter count."""
    gguf = gguf_package()
    from apt_ds.export.gguf_vocab import add_vocab

    if dtype not in GGUF_DTYPES:
        raise ConfigError(f"--dtype must be one of {list(GGUF_DTYPES)} for a GGUF export, got {dtype!r}")
    arch = gguf_architecture(shape)
    writer = gguf.GGUFWriter(path, arch)
    try:
        sizes = PaddedSizes.of(shape, dtype)
        plan, reads, left_out = _plan(shape, sizes, config, dtype, arch)
        check_gguf_reads_every_tensor(tensors.names(), reads, left_out, family_for(config.model_type), arch)
        add_hparams(writer, arch, shape, sizes, config, path.stem, dtype)
        add_vocab(writer, tokenizer_dir, shape.vocab)
        for gguf_name, _, out_shape, qtype in plan:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            writer.add_tensor_info(gguf_name, out_shape, np.float32, math.prod(out_shape) // block * type_size,
                                   raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        count = 0
        for gguf_name, make, out_shape, qtype in plan:
            data = make(tensors)
            if tuple(data.shape) != tuple(out_shape):
                raise ConfigError(f"tensor {gguf_name} has shape {tuple(data.shape)}, expected {tuple(out_shape)}")
            count += data.numel()
            quantized = gguf.quantize(data.numpy(), qtype)
            check_export_tensor(gguf_name, data, quantized, dtype)
            writer.write_tensor_data(quantized)
        return count
    finally:
        writer.close()


class PaddedSizes:
    """Hidden size and per-layer FFN widths as written: rounded up to `block` (1: as they are)."""

    def __init__(self, hidden: int, ffn: list[int], block: int):
        self.hidden, self.real_hidden = _round_up(hidden, block), hidden
        self.ffn = [_round_up(_ffn_rows(f), block) for f in ffn]

    @classmethod
    def of(cls, shape: ModelShape, dtype: str) -> PaddedSizes:
        """The sizes a file of `dtype` holds: padded to its quantization block, as they are otherwise."""
        return cls(shape.hidden, [layer.ffn for layer in shape.layers], BLOCK.get(dtype, 1))

    @property
    def norm_scale(self) -> float:
        """RMSNorm over D' channels of which D are real: weights x sqrt(D / D') and eps x D / D' undo it."""
        return math.sqrt(self.real_hidden / self.hidden)

    def zero_padding(self, shape: ModelShape) -> dict:
        """Zero units added: hidden channels, and per layer FFN neurons (a 0-neuron layer's one zero neuron included)."""
        return {"hidden": self.hidden - self.real_hidden, "ffn": [p - layer.ffn for p, layer in zip(self.ffn, shape.layers)]}


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _pad(tensor: torch.Tensor, out_shape: tuple) -> torch.Tensor:
    if tuple(tensor.shape) == tuple(out_shape):
        return tensor
    if tensor.dim() != len(out_shape) or any(n > m for n, m in zip(tensor.shape, out_shape)):
        raise ConfigError(f"tensor of shape {tuple(tensor.shape)} does not fit the padded shape {tuple(out_shape)}")
    padded = torch.zeros(out_shape, dtype=tensor.dtype)
    padded[tuple(slice(0, n) for n in tensor.shape)] = tensor
    return padded


def _ffn_rows(ffn: int) -> int:
    return max(ffn, 1)  # a zero neuron rather than deci's FFN-free layer, which drops the attention output


def _plan(shape: ModelShape, sizes: PaddedSizes, config, dtype: str, arch: str) -> tuple[list, set[str], set[str]]:
    """(GGUF name, maker(tensors) -> fp32 tensor, shape, GGML type) for every tensor, in file order;
    the HF tensors it reads; those it leaves out on purpose (a `deci` layer without heads)."""
    import gguf

    family = family_for(shape.family)
    D, plan, reads, left_out = sizes.hidden, [], set(), set()

    def add(gguf_name: str, make, out_shape: tuple, hf_name: str | None):
        plan.append((gguf_name, lambda t: _pad(make(t), out_shape), out_shape, _ggml_type(out_shape, dtype)))
        if hf_name is not None:
            reads.add(hf_name)

    def norm(hf_name: str):
        return lambda t: t.tensor(hf_name) * sizes.norm_scale

    add("token_embd.weight", lambda t: t.tensor(family.embedding), (shape.vocab, D), family.embedding)
    freqs = rope_freqs(config, shape.layers[0].head_dim)
    if freqs is not None:
        plan.append(("rope_freqs.weight", lambda t: freqs, tuple(freqs.shape), gguf.GGMLQuantizationType.F32))
    for l, layer in enumerate(shape.layers):
        width = {"q": layer.num_q_heads * layer.head_dim, "kv": layer.num_kv_groups * layer.head_dim,
                 "ffn": sizes.ffn[l], "hidden": D, "head": layer.head_dim}
        for tensor in family.layer_tensors:
            hf_name = f"{family.layers}.{l}.{tensor.name}"
            if layer.num_kv_groups == 0 and tensor.attention:
                left_out.add(hf_name)  # deci: a layer with 0 heads has no attention (nor its norm)
                continue
            make = (norm(hf_name) if tensor.dims == ("hidden",)  # a norm over the (padded) residual stream
                    else _maker(hf_name, tensor, layer, arch in INTERLEAVED_ROPE))
            add(f"blk.{l}.{tensor.gguf_name}", make, tuple(width[axis] for axis in tensor.dims), hf_name)
    add("output_norm.weight", norm(family.final_norm), (D,), family.final_norm)
    if not shape.tied_embeddings:  # llama.cpp reuses token_embd when there is no output tensor
        add("output.weight", lambda t: t.tensor(family.output_embedding), (shape.vocab, D), family.output_embedding)
    return plan, reads, left_out


def _maker(hf_name: str, tensor, layer, interleaved_rope: bool):
    def make(tensors) -> torch.Tensor:
        if layer.ffn == 0 and "ffn" in tensor.dims:  # the zero neuron of _ffn_rows (padded by the plan)
            return torch.zeros((1,) * len(tensor.dims), dtype=torch.float32)
        value = tensors.tensor(hf_name)
        if interleaved_rope and tensor.role in ROPED:
            return _permute(value, layer.num_q_heads if tensor.role == "attn_q" else layer.num_kv_groups)
        return value
    return make


def _permute(value: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half head layout -> llama.cpp's interleaved pairs (convert_hf_to_gguf's permute),
    for a projection's rows and for its bias alike."""
    rows = value.shape[0]
    return value.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(value.shape)


def _ggml_type(out_shape: tuple, dtype: str):
    from gguf import GGMLQuantizationType as T

    if len(out_shape) == 1 or dtype == "fp32":
        return T.F32
    if dtype == "q8_0":  # hidden and FFN rows are padded to the block (module docstring); o_proj rows
        # are kept heads x head_dim, a multiple of 32 for head_dim 64/128 but not always (OpenLLaMA: 100)
        return T.Q8_0 if out_shape[-1] % BLOCK["q8_0"] == 0 else T.F16
    return {"fp16": T.F16, "bf16": T.BF16}[dtype]


def write_gguf_export(out: Path, shape: ModelShape, tensors, config, dtype: str, tokenizer_dir: Path | None,
                      extra_report: dict | None = None) -> dict:
    """Atomically write `out/<out's name>.gguf` (`out/<out's name>` when that ends in .gguf) and the
    report (apt_export.json), as an HF export is written."""
    import json

    from apt_ds.export.out_dir import REPORT_FILE
    from apt_ds.export.writer import export_bytes, summary, write_atomically

    name = out.name or "model"
    filename = name if name.endswith(".gguf") else f"{name}.gguf"  # --out m.gguf: m.gguf/m.gguf, not m.gguf.gguf

    def fill(tmp: Path) -> dict:
        exported_params = write_gguf(tmp / filename, shape, tensors, config, tokenizer_dir, dtype)
        report = {"final": summary(shape), "uniform": shape.uniform, "format": "gguf", "file": filename,
                  "gguf_architecture": gguf_architecture(shape), "dtype": dtype, "exported_params": exported_params,
                  "zero_padding": PaddedSizes.of(shape, dtype).zero_padding(shape),
                  "notes": llama_cpp_differences(config, gguf_architecture(shape)), **(extra_report or {})}
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=1))
        return report

    return write_atomically(out, fill, export_bytes(shape, dtype))


def sliding_window(config) -> int | None:
    """The attention window a config applies in transformers (None: full attention everywhere).
    transformers 5 names each layer's kind in `layer_types` (Qwen2's window is off unless
    use_sliding_window); Mistral's configs apply `sliding_window` whenever it is set."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    if layer_types is None and not getattr(config, "use_sliding_window", True):
        return None
    return int(window) if window else None
