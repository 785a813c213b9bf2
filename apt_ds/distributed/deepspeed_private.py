"""Every use of a DeepSpeed internal, in one place.

`DeepSpeedBackend` carries fp32 masters and Adam state across engine rebuilds, partitions new
parameters one module at a time and tears engines down without leaks. DeepSpeed has public
API for most of it (`deepspeed.initialize`, `zero.GatheredParameters`, `deepspeed.utils.
safe_get/set_full_*`, `engine.destroy`); the rest needs attributes and methods DeepSpeed does
not document and may move in any release. They are all reached through the small functions
below, each saying which internal it touches, why no public API does the job, and the
DeepSpeed version it was read from. `PRIVATE_NAMES` lists every such name with the function
that uses it; tests/distributed/test_deepspeed_private.py checks each against the installed
DeepSpeed (and that this module uses no internal it does not list), so an upgrade that moves
one fails loudly, naming the function here to update.

Treated as public (used elsewhere, not listed here): `deepspeed.initialize`,
`deepspeed.init_distributed`, `deepspeed.zero.Init` / `GatheredParameters`, `deepspeed.utils.
safe_*`, `engine.destroy / backward / step / is_gradient_accumulation_boundary /
get_global_grad_norm / was_step_applied`, `deepspeed.monitor`'s `MonitorMaster` and
`get_monitor_config`, and the read-only ZeRO-3 parameter attributes `ds_id` (is it
partitioned?), `ds_shape` and `ds_numel` (its full shape and size), which DeepSpeed's ZeRO-3
documentation and the Hugging Face integration read the same way (and which apt_ds.algorithm
reads without importing this package).

Read from deepspeed 0.19.8 (runtime/engine.py, runtime/zero/stage_1_and_2.py,
runtime/zero/stage3.py, runtime/zero/partition_parameters.py, runtime/zero/parameter_offload.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

READ_FROM = "0.19.8"


class PrivateName(NamedTuple):
    owner: str  # where it lives: see OWNERS
    name: str
    function: str  # the function of this module that uses it


# Owners, as tests/distributed/test_deepspeed_private.py finds them on a real engine.
OWNERS = {
    "engine": "deepspeed.runtime.engine.DeepSpeedEngine instance",
    "zero12_optimizer": "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer instance",
    "zero3_optimizer": "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3 instance",
    "zero12_param": "trainable parameter under a ZeRO-1/2 engine",
    "zero3_param": "parameter under a ZeRO-3 engine (or made by zero.Init)",
    "zero3_partition": "a ZeRO-3 parameter's ds_tensor",
    "zero3_module": "submodule of a model under a ZeRO-3 engine, after one forward and backward",
    "csv_monitor": "deepspeed.monitor.csv_monitor.csvMonitor instance (rank 0 of a run whose JSON enables csv_monitor)",
    "comm_module": "the deepspeed.comm.comm module, after deepspeed.init_distributed",
}

PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName("engine", "optimizer", "basic_optimizer"),
    PrivateName("zero12_optimizer", "optimizer", "basic_optimizer"),
    PrivateName("zero3_optimizer", "optimizer", "basic_optimizer"),
    PrivateName("engine", "lr_scheduler", "set_engine_position"),
    PrivateName("engine", "global_steps", "set_engine_position"),
    PrivateName("engine", "micro_steps", "set_engine_position"),
    PrivateName("engine", "global_samples", "set_engine_position"),
    PrivateName("engine", "monitor", "set_engine_monitor"),
    PrivateName("csv_monitor", "log_dir", "csv_monitor_dir"),
    PrivateName("csv_monitor", "filenames", "mark_csv_files_started"),
    PrivateName("zero12_optimizer", "single_partition_of_fp32_groups", "flat_fp32_partitions"),
    PrivateName("zero3_optimizer", "fp32_partitioned_groups_flat", "flat_fp32_partitions"),
    PrivateName("zero12_optimizer", "_hp_optimizer_states_linked", "relink_fragment_states"),
    PrivateName("zero12_optimizer", "_lazy_init_hp_params_optimizer_state", "relink_fragment_states"),
    PrivateName("zero3_optimizer", "_get_param_partition_rank", "zero3_partition_rank"),
    PrivateName("zero3_optimizer", "_get_fp32_opt_state_partition", "zero3_fp32_partition"),
    PrivateName("zero3_optimizer", "_swappable_optimizer_subgroup", "zero3_fp32_partition"),
    PrivateName("zero3_optimizer", "_optimizer_states_and_gradient_swap_out", "zero3_fp32_partition"),
    PrivateName("zero3_param", "ds_tensor", "model_partition"),
    PrivateName("zero3_partition", "ds_numel", "model_partition"),
    PrivateName("zero3_param", "ds_process_group", "model_partition"),
    PrivateName("zero3_param", "convert_to_zero_parameters", "partition_like"),
    PrivateName("zero3_param", "ds_tensor", "release_partition"),
    PrivateName("zero3_module", "ds_external_parameters", "forget_external_parameters"),
    PrivateName("engine", "basic_optimizer", "release_engine"),
    PrivateName("engine", "module_forward_pre_hook", "release_engine"),
    PrivateName("engine", "module_forward_post_hook", "release_engine"),
    PrivateName("zero12_param", "_zero_optimizer", "release_engine"),
    PrivateName("zero12_param", "_hp_mapping", "release_engine"),
    PrivateName("zero3_param", "_z3_optimizer", "release_engine"),
    PrivateName("zero3_module", "pre_bwd_fn", "release_engine"),
    PrivateName("zero3_module", "post_bwd_fn", "release_engine"),
    PrivateName("comm_module", "cdb", "comm_backend"),
)


# ---- the torch optimizer inside the engine ---------------------------------------------------
def basic_optimizer(engine) -> torch.optim.Optimizer:
    """The client torch AdamW, whose param_groups ZeRO rewrote to its flat fp32 partitions.
    `engine.optimizer` is the ZeRO wrapper and its `.optimizer` the wrapped torch optimizer
    (stage_1_and_2.py / stage3.py `self.optimizer = init_optimizer`); no accessor returns it,
    and the LR schedule and the Adam state (keyed by the flat partitions) live on it."""
    return engine.optimizer.optimizer


def set_engine_position(engine, scheduler, global_steps: int, micro_steps: int, global_samples: int) -> None:
    """Put DeepSpeed's step counters and LR scheduler where a rebuilt or resumed run is.
    `deepspeed.initialize(lr_scheduler=...)` cannot take our LambdaLR, which must be built over
    the torch optimizer the engine creates; the counters (engine.py `global_steps`,
    `micro_steps`, `global_samples`) drive gradient-accumulation boundaries and have no setter
    (DeepSpeed restores them only from its own pickled checkpoints)."""
    engine.lr_scheduler = scheduler
    engine.global_steps = global_steps
    engine.micro_steps = micro_steps
    engine.global_samples = global_samples


def set_engine_monitor(engine, monitor) -> None:
    """Let a rebuilt engine write its own events (lr, timers) through the run's one monitor.
    engine.py creates `self.monitor = MonitorMaster(...)` in __init__ and has no way to hand one
    in; building a new one per rebuild would restart W&B runs and CSV headers."""
    engine.monitor = monitor


def csv_monitor_dir(monitor) -> str | None:
    """The folder a MonitorMaster's CSV writer fills (`csvMonitor.log_dir`, csv_monitor.py
    `setup_log_dir`: output_path/job_name); None without one (or off rank 0)."""
    writer = getattr(monitor, "csv_monitor", None)
    return None if writer is None else writer.log_dir


def mark_csv_files_started(monitor, names: list[str]) -> None:
    """csvMonitor writes a `step,<name>` header the first time its process writes a file (it keeps
    the names in `filenames`), also into a file that has one: a resumed run would put a second
    header mid-file. Files that already start with one are marked as written."""
    monitor.csv_monitor.filenames.extend(name for name in names if name not in monitor.csv_monitor.filenames)


# ---- ZeRO's flat fp32 partitions and their Adam state ---------------------------------------
def flat_fp32_partitions(zero_optimizer) -> list[torch.Tensor]:
    """The flat fp32 tensors the wrapped torch optimizer steps (the keys of its state):
    ZeRO-3 `fp32_partitioned_groups_flat` (stage3.py), ZeRO-1/2 `single_partition_of_fp32_groups`
    (stage_1_and_2.py). The public `safe_set_full_optimizer_state` writes into state that
    exists; creating the lazy Adam state of a fresh engine needs the tensors themselves."""
    for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):  # ZeRO-3, ZeRO-1/2
        if hasattr(zero_optimizer, attr):
            return list(getattr(zero_optimizer, attr))
    raise RuntimeError(f"unsupported DeepSpeed optimizer {type(zero_optimizer).__name__}")


def relink_fragment_states(zero_optimizer) -> None:
    """ZeRO-1/2: link each parameter's fragment (`_hp_mapping`) to Adam state created by hand.
    DeepSpeed links them once, lazily at its first step (`_lazy_init_hp_params_optimizer_state`,
    guarded by `_hp_optimizer_states_linked`); `safe_set_full_optimizer_state` before that step
    needs the links now. ZeRO-3 has no such links: nothing to do."""
    if hasattr(zero_optimizer, "_lazy_init_hp_params_optimizer_state"):
        zero_optimizer._hp_optimizer_states_linked = False
        zero_optimizer._lazy_init_hp_params_optimizer_state()


def zero3_partition_rank(zero_optimizer, param) -> int:
    """This rank's index in `param`'s partition group (stage3.py `_get_param_partition_rank`),
    which says which slice of the full tensor this rank's partitions hold."""
    return zero_optimizer._get_param_partition_rank(param)


def zero3_fp32_partition(zero_optimizer, param, key: str | None, write):
    """Call `write(partition)` on this rank's slice of `param`'s fp32 master (key None) or Adam
    state `key`, swapping NVMe-offloaded state in and out around it (stage3.py
    `_get_fp32_opt_state_partition`, `_swappable_optimizer_subgroup`,
    `_optimizer_states_and_gradient_swap_out`). The public `safe_set_full_*` narrows the
    unpadded full tensor by the padded partition size, which fails on the last rank whenever
    numel is not a multiple of the world size (shrunk and grown shapes make those routinely)."""
    partition, group = zero_optimizer._get_fp32_opt_state_partition(
        param, release_swap_buffers=False, optim_state_key=key)
    write(partition)
    if zero_optimizer._swappable_optimizer_subgroup(group):
        zero_optimizer._optimizer_states_and_gradient_swap_out(group)


# ---- ZeRO-3 parameter partitions ----------------------------------------------------------
class Partition(NamedTuple):
    tensor: torch.Tensor  # this rank's flat slice, zero-padded on the last rank
    size: int  # elements per rank (the padded partition size)
    rank: int  # this rank's index in the parameter's partition group


def model_partition(param) -> Partition:
    """This rank's slice of a ZeRO-3 parameter in the model's dtype (partition_parameters.py
    `ds_tensor`, its `ds_numel` and the param's `ds_process_group`). Loading weights straight
    into partitions and writing a resumed master into the model copy without a gather have no
    public API (`GatheredParameters` would hold the full tensor on every rank)."""
    import torch.distributed as dist

    tensor = param.ds_tensor
    return Partition(tensor, tensor.ds_numel, dist.get_rank(group=param.ds_process_group))


def model_partition_tensor(param) -> torch.Tensor | None:
    """`param.ds_tensor` without the collective's rank (None when not partitioned): for dtype and
    byte counts. Same internal as `model_partition`."""
    return getattr(param, "ds_tensor", None)


def release_partition(param) -> None:
    """Free this rank's slice of a ZeRO-3 parameter that is about to be replaced (its storage
    becomes empty; its shape attributes stay). zero.Init allocates a partition for every
    parameter it sees and has no public way to build a module without one."""
    param.ds_tensor.data = torch.empty(0, dtype=param.ds_tensor.dtype, device=param.ds_tensor.device)


def forget_external_parameters(module: torch.nn.Module, keep) -> None:
    """Unregister the parameters of other modules that ZeRO-3 gathers with `module` unless
    `keep(param)`. DeepSpeed registers one when a forward reads another module's weight outside
    that module's forward (T5's FFN reads `wo.weight.dtype`), keyed by the parameter object; only
    `deepspeed.zero.register_external_parameter` is exported and nothing public lists them
    (`ds_external_parameters` is put on every submodule by parameter_offload.py), so a parameter
    a shape change replaced would stay registered and be gathered from its released partition."""
    from deepspeed.runtime.zero.partition_parameters import unregister_external_parameter

    listing = getattr(module, "ds_external_parameters", None)
    for _, param in list(listing()) if listing is not None else []:
        if not keep(param):
            unregister_external_parameter(module, param)


def partition_like(anchor, params: list[torch.nn.Parameter]) -> None:
    """Partition `params` through the zero.Init that partitioned `anchor` (partition_parameters.py
    puts `convert_to_zero_parameters` on every parameter it makes). The public route,
    `deepspeed.zero.Init(module=...)`, partitions a whole module tree and needs a config again;
    this keeps a shape change to one new module held in full at a time."""
    anchor.convert_to_zero_parameters(param_list=params)


def comm_backend():
    """DeepSpeed's communication backend object (comm.py's module global `cdb`, a TorchBackend),
    through which ZeRO-3 gathers every parameter (`allgather_fn` -> `cdb.all_gather_into_tensor`);
    None before `deepspeed.init_distributed`. apt_ds.distributed.gloo_gather wraps its gather on
    gloo: DeepSpeed has no public hook for how a collective is carried out."""
    from deepspeed.comm import comm

    return comm.cdb


# ---- tearing an engine down ----------------------------------------------------------------
def release_engine(engine, model: torch.nn.Module) -> None:
    """Destroy `engine` so that it can be garbage-collected while `model` lives on. Beyond the
    public `engine.destroy()`, which in 0.19.8 frees optimizer buffers but keeps every reference:
    - engine.py `module_forward_pre_hook` / `module_forward_post_hook`: hook handles on the
      model whose closures hold the engine;
    - parameter back-references to the optimizer: ZeRO-1/2 `_zero_optimizer` and `_hp_mapping`
      (stage_1_and_2.py), ZeRO-3 `_z3_optimizer` (stage3.py); upstream issue #7204;
    - ZeRO-3 `pre_bwd_fn` / `post_bwd_fn` (parameter_offload.py): autograd Functions on every
      module whose closures hold the engine's DeepSpeedZeRoOffload; a later engine reuses them
      if present, so the FIRST engine's parameter coordinator stayed alive for the whole run
      (measured with weakrefs) and backward prefetched/released through it;
    - `lr_scheduler`, `optimizer`, `basic_optimizer`: dropped so the optimizer's flat buffers go
      with the engine even if something still holds it."""
    engine.destroy()
    for handle in ("module_forward_pre_hook", "module_forward_post_hook"):
        if getattr(engine, handle, None) is not None:
            getattr(engine, handle).remove()
            setattr(engine, handle, None)
    for param in model.parameters():
        for attr in ("_z3_optimizer", "_zero_optimizer", "_hp_mapping"):
            if attr in param.__dict__:
                delattr(param, attr)
    for module in model.modules():
        for attr in ("pre_bwd_fn", "post_bwd_fn"):
            module.__dict__.pop(attr, None)
    engine.lr_scheduler = engine.optimizer = engine.basic_optimizer = None
