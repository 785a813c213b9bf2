"""The DeepSpeed seam: `DeepSpeedBackend` runs the `TrainingBackend` contract on a ZeRO engine.

The only apt_ds module that imports deepspeed, lazily, so that `import apt_ds` works without it.

Decisions (measured with deepspeed 0.19.8, torch 2.13 CPU, gloo):
- The optimizer is always a client `torch.optim.AdamW` over the trainable parameters and the
  schedule a client `LambdaLR`, from APT's config; the JSON is read and its "auto" values
  resolved by `apt_ds.distributed.ds_config` (which says what is accepted, and why).
- Gradient accumulation: `backward` runs `engine.backward` (which scales by 1/gas) and, on
  every micro-batch except the last of a cycle, a no-op `engine.step` that only advances
  DeepSpeed's micro-step counter; `step` is the boundary step. So reduced gradients are
  readable by `full_grad` between the last backward and `step`.

Shape changes (`apply_shape_change`), the sequence that works on ZeRO-2 and ZeRO-3:
1. snapshot every trainable fp32 master and its Adam moments by name, plus the Adam step
   (`zero_state.snapshot`, collective);
2. destroy the engine and drop what DeepSpeed leaves holding it (`deepspeed_private.release_engine`);
3. run `change_fn`. ZeRO-3's unchanged parameters stay partitioned after destroy and can still be
   gathered; `param_access()` gives a read-only gather and partitions each module's NEW
   parameters right after they are made, so one module at a time is ever held in full
   (`zero_params`). Plain float32 parameters are cast to bf16/fp16 when that is on; replaced
   ones DeepSpeed registered as another module's external parameters are unregistered;
4. check every rank has the same shapes (a mismatch would hang DeepSpeed), re-run
   `deepspeed.initialize` (it broadcasts new parameters from rank 0), write back masters (grown
   entries take the new parameter's values) and moments (`backend.carry_adam_moment`) with
   `zero_state.restore_after_change`, and put the LR schedule and DeepSpeed's step counters back.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Callable, Iterable

import torch

from apt_ds.algorithm.edits import ShapeChange
from apt_ds.algorithm.shrink import ParamAccess
from apt_ds.distributed import deepspeed_private as private
from apt_ds.distributed import zero_comm, zero_params, zero_state
from apt_ds.distributed.backend import LrLambda, TrainingBackend, check_max_grad_norm
from apt_ds.distributed.ds_config import (
    DeepSpeedConfigError,
    engine_dtype,
    load_ds_config,
    resolve_config,
    resolve_precision,
    warn_single_rank_zero3,
)
from apt_ds.distributed.placement import DTYPES, rank_device
from apt_ds.distributed.zero_checkpoint import load_checkpoint_state, read_checkpoint_meta, write_checkpoint
from apt_ds.distributed.zero_monitor import build_monitor, metric_events, monitor_config_problem, without_monitor


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
        self.monitor = None  # DeepSpeed's MonitorMaster when the JSON enables one (zero_monitor)
        zero_comm.init_process_group()
        self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.device = rank_device()
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
    def place(self, model) -> None:
        zero_params.place_model(model, self.device)

    def barrier(self) -> None:
        torch.distributed.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place on `tensor` (also returned). CPU tensors work on any backend."""
        return zero_comm.all_reduce_sum(tensor)

    def all_gather_object(self, obj) -> list:
        return zero_comm.all_gather_object(obj)

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
        # adapters of a zero.Init model: DeepSpeed casts only unpartitioned models
        zero_params.cast_plain_params(self.module, self.param_dtype)
        self.monitor = build_monitor(self.ds_config)
        self._build_engine(step=0)

    def resolved_config(self, model, grad_accum_steps: int, max_grad_norm: float) -> dict:
        """The DeepSpeed config this model (or model config) and these settings would run with;
        raises DeepSpeedConfigError on contradictions. Callable before `attach`, to validate early."""
        from deepspeed.accelerator import get_accelerator

        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
        check_max_grad_norm(max_grad_norm)
        resolved = resolve_config(self.user_config, grad_accum_steps=grad_accum_steps, world_size=self.world_size,
                                  micro_batch_size=self.micro_batch_size, max_grad_norm=max_grad_norm,
                                  bf16_supported=get_accelerator().is_bf16_supported(),
                                  hidden_size=getattr(getattr(model, "config", model), "hidden_size", None),
                                  source=self.config_source, base_dtype=self.base_dtype, on_cpu=self.device.type == "cpu")
        problem = monitor_config_problem(resolved)
        if problem:
            raise DeepSpeedConfigError(f"DeepSpeed config {self.config_source}: {problem}")
        return resolved

    def validate(self, model, grad_accum_steps: int, max_grad_norm: float) -> None:
        resolved = self.resolved_config(model, grad_accum_steps, max_grad_norm)
        warn_single_rank_zero3(resolved, self.world_size, self.device.type, self.is_main())

    def _trainable(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.module.named_parameters() if p.requires_grad}

    def _build_engine(self, step: int) -> None:
        import deepspeed

        params = list(self._trainable().values())
        if not params:
            raise ValueError("the model has no trainable parameters (requires_grad)")
        optimizer = torch.optim.AdamW(params, lr=self._lr, weight_decay=self._weight_decay)
        engine, _, _, _ = deepspeed.initialize(model=self.module, optimizer=optimizer, config=without_monitor(self.ds_config))
        if self.monitor is not None:
            private.set_engine_monitor(engine, self.monitor)
        self.engine = engine
        self._reset_schedule(step)

    @property
    def adam_optimizer(self) -> torch.optim.Optimizer:
        return private.basic_optimizer(self.engine)

    def _reset_schedule(self, step: int) -> None:
        """A LambdaLR at position `step` (lr = base * lambda(step)), and DeepSpeed's counters."""
        basic = self.adam_optimizer
        for group in basic.param_groups:
            group["initial_lr"] = self._lr
        scheduler = self._scheduler = torch.optim.lr_scheduler.LambdaLR(basic, self._lr_lambda, last_epoch=step - 1)
        private.set_engine_position(self.engine, scheduler, global_steps=step, micro_steps=step * self.grad_accum_steps,
                                    global_samples=step * self.ds_config["train_batch_size"])
        self._steps, self._micro = step, 0

    def log_metrics(self, record: dict) -> None:
        """Also write a metrics record's numbers through DeepSpeed's monitor (rank 0 writes)."""
        if self.monitor is not None and self.rank == 0:
            self.monitor.write_events(metric_events(record))

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
        self.engine.step()  # ZeRO skips the update when the global norm is NaN or inf, and holds the LR schedule
        if self.step_skipped:  # back: the trainer's stays tied to the step count
            self._scheduler.step()
        self._micro = 0
        self._steps += 1

    @property
    def lr(self) -> float:
        return float(self.adam_optimizer.param_groups[0]["lr"])

    @property
    def optimizer_steps(self) -> int:
        return self._steps

    @property
    def grad_norm(self) -> float | None:
        """DeepSpeed's global norm of the last step (ZeRO reduces it over ranks; before clipping).
        None before the first step and until the first step after an engine rebuild."""
        norm = None if self._steps == 0 or self.engine is None else self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    @property
    def step_skipped(self) -> bool:
        return self.engine is not None and not self.engine.was_step_applied()

    def full_grad(self, name: str, param: torch.nn.Parameter) -> torch.Tensor | None:
        """Rank-averaged gradient of `param` (collective: every rank must call it for the same params)."""
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(param)

    def full_param(self, name: str, param: torch.nn.Parameter) -> torch.Tensor:
        """Full value of `param`, identical on every rank (collective, as full_grad). Trainable params
        give their fp32 master (more precise than the bf16 model copy); frozen ones a gathered copy."""
        from deepspeed.utils import safe_get_full_fp32_param

        if param.requires_grad and self.engine is not None:
            master = safe_get_full_fp32_param(param)
            if master is not None:
                return master
        with self.gathered([param], modifier_rank=None):
            return param.detach().clone()

    def gathered(self, params: Iterable[torch.nn.Parameter], modifier_rank: int | None = 0):
        """Full tensors of ZeRO-3 partitioned `params` inside the block (zero_params.gathered)."""
        return zero_params.gathered(params, modifier_rank)

    def param_access(self) -> ParamAccess:
        """Shape changes read gathered tensors without writing them back (the old parameters are
        discarded, so broadcasting them would be waste) and partition new ones at once."""
        return ParamAccess(read=lambda params: self.gathered(params, modifier_rank=None), adopt=self.partition_new_params,
                           release=zero_params.release_replaced, reads_copies=True)

    def partition_new_params(self, module) -> None:
        zero_params.partition_new_params(self.module, module, self.param_dtype)

    # ---- shape changes -----------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the engine without leaking it (`deepspeed_private.release_engine`); the model
        stays usable (ZeRO-3 params stay partitioned). Needed before attaching another engine."""
        engine, self.engine = self.engine, None
        if engine is not None:
            private.release_engine(engine, self.module)
            del engine
            gc.collect()

    def shutdown(self) -> None:
        """End of the process's distributed work: destroy the engine, then the process group
        once every rank got here (zero_comm.end_process_group)."""
        self.close()
        zero_comm.end_process_group()

    def apply_shape_change(self, change_fn: Callable[[], ShapeChange], carry_state: bool = True) -> None:
        """Destroy the engine, run `change_fn`, rebuild it carrying masters, Adam state and the
        LR position (the sequence: module docstring). Call after `step()`, on every rank;
        `change_fn` must produce identical shapes on every rank (checked). Every trainable param
        that existed before gets its old master and moments with `change[name]` applied (no entry:
        unchanged, so a replaced param of the same shape gets its old master back); new names
        keep their values and start with zero moments. If `change_fn` raises, the backend is left
        without an engine. `carry_state=False` (a checkpoint is loaded next): carry nothing."""
        if self._micro:
            raise RuntimeError("apply_shape_change() inside a gradient-accumulation cycle; call it after step()")
        snap, adam_step = zero_state.snapshot(self.engine, self._trainable()) if carry_state else ({}, None)
        self.close()
        change = change_fn() or {}
        zero_params.forget_replaced_external(self.module)
        zero_params.check_shapes_agree(self.module)
        zero_params.cast_plain_params(self.module, self.param_dtype)
        self._build_engine(step=self._steps)
        if carry_state:
            zero_state.restore_after_change(self.engine, self.zero_stage, self._trainable(), snap, adam_step, change)

    # ---- checkpoints (safetensors + JSON, nothing pickled: zero_checkpoint) -----------------
    def _shapes(self) -> dict[str, list[int]]:
        return {n: list(zero_state.full_shape(p)) for n, p in self._trainable().items()}

    def save(self, directory: Path) -> None:
        """Write the full fp32 masters and Adam moments of every trainable parameter plus step
        counters (call on all ranks: gathering is collective; rank 0 writes). Frozen weights and
        buffers are not included (the trainer saves those), as in LocalBackend. Loadable under
        any world size and ZeRO stage."""
        if self._micro:
            raise RuntimeError("save() inside a gradient-accumulation cycle; call it after step()")
        meta = {"optimizer_steps": self._steps, "zero_stage": self.zero_stage, "world_size": self.world_size,
                "param_dtype": str(self.param_dtype).replace("torch.", ""), "lr": self.lr, "shapes": self._shapes()}
        write_checkpoint(Path(directory), self.engine, self._trainable(), meta, writer=self.rank == 0)
        self.barrier()

    def load(self, directory: Path) -> None:
        """Restore a `save`d state into the attached engine; call on all ranks, after building
        the checkpoint's architecture (shapes are checked first: ValueError naming the first
        parameter that differs). World size and ZeRO stage may differ from when it was saved."""
        directory = Path(directory)
        meta: dict = {}  # filled on every rank; on_all_ranks raises everywhere if any rank fails
        zero_comm.on_all_ranks(lambda: meta.update(read_checkpoint_meta(directory, self._shapes())))
        load_checkpoint_state(directory, meta, self.engine, self.zero_stage, self._trainable())
        self._reset_schedule(int(meta["optimizer_steps"]))  # LambdaLR's state is its step count
