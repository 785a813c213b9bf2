"""A base model whose frozen projections are quantized as they load (`--base-quant`, QLoRA's
setting): from a safetensors directory tensor by tensor, each projection quantized on its device
as soon as it is read, so no full-precision copy of the model exists at any time; embeddings,
norms, biases and the LM head stay in the base dtype (apt_ds.algorithm.quant)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from apt_ds.algorithm.quant import BLOCKSIZE, BaseQuant, QuantizationError, bitsandbytes, is_quantized, quantize_linear
from apt_ds.config import ConfigError, TrainConfig
from apt_ds.models import family_for, family_of

# run_info's name for how a run stored its 4-bit projections (BaseQuant.pruned_axis_rows); runs
# without it stored every projection as the checkpoint holds it.
QUANT_LAYOUT = "pruned-axis-rows"
AS_STORED = "as-stored"


def base_quant_of(train: TrainConfig, dtype: torch.dtype, prunes: bool = True, zero3: bool = False) -> BaseQuant:
    """How the frozen projections are stored: --base-quant, computing in the base dtype; with the
    pruned axis as rows where the run prunes, as the checkpoint holds them (bitsandbytes' own
    kernels, transformers' layout) where it does not; 4-bit codes held in the base dtype under
    ZeRO-3, which partitions them (quant_storage)."""
    storage = dtype if zero3 and train.base_quant in ("nf4", "fp4") else torch.uint8
    return BaseQuant(train.base_quant, double_quant=train.double_quant, compute_dtype=dtype, pruned_axis_rows=prunes,
                     storage=storage)


def quant_layout(prunes: bool) -> str:
    """run_info's `quant_layout` of a quantized run that prunes or does not."""
    return QUANT_LAYOUT if prunes else AS_STORED


def merge_quant(meta: dict, merge_into: str | None, run_dir) -> BaseQuant | None:
    """How an export re-quantizes a run's base to merge into the dequantized weights it trained on,
    or None to merge into the original weights. `merge_into` None: dequantized for a --base-quant
    run (the export then computes exactly as the live model did, tests/training/
    test_quantized_base.py), original otherwise. The codes come from the weights rounded to the
    dtype the run computed in, as the run's own did (runs before it was recorded: fp32)."""
    if merge_into not in (None, "original", "dequantized"):
        raise ConfigError(f"--merge-into must be original or dequantized, got {merge_into!r}")
    train = meta.get("train_config", {})
    quantized = train.get("base_quant", "none") != "none"
    if merge_into == "dequantized" and not quantized:
        raise ConfigError(f"--merge-into dequantized: {run_dir} was trained on a full-precision base (no --base-quant); "
                          f"leave --merge-into out")
    if merge_into == "original" or not quantized:
        return None
    info = meta.get("run_info", {})  # runs without quant_layout: before 2026-12-07, stored as the checkpoint holds it
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        info.get("base_dtype", "float32")]
    return BaseQuant(train["base_quant"], double_quant=train.get("double_quant", True), compute_dtype=dtype,
                     pruned_axis_rows=info.get("quant_layout") == QUANT_LAYOUT)


def quantization_record(model, train: TrainConfig) -> dict:
    """What run_info records of a model's quantized base, read off the model itself (so a run made
    through the API, not the CLI, records it too): its layout and compute dtype, which an export
    needs to quantize the base again as the run held it. A model quantized otherwise than
    `train.base_quant` says is refused: the export would merge into other weights than it trained on."""
    quant = next((p.apt_quant for p in model.parameters() if is_quantized(p)), None)
    method = quant.method if quant is not None else "none"
    if method != train.base_quant:
        raise ConfigError(f"the model's projections are {'stored ' + method if quant else 'not quantized'} but "
                          f"TrainConfig.base_quant is {train.base_quant!r}: set base_quant={method!r}")
    if quant is None:
        return {}
    if method != "int8" and quant.double_quant != train.double_quant:
        raise ConfigError(f"the model's {method} projections were quantized with double_quant={quant.double_quant} "
                          f"but TrainConfig.double_quant is {train.double_quant}: set them alike")
    return {"quant_layout": quant_layout(quant.pruned_axis_rows),
            "base_dtype": str(quant.compute_dtype).removeprefix("torch.")}


def saved_quant_layout(meta: dict) -> str | None:
    """The layout a run's checkpoint stored its quantized base in (runs before 2026-12-07 recorded
    none: as the checkpoint holds it), or None for a full-precision run."""
    if meta["train_config"].get("base_quant", "none") == "none":
        return None
    return meta["run_info"].get("quant_layout", AS_STORED)


def check_quant_layout(checkpoint: Path, run_info: dict) -> None:
    """CheckpointError unless the checkpoint's base was stored in the layout of the model about to
    resume it (`run_info` from `quantization_record`): the codes are quantized again on resume."""
    from apt_ds.io.checkpoint import CheckpointError, read_meta

    saved, now = saved_quant_layout(read_meta(checkpoint)), run_info.get("quant_layout")
    if saved is not None and now is not None and saved != now:
        raise CheckpointError(f"{checkpoint}: the run stored its quantized base {saved}, the model to resume it is "
                              f"stored {now} (BaseQuant.pruned_axis_rows); quantize it as the run did, or train again")


def check_quantizable_base(model: str, quant: BaseQuant, zero_stage: int | None, device: torch.device) -> None:
    """What cannot be quantized here, in one line each, before anything loads. `zero_stage`: the
    --deepspeed JSON's ZeRO stage (None: one process).

    ZeRO-1/2 partition only the optimizer's state (the adapters'): every rank holds the frozen
    quantized base whole and quantizes it identically from the files. ZeRO-3 partitions the 4-bit
    codes themselves, held in the engine's dtype (bitsandbytes' quant_storage); LLM.int8's codes
    have no such storage, so int8 is refused there."""
    if not quant.enabled:
        return
    bitsandbytes()
    if isinstance(zero_stage, int) and zero_stage >= 3 and quant.method == "int8":  # a malformed stage: the config check's
        raise QuantizationError("--base-quant int8 cannot be partitioned under ZeRO-3 (bitsandbytes' int8 codes have no "
                                "quant_storage): use nf4 or fp4, or a ZeRO-2 config (ds_configs/zero2.json)")
    if Path(model).is_file():
        raise QuantizationError(f"--base-quant {quant.method}: --model {model} is a GGUF file; a quantized base is read "
                                f"tensor by tensor from safetensors: give the model's Hugging Face directory")
    if device.type == "cpu" and quant.compute_dtype == torch.float16:
        raise QuantizationError("--base-quant with fp16 compute needs a GPU: on a CPU use --base-dtype fp32 or bf16")
    if isinstance(zero_stage, int) and zero_stage >= 3 and (Path(model) / "config.json").is_file():
        check_partitionable_widths(Path(model), quant)


def check_partitionable_widths(model_dir: Path, quant: BaseQuant) -> None:
    """ZeRO-3 holds 4-bit codes in a float dtype, where codes re-quantized into a cut block would not
    fit: every projection's stored width must be whole blocks. Read from config.json, before the
    model loads (zero_init.quantize_partitioned checks the built modules again)."""
    from transformers import AutoConfig

    from apt_ds.algorithm.units import ModelShape

    config = AutoConfig.from_pretrained(str(model_dir))
    family, shape = family_for(config.model_type), ModelShape.from_config(config)
    for index, layer in enumerate(shape.layers):
        sizes = layer.axis_sizes(shape.hidden)
        for name, tensor in family.projections.items():
            out_size, in_size = (sizes[axis] for axis in tensor.dims)
            width = quant.stored_width(tensor.dims, out_size, in_size)
            if width % BLOCKSIZE:
                raise QuantizationError(partition_width_problem(quant, f"{family.layer_prefix(index)}.{tensor.module}.weight",
                                                                width))


def partition_width_problem(quant: BaseQuant, name: str, width: int) -> str:
    return (f"--base-quant {quant.method} under ZeRO-3 needs every projection's stored width to be a multiple of "
            f"{BLOCKSIZE}; {name} has {width}: use a ZeRO-2 config")


def projection_modules(model):
    """(name, Linear, its (out, in) unit axes) of every frozen projection the family lists
    (q/k/v/o, gate/up/down)."""
    family = family_of(model)
    for index, layer in enumerate(family.decoder_layers(model)):
        for tensor in family.projections.values():
            yield f"{family.layer_prefix(index)}.{tensor.module}", family.layer_module(layer, tensor.role), tensor.dims


def projection_weights(model) -> dict:
    """{checkpoint name: (Linear, its (out, in) unit axes)} of the frozen projections."""
    return {f"{name}.weight": (linear, dims) for name, linear, dims in projection_modules(model)}


def quantize_model(model, quant: BaseQuant):
    """Quantize the projections of a model already in memory (the built-in tiny ones), in place.
    Their full-precision weights stay beside them as the source a shrink re-quantizes from
    (algorithm/quant.py), which only a small model affords; files are read again instead."""
    with torch.no_grad():
        for _, linear, dims in projection_modules(model):
            original = linear.weight.detach().clone()
            quantize_linear(linear, quant, source=lambda original=original: original, dims=dims)
    return model


def load_quantized(path: Path, quant: BaseQuant, device: torch.device):
    """The family's causal LM from `path`'s safetensors, projections quantized on `device` as they
    are read, every other tensor in the compute dtype there."""
    from apt_ds.io.by_tensor import empty_model, fill_by_tensor
    from apt_ds.io.weights import SafetensorsWeights

    def place(name: str, tensor: torch.Tensor, param: nn.Parameter) -> None:
        tensor = tensor.to(device=device, dtype=quant.compute_dtype)
        if name in projections:
            linear, dims = projections[name]
            linear.weight = nn.Parameter(tensor, requires_grad=False)
            quantize_linear(linear, quant, source=lambda name=name: weights.read(name), dims=dims)
        else:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, nn.Parameter(tensor, requires_grad=False))

    weights = SafetensorsWeights(path)
    model = empty_model(path)
    projections = projection_weights(model)
    fill_by_tensor(model, weights, place, device)
    return model
