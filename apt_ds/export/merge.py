"""Export a run as a compact dense model: adapters merged, pruned units removed, shapes recorded.

Reads only the run's files (checkpoint/apt_state.json, trainable.safetensors, masks, the
tokenizer) and the original model, so it needs no DeepSpeed and works for any ZeRO stage or
world size. Output is written to a temporary sibling and renamed at the end: an interrupted
export leaves no directory that loads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from apt_ds.algorithm.adapters import merge_adapters
from apt_ds.algorithm.distill import TRANSFORM_ATTR
from apt_ds.algorithm.finite import NonFiniteError
from apt_ds.algorithm.masks import is_binary
from apt_ds.algorithm.pruner import KeepDecision
from apt_ds.algorithm.quant import dequantize_linears
from apt_ds.algorithm.state import APTModel
from apt_ds.algorithm.units import ModelShape, UnsupportedModelError
from apt_ds.config import APTConfig, ConfigError
from apt_ds.export.accounting import base_names_as_the_model_names_them, check_every_base_tensor_written
from apt_ds.export.out_dir import check_export_out
from apt_ds.export.output_scale import fold_output_scale
from apt_ds.export.shared_bias import share_bias_tables
from apt_ds.export.writer import DEFAULT_SHARD_SIZE, DTYPES, check_options, summary, write_export, write_export_dir
from apt_ds.io.checkpoint import CheckpointError, read_meta
from apt_ds.io.fingerprint import file_fingerprint, model_fingerprint, same_model
from apt_ds.io.hub import resolve_model
from apt_ds.io.modeling import TINY_MODELS, ModelLoadError, build_tiny_model, check_model_path, load_model
from apt_ds.io.pinned import pinned_directory, replaced
from apt_ds.io.quantized import merge_quant, quantize_model
from apt_ds.io.weights import SafetensorsWeights, WeightsError
from apt_ds.models import ENCODERS, SEQ2SEQ, family_for, family_of


def rebuild_trained_model(run_dir: Path, model_path: str | Path | None = None, checkpoint: Path | None = None,
                          quant=None):
    """The run's model as trained: original weights, shrunk, adapters loaded, masks installed.

    `model_path` overrides the base model recorded in the run (a run moved to another machine);
    `checkpoint`: where its checkpoint is read (default RUN/checkpoint; `export_run` pins it).
    `quant` (apt_ds.algorithm.quant.BaseQuant): quantize the base as the run did, so that the
    model computes with the weights it trained on. Every inconsistency of the run's files is
    reported as one CheckpointError."""
    checkpoint = run_dir / "checkpoint" if checkpoint is None else checkpoint
    meta = read_meta(checkpoint)
    try:
        return _rebuild(run_dir, checkpoint, meta, model_path, quant)
    except (KeyError, IndexError, ValueError, TypeError, RuntimeError, AttributeError) as err:
        if isinstance(err, (CheckpointError, ModelLoadError, UnsupportedModelError)):
            raise
        detail = f"missing field {err}" if isinstance(err, KeyError) else str(err).splitlines()[0]
        raise CheckpointError(f"{run_dir}: checkpoint is inconsistent ({type(err).__name__}: {detail})") from None


def _rebuild(run_dir: Path, checkpoint: Path, meta: dict, model_path, quant):
    info = meta["run_info"]
    apt = APTConfig.from_dict(meta["apt_config"])
    base = str(model_path) if model_path is not None else info["model"]
    if base in TINY_MODELS:
        from apt_ds.io.tokenizer import load_tokenizer

        tokenizer_dir = run_dir / info.get("tokenizer", "tokenizer")
        tokenizer = load_tokenizer(tokenizer_dir)
        trained = meta.get("original_shape", {}).get("vocab")
        if trained is not None and len(tokenizer) != trained:  # the built-in model's vocabulary is its tokenizer's
            raise CheckpointError(f"{run_dir}: its tokenizer ({tokenizer_dir}) has {len(tokenizer)} pieces, not the {trained} "
                                  f"the run trained with: its files were changed or removed")
        model = build_tiny_model(vocab_size=len(tokenizer), seed=meta["train_config"]["seed"], variant=base)
    else:
        if not Path(base).exists() and model_path is None and info.get("model_name"):  # trained from a Hub name whose
            base = resolve_model(info["model_name"], f"{run_dir}: its base model")  # snapshot moved: the name's, here
        if not Path(base).exists():
            raise CheckpointError(f"{run_dir}: its base model {base} does not exist here; pass --model PATH to the base model")
        model = load_model(base, num_labels=info.get("num_labels"), seed=meta["train_config"]["seed"])
    recorded = info.get("model_fingerprint")
    if recorded is not None:
        # As training computed it: a directory's files (a tensor transformers does not load counts), else the model.
        current = file_fingerprint(base) if Path(base).is_dir() else model_fingerprint(model)
        if not same_model(recorded, current):
            raise CheckpointError(f"{run_dir}: model {base} is not the base model this run was trained from")
    if quant is not None:  # before the shrinks: they re-quantize cut blocks from these very weights
        quantize_model(model, quant)
    state = APTModel(model, apt, seed=meta["train_config"]["seed"])
    if state.original_shape != ModelShape.from_dict(meta["original_shape"]):  # a run from before families were recorded too
        raise CheckpointError(f"{run_dir}: model {base} does not match the checkpoint's original shapes")
    state.restore_architecture(meta["kept"], meta["ranks"])
    if state.shape != ModelShape.from_dict(meta["shape"]):
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
    masks, family = state.masks, family_of(model)
    hidden, units = masks.hidden, family.unit_layers(model)
    if not is_binary(hidden):
        raise CheckpointError("the checkpoint was taken while hidden-channel masks were decaying; export a later checkpoint")
    with torch.no_grad():
        for unit, group_mask, neuron_mask, shape in zip(units, masks.kv_group, masks.ffn_neuron, state.shape.layers):
            attn_output = unit.kind.layer_module(unit.module, "attn_output")
            attn_output.weight.mul_(group_mask.repeat_interleave(shape.group_size * shape.head_dim).to(attn_output.weight.dtype))
            if unit.kind.has_ffn:
                ffn_down = unit.kind.layer_module(unit.module, "ffn_down")
                ffn_down.weight.mul_(neuron_mask.to(ffn_down.weight.dtype))
    decision = KeepDecision([m > 0 for m in masks.kv_group], [m > 0 for m in masks.ffn_neuron], hidden > 0, 0)
    masks.remove()
    state.salience.remove()
    if decision.removes_anything():
        state.shrink(decision)


def compact_model(model, state: APTModel):
    """Merge adapters and drop training-only modules; returns the family's plain causal LM."""
    if hasattr(model, TRANSFORM_ATTR):
        delattr(model, TRANSFORM_ATTR)
    merge_adapters(model)  # first: a mask on o_proj/down_proj inputs scales the adapter path too
    dequantize_linears(model)  # a quantized base's projections without an adapter (--base-quant)
    fold_masks(model, state)
    fold_output_scale(model)  # T5 v1.0's output scale, at the pruned hidden size
    share_bias_tables(model, state)  # a uniform T5: its bias tables cut to the kept heads, as stock T5 shares them
    for param in model.parameters():
        param.requires_grad_(False)
    return model.eval()


def merge_and_compact(trainer):
    """A trained `APTrainer`'s model, adapters merged, pruned units removed: its family's model
    (LlamaForCausalLM, ...) in eval mode without masks, hooks or distillation parts (per-layer widths
    after a non-uniform run), in the dtype it trained in (export_run merges in fp32, writes `dtype`).
    The trainer cannot train on afterwards. One process or ZeRO-1/2 (ZeRO-3: `apt_ds.export_run`)."""
    if any(hasattr(p, "ds_id") for p in trainer.model.parameters()):  # ZeRO-3's mark (export knows no DeepSpeed)
        raise ValueError("a ZeRO-3 model is partitioned across ranks: export the run from its out_dir "
                         "(apt_ds.export_run or launch/export.py)")
    if not is_binary(trainer.state.masks.hidden):  # checked before compact_model merges anything
        raise ValueError("the hidden-channel masks are decaying toward the next pruning event: train past it "
                         "(to the end of the run) before compacting")
    return compact_model(trainer.model, trainer.state)


def export_run(run_dir: Path, out: Path, dtype: str = "fp32", overwrite: bool = False,
               model_path: str | Path | None = None, max_shard_size: str | int = DEFAULT_SHARD_SIZE,
               streaming: bool | None = None, format: str = "hf", merge_into: str | None = None) -> dict:
    """Export a run. A base model that is a safetensors directory is streamed tensor by tensor
    (apt_ds.export.streaming: memory for about one shard); the built-in tiny models and GGUF
    files are rebuilt in memory. `streaming=False` forces the in-memory path (same output).
    `format="gguf"` writes one llama.cpp file instead (apt_ds.export.gguf). `merge_into`: a
    --base-quant run's adapters go into the dequantized weights (None, the default) or "original"."""
    run_dir, out = Path(run_dir), Path(out)
    check_options(dtype, max_shard_size, format)
    if model_path is not None and str(model_path) not in TINY_MODELS:  # e.g. a run directory given as the base
        check_model_path(model_path, flag="--model")
    recorded = read_meta(run_dir / "checkpoint")
    recorded_base = recorded.get("run_info", {}).get("model")
    family_name = recorded["shape"].get("family") if isinstance(recorded.get("shape"), dict) else None
    not_causal = family_name in ENCODERS or family_name in SEQ2SEQ
    if not_causal and format == "gguf":  # before any work
        what = "sequence classifier" if family_name in ENCODERS else "encoder-decoder"
        raise UnsupportedModelError(f"{run_dir}: a {family_name} {what} has no GGUF export (llama.cpp runs decoders); "
                                    f"export --format hf")
    if format == "gguf" and "shape" in recorded:  # before any work: a shape llama.cpp cannot run is refused in one line
        from apt_ds.export.gguf import gguf_architecture

        try:
            shape = ModelShape.from_dict(recorded["shape"])
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CheckpointError(f"{run_dir}: checkpoint/apt_state.json has a malformed shape ({type(err).__name__}: {err})") from None
        gguf_architecture(shape)
    bases = [Path(p) for p in (model_path, recorded_base) if p is not None and str(p) not in TINY_MODELS]
    check_export_out(out, overwrite, protected=[run_dir, *bases], run_dir=run_dir)
    base = str(model_path) if model_path is not None else recorded_base
    # An encoder's export is rebuilt in memory (its task head is trained, not in the base's files), and T5's
    stream = streaming is not False and not not_causal and base is not None and base not in TINY_MODELS and Path(base).is_dir()
    quant = merge_quant(recorded, merge_into, run_dir)
    for attempt in range(CHECKPOINT_READS):
        with pinned_directory(run_dir / "checkpoint") as checkpoint:
            try:
                if stream:
                    return _export_streaming(run_dir, out, Path(base), dtype, max_shard_size, format, checkpoint, quant)
                return _export_in_memory(run_dir, out, model_path, dtype, max_shard_size, format, checkpoint, quant)
            except CheckpointError as err:
                # A run in training renamed its next checkpoint into place and deleted this one while
                # it was read: read the new one (the export's output is only renamed into place at the end).
                if attempt + 1 == CHECKPOINT_READS or not replaced(checkpoint, run_dir / "checkpoint"):
                    raise CheckpointError(str(err).replace(str(checkpoint), str(run_dir / "checkpoint"))) from None


CHECKPOINT_READS = 3  # a checkpoint every few seconds could outpace one read; more is a misconfigured run


def _export_in_memory(run_dir: Path, out: Path, model_path, dtype: str, max_shard_size, format: str,
                      checkpoint: Path, quant) -> dict:
    model, state, meta = rebuild_trained_model(run_dir, model_path, checkpoint, quant)
    base = str(model_path) if model_path is not None else meta["run_info"]["model"]
    on_disk = base not in TINY_MODELS and Path(base).is_dir()  # the files count: a tensor transformers did not load too
    model = compact_model(model, state)
    base_names = base_names_as_the_model_names_them(SafetensorsWeights(base), model.state_dict(), family_of(model)) \
        if on_disk else None
    extra, tokenizer_dir = _run_report(run_dir, meta), run_dir / meta["run_info"].get("tokenizer", "tokenizer")
    if format == "gguf":
        from apt_ds.export.gguf import ModelTensors, write_gguf_export

        return write_gguf_export(out, state.shape, ModelTensors(model, base_names, base), model.config, dtype, tokenizer_dir, extra)
    return write_export(model, state.shape, out, DTYPES[dtype], tokenizer_dir=tokenizer_dir, extra_report=extra,
                        max_shard_size=max_shard_size, base_names=base_names, base=base)


def _run_report(run_dir: Path, meta: dict) -> dict:
    """What the export's report says of the run: its original shape, and the step it was exported
    at out of the steps it was started for (a stopped run exports its last checkpoint)."""
    return {"original": summary(ModelShape.from_dict(meta["original_shape"])), "run": str(run_dir.resolve()),
            "step": meta["step"], "steps": meta.get("train_config", {}).get("steps"), "finished": meta["finished"]}


def _export_streaming(run_dir: Path, out: Path, base: Path, dtype: str, max_shard_size, format: str,
                      checkpoint: Path, quant) -> dict:
    from huggingface_hub.serialization._base import parse_size_to_int
    from safetensors import SafetensorError, safe_open

    from apt_ds.export.streaming import RunTensors, exported_config, generation_config, stream_weights

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
        tensors = RunTensors(weights, meta, handle, masks, quant)
        config = exported_config(base, tensors.final_shape)
        check_every_base_tensor_written(weights.names(), tensors.names(), family_for(config.model_type),
                                        tensors.current.tied_embeddings, str(base))
        size = max_shard_size if isinstance(max_shard_size, int) else parse_size_to_int(max_shard_size)
        extra = _run_report(run_dir, meta)
        if format == "gguf":  # streamed too: the GGUF writer asks for one tensor at a time
            from apt_ds.export.gguf import write_gguf_export

            return write_gguf_export(out, tensors.final_shape, tensors, config, dtype,
                                     run_dir / meta["run_info"].get("tokenizer", "tokenizer"), extra)
        return write_export_dir(out, tensors.final_shape, lambda directory: stream_weights(tensors, directory, DTYPES[dtype], size),
                                config, generation_config(base, config), DTYPES[dtype],
                                tokenizer_dir=run_dir / meta["run_info"].get("tokenizer", "tokenizer"), extra_report=extra)
    except (KeyError, IndexError, ValueError, TypeError, RuntimeError) as err:
        if isinstance(err, (CheckpointError, ConfigError, NonFiniteError)):
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
    if ModelShape.from_config(AutoConfig.from_pretrained(str(base))) != ModelShape.from_dict(meta["original_shape"]):
        raise CheckpointError(f"{run_dir}: model {base} does not match the checkpoint's original shapes")
    return weights


def _check_trained_tensors(run_dir: Path, meta: dict, masks: dict, trained: set[str]) -> None:
    """Every adapter of the run has trained A and B, and the masks fit the run's shapes
    (exporting untrained adapters silently would be a wrong model)."""
    shape = ModelShape.from_dict(meta["shape"])
    family, targets = family_for(shape.family), meta["apt_config"]["adapter_targets"]
    modules = {target: tensor.module for target, tensor in family.projections.items()}  # one unknown: "lacks" below
    expected = [f"{family.layer_prefix(l)}.{modules.get(t, t)}.lora_{m}"
                for l in range(len(shape.layers)) for t in targets for m in "AB"]
    missing = [name for name in expected if name not in trained]
    if missing:
        raise CheckpointError(f"{run_dir}: checkpoint/trainable.safetensors lacks {len(missing)} trained tensors, e.g. {missing[0]}")
    sizes = {"hidden": shape.hidden, **{f"kv_group.{l}": s.num_kv_groups for l, s in enumerate(shape.layers)},
             **{f"ffn_neuron.{l}": s.ffn for l, s in enumerate(shape.layers)}}
    if set(masks) != set(sizes) or any(masks[k].shape != (n,) for k, n in sizes.items()):
        raise CheckpointError(f"{run_dir}: checkpoint/masks.safetensors does not match the checkpoint's shapes")
