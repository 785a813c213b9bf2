"""Export a run as a compact dense model: adapters merged, pruned units removed, shapes recorded.

Reads only the run's files (checkpoint/apt_state.json, trainable.safetensors, masks, the
tokenizer) and the original model, so it needs no DeepSpeed and works for any ZeRO stage or
world size. Output is written to a temporary sibling and renamed at the end: an interrupted
export leaves no directory that loads.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .adapters import merge_adapters
from .checkpoint import CheckpointError, read_meta
from .config import APTConfig
from .distill import TRANSFORM_ATTR
from .modeling import TINY_MODEL, build_tiny_llama, load_model
from .pruner import KeepDecision
from .state import APTModel
from .units import ModelShape

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def rebuild_trained_model(run_dir: Path):
    """The run's model as trained: original weights, shrunk, adapters loaded, masks installed."""
    checkpoint = run_dir / "checkpoint"
    meta = read_meta(checkpoint)
    info = meta["run_info"]
    apt = APTConfig.from_dict(meta["apt_config"])
    if info["model"] == TINY_MODEL:
        from .data import load_tokenizer

        tokenizer = load_tokenizer(run_dir / info.get("tokenizer", "tokenizer"))
        model = build_tiny_llama(vocab_size=len(tokenizer), seed=meta["train_config"]["seed"])
    else:
        model = load_model(info["model"])
    state = APTModel(model, apt, seed=meta["train_config"]["seed"])
    if state.original_shape.to_dict() != meta["original_shape"]:
        raise CheckpointError(f"{run_dir}: model {info['model']} does not match the checkpoint's original shapes")
    state.restore_architecture(meta["kept"], meta["ranks"])
    if state.shape.to_dict() != meta["shape"]:
        raise CheckpointError(f"{run_dir}: checkpoint shapes contradict its recorded config")
    try:
        trainable = load_file(str(checkpoint / "trainable.safetensors"))
        masks = load_file(str(checkpoint / "masks.safetensors"))
    except Exception as err:
        raise CheckpointError(f"{run_dir}: cannot read checkpoint tensors: {err}") from None
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in trainable.items():
            if name not in params or params[name].shape != tensor.shape:
                raise CheckpointError(f"{run_dir}: checkpoint tensor {name} {tuple(tensor.shape)} does not fit the rebuilt model")
            params[name].copy_(tensor)
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
        state.shrink(decision, gather=lambda params: contextlib.nullcontext())


def compact_model(model, state: APTModel):
    """Merge adapters and drop training-only modules; returns a plain LlamaForCausalLM."""
    if hasattr(model, TRANSFORM_ATTR):
        delattr(model, TRANSFORM_ATTR)
    merge_adapters(model)  # first: a mask on o_proj/down_proj inputs scales the adapter path too
    fold_masks(model, state)
    for param in model.parameters():
        param.requires_grad_(False)
    return model.eval()


def _config_dict(model, shape: ModelShape) -> dict:
    config = model.config.to_dict()
    for key in ("apt_layer_shapes", "_name_or_path", "transformers_version", "quantization_config"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["hidden_size"] = shape.hidden
    first = shape.layers[0]
    config.update(head_dim=first.head_dim, num_attention_heads=first.num_q_heads,
                  num_key_value_heads=first.num_kv_groups, intermediate_size=first.ffn)
    if not shape.uniform:
        config["apt_layer_shapes"] = [dict(layer.__dict__) for layer in shape.layers]
        if shape.hidden % first.num_q_heads:
            # LlamaConfig refuses hidden % heads != 0; per-layer shapes are authoritative anyway.
            config.update(num_attention_heads=1, num_key_value_heads=1)
    return config


def export_run(run_dir: Path, out: Path, dtype: str = "fp32", overwrite: bool = False) -> dict:
    run_dir, out = Path(run_dir), Path(out)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if out.exists() and not overwrite:
        raise FileExistsError(f"--out {out} already exists; pass --overwrite to replace it")
    model, state, meta = rebuild_trained_model(run_dir)
    original = ModelShape.from_dict(meta["original_shape"])
    model = compact_model(model, state)
    report = write_export(model, state.shape, out, DTYPES[dtype], tokenizer_dir=run_dir / meta["run_info"].get("tokenizer", "tokenizer"))
    report.update(original=_summary(original), run=str(run_dir), step=meta["step"], finished=meta["finished"])
    (out / "apt_export.json").write_text(json.dumps(report, indent=1))
    return report


def write_export(model, shape: ModelShape, out: Path, dtype: torch.dtype, tokenizer_dir: Path | None = None) -> dict:
    """Atomically write weights + config + generation config + tokenizer into `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        state_dict = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items() if "rotary" not in k}
        if shape.tied_embeddings:
            state_dict.pop("lm_head.weight", None)
        save_file(state_dict, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = _config_dict(model, shape)
        config["dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        generation = model.generation_config.to_dict() if model.generation_config is not None else {}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=1))
        if tokenizer_dir is not None and tokenizer_dir.is_dir():
            for item in tokenizer_dir.iterdir():
                if item.is_file() and _is_tokenizer_file(item.name):
                    shutil.copy2(item, tmp / item.name)
        report = {"final": _summary(shape), "uniform": shape.uniform,
                  "exported_params": sum(v.numel() for v in state_dict.values())}
        (tmp / "apt_export.json").write_text(json.dumps(report, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def _is_tokenizer_file(name: str) -> bool:
    """Tokenizer files only: a model directory also holds weights and a config we replace."""
    return (name.startswith(("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "chat_template"))
            or name.endswith(".model"))


def _summary(shape: ModelShape) -> dict:
    return {"hidden": shape.hidden, "block_params": shape.block_params(), "total_params": shape.total_params(),
            "layers": [dict(layer.__dict__) for layer in shape.layers]}


def export_pruned(model, kept: dict, out: Path, dtype: str = "fp32", tokenizer_dir: Path | None = None,
                  overwrite: bool = False) -> dict:
    """Export a plain LLaMA (adapters already merged, or none) pruned to `kept` ORIGINAL unit
    indices ({"groups": [[...] per layer], "neurons": [[...] per layer], "hidden": [...]}, as
    in a run's checkpoint/apt_state.json). Needs neither DeepSpeed nor a run directory."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"--out {out} already exists; pass --overwrite to replace it")
    from .shrink import shrink_model
    from .units import check_llama_model

    check_llama_model(model)
    original = ModelShape.from_model(model)
    try:
        groups = [torch.tensor(g, dtype=torch.long) for g in kept["groups"]]
        neurons = [torch.tensor(n, dtype=torch.long) for n in kept["neurons"]]
        hidden = torch.tensor(kept["hidden"], dtype=torch.long)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"kept-units record is malformed ({err}); expected groups/neurons/hidden lists") from None
    limits = [(g, l.num_kv_groups) for g, l in zip(groups, original.layers)] + [(n, l.ffn) for n, l in zip(neurons, original.layers)]
    if len(groups) != len(original.layers) or len(neurons) != len(original.layers) or any(
        len(ix) == 0 or int(ix.max()) >= size or int(ix.min()) < 0 for ix, size in limits + [(hidden, original.hidden)]
    ):
        raise CheckpointError("kept-units record does not fit this model (layer count or unit indices out of range)")
    shape, _ = shrink_model(model, original, groups, neurons, hidden)
    report = write_export(model.eval(), shape, out, DTYPES[dtype], tokenizer_dir=tokenizer_dir)
    report["original"] = _summary(original)
    (out / "apt_export.json").write_text(json.dumps(report, indent=1))
    return report
