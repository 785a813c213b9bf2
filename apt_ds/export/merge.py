"""Export a run as a compact dense model: adapters merged, pruned units removed, shapes recorded.

Reads only the run's files (checkpoint/apt_state.json, trainable.safetensors, masks, the
tokenizer) and the original model, so it needs no DeepSpeed and works for any ZeRO stage or
world size. Output is written to a temporary sibling and renamed at the end: an interrupted
export leaves no directory that loads.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from apt_ds.algorithm.adapters import merge_adapters
from apt_ds.io.checkpoint import CheckpointError, read_meta
from apt_ds.export.out_dir import REPORT_FILE, check_export_out, recover_interrupted_overwrite, remove_stale_temporaries
from apt_ds.config import APTConfig, ConfigError
from apt_ds.algorithm.distill import TRANSFORM_ATTR
from apt_ds.io.modeling import TINY_MODELS, ModelLoadError, build_tiny_llama, file_fingerprint, load_model, model_fingerprint, same_model
from apt_ds.algorithm.pruner import KeepDecision
from apt_ds.algorithm.state import APTModel
from apt_ds.algorithm.units import ModelShape, UnsupportedModelError
from apt_ds.io.weights import WeightsError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SHARD_SIZE = "5GB"  # as transformers' save_pretrained


def rebuild_trained_model(run_dir: Path, model_path: str | Path | None = None):
    """The run's model as trained: original weights, shrunk, adapters loaded, masks installed.

    `model_path` overrides the base model recorded in the run (a run moved to another machine).
    Every inconsistency of the run's files is reported as one CheckpointError."""
    checkpoint = run_dir / "checkpoint"
    meta = read_meta(checkpoint)
    try:
        return _rebuild(run_dir, checkpoint, meta, model_path)
    except (KeyError, IndexError, ValueError, TypeError, RuntimeError, AttributeError) as err:
        if isinstance(err, (CheckpointError, ModelLoadError, UnsupportedModelError)):
            raise
        detail = f"missing field {err}" if isinstance(err, KeyError) else str(err).splitlines()[0]
        raise CheckpointError(f"{run_dir}: checkpoint is inconsistent ({type(err).__name__}: {detail})") from None


def _rebuild(run_dir: Path, checkpoint: Path, meta: dict, model_path):
    info = meta["run_info"]
    apt = APTConfig.from_dict(meta["apt_config"])
    base = str(model_path) if model_path is not None else info["model"]
    if base in TINY_MODELS:
        from apt_ds.io.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(run_dir / info.get("tokenizer", "tokenizer"))
        model = build_tiny_llama(vocab_size=len(tokenizer), seed=meta["train_config"]["seed"], variant=base)
    else:
        if not Path(base).exists():
            raise CheckpointError(f"{run_dir}: its base model {base} does not exist here; pass --model PATH to the base model")
        model = load_model(base)
    recorded = info.get("model_fingerprint")
    if recorded is not None:
        if not same_model(recorded, model_fingerprint(model)):
            raise CheckpointError(f"{run_dir}: model {base} is not the base model this run was trained from")
    state = APTModel(model, apt, seed=meta["train_config"]["seed"])
    if state.original_shape.to_dict() != meta["original_shape"]:
        raise CheckpointError(f"{run_dir}: model {base} does not match the checkpoint's original shapes")
    state.restore_architecture(meta["kept"], meta["ranks"])
    if state.shape.to_dict() != meta["shape"]:
        raise CheckpointError(f"{run_dir}: checkpoint shapes contradict its recorded config")
    try:
        trainable = load_file(str(checkpoint / "trainable.safetensors"))
        masks = load_file(str(checkpoint / "masks.safetensors"))
    except Exception as err:
        raise CheckpointError(f"{run_dir}: cannot read checkpoint tensors: {err}") from None
    params = dict(model.named_parameters())
    missing = sorted(n for n, p in params.items() if p.requires_grad and n not in trainable)
    if missing:  # exporting untrained adapters silently would be a wrong model
        raise CheckpointError(f"{run_dir}: checkpoint/trainable.safetensors lacks {len(missing)} trained tensors, e.g. {missing[0]}")
    with torch.no_grad():
        for name, tensor in trainable.items():
            if name not in params or params[name].shape != tensor.shape:
                raise CheckpointError(f"{run_dir}: checkpoint tensor {name} {tuple(tensor.shape)} does not fit the rebuilt model")
            params[name].copy_(tensor)
    expected = state.masks.state_dict()
    if set(masks) != set(expected) or any(masks[k].shape != expected[k].shape for k in expected):
        raise CheckpointError(f"{run_dir}: checkpoint/masks.safetensors does not match the checkpoint's shapes")
    state.masks.load_state_dict(masks)
    return model, state, meta


def fold_masks(model, state: APTModel) -> None:
    """Remove units whose mask is 0; fold fractional group/neuron masks into o_proj/down_proj.

    The hidden mask is only exact when binary (RMSNorm averages over kept channels)."""
    masks = state.masks
    hidden = masks.hidden
    if not bool(((hidden == 0) | (hidden == 1)).all()):
        raise CheckpointError("the checkpoint was taken while hidden-channel masks were decaying; export a later checkpoint")
    with torch.no_grad():
        for layer, group_mask, neuron_mask, shape in zip(model.model.layers, masks.kv_group, masks.ffn_neuron, state.shape.layers):
            o_proj, down = layer.self_attn.o_proj, layer.mlp.down_proj
            o_proj.weight.mul_(group_mask.repeat_interleave(shape.group_size * shape.head_dim).to(o_proj.weight.dtype))
            down.weight.mul_(neuron_mask.to(down.weight.dtype))
    decision = KeepDecision([m > 0 for m in masks.kv_group], [m > 0 for m in masks.ffn_neuron], hidden > 0, 0)
    masks.remove()
    state.salience.remove()
    if decision.removes_anything():
        state.shrink(decision)


def compact_model(model, state: APTModel):
    """Merge adapters and drop training-only modules; returns a plain LlamaForCausalLM."""
    if hasattr(model, TRANSFORM_ATTR):
        delattr(model, TRANSFORM_ATTR)
    merge_adapters(model)  # first: a mask on o_proj/down_proj inputs scales the adapter path too
    fold_masks(model, state)
    for param in model.parameters():
        param.requires_grad_(False)
    return model.eval()


def _config_dict(model_config, shape: ModelShape) -> dict:
    config = model_config.to_dict()
    for key in ("apt_layer_shapes", "_name_or_path", "transformers_version", "quantization_config"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["hidden_size"] = shape.hidden
    first = shape.layers[0]
    config.update(head_dim=first.head_dim, num_attention_heads=first.num_q_heads,
                  num_key_value_heads=first.num_kv_groups, intermediate_size=first.ffn)
    if not stock_loadable(shape):
        config["apt_layer_shapes"] = [dict(layer.__dict__) for layer in shape.layers]
        if shape.hidden % first.num_q_heads:
            # LlamaConfig refuses hidden % heads != 0; per-layer shapes are authoritative anyway.
            config.update(num_attention_heads=1, num_key_value_heads=1)
    return config


def stock_loadable(shape: ModelShape) -> bool:
    """A plain LlamaConfig describes the model: every layer alike and a hidden size that
    transformers accepts for that head count (it requires hidden % num_attention_heads == 0)."""
    return shape.uniform and shape.hidden % shape.layers[0].num_q_heads == 0


def export_run(run_dir: Path, out: Path, dtype: str = "fp32", overwrite: bool = False,
               model_path: str | Path | None = None, max_shard_size: str | int = DEFAULT_SHARD_SIZE,
               streaming: bool | None = None) -> dict:
    """Export a run. A base model that is a safetensors directory is streamed tensor by tensor
    (apt_ds.export.streaming: memory for about one shard); the built-in tiny models and GGUF
    files are rebuilt in memory. `streaming=False` forces the in-memory path (same output)."""
    run_dir, out = Path(run_dir), Path(out)
    _check_options(dtype, max_shard_size)
    recorded_base = read_meta(run_dir / "checkpoint").get("run_info", {}).get("model")
    bases = [Path(p) for p in (model_path, recorded_base) if p is not None and str(p) not in TINY_MODELS]
    check_export_out(out, overwrite, protected=[run_dir, *bases])
    base = str(model_path) if model_path is not None else recorded_base
    if streaming is not False and base is not None and base not in TINY_MODELS and Path(base).is_dir():
        return _export_streaming(run_dir, out, Path(base), dtype, max_shard_size)
    model, state, meta = rebuild_trained_model(run_dir, model_path)
    original = ModelShape.from_dict(meta["original_shape"])
    model = compact_model(model, state)
    extra = {"original": _summary(original), "run": str(run_dir.resolve()), "step": meta["step"], "finished": meta["finished"]}
    return write_export(model, state.shape, out, DTYPES[dtype], tokenizer_dir=run_dir / meta["run_info"].get("tokenizer", "tokenizer"),
                        extra_report=extra, max_shard_size=max_shard_size)


def _export_streaming(run_dir: Path, out: Path, base: Path, dtype: str, max_shard_size) -> dict:
    from huggingface_hub.serialization._base import parse_size_to_int
    from safetensors import SafetensorError, safe_open

    from apt_ds.export.streaming import RunTensors, exported_config, generation_config, stream_weights

    checkpoint = run_dir / "checkpoint"
    meta = read_meta(checkpoint)
    try:
        weights = _checked_base(run_dir, base, meta)
    except WeightsError as err:
        raise CheckpointError(f"{run_dir}: cannot read its base model: {err}") from None
    try:
        masks = load_file(str(checkpoint / "masks.safetensors"))
        handle = safe_open(str(checkpoint / "trainable.safetensors"), framework="pt")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{run_dir}: cannot read checkpoint tensors: {str(err).splitlines()[0]}") from None
    try:
        _check_trained_tensors(run_dir, meta, masks, set(handle.keys()))
        tensors = RunTensors(weights, meta, handle, masks)
        missing = [name for name in tensors.names() if name not in weights]
        if missing:
            raise CheckpointError(f"{run_dir}: the base model {base} has no tensor {missing[0]} "
                                  f"({len(missing)} missing); is it the model this run was trained from?")
        config = exported_config(base, tensors.final_shape)
        size = max_shard_size if isinstance(max_shard_size, int) else parse_size_to_int(max_shard_size)
        extra = {"original": _summary(ModelShape.from_dict(meta["original_shape"])), "run": str(run_dir.resolve()),
                 "step": meta["step"], "finished": meta["finished"]}
        return write_export_dir(out, tensors.final_shape, lambda directory: stream_weights(tensors, directory, DTYPES[dtype], size),
                                config, generation_config(base, config), DTYPES[dtype],
                                tokenizer_dir=run_dir / meta["run_info"].get("tokenizer", "tokenizer"), extra_report=extra)
    except (KeyError, IndexError, ValueError, TypeError, RuntimeError) as err:
        if isinstance(err, (CheckpointError, ConfigError)):
            raise
        detail = f"missing field {err}" if isinstance(err, KeyError) else str(err).splitlines()[0]
        raise CheckpointError(f"{run_dir}: checkpoint is inconsistent ({type(err).__name__}: {detail})") from None


def _checked_base(run_dir: Path, base: Path, meta: dict):
    """The base model's weights, after checking it is the model the run was trained from."""
    from transformers import AutoConfig

    from apt_ds.io.weights import SafetensorsWeights

    if not (base / "config.json").is_file():
        raise CheckpointError(f"{run_dir}: its base model {base} has no config.json; pass --model PATH to the base model")
    weights = SafetensorsWeights(base)
    recorded = meta["run_info"].get("model_fingerprint")
    if recorded is not None and not same_model(recorded, file_fingerprint(base)):
        raise CheckpointError(f"{run_dir}: model {base} is not the base model this run was trained from")
    if ModelShape.from_config(AutoConfig.from_pretrained(str(base))).to_dict() != meta["original_shape"]:
        raise CheckpointError(f"{run_dir}: model {base} does not match the checkpoint's original shapes")
    return weights


def _check_trained_tensors(run_dir: Path, meta: dict, masks: dict, trained: set[str]) -> None:
    """Every adapter of the run has trained A and B, and the masks fit the run's shapes
    (exporting untrained adapters silently would be a wrong model)."""
    shape = ModelShape.from_dict(meta["shape"])
    targets = meta["apt_config"]["adapter_targets"]
    expected = [f"model.layers.{l}.{'self_attn' if t in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{t}.lora_{m}"
                for l in range(len(shape.layers)) for t in targets for m in "AB"]
    missing = [name for name in expected if name not in trained]
    if missing:
        raise CheckpointError(f"{run_dir}: checkpoint/trainable.safetensors lacks {len(missing)} trained tensors, e.g. {missing[0]}")
    sizes = {"hidden": shape.hidden, **{f"kv_group.{l}": s.num_kv_groups for l, s in enumerate(shape.layers)},
             **{f"ffn_neuron.{l}": s.ffn for l, s in enumerate(shape.layers)}}
    if set(masks) != set(sizes) or any(masks[k].shape != (n,) for k, n in sizes.items()):
        raise CheckpointError(f"{run_dir}: checkpoint/masks.safetensors does not match the checkpoint's shapes")


def write_export(model, shape: ModelShape, out: Path, dtype: torch.dtype, tokenizer_dir: Path | None = None,
                 extra_report: dict | None = None, max_shard_size: str | int = DEFAULT_SHARD_SIZE) -> dict:
    """Atomically write an in-memory model's weights (safetensors shards + index when sharded),
    config, generation config, tokenizer and report into `out`."""
    def save_weights(directory: Path) -> int:
        state_dict = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items() if "rotary" not in k}
        if shape.tied_embeddings:
            state_dict.pop("lm_head.weight", None)
        _save_shards(state_dict, directory, max_shard_size)
        return sum(v.numel() for v in state_dict.values())

    generation = model.generation_config.to_diff_dict() if model.generation_config is not None else {}
    return write_export_dir(out, shape, save_weights, model.config, generation, dtype, tokenizer_dir, extra_report)


def write_export_dir(out: Path, shape: ModelShape, save_weights, config, generation: dict, dtype: torch.dtype,
                     tokenizer_dir: Path | None = None, extra_report: dict | None = None) -> dict:
    """Atomically write an export: `save_weights(directory)` writes the weights and returns the
    parameter count; then generation config, tokenizer, report and config.json.

    Everything goes into a hidden temporary sibling, config.json last, then one rename: a
    killed export leaves at most a `.NAME.tmp-*` directory, which the next export removes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_interrupted_overwrite(out)
    remove_stale_temporaries(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        exported_params = save_weights(tmp)
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=1))
        if tokenizer_dir is not None and tokenizer_dir.is_dir():
            for item in tokenizer_dir.iterdir():
                if item.is_file() and _is_tokenizer_file(item.name):
                    shutil.copy2(item, tmp / item.name)
        report = {"final": _summary(shape), "uniform": shape.uniform, "stock_loadable": stock_loadable(shape),
                  "exported_params": exported_params, **(extra_report or {})}
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=1))
        config = _config_dict(config, shape)
        config["dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        _make_readable(tmp)
        if out.exists():
            old = out.parent / f".{out.name}.old-{tmp.name.rsplit('-', 1)[-1]}"
            out.rename(old)  # the previous export is only deleted once the new one is in place
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def _check_options(dtype: str, max_shard_size) -> None:
    from huggingface_hub.serialization._base import parse_size_to_int

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    try:
        size = max_shard_size if isinstance(max_shard_size, int) else parse_size_to_int(max_shard_size)
        if size <= 0:
            raise ValueError
    except (ValueError, TypeError, AttributeError):
        raise ConfigError(f"--max-shard-size must be a positive size such as 500MB or 5GB, got {max_shard_size!r}") from None


def _save_shards(state_dict: dict, directory: Path, max_shard_size) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(state_dict, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({name: state_dict[name] for name in names}, str(directory / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {**split.metadata, "total_size": sum(v.numel() * v.element_size() for v in state_dict.values())},
                 "weight_map": split.tensor_to_filename}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _make_readable(directory: Path) -> None:
    """mkdtemp makes a 0700 directory: give the export the permissions the umask allows, so a
    serving user other than the exporter can read it."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for item in directory.iterdir():
        item.chmod(0o666 & ~umask)


def weight_files(export_dir: Path) -> list[Path]:
    """The safetensors files of an export (one file, or the shards of its index)."""
    index = export_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted({export_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    return [export_dir / "model.safetensors"]


def _is_tokenizer_file(name: str) -> bool:
    """Tokenizer files only: a model directory also holds weights and a config we replace."""
    return (name.startswith(("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "chat_template"))
            or name.endswith(".model"))


def _summary(shape: ModelShape) -> dict:
    return {"hidden": shape.hidden, "block_params": shape.block_params(), "total_params": shape.total_params(),
            "layers": [dict(layer.__dict__) for layer in shape.layers]}


def kept_from_masks(path: str) -> dict:
    """Binary unit masks over the ORIGINAL model (`hidden`, `kv_group.<layer>`, `ffn_neuron.<layer>`,
    as `UnitMasks.state_dict()` names them) -> the kept-units record."""
    try:
        masks = load_file(path)
    except Exception as err:
        raise ConfigError(f"cannot read --kept {path}: {str(err).splitlines()[0]}") from None
    layers = sum(1 for key in masks if key.startswith("kv_group."))
    names = ["hidden"] + [f"{kind}.{i}" for i in range(layers) for kind in ("kv_group", "ffn_neuron")]
    if not layers or any(name not in masks for name in names):
        raise CheckpointError(f"--kept {path}: expected masks hidden, kv_group.<i>, ffn_neuron.<i> for every layer")
    if any(not bool(((m == 0) | (m == 1)).all()) for m in masks.values()):
        raise CheckpointError(f"--kept {path}: masks must be binary (0/1) to be exported; finish the decay first")

    def kept(name: str) -> list[int]:
        return masks[name].nonzero().flatten().tolist()

    return {"groups": [kept(f"kv_group.{i}") for i in range(layers)],
            "neurons": [kept(f"ffn_neuron.{i}") for i in range(layers)], "hidden": kept("hidden")}


def read_kept_record(kept) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """(groups per layer, neurons per layer, hidden) index tensors of a kept-units record, checked
    for form and duplicates (a unit listed twice would be copied twice)."""
    if not isinstance(kept, dict):
        raise CheckpointError("kept-units record is malformed: expected a JSON object with groups/neurons/hidden lists")
    try:
        lists = [*kept["groups"], *kept["neurons"], kept["hidden"]]
        if not all(isinstance(ix, list) and all(type(i) is int for i in ix) for ix in lists):
            raise TypeError("indices must be lists of integers")
        groups = [torch.tensor(g, dtype=torch.long) for g in kept["groups"]]
        neurons = [torch.tensor(n, dtype=torch.long) for n in kept["neurons"]]
        hidden = torch.tensor(kept["hidden"], dtype=torch.long)
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"kept-units record is malformed ({err}); expected groups/neurons/hidden lists") from None
    if any(ix.dim() != 1 or len(torch.unique(ix)) != len(ix) for ix in [*groups, *neurons, hidden]):
        raise CheckpointError("kept-units record lists a unit twice (or is not flat lists); every kept index must be unique")
    return groups, neurons, hidden


def export_pruned(model, kept: dict, out: Path, dtype: str = "fp32", tokenizer_dir: Path | None = None,
                  overwrite: bool = False, max_shard_size: str | int = DEFAULT_SHARD_SIZE) -> dict:
    """Export a plain LLaMA (adapters already merged, or none) pruned to `kept` ORIGINAL unit
    indices ({"groups": [[...] per layer], "neurons": [[...] per layer], "hidden": [...]}, as
    in a run's checkpoint/apt_state.json): the binary masks of the run, stated as the units
    they keep. Needs neither DeepSpeed nor a run directory."""
    out = Path(out)
    _check_options(dtype, max_shard_size)
    check_export_out(out, overwrite, protected=[tokenizer_dir] if tokenizer_dir else [])
    from apt_ds.algorithm.shrink import shrink_model
    from apt_ds.algorithm.units import check_llama_model

    check_llama_model(model)
    original = ModelShape.from_model(model)
    groups, neurons, hidden = read_kept_record(kept)
    limits = [(g, l.num_kv_groups) for g, l in zip(groups, original.layers)] + [(n, l.ffn) for n, l in zip(neurons, original.layers)]
    if len(groups) != len(original.layers) or len(neurons) != len(original.layers) or any(
        ix.dim() != 1 or len(ix) == 0 or int(ix.max()) >= size or int(ix.min()) < 0 for ix, size in limits + [(hidden, original.hidden)]
    ):
        raise CheckpointError("kept-units record does not fit this model (layer count or unit indices out of range)")
    shape, _ = shrink_model(model, original, groups, neurons, hidden)
    return write_export(model.eval(), shape, out, DTYPES[dtype], tokenizer_dir=tokenizer_dir,
                        extra_report={"original": _summary(original)}, max_shard_size=max_shard_size)
