"""The files of an export: safetensors weights (sharded like save_pretrained), config.json with
every layer's shape, generation config, tokenizer and a report, written into a hidden temporary
sibling and renamed into place in one step, so an interrupted export leaves nothing that loads."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from apt_ds.algorithm.position_bias import BIAS_HEAD_INDEX
from apt_ds.algorithm.units import BIAS_HEADS, ModelShape
from apt_ds.config import ConfigError
from apt_ds.export.accounting import check_every_base_tensor_written
from apt_ds.export.checks import check_export_tensor, dtype_name
from apt_ds.export.out_dir import REPORT_FILE, recover_interrupted_overwrite, remove_stale_temporaries
from apt_ds.io import run_lock
from apt_ds.io.checkpoint import is_disk_full, megabytes
from apt_ds.io.permissions import make_readable
from apt_ds.io.tokenizer import is_tokenizer_file
from apt_ds.models import family_for

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SHARD_SIZE = "5GB"  # as transformers' save_pretrained
EXPORT_FORMATS = ("hf", "gguf")  # hf: safetensors + config directory; gguf: one llama.cpp file (export.gguf)
GGUF_ONLY_DTYPES = ("q8_0",)


def exported_config(model_config, shape: ModelShape) -> dict:
    config = model_config.to_dict()
    for key in ("apt_layer_shapes", "_name_or_path", "transformers_version", "quantization_config"):
        config.pop(key, None)
    family = family_for(config.get("model_type"))
    names = getattr(family.classes()[0], "attribute_map", {})  # T5's config calls hidden_size d_model, ...
    config["architectures"] = [family.causal_lm_class]
    first = shape.layers[0]
    config.update({names.get("hidden_size", "hidden_size"): shape.hidden,
                   names.get("num_attention_heads", "num_attention_heads"): first.num_q_heads,
                   family.ffn_config: shape.config_ffn})
    if family.config_head_dim:
        config[names.get("head_dim", "head_dim")] = first.head_dim
        if family.kind != "seq2seq":  # T5's heads are never grouped
            config["num_key_value_heads"] = first.num_kv_groups
    else:  # BERT's config has neither (its heads are hidden_size / heads wide): the shrink's notes go
        config.pop("head_dim", None)
        config.pop("num_key_value_heads", None)
    for key, value in transformers4_rope(config).items():
        config.setdefault(key, value)
    if stock_loadable(shape):
        for key in (BIAS_HEAD_INDEX, BIAS_HEADS):  # every head kept: the stock bias sharing is right
            config.pop(key, None)
    else:
        config["apt_layer_shapes"] = [layer.to_dict() for layer in shape.layers]
        if shape.heads:  # T5: its bias tables keep every original head, whatever num_heads says
            config[BIAS_HEADS] = shape.heads
        if shape.hidden % first.num_q_heads and family.kind != "seq2seq":  # T5's d_kv is its own
            # The configs refuse hidden % heads != 0; per-layer shapes are authoritative anyway.
            config["num_attention_heads"] = 1
            if family.config_head_dim:
                config["num_key_value_heads"] = 1
    return config


def transformers4_rope(config: dict) -> dict:
    """transformers 5 writes RoPE as `rope_parameters`; 4.x, and tools that read config.json as 4.x
    wrote it (older vLLM and TGI, llama.cpp's converter), read `rope_theta` and `rope_scaling`
    (None when unscaled). Both are written, with the same values; transformers 5 reads either."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        return {}
    scaled = rope.get("rope_type", rope.get("type", "default")) != "default"
    return {"rope_theta": rope["rope_theta"],
            "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if scaled else None}


def stock_loadable(shape: ModelShape) -> bool:
    """The family's stock config describes the model: every layer alike and a hidden size that
    transformers accepts for that head count (it requires hidden % num_attention_heads == 0; a
    config without head_dim, BERT's, also hidden == heads x head_dim)."""
    first = shape.layers[0]
    if not family_for(shape.family).config_head_dim and shape.hidden != first.num_q_heads * first.head_dim:
        return False
    if shape.heads:  # T5: a stack's layers share its bias table's heads; its d_kv is not hidden / heads
        return shape.uniform and first.num_q_heads == shape.heads
    return shape.uniform and shape.hidden % first.num_q_heads == 0


def write_export(model, shape: ModelShape, out: Path, dtype: torch.dtype, tokenizer_dir: Path | None = None,
                 extra_report: dict | None = None, max_shard_size: str | int = DEFAULT_SHARD_SIZE,
                 base_names: list[str] | None = None, base: str = "the model") -> dict:
    """Atomically write an in-memory model's weights (safetensors shards + index when sharded),
    config, generation config, tokenizer and report into `out`.

    Not through `save_pretrained`: the streaming export, which never holds a model, must write
    the same files as this in-memory path, and save_pretrained cannot stream; it would also refuse
    the config of a pruned hidden size that is not a multiple of the head count (e.g. 121 with 4
    heads: LlamaConfig's validation). Both paths shard with huggingface_hub's splitter, which is
    what save_pretrained uses, and name the files as it does. `base_names`: the base checkpoint's
    tensors, every one of which must be written or left out on purpose (default: the model's own)."""
    def save_weights(directory: Path) -> int:
        state, family = model.state_dict(), family_for(model.config.model_type)
        full = {k: v.detach() for k, v in state.items() if not family.left_out_on_purpose(k, shape.tied_embeddings)}
        check_every_base_tensor_written(state if base_names is None else base_names, full, family, shape.tied_embeddings, base)
        state_dict = {k: v.to(dtype).contiguous() for k, v in full.items()}
        for name, tensor in state_dict.items():
            check_export_tensor(name, full[name].float(), tensor, dtype_name(dtype))
        _save_shards(state_dict, directory, max_shard_size)
        return sum(v.numel() for v in state_dict.values())

    generation = getattr(model, "generation_config", None)  # a sequence classifier has none
    generation = generation.to_diff_dict() if generation is not None else None
    return write_export_dir(out, shape, save_weights, model.config, generation, dtype, tokenizer_dir, extra_report)


def write_export_dir(out: Path, shape: ModelShape, save_weights, config, generation: dict | None, dtype: torch.dtype,
                     tokenizer_dir: Path | None = None, extra_report: dict | None = None) -> dict:
    """Atomically write an export: `save_weights(directory)` writes the weights and returns the
    parameter count; then generation config, tokenizer, report and config.json (last)."""
    def fill(tmp: Path) -> dict:
        exported_params = save_weights(tmp)
        if generation is not None:  # None: a model that does not generate (a sequence classifier)
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=1))
        if tokenizer_dir is not None and tokenizer_dir.is_dir():
            for item in tokenizer_dir.iterdir():
                if item.is_file() and is_tokenizer_file(item.name):
                    shutil.copy2(item, tmp / item.name)
        report = {"final": summary(shape), "uniform": shape.uniform, "stock_loadable": stock_loadable(shape),
                  "exported_params": exported_params, **(extra_report or {})}
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=1))
        exported = exported_config(config, shape)
        exported["dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        (tmp / "config.json").write_text(json.dumps(exported, indent=1))
        return report

    dtype_key = {value: key for key, value in DTYPES.items()}[dtype]
    return write_atomically(out, fill, export_bytes(shape, dtype_key))


def write_atomically(out: Path, fill, needed_bytes: int | None = None) -> dict:
    """`fill(directory)` writes an export's files and returns its report; they appear as `out`
    all at once. Everything goes into a hidden temporary sibling, then one rename: a killed
    export leaves at most a `.NAME.tmp-*` directory, which the next export removes; a full disk
    leaves nothing and says how much space it needed (`needed_bytes`, about)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with run_lock.held(out, "export"):  # held from the start by launch/export.py; taken here where the parent was new
        recover_interrupted_overwrite(out)
        remove_stale_temporaries(out)  # another export's would go too: hence the lock
        return _fill_and_rename(out, fill, needed_bytes)


def _fill_and_rename(out: Path, fill, needed_bytes: int | None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        report = fill(tmp)
        # the files this export wrote: a later --overwrite replaces these and refuses anything else
        report = {**report, "files": sorted(item.name for item in tmp.iterdir())}
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=1))
        make_readable(tmp)  # mkdtemp's 0700, safetensors' 0600: a serving user reads the export
        if out.exists():
            old = out.parent / f".{out.name}.old-{tmp.name.rsplit('-', 1)[-1]}"
            out.rename(old)  # the previous export is only deleted once the new one is in place
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial export would keep the disk full
        if isinstance(err, (OSError, SafetensorError, RuntimeError)) and is_disk_full(err):
            raise ExportDiskFullError(disk_full_message(out, needed_bytes)) from None
        raise
    return report


class ExportDiskFullError(ConfigError):
    """The disk filled up while an export was written; nothing of it was left behind."""


def disk_full_message(out: Path, needed_bytes: int | None) -> str:
    free = shutil.disk_usage(out.parent).free
    needs = f"it needs about {megabytes(needed_bytes)}, " if needed_bytes else ""
    kept = "the previous export in --out is unchanged" if (out / REPORT_FILE).is_file() else "nothing was written"
    return f"disk full while writing the export to {out}: {needs}{megabytes(free)} are free; {kept}. Free space and run again"


def export_bytes(shape: ModelShape, dtype: str) -> int:
    """About what an export of `shape` in `dtype` takes on disk (weights only; q8_0 stores 34 bytes per 32 weights)."""
    per_weight = {"fp32": 4, "bf16": 2, "fp16": 2, "q8_0": 34 / 32}[dtype]
    return int(shape.total_params() * per_weight)


def check_options(dtype: str, max_shard_size, format: str = "hf") -> None:
    from huggingface_hub.serialization._base import parse_size_to_int

    if format not in EXPORT_FORMATS:
        raise ConfigError(f"--format must be one of {list(EXPORT_FORMATS)}, got {format!r}")
    if format == "hf" and dtype in GGUF_ONLY_DTYPES:
        raise ConfigError(f"--dtype {dtype} is a GGUF quantisation: give --format gguf, or --dtype fp32, bf16 or fp16")
    if dtype not in DTYPES and dtype not in GGUF_ONLY_DTYPES:
        raise ConfigError(f"--dtype must be one of {sorted(DTYPES) + list(GGUF_ONLY_DTYPES)}, got {dtype!r}")
    try:
        size = max_shard_size if isinstance(max_shard_size, int) else parse_size_to_int(max_shard_size)
        if size <= 0:
            raise ValueError
    except (ValueError, TypeError, AttributeError):
        raise ConfigError(f"--max-shard-size must be a positive size in KB, MB, GB or TB (powers of 1000) such as 500MB "
                          f"or 5GB, got {max_shard_size!r}") from None
    if format == "gguf" and max_shard_size != DEFAULT_SHARD_SIZE:
        raise ConfigError("--max-shard-size applies to --format hf: a GGUF export is one file")


def _save_shards(state_dict: dict, directory: Path, max_shard_size) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(state_dict, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({name: state_dict[name] for name in names}, str(directory / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {**split.metadata, "total_size": sum(v.numel() * v.element_size() for v in state_dict.values())},
                 "weight_map": split.tensor_to_filename}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def weight_files(export_dir: Path) -> list[Path]:
    """The safetensors files of an export (one file, or the shards of its index)."""
    index = export_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted({export_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    return [export_dir / "model.safetensors"]


def summary(shape: ModelShape) -> dict:
    return {"hidden": shape.hidden, "block_params": shape.block_params(), "total_params": shape.total_params(),
            "layers": [layer.to_dict() for layer in shape.layers]}


