"""The on-disk format of `DeepSpeedBackend` checkpoints: writing, validating and loading it.

Checkpoints hold the same full, unpartitioned state as a shape change (apt_ds.distributed.
zero_state), so nothing DeepSpeed-specific and nothing pickled is written (DeepSpeed's own
checkpoint files are loaded with `torch.load(weights_only=False)`, which this project does not
allow). Because the tensors are full, a checkpoint can be loaded under another world size or
ZeRO stage (tested: 2-rank ZeRO-2 -> 1-rank ZeRO-3 and 2-rank ZeRO-3 -> 1-rank ZeRO-1 continue
the fp32 loss trajectory within 1e-5).

A checkpoint directory holds `trainable.safetensors` (`master/<name>`, `exp_avg/<name>`,
`exp_avg_sq/<name>`: full, unpartitioned fp32 tensors) and `optimizer.json` (optimizer steps,
Adam step, ZeRO stage and world size at save time, parameter shapes). Nothing is pickled.
Validation is a pure function of the files and the model's trainable shapes, so every rank
can run it and agree before any collective starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from apt_ds.distributed import zero_state
from apt_ds.distributed.zero_state import ADAM_MOMENTS

CHECKPOINT_FORMAT = 1
TENSOR_FILE = "trainable.safetensors"
META_FILE = "optimizer.json"


def read_checkpoint_meta(directory: Path, model_shapes: dict[str, list[int]]) -> dict:
    """The checkpoint's `optimizer.json`, after checking that it and the tensor file hold exactly
    the state of `model_shapes` (name -> full shape). FileNotFoundError if files are missing,
    ValueError naming the first problem otherwise (corrupt files, other shapes, extra state)."""
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    tensor_path, meta_path = directory / TENSOR_FILE, directory / META_FILE
    if not meta_path.is_file() or not tensor_path.is_file():
        legacy = " (a pickled DeepSpeed checkpoint from an older apt_ds: not loadable)" \
            if (directory / "deepspeed").is_dir() else ""
        raise FileNotFoundError(f"no apt_ds checkpoint in {directory}: {META_FILE} or {TENSOR_FILE} missing{legacy}")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"corrupt {meta_path}: {err}") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT or meta.get("backend") != "deepspeed" \
            or not isinstance(meta.get("shapes"), dict) or "adam_step" not in meta or "optimizer_steps" not in meta:
        raise ValueError(f"{meta_path}: not a DeepSpeedBackend checkpoint of format {CHECKPOINT_FORMAT}")
    saved = meta["shapes"]
    for name, shape in model_shapes.items():
        if name not in saved:
            raise ValueError(f"checkpoint {directory} has no state for trainable parameter {name} (shape {shape})")
        if saved[name] != shape:
            raise ValueError(f"checkpoint {directory}: trainable parameter {name} has shape {saved[name]} "
                             f"in the checkpoint but {shape} in the model")
    extra = sorted(set(saved) - set(model_shapes))
    if extra:
        raise ValueError(f"checkpoint {directory} has state for {extra[0]} (and {len(extra) - 1} more), "
                         f"which is not a trainable parameter of the model")
    keys = ["master"] + (list(ADAM_MOMENTS) if meta["adam_step"] is not None else [])
    try:
        with safe_open(str(tensor_path), framework="pt") as handle:
            stored = {key: list(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except SafetensorError as err:  # a damaged header; OSError (e.g. permissions) passes as it is
        raise ValueError(f"corrupt {tensor_path}: {err}") from None
    for name, shape in model_shapes.items():
        for key in keys:
            if stored.get(f"{key}/{name}") != shape:
                raise ValueError(f"{tensor_path}: {key}/{name} is missing or has shape "
                                 f"{stored.get(f'{key}/{name}')}, expected {shape}")
    return meta


def write_checkpoint(directory: Path, engine, trainable: dict[str, torch.nn.Parameter], meta: dict, writer: bool) -> None:
    """Gather the full state of `trainable` (collective: call on every rank) and, where `writer`,
    write it with `meta` (optimizer steps, ZeRO stage, world size, shapes, ...) added to the format
    fields."""
    from safetensors.torch import save_file

    adam_step = zero_state.adam_step(engine)
    tensors: dict[str, torch.Tensor] = {}
    for name, _, entry in zero_state.full_states(trainable, adam_step is not None):
        if writer:
            tensors.update({f"{key}/{name}": value.float().contiguous() for key, value in entry.items()})
    if writer:
        directory.mkdir(parents=True, exist_ok=True)
        meta = {"format": CHECKPOINT_FORMAT, "backend": "deepspeed", "adam_step": None if adam_step is None else float(adam_step),
                **meta}
        save_file(tensors, str(directory / TENSOR_FILE), metadata={"format": str(CHECKPOINT_FORMAT)})
        (directory / META_FILE).write_text(json.dumps(meta, indent=1))


def load_checkpoint_state(directory: Path, meta: dict, engine, zero_stage: int,
                          trainable: dict[str, torch.nn.Parameter]) -> None:
    """Write a checkpoint's masters and moments into `engine` (`meta`: its validated
    `read_checkpoint_meta`). Collective under ZeRO-3: call on every rank."""
    from safetensors import safe_open

    adam_step = meta["adam_step"]
    # A fresh Adam state (step 0, zero moments) behaves exactly like the lazy one.
    zero_state.init_adam_state(engine, torch.tensor(float(adam_step or 0.0), dtype=torch.float32))
    with safe_open(str(directory / TENSOR_FILE), framework="pt") as handle:
        for name, param in trainable.items():  # same order on every rank
            moments = {key: handle.get_tensor(f"{key}/{name}") for key in ADAM_MOMENTS} if adam_step is not None \
                else {}  # saved before the first step: the zero moments just created
            zero_state.set_full_state(engine, zero_stage, param, handle.get_tensor(f"master/{name}"), moments, model_copy=True)
