"""A causal LM read from a safetensors directory one tensor at a time, into process memory.

A pruning run must hold its weights in its own memory: a slice of a memory-mapped file leaves
the file's pages resident, so memory would not drop as units are removed. transformers'
`disable_mmap` reads each file whole before it builds tensors from it, so the model is held
twice at the load's peak (1.42 GB for SmolLM2-135M's 540 MB of fp32 weights, measured), which
made a pruning run's whole-run peak higher than a LoRA run's that maps the file. Read tensor by
tensor, each a mapping of its own bytes (SafetensorsWeights.read, apt_ds.io.tensor_map), the peak
is the model plus its largest tensor, and each tensor's pages go when a shrink replaces it. The
quantized loader (apt_ds.io.quantized) fills its model the same way.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from apt_ds.io.errors import ModelLoadError
from apt_ds.models import family_for

logger = logging.getLogger(__name__)

# Receives each checkpoint tensor as read (its file dtype, on the CPU) with the parameter it fills.
PlaceTensor = Callable[[str, torch.Tensor, nn.Parameter], None]


def load_by_tensor(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                   num_labels: int | None = None, seed: int = 0):
    """`path`'s model (its family's class) with every weight in `dtype` on `device`, read one
    tensor at a time; an encoder's classifier with `num_labels` classes, new where the checkpoint
    has none (seeded: `seed`)."""

    from apt_ds.io.weights import SafetensorsWeights

    def place(name: str, tensor: torch.Tensor, param: nn.Parameter) -> None:
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, nn.Parameter(tensor.to(device=device, dtype=dtype),
                                                               requires_grad=param.requires_grad))

    model = empty_model(path, num_labels)
    fill_by_tensor(model, SafetensorsWeights(path), place, torch.device(device), seed)
    model.config.dtype = dtype  # as from_pretrained(dtype=...) records it
    return model


def empty_model(path: str | Path, num_labels: int | None = None):
    """The family's model for `path`'s config on the meta device (an encoder's classifier with
    `num_labels` classes), its LM head tied where the config ties it, with the generation config
    from_pretrained would give it."""
    from transformers import AutoConfig, GenerationConfig
    from transformers.initialization import no_init_weights

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path))
    if num_labels is not None and config.num_labels != num_labels:
        config.num_labels = num_labels  # the setter makes id2label and label2id of that length
    family = family_for(config.model_type)
    with torch.device("meta"), no_init_weights():
        model = family.classes()[1](config)
    family.tie_embedding(model)  # tied before the parameters are listed: the head (and T5's views) are the embedding's
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    return model


def fill_by_tensor(model, weights, place: PlaceTensor, device: torch.device, seed: int = 0) -> None:
    """Give every parameter of `model` (from empty_model) its tensor from `weights` (a directory's
    SafetensorsWeights), through `place`, under its own name or as a base model's checkpoint
    holds it (SafetensorsWeights.stored); a task head the checkpoint
    lacks (`modules_to_save`) is made new, seeded. Then tie the head again and make RoPE's
    tables or position ids on `device`. Fails on a missing tensor, a shape the config does not
    give, or a parameter or buffer left unset; says which checkpoint tensors the model has no
    place for, as transformers does."""
    path = weights.directory
    family = family_for(model.config.model_type)
    params = dict(model.named_parameters())  # a tied LM head once, under the embedding's name
    stored = {name: weights.stored(name) for name in params}
    new = {name for name in params if stored[name] not in weights and name in family.head_names}
    missing = [name for name in params if stored[name] not in weights and name not in new]
    if missing:
        raise ModelLoadError(f"the checkpoint {path} has no weights for {missing[:3]} ({len(missing)} tensors)")
    tied = family.ties(model.config)
    read = set(stored.values())
    unused = [name for name in weights.names() if name not in read and not family.left_out_on_purpose(name, tied)]
    if unused:
        logger.warning("%s: %d tensors the model has no place for are not loaded: %s", path, len(unused), unused[:3])
    with torch.no_grad():
        for name, param in params.items():
            if name in new:
                continue
            tensor = weights.read(stored[name])  # a mapping of its own: nothing else holds the file's pages
            if list(tensor.shape) != list(param.shape):
                raise ModelLoadError(f"weight {name} has shape {list(tensor.shape)} in {path}, the model built from "
                                     f"config.json and this run's settings (e.g. a classifier's labels) has {list(param.shape)}")
            place(name, tensor, param)
            del tensor
    if new:
        _new_head(model, family, new, place, seed)
    family.tie_embedding(model)
    family.rebuild_rotary(model, device)
    rebuild_position_ids(model, device)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelLoadError(f"loading {path} left {left[:3]} unset: this family's tensors are not all known")
    model.eval()


def _new_head(model, family, names: set[str], place: PlaceTensor, seed: int) -> None:
    """Place the task head's parameters `names`, new (new_head_values), saying which are frozen."""
    for name, value in new_head_values(model, names, seed).items():
        place(name, value, model.get_parameter(name))
    trained = family.modules_to_save
    for owner in sorted({name.rpartition(".")[0] for name in names}):
        if not any(owner == path or owner.startswith(path + ".") for path in trained):
            logger.warning("the checkpoint has no %s: it is made from the seed and stays frozen, as the base does "
                           "(a checkpoint of the model's own pretraining has one)", owner)


def new_head_values(model, names: set[str], seed: int) -> dict[str, torch.Tensor]:
    """Values for the task head's parameters `names` (Linear weights and biases) that a base
    checkpoint lacks, initialised as transformers initialises the module, from `seed` alone:
    every rank, a ZeRO-3 build (whose modules hold partitions) and a resume's rebuild make the
    same ones. Module by module in name order, each a fresh copy of its Linear's logical shape."""
    modules: dict[str, list[str]] = {}
    for name in sorted(names):
        owner, _, leaf = name.rpartition(".")
        modules.setdefault(owner, []).append(leaf)
    values = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for owner, leaves in modules.items():
            module = model.get_submodule(owner)
            if not isinstance(module, nn.Linear):
                raise ModelLoadError(f"the checkpoint has no {owner}, and a new {type(module).__name__} is not made here")
            fresh = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
            fresh = fresh.to_empty(device="cpu")  # no initialisation of its own: the RNG is _init_weights' alone
            model._init_weights(fresh)
            values.update({f"{owner}.{leaf}": getattr(fresh, leaf).detach() for leaf in leaves})
    return values


def rebuild_position_ids(model, device: torch.device) -> None:
    """An encoder's non-persistent index buffers (`embeddings.position_ids`, `token_type_ids`),
    which a meta-device build leaves empty, as transformers makes them."""
    for name, buffer in list(model.named_buffers()):
        if buffer.is_meta and name.rsplit(".", 1)[-1] in ("position_ids", "token_type_ids"):
            owner, _, leaf = name.rpartition(".")
            length = model.config.max_position_embeddings
            value = torch.arange(length, device=device).expand(1, -1) if leaf == "position_ids" else \
                torch.zeros((1, length), dtype=torch.long, device=device)
            model.get_submodule(owner).register_buffer(leaf, value, persistent=False)
