"""The seam between the APT loop and whatever executes it.

The trainer talks only to a `TrainingBackend`: forward/backward/step, a cross-rank sum, the
global gradient of a parameter, gathered access to (possibly partitioned) weights, and a
shape change that rebuilds the optimizer carrying its state. `LocalBackend` is plain
PyTorch on one process; `apt_ds.distributed.zero.DeepSpeedBackend` implements the same contract on a
DeepSpeed engine (ZeRO-2/3, many ranks).
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors.torch import load_file, save_file

from apt_ds.algorithm.edits import Grow, ShapeChange, apply_edits
from apt_ds.algorithm.finite import all_finite
from apt_ds.algorithm.shrink import LOCAL_ACCESS, ParamAccess

LrLambda = Callable[[int], float]


def carry_adam_moment(key: str, value: torch.Tensor, edits: list) -> torch.Tensor:
    """An Adam moment after a shape change: carried entries keep theirs; grown entries start at
    exp_avg = 0 and exp_avg_sq = the parameter's mean exp_avg_sq before the change.

    Why not zero: torch's Adam keeps ONE step count per parameter, so grown entries inherit its
    bias correction (about 1 after a few hundred steps). With both moments zero, their first
    update would be lr * (1 - beta1) / sqrt(1 - beta2), about 3.2 x lr, where a fresh Adam's is lr.
    Starting the second moment at the parameter's typical value keeps that first update below lr
    for any gradient up to about 10x the typical one (tests/training/test_trainer.py)."""
    if key != "exp_avg_sq" or not any(isinstance(e, Grow) for e in edits):
        return apply_edits(value, edits)
    grown_shape = apply_edits(value, edits).shape
    return apply_edits(value, edits, fill=torch.full(grown_shape, float(value.float().mean()), dtype=value.dtype))


def check_max_grad_norm(max_grad_norm: float) -> None:
    if not (max_grad_norm >= 0 and math.isfinite(max_grad_norm)):
        raise ValueError(f"max_grad_norm must be a finite number >= 0 (0: no clipping), got {max_grad_norm}")


class TrainingBackend:
    """Contract used by APTrainer. Subclasses must implement every method."""

    world_size: int = 1
    rank: int = 0
    device: torch.device = torch.device("cpu")
    module: torch.nn.Module

    def place(self, model: torch.nn.Module) -> None:
        """Put `model` on this backend's device before adapters, masks and the engine are made."""
        model.to(self.device)

    def attach(self, model: torch.nn.Module, lr: float, lr_lambda: LrLambda, weight_decay: float, grad_accum_steps: int,
               *, max_grad_norm: float) -> None:
        raise NotImplementedError

    def forward(self, **batch):
        raise NotImplementedError

    def validate(self, model: torch.nn.Module, grad_accum_steps: int, max_grad_norm: float) -> None:
        """Refuse settings `attach` would refuse, before anything is written. No-op by default:
        TrainConfig already checks its own values; DeepSpeed adds its JSON's contradictions."""

    def forward_no_grad(self, **batch):
        with torch.no_grad():
            return self.module(**batch)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch; the loss is scaled by 1 / grad_accum_steps here."""
        raise NotImplementedError

    def step(self) -> None:
        """Optimizer + LR-scheduler step at the end of a gradient-accumulation cycle; clips the
        global gradient norm to `max_grad_norm` first (0: no clipping)."""
        raise NotImplementedError

    @property
    def grad_norm(self) -> float | None:
        """Global gradient norm of the last step, before clipping (None before the first step)."""
        raise NotImplementedError

    @property
    def step_skipped(self) -> bool:
        """Whether the last step() left weights and Adam state alone, its global gradient norm NaN or
        inf (as DeepSpeed skips an overflowed step). It still counts: the LR and pruning schedules move on."""
        raise NotImplementedError

    @property
    def lr(self) -> float:
        raise NotImplementedError

    @property
    def adam_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer holding this rank's Adam moments (under ZeRO: of its partitions)."""
        raise NotImplementedError

    def optimizer_state_finite(self) -> bool:
        """Whether every Adam moment on every rank is finite (collective: one flag summed over ranks)."""
        moments = (v for state in self.adam_optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim())
        return not float(self.all_reduce_sum(torch.tensor([float(not all_finite(moments))])))

    @property
    def optimizer_steps(self) -> int:
        raise NotImplementedError

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_object(self, obj) -> list:
        return [obj]

    def full_grad(self, name: str, param: torch.nn.Parameter) -> torch.Tensor | None:
        """Gradient of the global (rank-averaged) loss; readable between backward and step."""
        raise NotImplementedError

    def full_param(self, name: str, param: torch.nn.Parameter) -> torch.Tensor:
        """Full (unpartitioned) value of a trainable parameter, identical on every rank."""
        return param.detach()

    def gathered(self, params: Iterable[torch.nn.Parameter]):
        """Context in which full tensors of `params` can be read and replaced on every rank."""
        return contextlib.nullcontext()

    def param_access(self) -> ParamAccess:
        """How shape changes read and re-home parameters (apt_ds.algorithm.shrink.ParamAccess)."""
        return LOCAL_ACCESS

    def apply_shape_change(self, change_fn: Callable[[], ShapeChange], carry_state: bool = True) -> None:
        """Run `change_fn` (which replaces parameters and returns their edits), then rebuild
        the optimizer carrying masters, Adam moments, step count and LR schedule
        (`carry_state=False`: a checkpoint is loaded next, carry nothing)."""
        raise NotImplementedError

    def save(self, directory: Path) -> None:
        raise NotImplementedError

    def load(self, directory: Path) -> None:
        raise NotImplementedError

    def barrier(self) -> None:
        pass

    def log_metrics(self, record: dict) -> None:
        """Also send a metrics record (already in metrics.jsonl) to the backend's own monitoring;
        called on every rank. No-op by default; DeepSpeed: its monitor, when the JSON enables one."""

    def shutdown(self) -> None:
        """Called once when the run is over (DeepSpeed: tear the process group down cleanly)."""

    def is_main(self) -> bool:
        return self.rank == 0


class LocalBackend(TrainingBackend):
    """One process, torch.optim.AdamW + LambdaLR; the reference the DeepSpeed seam must match. A step
    whose gradient norm is not finite is skipped; on a GPU without a host read: AdamW is fused there
    (`fused=None`) and gets the verdict as `found_inf`, as from torch's GradScaler, and its kernel
    leaves weights, moments and step count alone (on a CPU, reading the norm stalls no device)."""

    def __init__(self, device: torch.device | str = "cpu", fused: bool | None = None):
        self.device = torch.device(device)
        self.fused = self.device.type == "cuda" if fused is None else fused

    def attach(self, model, lr, lr_lambda, weight_decay, grad_accum_steps, *, max_grad_norm):
        check_max_grad_norm(max_grad_norm)
        self.module = model
        self._lr, self._lr_lambda, self._weight_decay = lr, lr_lambda, weight_decay
        self.grad_accum_steps = grad_accum_steps
        self.max_grad_norm = max_grad_norm
        self._grad_norm = None
        self._skipped: torch.Tensor | bool = False
        self._build_optimizer(step=0)

    def _trainable(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.module.named_parameters() if p.requires_grad}

    def _build_optimizer(self, step: int) -> None:
        params = list(self._trainable().values())
        self.optimizer = torch.optim.AdamW(params, lr=self._lr, weight_decay=self._weight_decay, fused=self.fused or None)
        for group in self.optimizer.param_groups:
            group["initial_lr"] = self._lr
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda, last_epoch=step - 1)
        self._steps = step

    def forward(self, **batch):
        return self.module(**batch)

    def backward(self, loss):
        (loss / self.grad_accum_steps).backward()

    def step(self):
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        # Kept as a tensor: reading it here would stall the device before the optimizer step is queued.
        if self.max_grad_norm > 0:
            self._grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm).detach()
        else:  # measure only: a clip coefficient of inf/inf would turn the gradients into NaN
            grads = [p.grad for p in params if p.grad is not None]
            self._grad_norm = torch.nn.utils.get_total_norm(grads).detach() if grads else torch.zeros((), device=self.device)
        nonfinite = ~torch.isfinite(self._grad_norm)
        if self.fused:  # the kernel skips the update where found_inf is 1 (see the class docstring)
            self.optimizer.found_inf = nonfinite.float()  # a 0-d tensor, as GradScaler's
            self.optimizer.step()
            del self.optimizer.found_inf
        elif not (skipped := bool(nonfinite)):
            self.optimizer.step()
        self._skipped = nonfinite if self.fused else skipped
        with warnings.catch_warnings(action="ignore", category=UserWarning):  # a skipped 1st step: "...before optimizer.step()"
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._steps += 1

    @property
    def lr(self):
        return self.optimizer.param_groups[0]["lr"]

    @property
    def grad_norm(self) -> float | None:
        return None if self._grad_norm is None else float(self._grad_norm)

    @property
    def step_skipped(self) -> bool:
        return bool(self._skipped)

    adam_optimizer = property(lambda self: self.optimizer)

    @property
    def optimizer_steps(self):
        return self._steps

    def full_grad(self, name, param):
        return param.grad

    # ---- shape changes -------------------------------------------------------------------
    def _state_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        by_param = {id(p): n for n, p in self._trainable().items()}
        out = {}
        for param, state in self.optimizer.state.items():
            if id(param) in by_param and state:
                out[by_param[id(param)]] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}
        return out

    def apply_shape_change(self, change_fn, carry_state=True):
        old_state = self._state_by_name() if carry_state else {}
        change = change_fn()
        self._build_optimizer(step=self._steps)
        self._restore_state(old_state, change)

    def _restore_state(self, old_state, change: ShapeChange) -> None:
        for name, param in self._trainable().items():
            if name not in old_state:
                continue
            edits = change.get(name, [])
            new_state = {}
            for key, value in old_state[name].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    value = carry_adam_moment(key, value, edits)
                    if value.shape != param.shape:
                        raise RuntimeError(f"optimizer state {name}.{key} has shape {tuple(value.shape)} != {tuple(param.shape)}")
                new_state[key] = value
            self.optimizer.state[param] = new_state

    # ---- checkpoints (safetensors + JSON, nothing pickled) ---------------------------------
    def save(self, directory):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors, steps = {}, {}
        for name, param in self._trainable().items():
            tensors[f"param/{name}"] = param.detach().contiguous()
            state = self.optimizer.state.get(param, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    tensors[f"{key}/{name}"] = state[key].contiguous()
            if "step" in state:
                steps[name] = float(state["step"])
        save_file(tensors, str(directory / "trainable.safetensors"))
        meta = {"optimizer_steps": self._steps, "adam_steps": steps, "scheduler": self.scheduler.state_dict()}
        meta["scheduler"].pop("lr_lambdas", None)
        (directory / "optimizer.json").write_text(json.dumps(meta))

    @torch.no_grad()
    def load(self, directory):
        directory = Path(directory)
        tensors = load_file(str(directory / "trainable.safetensors"))
        meta = json.loads((directory / "optimizer.json").read_text())
        trainable = self._trainable()
        missing = [n for n in trainable if f"param/{n}" not in tensors]
        if missing:
            raise ValueError(f"checkpoint {directory} lacks trainable parameters {missing[:3]}...")
        for name, param in trainable.items():
            saved = tensors[f"param/{name}"]
            if saved.shape != param.shape:
                raise ValueError(f"checkpoint {directory}: {name} has shape {tuple(saved.shape)}, model has {tuple(param.shape)}")
            param.copy_(saved)
        self._build_optimizer(step=int(meta["optimizer_steps"]))
        for name, param in self._trainable().items():
            if f"exp_avg/{name}" in tensors:
                self.optimizer.state[param] = {  # fused AdamW keeps its step count on the parameter's device
                    "step": torch.tensor(meta["adam_steps"].get(name, 0.0), device=param.device if self.fused else "cpu"),
                    "exp_avg": tensors[f"exp_avg/{name}"].to(param.device, copy=True),
                    "exp_avg_sq": tensors[f"exp_avg_sq/{name}"].to(param.device, copy=True),
                }
