"""Resumable checkpoints: APT state as JSON + safetensors, the optimizer via the backend.

Layout of RUN/checkpoint/: apt_state.json (step, shapes, ORIGINAL indices of kept units,
adapter ranks, tuner state, configs, model fingerprint), masks / salience / teacher /
rng .safetensors, engine/ (the backend's own checkpoint). A checkpoint is written to a
temporary sibling and renamed into place, so a crash never leaves a half-written one.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from apt_ds.config import LORA_SETTINGS, SCHEDULE_FIELDS, APTConfig
from apt_ds.io.permissions import make_readable

FORMAT_VERSION = 1
EXPORT_COPY = "trainable.safetensors"  # what export reads; a resume does not


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not belong to this model/config."""


# APT fields added after checkpoints existed, with the value closest to what runs did before (resumable with it).
LEGACY_APT_FIELDS = {"shape_multiple": 1, "uniform_shape_trials": 1, "uniform_shape_metric": "task"}


def save_checkpoint(trainer, directory: Path) -> None:
    """Write the checkpoint beside `directory` and rename it into place. A full disk leaves the
    previous checkpoint as it was and raises a CheckpointError saying how much space was needed."""
    tmp = directory.with_name(directory.name + ".tmp")
    try:
        _save_and_rename(trainer, directory, tmp)
    except (OSError, SafetensorError, RuntimeError) as err:  # safetensors and torch.save wrap ENOSPC
        if not is_disk_full(err):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # the partial checkpoint would keep the disk full
        free = shutil.disk_usage(directory.parent).free
        if (directory / "apt_state.json").is_file():
            kept = f"the previous checkpoint (step {read_meta(directory)['step']}) is kept. Free space, then run again with --resume"
        else:
            kept = "no checkpoint was written yet. Free space, then start the run again"
        raise CheckpointError(f"disk full while writing the step-{trainer.step} checkpoint in {directory.parent}: it needs "
                              f"about {_mb(checkpoint_bytes(trainer))}, {_mb(free)} are free; {kept}") from None


def is_disk_full(err: BaseException) -> bool:
    """ENOSPC / EDQUOT, whether raised as OSError or wrapped in a library's error text
    (safetensors 0.8: "I/O error: No space left on device (os error 28)")."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    return any(marker in text for marker in (f"os error {errno.ENOSPC}", f"os error {errno.EDQUOT}",
                                              "No space left on device", "Disk quota exceeded"))


def checkpoint_bytes(trainer) -> int:
    """About what one checkpoint takes on disk: every trainable parameter in fp32 twice (the
    export's copy and the engine's master) with its two Adam moments, plus masks, salience and
    the teacher's adapters."""
    state = trainer.state
    # ds_numel: a ZeRO-3 parameter's full size (numel() is its empty placeholder's)
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in state.model.parameters() if p.requires_grad)
    buffers = [*state.masks.state_dict().values(), *state.salience.state_dict().values()]
    buffers += [t for adapter in state.adapters.values() for t in (adapter.teacher_A, adapter.teacher_B)]
    return 16 * trainable + sum(t.numel() * t.element_size() for t in buffers)


def _mb(size: int) -> str:
    return f"{size / 2**20:,.1f} MB"


def _save_and_rename(trainer, directory: Path, tmp: Path) -> None:
    backend, state = trainer.backend, trainer.state
    if backend.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    backend.barrier()
    backend.save(tmp / "engine")  # collective: every rank writes its shard
    _write_export_copy(trainer, tmp / EXPORT_COPY)
    if backend.is_main():
        meta = {
            "format": FORMAT_VERSION,
            "step": trainer.step,
            "consumed_micro_batches": trainer.consumed_micro_batches,
            "teacher_ready": trainer.teacher_ready,
            "uniform_shapes": {str(step): list(shape) for step, shape in trainer.uniform_shapes.items()},
            "finished": trainer.step >= trainer.train_config.steps,
            "world_size": backend.world_size,
            "original_shape": state.original_shape.to_dict(),
            "shape": state.shape.to_dict(),
            "kept": state.kept_record(),
            "ranks": state.ranks(),
            "tuner": trainer.tuner.state_dict(),
            "apt_config": trainer.apt_config.to_dict(),
            "train_config": trainer.train_config.to_dict(),
            "run_info": trainer.run_info,
        }
        (tmp / "apt_state.json").write_text(json.dumps(meta, indent=1))
        save_file({k: v.contiguous() for k, v in state.masks.state_dict().items()}, str(tmp / "masks.safetensors"))
        save_file({k: v.contiguous() for k, v in state.salience.state_dict().items()} or {"empty": torch.zeros(0)},
                  str(tmp / "salience.safetensors"))
        teacher = {}
        for name, adapter in state.adapters.items():
            teacher[f"{name}.teacher_A"] = adapter.teacher_A.cpu().contiguous()
            teacher[f"{name}.teacher_B"] = adapter.teacher_B.cpu().contiguous()
        save_file(teacher, str(tmp / "teacher.safetensors"))
        rng = {"distill": trainer.distiller.generator.get_state(), "growth": trainer.growth_generator.get_state()}
        save_file(rng, str(tmp / "rng.safetensors"))
        make_readable(tmp)  # safetensors writes 0600; a checkpoint is as readable as the run's other files
        old = directory.with_name(directory.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if directory.exists():
            directory.rename(old)
        tmp.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
    backend.barrier()


def _write_export_copy(trainer, path: Path) -> None:
    """Full fp32 trainable tensors (collective under ZeRO-3): export reads these, no DeepSpeed needed."""
    backend = trainer.backend
    trainable = {n: backend.full_param(n, p).float().cpu().contiguous() for n, p in trainer.state.model.named_parameters() if p.requires_grad}
    if backend.is_main():
        save_file(trainable, str(path))


def repair_export_copy(trainer, directory: Path, finished: bool = False) -> None:
    """After load_checkpoint, which reads engine/: rewrite a damaged export copy from the restored weights
    (else export fails until the next checkpoint). A failure is said, or for a `finished` run, whose
    copy no later checkpoint writes, an error."""
    backend, path = trainer.backend, directory / EXPORT_COPY
    if not _export_copy_damaged(backend, path):
        return
    tmp, failed = path.with_name(path.name + ".tmp"), None
    try:
        _write_export_copy(trainer, tmp)  # only the main rank writes: only it can fail here
        if backend.is_main():
            make_readable(tmp)
            tmp.replace(path)
    except (OSError, SafetensorError) as err:  # e.g. the disk is full
        tmp.unlink(missing_ok=True)
        failed = err
    backend.barrier()
    if not backend.is_main():
        return
    if failed is not None and finished:
        raise CheckpointError(f"{path} (the export's copy of the weights) is unreadable and could not be rewritten from "
                              f"{directory / 'engine'} ({failed}); free space, then run --resume again")
    done = "rewritten from the restored weights" if failed is None else f"could not rewrite it ({failed}); the next checkpoint will"
    print(f"apt-ds: {path} was unreadable (the export's copy of the weights; a resume reads {directory / 'engine'}): "
          f"{done}", file=sys.stderr)


def repair_finished_run(trainer, directory: Path) -> None:
    """A finished run is not resumed, but export reads its copy: a damaged one is rewritten from engine/."""
    if _export_copy_damaged(trainer.backend, directory / EXPORT_COPY):
        load_checkpoint(trainer, directory)
        repair_export_copy(trainer, directory, finished=True)


def _export_copy_damaged(backend, path: Path) -> bool:
    """The main rank's answer on every rank: the rewrite gathers ZeRO-3 partitions collectively."""
    return backend.all_gather_object(backend.is_main() and not _readable_safetensors(path))[0]


def _readable_safetensors(path: Path) -> bool:
    """The header parses and the data it lists covers the file (safetensors checks both on open)."""
    try:
        with safe_open(str(path), "pt"):
            return True
    except (OSError, SafetensorError):
        return False


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
    if meta["original_shape"] != state.original_shape.to_dict():
        raise CheckpointError(f"checkpoint {directory} was made from a different model (original shapes differ)")
    check_same_apt_config(meta, trainer.apt_config.to_dict(), directory)
    access = trainer.backend.param_access()

    def rebuild():
        state.restore_architecture(meta["kept"], meta["ranks"], access)
        return {}

    trainer.backend.apply_shape_change(rebuild, carry_state=False)
    if state.shape.to_dict() != meta["shape"]:
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
