"""The DeepSpeed seam: `DeepSpeedBackend` runs the `TrainingBackend` contract on a ZeRO engine.

This is the only apt_ds module that imports deepspeed, and it does so lazily, so that
`import apt_ds` works without it.

Decisions (measured with deepspeed 0.19.8, torch 2.13 CPU, gloo):
- The optimizer is always a client `torch.optim.AdamW` over the trainable parameters and the
  schedule a client `LambdaLR`; lr, weight decay and schedule come from APT's config. An
  "optimizer" or "scheduler" section in the DeepSpeed JSON is dropped with a warning.
  `torch.optim.AdamW` needs no JIT build on CPU, also with `offload_optimizer` (`resolve_config`
  sets `zero_force_ds_cpu_optimizer: false` for that).
- The DeepSpeed JSON is read and its "auto" values resolved by `apt_ds.distributed.ds_config` (which also
  says which values are accepted and why ZeRO stage 0 is refused).
- Gradient accumulation: `backward` runs `engine.backward` (which scales by 1/gas) and, on
  every micro-batch except the last of a cycle, a no-op `engine.step` that only advances
  DeepSpeed's micro-step counter; `step` is the boundary step. So reduced gradients are
  readable by `full_grad` between the last backward and `step`.

Shape changes (`apply_shape_change`), the sequence that works on ZeRO-2 and ZeRO-3:
1. snapshot every trainable fp32 master and its Adam moments by name (collectives) plus the
   Adam step;
2. destroy the engine, remove its two module hooks and the `_z3_optimizer` / `_zero_optimizer`
   back-references DeepSpeed leaves on parameters (upstream issue #7204), so the old engine
   is garbage-collected; under ZeRO-3 also the per-module `pre_bwd_fn` / `post_bwd_fn`
   autograd Functions, which would otherwise keep the first engine's parameter coordinator
   alive and route every later backward through it;
3. run `change_fn`. Under ZeRO-3 the unchanged parameters stay partitioned after destroy, and
   `backend.gathered(params)` still works there (measured). `param_access()` gives shape
   changes a read-only gather (parameters about to be replaced are never broadcast back) and
   `partition_new_params`, which partitions a module's NEW parameters right after they are
   made (through the zero.Init that partitioned the model), so one module at a time is ever
   held in full. Remaining plain float32 parameters are cast to bf16/fp16 when that is on;
4. check every rank produced the same shapes (a mismatch would hang DeepSpeed), re-run
   `deepspeed.initialize` (it broadcasts new parameters from rank 0), recreate the Adam state
   of each flat fp32 partition, then write back masters (grown entries take the new
   parameter's values) and moments (zeros for grown entries) with `safe_set_full_*`, and put
   the LR schedule and DeepSpeed's step counters back where they were.

Checkpoints (`save` / `load`) hold the same full, unpartitioned state as a shape change, so
nothing DeepSpeed-specific and nothing pickled is written (DeepSpeed's own checkpoint files
are loaded with `torch.load(weights_only=False)`, which this project does not allow):
`trainable.safetensors` with `master/<name>`, `exp_avg/<name>`, `exp_avg_sq/<name>` (fp32,
full shapes) and `optimizer.json` (optimizer steps, Adam step, ZeRO stage and world size at
save time, shapes). Because the tensors are full, a checkpoint can be loaded under another
world size or ZeRO stage (tested: 2-rank ZeRO-2 -> 1-rank ZeRO-3 and 2-rank ZeRO-3 -> 1-rank
ZeRO-1 continue the fp32 loss trajectory within 1e-5).

Launchers: `deepspeed`, `torchrun` and `mpirun`/`srun` all work; `apt_ds.distributed.ds_config.launcher_env`
maps OpenMPI / Slurm variables (or a plain `python script.py`) to a process group.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from pathlib import Path
from typing import Callable, Iterable

import torch

from apt_ds.distributed.backend import LrLambda, TrainingBackend, check_max_grad_norm
from apt_ds.distributed.ds_config import DeepSpeedConfigError, engine_dtype, launcher_env, load_ds_config, resolve_config, resolve_precision
from apt_ds.algorithm.edits import Grow, ShapeChange, apply_edits
from apt_ds.distributed.placement import DTYPES, rank_device
from apt_ds.algorithm.shrink import ParamAccess
from apt_ds.distributed.zero_checkpoint import ADAM_MOMENTS, CHECKPOINT_FORMAT, META_FILE, TENSOR_FILE, read_checkpoint_meta


def _flat_fp32_partitions(zero_optimizer) -> list[torch.Tensor]:
    """The flat fp32 tensors the wrapped torch optimizer steps (keys of its state)."""
    for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):  # ZeRO-3, ZeRO-1/2
        if hasattr(zero_optimizer, attr):
            return list(getattr(zero_optimizer, attr))
    raise RuntimeError(f"unsupported DeepSpeed optimizer {type(zero_optimizer).__name__}")


@torch.no_grad()
def _copy_rank_slice(partition: torch.Tensor, full: torch.Tensor, rank: int) -> None:
    """partition[:] = flat(full)[rank * n : (rank + 1) * n], zero where DeepSpeed padded."""
    size = partition.numel()
    piece = full.reshape(-1)[size * rank : size * (rank + 1)]
    flat = partition.data.view(-1)
    flat[: piece.numel()].copy_(piece.to(flat.dtype))
    flat[piece.numel():].zero_()


class DeepSpeedBackend(TrainingBackend):
    """`TrainingBackend` on a DeepSpeed ZeRO-1/2/3 engine. See the module docstring.

    config: DeepSpeed config as a dict or a JSON path. micro_batch_size: per-rank micro batch
    (DeepSpeed's sample bookkeeping only). Constructing the backend initializes
    torch.distributed (a 1-rank group on 127.0.0.1 when not started by a launcher).
    """

    def __init__(self, config: dict | str | os.PathLike, micro_batch_size: int | None = None, base_dtype: str = "auto"):
        self.user_config, self.config_source = load_ds_config(config)
        if micro_batch_size is not None and micro_batch_size < 1:
            raise DeepSpeedConfigError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.micro_batch_size = micro_batch_size
        self.base_dtype = base_dtype
        self.engine = None
        self.ds_config: dict | None = None
        self._init_distributed()
        self.param_dtype = DTYPES[self._precision()]

    def _precision(self) -> str:
        from deepspeed.accelerator import get_accelerator

        return resolve_precision(self.user_config, self.base_dtype, on_cpu=self.device.type == "cpu",
                                 bf16_supported=get_accelerator().is_bf16_supported(), source=self.config_source)

    @property
    def zero_stage_requested(self) -> int:
        """The JSON's ZeRO stage (validated later by resolve_config)."""
        return (self.user_config.get("zero_optimization") or {}).get("stage", 0)

    # ---- process group ---------------------------------------------------------------------
    def _init_distributed(self) -> None:
        import deepspeed
        import torch.distributed as dist

        from deepspeed.accelerator import get_accelerator

        if not dist.is_initialized():
            os.environ.update(launcher_env(os.environ))  # OpenMPI / Slurm / plain python -> RANK, WORLD_SIZE
            # Before the process group: NCCL binds each rank to the device current at its first use.
            get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", 0)))
            deepspeed.init_distributed(verbose=False)
            if get_accelerator().device_name() == "cpu":
                self._release_shm_buffers()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = rank_device()

    @staticmethod
    def _release_shm_buffers() -> None:
        """DeepSpeed's CPU all-reduce leaves a 69 MB /dev/shm file per rank: unlink ours once every
        rank has mapped them all, and remove those of dead runs (apt_ds.distributed.shm)."""
        import torch.distributed as dist

        from apt_ds.distributed.shm import remove_stale_buffers, unlink_own_buffer

        dist.barrier()  # every rank is past DeepSpeed's init, which maps every rank's buffer
        unlink_own_buffer(dist.get_rank())
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            remove_stale_buffers()

    def place(self, model) -> None:
        """Everything that is not a ZeRO-3 partition onto this rank's device (a model created
        under zero.Init is never moved as a whole: its partitions already live where they belong)."""
        if not any(hasattr(p, "ds_id") for p in model.parameters()):
            model.to(self.device)
            return
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if not hasattr(param, "ds_id"):
                    param.data = param.data.to(self.device)
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(self.device)

    def barrier(self) -> None:
        torch.distributed.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place on `tensor` (also returned). CPU tensors work on any backend."""
        import torch.distributed as dist

        if tensor.device.type == "cpu" and dist.get_backend() not in ("gloo", "ccl"):
            from deepspeed.accelerator import get_accelerator

            moved = tensor.to(get_accelerator().current_device_name())
            dist.all_reduce(moved, op=dist.ReduceOp.SUM)
            tensor.copy_(moved.cpu())
        else:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_gather_object(self, obj) -> list:
        out = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    # ---- engine ------------------------------------------------------------------------------
    def attach(self, model, lr: float, lr_lambda: LrLambda, weight_decay: float, grad_accum_steps: int,
               *, max_grad_norm: float) -> None:
        self.ds_config = self.resolved_config(model, grad_accum_steps, max_grad_norm)
        self._lr, self._lr_lambda, self._weight_decay = lr, lr_lambda, weight_decay
        self.grad_accum_steps = grad_accum_steps
        self.zero_stage = self.ds_config["zero_optimization"]["stage"]
        self.param_dtype = DTYPES[engine_dtype(self.ds_config)]
        self.module = model
        self._steps, self._micro = 0, 0
        self._cast_plain_params()  # adapters of a zero.Init model: DeepSpeed casts only unpartitioned models
        self._build_engine(step=0)

    def resolved_config(self, model, grad_accum_steps: int, max_grad_norm: float) -> dict:
        """The DeepSpeed config this model (or model config) and these settings would run with;
        raises DeepSpeedConfigError on contradictions. Callable before `attach`, to validate early."""
        from deepspeed.accelerator import get_accelerator

        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
        check_max_grad_norm(max_grad_norm)
        return resolve_config(self.user_config, grad_accum_steps=grad_accum_steps, world_size=self.world_size,
                              micro_batch_size=self.micro_batch_size, max_grad_norm=max_grad_norm,
                              bf16_supported=get_accelerator().is_bf16_supported(),
                              hidden_size=getattr(getattr(model, "config", model), "hidden_size", None),
                              source=self.config_source, base_dtype=self.base_dtype, on_cpu=self.device.type == "cpu")

    def validate(self, model, grad_accum_steps: int, max_grad_norm: float) -> None:
        self.resolved_config(model, grad_accum_steps, max_grad_norm)

    def _trainable(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.module.named_parameters() if p.requires_grad}

    def _build_engine(self, step: int) -> None:
        import deepspeed

        params = list(self._trainable().values())
        if not params:
            raise ValueError("the model has no trainable parameters (requires_grad)")
        optimizer = torch.optim.AdamW(params, lr=self._lr, weight_decay=self._weight_decay)
        engine, _, _, _ = deepspeed.initialize(model=self.module, optimizer=optimizer, config=self.ds_config)
        self.engine = engine
        self._reset_schedule(step)

    @property
    def _basic_optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer.optimizer

    def _reset_schedule(self, step: int) -> None:
        """A LambdaLR at position `step` (lr = base * lambda(step)), and DeepSpeed's counters."""
        basic = self._basic_optimizer
        for group in basic.param_groups:
            group["initial_lr"] = self._lr
        self.engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(basic, self._lr_lambda, last_epoch=step - 1)
        self.engine.global_steps = step
        self.engine.micro_steps = step * self.grad_accum_steps
        self.engine.global_samples = step * self.ds_config["train_batch_size"]
        self._steps, self._micro = step, 0

    def forward(self, **batch):
        return self.engine(**batch)

    def forward_no_grad(self, **batch):
        with torch.no_grad():
            return self.engine(**batch)

    def backward(self, loss: torch.Tensor) -> None:
        if self._micro >= self.grad_accum_steps:
            raise RuntimeError(f"backward() called {self._micro + 1} times without step() (grad_accum_steps="
                               f"{self.grad_accum_steps})")
        self.engine.backward(loss)  # scales by 1 / grad_accum_steps
        self._micro += 1
        if self._micro < self.grad_accum_steps:
            self.engine.step()  # not a boundary: only advances DeepSpeed's micro-step counter

    def step(self) -> None:
        if self._micro != self.grad_accum_steps or not self.engine.is_gradient_accumulation_boundary():
            raise RuntimeError(f"step() after {self._micro} backward() calls; expected {self.grad_accum_steps}")
        self.engine.step()
        self._micro = 0
        self._steps += 1

    @property
    def lr(self) -> float:
        return float(self._basic_optimizer.param_groups[0]["lr"])

    @property
    def optimizer_steps(self) -> int:
        return self._steps

    @property
    def grad_norm(self) -> float | None:
        """DeepSpeed's global norm of the last step (ZeRO reduces it over ranks; before clipping).
        None before the first step and until the first step after an engine rebuild."""
        if self._steps == 0 or self.engine is None:
            return None
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    @property
    def skipped_steps(self) -> int:
        """Steps DeepSpeed skipped for inf/nan gradients (bf16/fp16 overflow check)."""
        return int(getattr(self.engine, "skipped_steps", 0))

    def full_grad(self, name: str, param: torch.nn.Parameter) -> torch.Tensor | None:
        """Rank-averaged gradient of `param` (collective: every rank must call it for the same params)."""
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(param)

    def full_param(self, name: str, param: torch.nn.Parameter) -> torch.Tensor:
        """Full value of `param`, identical on every rank (collective: every rank must call it for
        the same params). Trainable params give their fp32 master (more precise than the bf16
        model copy); frozen ones a gathered copy in their own dtype."""
        from deepspeed.utils import safe_get_full_fp32_param

        if param.requires_grad and self.engine is not None:
            master = safe_get_full_fp32_param(param)
            if master is not None:
                return master
        with self.gathered([param], modifier_rank=None):
            return param.detach().clone()

    def gathered(self, params: Iterable[torch.nn.Parameter], modifier_rank: int | None = 0):
        """Full tensors of ZeRO-3 partitioned `params` inside the block, on every rank (collective:
        every rank must enter with the same list). On exit rank `modifier_rank`'s in-place edits
        are broadcast (None: read only, cheaper). Replacing a module's Parameter by a new one
        inside the block is fine. No-op for params that are not partitioned (ZeRO-1/2)."""
        partitioned = [p for p in params if hasattr(p, "ds_id")]
        if not partitioned:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank)

    def param_access(self) -> ParamAccess:
        """Shape changes read gathered tensors without writing them back (the old parameters are
        discarded, so broadcasting them would be waste) and partition new ones at once."""
        return ParamAccess(read=lambda params: self.gathered(params, modifier_rank=None), adopt=self.partition_new_params)

    def partition_new_params(self, module) -> None:
        """ZeRO-3: partition the plain parameters just put into `module` (in the engine's dtype),
        so a shape change never holds more than one module in full. Other stages: nothing."""
        new = [p for p in module.parameters(recurse=False) if not hasattr(p, "ds_id")]
        anchor = next((p for p in self.module.parameters() if hasattr(p, "ds_id")), None)
        if not new or anchor is None:  # nothing partitioned yet: deepspeed.initialize will do it
            return
        for param in new:
            if param.is_floating_point() and param.dtype != self.param_dtype:
                param.data = param.data.to(self.param_dtype)
        anchor.convert_to_zero_parameters(param_list=new)  # the Init that partitioned the model

    # ---- shape changes -----------------------------------------------------------------------
    def _adam_step(self) -> torch.Tensor | None:
        """The Adam step of the flat fp32 partitions (None before the first step: state is lazy)."""
        basic = self._basic_optimizer
        flats = [f for f in _flat_fp32_partitions(self.engine.optimizer) if f in basic.state and basic.state[f]]
        return basic.state[flats[0]]["step"].detach().clone() if flats else None

    def _full_states(self, moments: bool):
        """(name, param, {"master", "exp_avg", "exp_avg_sq"}) per trainable param, full fp32 CPU
        tensors identical on every rank. Collectives in the same order on every rank: consume
        the whole iterator on every rank."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        for name, param in self._trainable().items():
            entry = {"master": safe_get_full_fp32_param(param).detach().cpu().clone()}
            if moments:
                for key in ADAM_MOMENTS:
                    entry[key] = safe_get_full_optimizer_state(param, key).detach().cpu().clone()
            yield name, param, entry

    def _snapshot(self) -> tuple[dict[str, dict[str, torch.Tensor]], torch.Tensor | None]:
        adam_step = self._adam_step()
        return {name: entry for name, _, entry in self._full_states(adam_step is not None)}, adam_step

    def _destroy_engine(self) -> None:
        engine, self.engine = self.engine, None
        engine.destroy()
        for handle in ("module_forward_pre_hook", "module_forward_post_hook"):
            if getattr(engine, handle, None) is not None:
                getattr(engine, handle).remove()
                setattr(engine, handle, None)
        for param in self.module.parameters():
            for attr in ("_z3_optimizer", "_zero_optimizer", "_hp_mapping"):
                if attr in param.__dict__:
                    delattr(param, attr)
        # ZeRO-3 puts autograd Functions on every module whose closures hold the engine's
        # DeepSpeedZeRoOffload, and a later engine reuses them if present: the FIRST engine's
        # offload and parameter coordinator then stay alive for the rest of the run (measured
        # with weakrefs) and backward prefetches/releases through that stale coordinator.
        for module in self.module.modules():
            for attr in ("pre_bwd_fn", "post_bwd_fn"):
                module.__dict__.pop(attr, None)
        engine.lr_scheduler = engine.optimizer = engine.basic_optimizer = None
        del engine
        gc.collect()

    def close(self) -> None:
        """Destroy the engine (without leaking it); the model stays usable (ZeRO-3 params stay
        partitioned). Needed before attaching another engine in the same process."""
        if self.engine is not None:
            self._destroy_engine()

    def shutdown(self) -> None:
        """End of the process's distributed work: wait for every rank, then destroy the process
        group. Without it a rank that exits first can make another abort in its communication
        threads' teardown ("terminate called without an active exception", seen ~1 in 4 runs)."""
        self.close()
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()

    def _check_shapes_agree(self) -> None:
        shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in self.module.named_parameters()}
        trainable = sorted(self._trainable())
        views = self.all_gather_object((shapes, trainable))
        for rank, view in enumerate(views):
            if view != views[0]:
                diff = sorted(set(view[0].items()) ^ set(views[0][0].items()))[:4]
                raise RuntimeError(f"after change_fn rank {rank} has other parameter shapes / trainable set "
                                   f"than rank 0: {diff}")

    def _cast_plain_params(self) -> None:
        """New fp32 params in a bf16/fp16 model: ZeRO-3 re-init would not cast them (ZeRO-1/2 does)."""
        if self.param_dtype == torch.float32:
            return
        for param in self.module.parameters():
            if not hasattr(param, "ds_id") and param.dtype == torch.float32:
                param.data = param.data.to(self.param_dtype)

    def apply_shape_change(self, change_fn: Callable[[], ShapeChange], carry_state: bool = True) -> None:
        """Destroy the engine, run `change_fn`, rebuild it carrying masters, Adam state and the
        LR position (see the module docstring). Call after `step()`, on every rank; `change_fn`
        must produce identical shapes on every rank (checked) and may gather ZeRO-3 params with
        `self.gathered`. Every trainable param that existed before gets its old master and
        moments with `change[name]` applied (no entry: unchanged, so a replaced param of the same
        shape gets its old master back); trainable params with new names keep their values and
        start with zero moments. If `change_fn` raises, the backend is left without an engine.
        `carry_state=False` (resume: a checkpoint is loaded next) rebuilds without carrying."""
        if self._micro:
            raise RuntimeError("apply_shape_change() inside a gradient-accumulation cycle; call it after step()")
        snap, adam_step = self._snapshot() if carry_state else ({}, None)
        self._destroy_engine()
        change = change_fn() or {}
        self._check_shapes_agree()
        self._cast_plain_params()
        self._build_engine(step=self._steps)
        if carry_state:
            self._restore(snap, adam_step, change)

    def _init_adam_state(self, adam_step: torch.Tensor) -> None:
        """Create the (lazy) Adam state of every flat fp32 partition with zero moments, so that
        `safe_set_full_optimizer_state` has somewhere to write."""
        zero_optimizer, basic = self.engine.optimizer, self._basic_optimizer
        for flat in _flat_fp32_partitions(zero_optimizer):
            basic.state[flat] = {"step": adam_step.clone(), "exp_avg": torch.zeros_like(flat),
                                 "exp_avg_sq": torch.zeros_like(flat)}
        if hasattr(zero_optimizer, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2 fragment links
            zero_optimizer._hp_optimizer_states_linked = False
            zero_optimizer._lazy_init_hp_params_optimizer_state()

    def _set_full_state(self, param, master: torch.Tensor, moments: dict[str, torch.Tensor],
                        model_copy: bool = False) -> None:
        """Write full tensors into this rank's partitions (collective under ZeRO-3). `model_copy`:
        also set the model's working copy (bf16/fp16 or fp32) from the master, which the optimizer
        otherwise does only at its next step."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        if self.zero_stage == 3:
            self._set_zero3_state(param, master, moments, model_copy)
            return
        safe_set_full_fp32_param(param, master)
        for key, value in moments.items():
            safe_set_full_optimizer_state(param, value, key)
        if model_copy:
            with torch.no_grad():
                param.data.copy_(master.view(param.shape))

    def _set_zero3_state(self, param, master: torch.Tensor, moments: dict[str, torch.Tensor], model_copy: bool) -> None:
        """ZeRO-3: copy this rank's slice of each full tensor into its partitions, locally.
        DeepSpeed's `set_full_hp_param` narrows the unpadded tensor by the padded partition size,
        which fails on the last rank whenever numel is not a multiple of the world size (a
        shrunk hidden size or a grown rank makes such shapes routinely)."""
        optimizer = self.engine.optimizer
        rank = optimizer._get_param_partition_rank(param)
        for key, value in (("master", master), *moments.items()):
            partition, group = optimizer._get_fp32_opt_state_partition(
                param, release_swap_buffers=False, optim_state_key=None if key == "master" else key)
            _copy_rank_slice(partition, value, rank)
            if optimizer._swappable_optimizer_subgroup(group):
                optimizer._optimizer_states_and_gradient_swap_out(group)
        if model_copy:  # the model's own partition (bf16/fp16 or fp32), without a gather
            _copy_rank_slice(param.ds_tensor, master, rank)

    def _restore(self, snap, adam_step, change: ShapeChange) -> None:
        from deepspeed.utils import safe_get_full_fp32_param

        if adam_step is not None:
            self._init_adam_state(adam_step)
        for name, param in self._trainable().items():
            if name not in snap:
                continue
            edits = change.get(name, [])
            shape = tuple(getattr(param, "ds_shape", param.shape))
            fill = safe_get_full_fp32_param(param).cpu() if any(isinstance(e, Grow) for e in edits) else None
            master = apply_edits(snap[name]["master"], edits, fill=fill)
            if tuple(master.shape) != shape:
                raise RuntimeError(f"{name}: edits give shape {tuple(master.shape)} but the new parameter is {shape}")
            moments = {key: apply_edits(snap[name][key], edits) for key in ADAM_MOMENTS} if adam_step is not None else {}
            self._set_full_state(param, master, moments)

    # ---- checkpoints (safetensors + JSON, nothing pickled) ------------------------------------
    def _shapes(self) -> dict[str, list[int]]:
        return {n: list(getattr(p, "ds_shape", p.shape)) for n, p in self._trainable().items()}

    def _on_all_ranks(self, check: Callable[[], None]) -> None:
        """Run `check` on every rank; if it fails anywhere, raise on every rank (instead of one
        rank raising while the others wait in the next collective)."""
        try:
            check()
            error = None
        except (OSError, ValueError, KeyError) as err:
            error = (type(err).__name__, str(err))
        errors = [e for e in self.all_gather_object(error) if e is not None]
        if errors:
            kind, message = errors[0]
            raise {"FileNotFoundError": FileNotFoundError, "KeyError": KeyError}.get(kind, ValueError)(message)

    def save(self, directory: Path) -> None:
        """Write the full fp32 masters and Adam moments of every trainable parameter plus step
        counters (call on all ranks: gathering is collective; rank 0 writes). Layout:
        directory/trainable.safetensors (`master/<name>`, `exp_avg/<name>`, `exp_avg_sq/<name>`)
        and directory/optimizer.json. Frozen weights and buffers are not included (the trainer
        saves those), as in LocalBackend. Loadable under any world size and ZeRO stage."""
        from safetensors.torch import save_file

        if self._micro:
            raise RuntimeError("save() inside a gradient-accumulation cycle; call it after step()")
        directory = Path(directory)
        adam_step = self._adam_step()
        tensors: dict[str, torch.Tensor] = {}
        for name, _, entry in self._full_states(adam_step is not None):
            if self.rank == 0:
                tensors.update({f"{key}/{name}": value.float().contiguous() for key, value in entry.items()})
        if self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            meta = {"format": CHECKPOINT_FORMAT, "backend": "deepspeed", "optimizer_steps": self._steps,
                    "adam_step": None if adam_step is None else float(adam_step),
                    "zero_stage": self.zero_stage, "world_size": self.world_size,
                    "param_dtype": str(self.param_dtype).replace("torch.", ""), "lr": self.lr, "shapes": self._shapes()}
            save_file(tensors, str(directory / TENSOR_FILE), metadata={"format": str(CHECKPOINT_FORMAT)})
            (directory / META_FILE).write_text(json.dumps(meta, indent=1))
        self.barrier()

    def load(self, directory: Path) -> None:
        """Restore a `save`d state into the attached engine; call on all ranks, after building
        the checkpoint's architecture (shapes are checked first: ValueError naming the first
        parameter that differs). World size and ZeRO stage may differ from when it was saved."""
        from safetensors import safe_open

        directory = Path(directory)
        tensor_path = directory / TENSOR_FILE
        meta: dict = {}  # filled on every rank; _on_all_ranks raises everywhere if any rank fails
        self._on_all_ranks(lambda: meta.update(read_checkpoint_meta(directory, self._shapes())))
        adam_step = meta["adam_step"]
        # A fresh Adam state (step 0, zero moments) behaves exactly like the lazy one.
        self._init_adam_state(torch.tensor(float(adam_step or 0.0), dtype=torch.float32))
        with safe_open(str(tensor_path), framework="pt") as handle:
            for name, param in self._trainable().items():  # collectives under ZeRO-3: same order everywhere
                moments = {key: handle.get_tensor(f"{key}/{name}") for key in ADAM_MOMENTS} if adam_step is not None \
                    else {}  # saved before the first step: the zero moments just created
                self._set_full_state(param, handle.get_tensor(f"master/{name}"), moments, model_copy=True)
        self._reset_schedule(int(meta["optimizer_steps"]))  # LambdaLR's state is its step count
