"""Export a run tensor by tensor: exporting a 70B run needs memory for about one shard.

The in-memory export (`export.rebuild_trained_model` + `compact_model`) loads the whole base
model. Here every output tensor is made on its own, exactly as that path makes it: the base
tensor read from the safetensors files (as fp32, like `load_model`), sliced to the units the
run kept, its adapter merged (W + s * B @ A in fp32, `APTAdapter.merged_weight`), fractional
group / neuron masks folded into o_proj / down_proj columns (`export.fold_masks`), units whose
mask is 0 removed, cast to the export dtype, and appended to the current shard. Shards are
split as `huggingface_hub.split_torch_state_dict_into_shards` splits a state dict in order
(a tensor over the limit gets a shard of its own), so both paths write the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from apt_ds.algorithm.masks import is_binary
from apt_ds.algorithm.quant import dequantize, quantize
from apt_ds.algorithm.quant_shrink import keep_quantized
from apt_ds.algorithm.shrink import _kept_shape, group_channels, write_shape_to_config
from apt_ds.algorithm.units import ModelShape
from apt_ds.export.checks import check_export_tensor, dtype_name
from apt_ds.io.checkpoint import CheckpointError
from apt_ds.models import family_for


def _kept_index(record: list[int]) -> torch.Tensor:
    return torch.tensor(record, dtype=torch.long)


class RunTensors:
    """The exported tensors of a run, one at a time, from the base weights and the checkpoint."""

    def __init__(self, weights, meta: dict, trainable, masks: dict[str, torch.Tensor], quant=None):
        """`weights`: apt_ds.io.weights.SafetensorsWeights of the base model; `trainable`: an open
        safetensors handle of checkpoint/trainable.safetensors; `masks`: the checkpoint's masks;
        `quant` (a BaseQuant): merge into the projections as the run's quantized base held them."""
        self.weights, self.trainable, self.quant = weights, trainable, quant
        self.trainable_names = set(trainable.keys())
        apt = meta["apt_config"]
        self.scaling = apt["adapter_alpha"] / apt["adapter_rank"]  # fixed at wrap time, kept when ranks grow
        self.current = ModelShape.from_dict(meta["shape"])
        self.family = family_for(self.current.family)
        self.layer_dims = {tensor.name: tensor.dims for tensor in self.family.layer_tensors}
        self.projection_weights = {f"{tensor.module}.weight" for tensor in self.family.projections.values()}
        kept = meta["kept"]
        hidden_mask = masks["hidden"]
        if not is_binary(hidden_mask):
            raise CheckpointError("the checkpoint was taken while hidden-channel masks were decaying; export a later checkpoint")
        self.group_masks = [masks[f"kv_group.{l}"] for l in range(len(self.current.layers))]
        self.neuron_masks = [masks[f"ffn_neuron.{l}"] for l in range(len(self.current.layers))]
        # Indices at the run's current shapes (into its kept units) of what the masks keep.
        groups_now = [(m > 0).nonzero().flatten() for m in self.group_masks]
        neurons_now = [(m > 0).nonzero().flatten() for m in self.neuron_masks]
        hidden_now = (hidden_mask > 0).nonzero().flatten()
        self.final_shape = _kept_shape(self.current, groups_now, neurons_now, hidden_now)
        self.kept_groups = [_kept_index(g) for g in kept["groups"]]  # ORIGINAL indices at current shapes
        self.kept_neurons = [_kept_index(n) for n in kept["neurons"]]
        self.kept_hidden = _kept_index(kept["hidden"])
        self.groups_now, self.neurons_now, self.hidden_now = groups_now, neurons_now, hidden_now
        self.final_hidden = self.kept_hidden[hidden_now]

    def names(self) -> list[str]:
        """Output tensor names in the family's `state_dict()` order (the LM head last, not when tied)."""
        family = self.family
        names = [family.embedding]
        for l in range(len(self.current.layers)):
            names += [f"{family.layer_prefix(l)}.{tensor.name}" for tensor in family.layer_tensors]
        names.append(family.final_norm)
        if not self.current.tied_embeddings:
            names.append(family.output_embedding)
        return names

    def _axes(self, layer: int) -> dict[str, tuple[torch.Tensor, torch.Tensor] | None]:
        """Per unit axis: (original indices at current shapes, final indices at current shapes)."""
        shape = self.current.layers[layer]
        q_orig, kv_orig = group_channels(self.kept_groups[layer], shape.group_size, shape.head_dim)
        q_final, kv_final = group_channels(self.groups_now[layer], shape.group_size, shape.head_dim)
        return {"q": (q_orig, q_final), "kv": (kv_orig, kv_final), "hidden": (self.kept_hidden, self.hidden_now),
                "ffn": (self.kept_neurons[layer], self.neurons_now[layer]), "head": None}

    def tensor(self, name: str) -> torch.Tensor:
        """The exported fp32 tensor `name`."""
        if name not in self.weights:
            raise CheckpointError(f"the base model has no tensor {name}; is it the model this run was trained from?")
        base = self.weights.get(name).float()
        if not self.family.is_layer_tensor(name):
            return base.index_select(base.dim() - 1, self.final_hidden)  # embedding / LM head columns, final norm
        index, local = name[len(self.family.layers) + 1:].split(".", 1)
        layer, dims = int(index), self.layer_dims[local]
        axes = self._axes(layer)
        tensor = base
        if self.quant is not None and local in self.projection_weights:  # the codes the run held, dequantized
            kept = [None if axes[axis] is None else axes[axis][0] for axis in dims]
            tensor = dequantize(keep_quantized(quantize(base, self.quant, source=lambda: base, dims=dims), *kept)[0]).float()
        else:
            for dim, axis in enumerate(dims):  # the run's current shapes
                if axes[axis] is not None:
                    tensor = tensor.index_select(dim, axes[axis][0])
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and f"{module}.lora_A" in self.trainable_names:
            lora_a, lora_b = self.trainable.get_tensor(f"{module}.lora_A"), self.trainable.get_tensor(f"{module}.lora_B")
            tensor = tensor + (lora_b.float() @ lora_a.float()) * self.scaling
        if len(dims) == 2 and dims[1] == "q":  # o_proj: fractional group masks fold into its input columns
            shape = self.current.layers[layer]
            tensor = tensor * self.group_masks[layer].repeat_interleave(shape.group_size * shape.head_dim).float()
        elif len(dims) == 2 and dims[1] == "ffn":  # down_proj: the neuron masks
            tensor = tensor * self.neuron_masks[layer].float()
        for dim, axis in enumerate(dims):  # units whose mask is 0 removed
            if axes[axis] is not None:
                tensor = tensor.index_select(dim, axes[axis][1])
        return tensor


class ShardWriter:
    """Writes tensors into `directory` as huggingface_hub would shard that state dict, holding at
    most one shard in memory; `close` names the files and writes the index."""

    def __init__(self, directory: Path, max_shard_size: int):
        self.directory, self.max_shard_size = directory, max_shard_size
        self.files: list[tuple[Path, list[str]]] = []  # in HF's shard order
        self.current: dict[str, torch.Tensor] = {}
        self.current_size = self.total_size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self.total_size += size
        if size > self.max_shard_size:  # its own shard, placed before the one being filled
            self._write({name: tensor})
            return
        if self.current and self.current_size + size > self.max_shard_size:
            self._flush()
        self.current[name] = tensor
        self.current_size += size

    def _flush(self) -> None:
        self._write(self.current)
        self.current, self.current_size = {}, 0

    def _write(self, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        path = self.directory / f".shard-{len(self.files)}.safetensors"
        save_file(tensors, str(path), metadata={"format": "pt"})
        self.files.append((path, list(tensors)))

    def close(self) -> None:
        if self.current:
            self._flush()
        count = len(self.files)
        if count == 1:
            self.files[0][0].rename(self.directory / "model.safetensors")
            return
        weight_map = {}
        for index, (path, names) in enumerate(self.files, 1):
            filename = f"model-{index:05d}-of-{count:05d}.safetensors"
            path.rename(self.directory / filename)
            weight_map.update({name: filename for name in names})
        index = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def stream_weights(tensors: RunTensors, directory: Path, dtype: torch.dtype, max_shard_size: int) -> int:
    """Write every exported tensor; returns the number of exported parameters."""
    writer = ShardWriter(directory, max_shard_size)
    count = 0
    for name in tensors.names():
        full = tensors.tensor(name)
        tensor = full.to(dtype).contiguous()
        check_export_tensor(name, full, tensor, dtype_name(dtype))
        count += tensor.numel()
        writer.add(name, tensor)
    writer.close()
    return count


def exported_config(base_dir: Path, shape: ModelShape):
    """The base model's config with the exported shapes written in (no model is built)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(base_dir))
    write_shape_to_config(config, shape)
    return config


def generation_config(base_dir: Path, config) -> dict:
    """What `model.generation_config.to_diff_dict()` gives for a model loaded from `base_dir`."""
    from transformers import GenerationConfig

    if (base_dir / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(str(base_dir)).to_diff_dict()
    return GenerationConfig.from_model_config(config).to_diff_dict()
