"""apt_ds.distributed.ds_config: loading and resolving DeepSpeed configs ("auto" values, batch sizes,
contradictions, the shipped configs, DeepSpeed's monitor sections) and the launcher variables,
all without a process group."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from apt_ds.distributed.ds_config import (
    DeepSpeedConfigError,
    load_ds_config,
    precheck_config,
    resolve_config,
    single_rank_zero3_warning,
    warn_single_rank_zero3,
)
from apt_ds.distributed.launcher_env import deepspeed_maps_platform, launch_world_size, launcher_env
from apt_ds.distributed.zero_monitor import metric_events, monitor_config_problem, without_monitor

CONFIGS = Path(__file__).resolve().parents[2] / "ds_configs"


# ---- config handling -------------------------------------------------------------------------
def _resolve(user, **kw):
    args = dict(grad_accum_steps=4, world_size=2, micro_batch_size=None, bf16_supported=True, hidden_size=64)
    args.update(kw)
    return resolve_config(user, **args)


def test_resolve_sets_batch_sizes_from_trainer():
    cfg = _resolve({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto"}, micro_batch_size=3)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == (3, 4, 24)
    derived = _resolve({"zero_optimization": {"stage": 2}, "train_batch_size": 16})
    assert derived["train_micro_batch_size_per_gpu"] == 2


@pytest.mark.parametrize("user, kw, message", [
    ({"gradient_accumulation_steps": 2}, {}, "gradient_accumulation_steps=2 contradicts the trainer's --grad-accum-steps 4"),
    ({"train_micro_batch_size_per_gpu": 8}, {"micro_batch_size": 4}, r"train_micro_batch_size_per_gpu=8 contradicts the trainer's --micro-batch-size 4 \(its default unless given\); "
     r"pass --micro-batch-size 8"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 1}, {}, r"train_batch_size=10 != micro 1"),
    ({"train_batch_size": 12}, {}, "not divisible"),
    ({"gradient_clipping": 0.5}, {}, r"gradient_clipping=0.5 contradicts the trainer.s max_grad_norm=0.0"),
    ({"gradient_clipping": "big"}, {}, r"gradient_clipping='big' is not a number"),
    ({"gradient_clipping": True}, {"max_grad_norm": 1.0}, r"gradient_clipping=True is not a number"),
    ({"zero_optimization": {"stage": 2, "compute_grad_norm": False}}, {"max_grad_norm": 1.0},
     r"compute_grad_norm=false cannot clip gradients \(max_grad_norm=1.0\)"),
    ({"zero_optimization": {"stage": 2, "round_robin_gradients": "auto"}}, {}, r"\"auto\" is not supported for zero_optimization.round_robin_gradients"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, {}, "both enabled"),
])
def test_resolve_refuses_contradictions(user, kw, message):
    user = {"zero_optimization": {"stage": 2}, **user}
    with pytest.raises(DeepSpeedConfigError, match=message):
        _resolve(user, **kw)


def test_gradient_clipping_comes_from_the_trainer():
    for user_value in (None, "auto", 1.0):
        user = {"zero_optimization": {"stage": 2}}
        if user_value is not None:
            user["gradient_clipping"] = user_value
        assert _resolve(user, max_grad_norm=1.0)["gradient_clipping"] == 1.0
    # 0 is written too: DeepSpeed's own default (key absent) is to clip at 1.0.
    assert _resolve({"zero_optimization": {"stage": 2}})["gradient_clipping"] == 0.0
    no_norm = {"zero_optimization": {"stage": 2, "compute_grad_norm": False}}
    assert _resolve(no_norm, max_grad_norm=0.0)["gradient_clipping"] == 0.0


def test_resolve_refuses_stage0_and_forced_ds_cpu_adam():
    with pytest.raises(DeepSpeedConfigError, match="stage must be 1, 2 or 3"):
        _resolve({"zero_optimization": {}})
    with pytest.raises(DeepSpeedConfigError, match=r"has no zero_optimization section \(stage 1, 2 or 3\)$"):
        _resolve({})
    with pytest.raises(DeepSpeedConfigError, match="did you mean 'zero_optimisation'"):  # a misspelled key
        _resolve({"zero_optimisation": {"stage": 3}})
    forced = {"zero_force_ds_cpu_optimizer": True, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(DeepSpeedConfigError, match="zero_force_ds_cpu_optimizer"):
        _resolve(forced)


def test_resolve_drops_optimizer_and_scheduler(caplog, monkeypatch):
    import apt_ds.distributed.ds_config as ds_config

    monkeypatch.setattr(ds_config, "_WARNED", {})
    user = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 5}},
            "scheduler": {"type": "WarmupLR"}}
    cfg = _resolve(user)
    assert "optimizer" not in cfg and "scheduler" not in cfg
    assert "optimizer" in user  # the caller's dict is not modified
    assert "ignoring its 'optimizer' section" in caplog.text
    again = _resolve(user)  # a run resolves its JSON at validation and at each engine build: warned once
    assert "optimizer" not in again and "scheduler" not in again
    assert caplog.text.count("ignoring its 'optimizer' section") == 1
    for run in range(3, 6):  # other runs' configs (other dicts, each freed after use): warned again, each
        _resolve(dict(user))
        assert caplog.text.count("ignoring its 'optimizer' section") == run - 1


@pytest.mark.parametrize("name", ["zero2.json", "zero3.json", "zero3_offload.json", "zero2_monitor.json"])
@pytest.mark.parametrize("bf16_supported", [True, False])
def test_shipped_configs_resolve(name, bf16_supported):
    user, _ = load_ds_config(CONFIGS / name)
    assert "optimizer" not in user and user["bf16"]["enabled"] == "auto"
    cfg = _resolve(user, bf16_supported=bf16_supported, hidden_size=4096)
    assert cfg["bf16"]["enabled"] is bf16_supported
    zero = cfg["zero_optimization"]
    if zero["stage"] == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True
        assert zero["reduce_bucket_size"] == 4096 * 4096 and zero["stage3_param_persistence_threshold"] == 40960
    if "offload_optimizer" in zero:
        assert cfg["zero_force_ds_cpu_optimizer"] is False
    assert monitor_config_problem(cfg) is None  # zero2_monitor.json: DeepSpeed's own model accepts it


@pytest.mark.parametrize("name", ["zero3.json", "zero3_offload.json"])
def test_gathered_weights_are_kept_for_reuse_on_gpus_and_released_on_the_cpu(name):
    """The shipped ZeRO-3 configs keep up to 1e9 gathered parameters for their reuse on a GPU and
    none on the CPU accelerator, where 1e9 fp32 parameters (4 GB a rank) ran a 3B model out of memory."""
    user, _ = load_ds_config(CONFIGS / name)
    keys = ("stage3_max_live_parameters", "stage3_max_reuse_distance")
    on_gpu = _resolve(user, hidden_size=4096)["zero_optimization"]
    on_cpu = _resolve(user, hidden_size=4096, on_cpu=True)["zero_optimization"]
    assert [on_gpu[key] for key in keys] == [10**9, 10**9] and [on_cpu[key] for key in keys] == [0, 0]
    given = {**user, "zero_optimization": {**user["zero_optimization"], "stage3_max_live_parameters": 12345}}
    assert _resolve(given, hidden_size=4096, on_cpu=True)["zero_optimization"]["stage3_max_live_parameters"] == 12345


# ---- launcher environments (pure function) -----------------------------------------------------
def _port() -> int:
    return 4242


def test_launcher_env_keeps_launcher_settings():
    assert launcher_env({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, _port) == {}
    assert launcher_env({"WORLD_SIZE": "1"}, _port) == {}


def test_launcher_env_plain_python_is_one_rank():
    assert launcher_env({}, _port) == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": "4242"}
    assert launcher_env({"MASTER_PORT": "29999"}, _port)["MASTER_PORT"] == "29999"


@pytest.mark.parametrize("launcher, keys", [
    ("Slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")),
    ("OpenMPI", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")),
])
def test_launcher_env_maps_slurm_and_openmpi(launcher, keys):
    rank, size, local = keys
    env = {rank: "5", size: "8", local: "1", "MASTER_ADDR": "node17", "MASTER_PORT": "29500"}
    assert launcher_env(env, _port) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}
    for missing in ("MASTER_ADDR", "MASTER_PORT"):
        partial = {k: v for k, v in env.items() if k != missing}
        with pytest.raises(DeepSpeedConfigError, match=rf"{launcher} launch with {size}=8: {missing} not set; "
                                                       r"export MASTER_ADDR=") as err:
            launcher_env(partial, _port)
        assert "\n" not in str(err.value)
    # One task needs no rendezvous address.
    single = launcher_env({rank: "0", size: "1", local: "0"}, _port)
    assert single == {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4242"}
    with pytest.raises(DeepSpeedConfigError, match="inconsistent"):
        launcher_env({rank: "8", size: "8", local: "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, _port)
    with pytest.raises(DeepSpeedConfigError, match="is not an integer"):
        launcher_env({rank: "x", size: "8"}, _port)


def test_launcher_env_slurm_hint_and_openmpi_precedence():
    with pytest.raises(DeepSpeedConfigError, match=r"scontrol show hostnames \$SLURM_JOB_NODELIST"):
        launcher_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, _port)
    # mpirun inside a Slurm allocation: the MPI variables describe the processes actually started.
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "OMPI_COMM_WORLD_RANK": "3",
           "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert launcher_env(env, _port)["RANK"] == "3"


def test_launcher_env_leaves_azureml_and_sagemaker_to_deepspeed():
    ompi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert launcher_env({**ompi, "AZUREML_EXPERIMENT_ID": "x"}, _port) == {}  # init_distributed patches it
    assert launcher_env({**ompi, "SM_TRAINING_ENV": "{}"}, _port) == {}
    assert launch_world_size({**ompi, "AZUREML_EXPERIMENT_ID": "x"}) == 2
    # DeepSpeed skips its AzureML patch on DLTS: ours maps OpenMPI there (and wants MASTER_*).
    with pytest.raises(DeepSpeedConfigError, match="MASTER_ADDR"):
        launcher_env({**ompi, "AZUREML_EXPERIMENT_ID": "x", "DLTS_JOB_ID": "y"}, _port)


@pytest.mark.parametrize("environ", [{}, {"AZUREML_EXPERIMENT_ID": "1"}, {"AZUREML_EXPERIMENT_ID": "1", "DLTS_JOB_ID": "2"},
                                     {"SM_TRAINING_ENV": "{}"}, {"DLTS_JOB_ID": "2", "SM_TRAINING_ENV": "{}"}])
def test_platform_detection_agrees_with_deepspeed(monkeypatch, environ):
    from deepspeed.comm import comm

    for key in ("AZUREML_EXPERIMENT_ID", "DLTS_JOB_ID", "SM_TRAINING_ENV"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    deepspeed_maps = (comm.in_aml() and not comm.in_dlts()) or comm.in_aws_sm()  # init_distributed's branches
    assert (deepspeed_maps_platform(environ) is not None) == deepspeed_maps


def test_other_mpi_is_left_to_deepspeed_discovery_only_with_mpi4py():
    mpich = {"PMI_RANK": "1", "PMI_SIZE": "4"}
    assert launcher_env(mpich, _port, has_mpi4py=lambda: True) == {}
    with pytest.raises(DeepSpeedConfigError, match=r"PMI_SIZE=4: install mpi4py") as err:
        launcher_env(mpich, _port, has_mpi4py=lambda: False)
    assert "\n" not in str(err.value)
    assert launch_world_size(mpich) == 4
    assert launcher_env({"PMI_RANK": "0", "PMI_SIZE": "1"}, _port, has_mpi4py=lambda: False)["WORLD_SIZE"] == "1"


# ---- DeepSpeed's monitor sections ---------------------------------------------------------------
MONITORS = {"csv_monitor": {"enabled": True, "output_path": "/tmp/x", "job_name": "apt"},
            "tensorboard": {"enabled": False, "output_path": "tb"}, "wandb": {"enabled": False, "project": "apt"}}


def test_precheck_accepts_monitor_sections(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, **MONITORS}))
    precheck_config(path, grad_accum_steps=1, micro_batch_size=1, max_grad_norm=1.0, environ={})
    resolved = resolve_config({"zero_optimization": {"stage": 2}, **MONITORS}, grad_accum_steps=1, world_size=1)
    assert all(resolved[key] == value for key, value in MONITORS.items())
    assert monitor_config_problem(resolved) is None
    assert without_monitor(resolved).keys().isdisjoint(MONITORS)


@pytest.mark.parametrize("section, message", [
    ({"csv_monitor": {"enabled": "maybe"}}, r"csv_monitor\.enabled: Input should be a valid boolean"),
    ({"csv_monitor": {"enabled": True, "out": "x"}}, r"csv_monitor\.out: Extra inputs are not permitted"),
    ({"tensorboard": []}, r"tensorboard: Input should be"),
])
def test_bad_monitor_sections_are_named(section, message):
    problem = monitor_config_problem(section)
    assert problem and re.search(message, problem) and "\n" not in problem


def test_enabled_monitor_without_its_package_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert monitor_config_problem({"wandb": {"enabled": True}}) == \
        "wandb.enabled is true but the wandb package is not installed (pip install wandb)"


def test_precheck_names_a_missing_monitor_package_before_any_process_group(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "tensorboard": {"enabled": True}}))
    with pytest.raises(DeepSpeedConfigError, match=r"tensorboard\.enabled is true but the tensorboard package is not "):
        precheck_config(path, grad_accum_steps=1, micro_batch_size=1, max_grad_norm=1.0, environ={})


def test_metric_events_are_the_numbers_of_a_record():
    record = {"step": 7, "loss": 1.5, "task_loss": 1.25, "total_rank": 12, "event": True, "decision": "ab12",
              "truncation": {"rows": 3}, "eval_loss": float("nan")}
    events = metric_events(record)
    assert [e[0] for e in events] == ["apt/loss", "apt/task_loss", "apt/total_rank", "apt/eval_loss"]
    assert all(step == 7 for _, _, step in events) and events[2][1] == 12


# ---- ZeRO-3 on one GPU -------------------------------------------------------------------------
@pytest.mark.parametrize("name, world_size, device, warned", [
    ("zero3.json", 1, "cuda", True),         # one GPU, nothing offloaded: the only case
    ("zero3.json", 2, "cuda", False),        # partitions across ranks
    ("zero3.json", 1, "cpu", False),         # the CPU accelerator (tests, emulation)
    ("zero3_offload.json", 1, "cuda", False),  # offload is why one would use it on one GPU
    ("zero2.json", 1, "cuda", False),
])
def test_single_rank_zero3_on_a_gpu_is_pointed_out(name, world_size, device, warned, capsys):
    cfg = _resolve(json.loads((CONFIGS / name).read_text()), world_size=world_size, micro_batch_size=1)
    message = single_rank_zero3_warning(cfg, world_size, device)
    assert (message is not None) == warned
    warn_single_rank_zero3(cfg, world_size, device, main_rank=True)
    warn_single_rank_zero3(cfg, world_size, device, main_rank=False)
    printed = capsys.readouterr().err
    assert printed.count("ZeRO-3 on a single rank") == (1 if warned else 0)
    if warned:
        assert "run without --deepspeed" in printed and printed.count("\n") == 1


@pytest.mark.parametrize("key", ["offload_param", "offload_optimizer"])
@pytest.mark.parametrize("value", ["cpu", False, [], 0])
def test_an_offload_section_that_is_not_an_object_is_a_config_error(key, value):
    with pytest.raises(DeepSpeedConfigError, match=f"zero_optimization.{key} must be an object"):
        _resolve({"zero_optimization": {"stage": 3, key: value}}, micro_batch_size=1)
