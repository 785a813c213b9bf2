"""Resumable checkpoints: APT state as JSON + safetensors, the optimizer via the backend.

Layout of RUN/checkpoint/: apt_state.json (step, shapes, ORIGINAL indices of kept units,
adapter ranks, tuner state, configs, model fingerprint), masks / salience / teacher /
rng .safetensors, engine/ (the backend's own checkpoint). apt_ds.io.checkpoint_save writes
one into a temporary sibling and renames it into place, so a crash never leaves a half-written one.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from apt_ds.algorithm.units import ModelShape
from apt_ds.config import LORA_SETTINGS, SCHEDULE_FIELDS, APTConfig

FORMAT_VERSION = 1
EXPORT_COPY = "trainable.safetensors"  # what export reads; a resume does not


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not belong to this model/config."""


# APT fields added after checkpoints existed, with the value closest to what runs did before (resumable with it).
LEGACY_APT_FIELDS = {"shape_multiple": 1, "uniform_shape_trials": 1, "uniform_shape_metric": "task"}


def is_disk_full(err: BaseException) -> bool:
    """ENOSPC / EDQUOT, whether raised as OSError or wrapped in a library's error text
    (safetensors 0.8: "I/O error: No space left on device (os error 28)")."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    if isinstance(err, OSError) and re.fullmatch(r"\d+ requested and \d+ written", text):  # numpy's tofile (gguf's writer)
        return True
    return any(marker in text for marker in (f"os error {errno.ENOSPC}", f"os error {errno.EDQUOT}",
                                              "No space left on device", "Disk quota exceeded"))


def megabytes(size: int) -> str:
    """A size for a disk-full message (MiB, as df -m)."""
    return f"{size / 2**20:,.1f} MB"


def read_meta(directory: Path) -> dict:
    path = Path(directory) / "apt_state.json"
    if not path.is_file():
        run = Path(directory).parent
        if not run.exists():
            raise CheckpointError(f"{run} does not exist: give the run directory that launch/train.py --out wrote")
        if not run.is_dir():
            raise CheckpointError(f"{run} is not a directory: give the run directory that launch/train.py --out wrote")
        raise CheckpointError(f"no checkpoint at {directory} (missing apt_state.json)")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"corrupt checkpoint {path}: {err}") from None
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {directory} has format {meta.get('format')!r}, expected {FORMAT_VERSION}")
    return meta


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises several types for truncated/corrupt files
        raise CheckpointError(f"corrupt checkpoint file {path}: {err}") from None


def check_same_apt_config(meta: dict, current: dict, directory: Path, leave_out: tuple[str, ...] = (),
                          method: str | None = None) -> None:
    """A resume must run the APT config the checkpoint was made with (`current`: APTConfig.to_dict()).
    `leave_out`: fields not compared, because the caller already named the setting they follow.
    `method`: the run's --method now, when known, to name a change of method as such."""
    check_known_apt_fields(meta, current, directory)
    saved = {k: v for k, v in _saved_apt_config(meta).items() if k not in leave_out}
    current = {k: v for k, v in current.items() if k not in leave_out}
    # ... but trial fields changed nothing where no trials could run: those it lacks compare as given now
    unused = {"uniform_shape_trials": not saved.get("uniform"),
              "uniform_shape_metric": not (saved.get("uniform") and saved["uniform_shape_trials"] > 1)}
    for field, changed_nothing in unused.items():
        if changed_nothing and field not in meta["apt_config"]:
            saved[field] = current[field]
    if saved == current:
        return
    changed = sorted(k for k in saved if saved[k] != current[k])
    details = ", ".join(f"{k}: {_flag_value(saved[k])} -> {_flag_value(current[k])}" for k in changed)
    legacy = [k for k in changed if k in LEGACY_APT_FIELDS and k not in meta["apt_config"]]
    why = f"; the run predates {', '.join(legacy)}" if legacy else ""
    trained_as = meta.get("run_info", {}).get("method")
    to_do = "pass " + " ".join(as_flag(k, saved[k]) for k in changed)
    if method and trained_as and method != trained_as:
        # --method lora sets LORA_SETTINGS and the schedule's defaults whatever else is given: back to
        # LoRA, the method is the flag to fix; back to APT, so are those of its settings that were not
        # the defaults (--prune false, --target-density 0.5), which --method apt alone does not restore
        if trained_as == "lora":
            flags = [as_flag(k, saved[k]) for k in changed if k not in LORA_SETTINGS and k not in SCHEDULE_FIELDS]
        else:
            apt_defaults = {f.name: f.default for f in dataclasses.fields(APTConfig)}
            flags = [as_flag(k, saved[k]) for k in sorted(set(changed) | set(LORA_SETTINGS))
                     if k not in LORA_SETTINGS or saved.get(k, apt_defaults[k]) != apt_defaults[k]]
        to_do = f"it was trained with --method {trained_as}: pass {' '.join([f'--method {trained_as}', *flags])}"
    raise CheckpointError(f"checkpoint {directory} used a different APT config; changed: {details}{why} ({to_do})")


def check_known_apt_fields(meta: dict, current: dict, directory: Path) -> None:
    """A checkpoint whose APT config lacks fields this apt-ds has, or holds fields it does not know,
    cannot be resumed by it whatever the flags."""
    saved = _saved_apt_config(meta)
    missing, unknown = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing:  # written by an earlier apt-ds whose algorithm lacked these knobs
        raise CheckpointError(f"checkpoint {directory} was written by an earlier apt-ds without the APT fields {missing} "
                              f"and cannot be resumed by this one; export it as it is (launch/export.py) or start a new run")
    if unknown:
        raise CheckpointError(f"checkpoint {directory} was written by another apt-ds, with the APT fields {unknown} that "
                              "this one does not know; resume it with the apt-ds that wrote it")


def _saved_apt_config(meta: dict) -> dict:
    # A checkpoint from before a LEGACY_APT_FIELDS setting existed ran with its value there (the old behaviour)
    return {**LEGACY_APT_FIELDS, **meta["apt_config"]}


def as_flag(name: str, value) -> str:
    return f"--{name.replace('_', '-')} {_flag_value(value)}"


def _flag_value(value) -> str:
    """A config value as its command-line flag takes it (`--prune-heads false`, `--adapter-targets q_proj v_proj`)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def load_checkpoint(trainer, directory: Path) -> None:
    meta = read_meta(directory)
    state = trainer.state
    if ModelShape.from_dict(meta["original_shape"]) != state.original_shape:  # also a run from before families were recorded
        raise CheckpointError(f"checkpoint {directory} was made from a different model (original shapes differ)")
    check_same_apt_config(meta, trainer.apt_config.to_dict(), directory)
    access = trainer.backend.param_access()

    def rebuild():
        state.restore_architecture(meta["kept"], meta["ranks"], access)
        return {}

    trainer.backend.apply_shape_change(rebuild, carry_state=False)
    if state.shape != ModelShape.from_dict(meta["shape"]):
        raise CheckpointError(f"checkpoint {directory}: rebuilt shapes do not match the recorded ones")
    try:
        trainer.backend.load(directory / "engine")
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as err:
        raise CheckpointError(f"cannot load optimizer/engine state from {directory / 'engine'}: {err}") from None
    state.masks.load_state_dict(_load_tensors(directory / "masks.safetensors"))
    salience = _load_tensors(directory / "salience.safetensors")
    salience.pop("empty", None)
    state.salience.load_state_dict(salience)
    teacher = _load_tensors(directory / "teacher.safetensors")
    for name, adapter in state.adapters.items():
        adapter.teacher_A = teacher[f"{name}.teacher_A"].to(adapter.teacher_A.device)
        adapter.teacher_B = teacher[f"{name}.teacher_B"].to(adapter.teacher_B.device)
    rng = _load_tensors(directory / "rng.safetensors")
    trainer.distiller.generator.set_state(rng["distill"])
    trainer.growth_generator.set_state(rng["growth"])
    trainer.tuner.load_state_dict(meta["tuner"])
    trainer.consumed_micro_batches = meta["consumed_micro_batches"]
    trainer.teacher_ready = meta["teacher_ready"]
    trainer.uniform_shapes = {int(step): tuple(shape) for step, shape in meta.get("uniform_shapes", {}).items()}
