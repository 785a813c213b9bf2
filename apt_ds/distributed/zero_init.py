"""ZeRO-3 models partitioned from the first byte.

Loading a pretrained LLaMA the ordinary way builds the whole model on every rank before
DeepSpeed partitions it (LLaMA-2-70B: 276 GB of fp32 per rank). Here the model is created
under `deepspeed.zero.Init`, which partitions each module's parameters as soon as the module
is constructed (transformers' `no_init_weights` skips the random initialisation that would be
overwritten anyway), and then every rank copies ITS OWN slice of each parameter straight from
the safetensors files: the flat range [rank * partition, (rank + 1) * partition) of the
row-major tensor, which is where DeepSpeed keeps a rank's partition (`partition_parameters`:
`start = partition_size * partition_rank`, the last partition zero-padded). No collective, no
rank ever holds more than one tensor's rows beyond its partitions.

The model's partitions are reached through `deepspeed_private.model_partition` (DeepSpeed's
`ds_tensor`, an internal).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from apt_ds.distributed import deepspeed_private as private
from apt_ds.io.modeling import ModelLoadError
from apt_ds.models import family_for


def build_partitioned_model(config, source, ds_config: dict, dtype: torch.dtype, device: torch.device, quant=None,
                            seed: int = 0):
    """The family's model (LlamaForCausalLM, ..., BertForSequenceClassification) of `config` whose
    parameters are ZeRO-3 partitions filled from `source` (apt_ds.io.weights.SafetensorsWeights,
    or a name -> tensor dict), in `dtype`; `quant` (an enabled apt_ds.algorithm.quant.BaseQuant):
    the frozen projections quantized as they are read (`quantize_partitioned`). An encoder's task
    head the files lack is made from `seed` (apt_ds.io.by_tensor.new_head_values)."""
    import deepspeed
    from transformers.initialization import no_init_weights

    from apt_ds.distributed.ds_config import engine_dtype
    from apt_ds.distributed.placement import DTYPES

    family = family_for(config.model_type)
    if DTYPES[engine_dtype(ds_config)] != dtype:
        raise ValueError(f"the DeepSpeed config trains in {engine_dtype(ds_config)}, the weights were asked in {dtype}")
    # dtype=None: zero.Init then takes the dtype from the config's bf16/fp16 sections. An explicit
    # dtype is ignored by deepspeed 0.19 wherever the accelerator lacks fp16 (`dtype or float16 if
    # fp16 else bfloat16 ...` binds as `(dtype or float16) if ...`): on a CPU without AVX512-FP16
    # (an AMD EPYC here) an fp32 model came out in bf16.
    released = projections_released(family.projections) if quant is not None else contextlib.nullcontext()
    with no_init_weights(), deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=None), released:
        model = family.classes()[1](config)
    made = {private.model_partition_tensor(p).dtype for p in model.parameters() if hasattr(p, "ds_id")}
    if made != {dtype}:
        raise RuntimeError(f"deepspeed.zero.Init partitioned the model in {made}, not {dtype}")
    family.tie_embedding(model)  # post_init's tying runs inside init_weights, skipped above
    # zero.Init makes every tensor constructor produce `dtype`, RoPE's inverse frequencies too:
    # rebuild them outside it, in fp32 as transformers computes them.
    family.rebuild_rotary(model, device)
    from apt_ds.io.quantized import projection_weights

    projections = projection_weights(model) if quant is not None else {}
    load_partitions(model, source, skip=set(projections), seed=seed)
    if quant is not None:
        quantize_partitioned(model, projections, source, quant, device)
    return model.eval()  # as from_pretrained returns it: an encoder's dropout off (apt-ds trains without it)


@contextlib.contextmanager
def projections_released(leaf_names):
    """While a model is built under zero.Init: free the full-precision partition of each
    projection named in `leaf_names` (`q_proj`, ..., the family's) as soon as its Linear is
    assigned to its parent, so a quantized build never holds more than one projection in full
    precision (zero.Init partitions every Linear it sees; its codes replace it after the build).
    torch's module registration hook is global: it is removed on leaving."""

    def release(parent, name, submodule):
        if name in leaf_names and isinstance(submodule, torch.nn.Linear) and hasattr(submodule.weight, "ds_id"):
            private.release_partition(submodule.weight)

    handle = torch.nn.modules.module.register_module_module_registration_hook(release)
    try:
        yield
    finally:
        handle.remove()


def quantize_partitioned(model, projections: dict, source, quant, device: torch.device) -> None:
    """Replace each projection's weight by its quantized codes, partitioned at once: one tensor is
    read in full on each rank, quantized there and partitioned before the next one is read, so a
    rank holds its partitions plus one tensor (as `load_partitions` does). The quantization state
    (absmax: ~1/32 of the codes' bytes nested, 1/8 once a shrink un-nests it) stays whole on every
    rank; resume and shrinks re-read the original weight through `source` as one process does."""
    from apt_ds.algorithm.quant import BLOCKSIZE, QuantizationError, quantize_linear
    from apt_ds.distributed.zero_params import partition_new_params
    from apt_ds.io.quantized import partition_width_problem

    read = source.__getitem__ if isinstance(source, dict) else source.read  # a whole tensor, by name
    for name, (linear, dims) in projections.items():  # before any tensor is read
        width = quant.stored_width(dims, linear.out_features, linear.in_features)
        if width % BLOCKSIZE:  # codes of cut blocks would be re-quantized into sizes a float storage cannot hold
            raise QuantizationError(partition_width_problem(quant, name, width))
    with torch.no_grad():
        for name, (linear, dims) in projections.items():
            full = read(name).to(device, quant.compute_dtype)
            linear.weight = torch.nn.Parameter(full, requires_grad=False)  # the partitioned placeholder is dropped
            quantize_linear(linear, quant, source=functools.partial(read, name), dims=dims)
            del full
            partition_new_params(model, linear, quant.compute_dtype)


class _PartitionSource:
    """What load_partitions reads: a state dict, or the files by the names they hold
    (SafetensorsWeights.stored), with new tensors (a task head the files lack) over them."""

    def __init__(self, source, new: dict | None = None):
        self.source, self.new = source, dict(new or {})

    def _dict(self, name: str):
        return self.new.get(name, self.source.get(name) if isinstance(self.source, dict) else None)

    def __contains__(self, name: str) -> bool:
        if self._dict(name) is not None:
            return True
        return not isinstance(self.source, dict) and self.source.stored(name) in self.source

    def shape(self, name: str) -> list[int]:
        tensor = self._dict(name)
        return list(tensor.shape) if tensor is not None else self.source.shape(self.source.stored(name))

    def flat(self, name: str, start: int, length: int) -> torch.Tensor:
        tensor = self._dict(name)
        if tensor is not None:
            return tensor.reshape(-1)[start : start + length]
        return self.source.flat_range(self.source.stored(name), start, length)


def load_partitions(model, source, skip: set[str] = frozenset(), seed: int = 0) -> None:
    """Fill every rank's partitions of `model` from `source`; tied parameters once; the names in
    `skip` are left as zero.Init made them (they are replaced next). A name is read as the files
    hold it (SafetensorsWeights.stored); a task head they lack is made from `seed`, whole on
    every rank (it is small), and each rank keeps its slice."""
    from apt_ds.io.by_tensor import new_head_values

    source = _PartitionSource(source)
    absent = {name for name, _ in model.named_parameters() if name not in source}
    missing = sorted(absent - family_for(model.config.model_type).head_names)
    if missing:
        raise ModelLoadError(f"the checkpoint has no weights for {missing[:3]} ({len(missing)} parameters)")
    source.new = new_head_values(model, absent, seed) if absent else {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not hasattr(param, "ds_id"):
                raise RuntimeError(f"{name} was not partitioned by zero.Init")
            expected = list(param.ds_shape)
            stored = source.shape(name)
            if stored != expected:
                raise ModelLoadError(f"weight {name} has shape {stored} in the checkpoint, the config says {expected}")
            if name in skip:
                continue
            partition, size, rank = private.model_partition(param)
            piece = source.flat(name, size * rank, size)
            partition[: piece.numel()].copy_(piece.to(partition.dtype))
            partition[piece.numel():].zero_()  # DeepSpeed's padding of the last partition


def partition_bytes(model) -> int:
    """Bytes of this rank's parameter partitions (plus any parameter that is not partitioned)."""
    total = 0
    seen = set()
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        partition = private.model_partition_tensor(param)
        tensor = partition if partition is not None else param.data
        total += tensor.numel() * tensor.element_size()
    return total
