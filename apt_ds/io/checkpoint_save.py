"""Writing a checkpoint (apt_ds.io.checkpoint reads them): into a temporary sibling, renamed into
place, never over a good checkpoint with a bad one. A full disk, or an adapter or Adam moment that
is NaN or inf (a diverged run), leaves the previous checkpoint as it was and says so in one line.
The export's copy of the trainable weights (trainable.safetensors) is written here, and rewritten
from engine/ on resume when it was damaged.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from apt_ds.algorithm.finite import NonFiniteError, first_nonfinite
from apt_ds.io.checkpoint import (
    EXPORT_COPY,
    FORMAT_VERSION,
    CheckpointError,
    is_disk_full,
    load_checkpoint,
    megabytes,
    read_meta,
)
from apt_ds.io.permissions import make_readable


def save_checkpoint(trainer, directory: Path) -> None:
    """Write the checkpoint beside `directory` and rename it into place. A full disk leaves the
    previous checkpoint as it was and raises a CheckpointError saying how much space was needed."""
    trainable = _full_trainable(trainer)  # collective under ZeRO-3; checked, then written as the export's copy
    _refuse_nonfinite_state(trainer, trainable, directory)
    tmp = directory.with_name(directory.name + ".tmp")
    try:
        _save_and_rename(trainer, directory, tmp, trainable)
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
                              f"about {megabytes(checkpoint_bytes(trainer))}, {megabytes(free)} are free; {kept}") from None


def _refuse_nonfinite_state(trainer, trainable: dict[str, torch.Tensor], directory: Path) -> None:
    """A NaN or inf adapter, Adam moment, salience score, teacher adapter or tuner importance is
    never checkpointed: the previous checkpoint stays, and --resume continues from it (the same
    answer on every rank: the tensors are full copies or all-reduced, the moments' flag is summed
    over ranks)."""
    state = trainer.state
    teacher = [(f"{name}.{part}", getattr(adapter, part)) for name, adapter in state.adapters.items()
               for part in ("teacher_A", "teacher_B")]
    bad = first_nonfinite([*trainable.items(), *((f"salience {k}", v) for k, v in state.salience.state_dict().items()),
                           *teacher])
    if bad is None and not trainer.backend.optimizer_state_finite():
        bad = "an Adam moment of the optimizer"
    if bad is None:
        try:
            json.dumps(trainer.tuner.state_dict(), allow_nan=False)
        except ValueError:
            bad = "the adapter tuner's importance"
    if bad is None:
        return
    if (directory / "apt_state.json").is_file():
        kept = f"the previous checkpoint (step {read_meta(directory)['step']}) is kept: --resume continues from it"
    else:
        kept = "no checkpoint was written yet"
    raise NonFiniteError(f"the step-{trainer.step} checkpoint was not written: {bad} is not finite, so the run "
                         f"has diverged (a lower learning rate, --lr, usually fixes it); {kept}")


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


def _save_and_rename(trainer, directory: Path, tmp: Path, trainable: dict[str, torch.Tensor]) -> None:
    backend, state = trainer.backend, trainer.state
    if backend.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    backend.barrier()
    backend.save(tmp / "engine")  # collective: every rank writes its shard
    if backend.is_main():
        save_file(trainable, str(tmp / EXPORT_COPY))
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


def _full_trainable(trainer) -> dict[str, torch.Tensor]:
    """Full fp32 trainable tensors on every rank (collective under ZeRO-3): the export reads these, no DeepSpeed needed."""
    backend = trainer.backend
    return {n: backend.full_param(n, p).float().cpu().contiguous() for n, p in trainer.state.model.named_parameters() if p.requires_grad}


def _write_export_copy(trainer, path: Path) -> None:
    trainable = _full_trainable(trainer)
    if trainer.backend.is_main():
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
