"""From a launcher's variables to the ones `torch.distributed` needs (RANK, WORLD_SIZE, ...).

`deepspeed`, `torchrun`, `mpirun` and `srun` all work. Who maps what (deepspeed 0.19.8 read):
- the `deepspeed` launcher (also its MPICH / Intel MPI runners, through launcher_helper.py) and
  `torchrun` export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*: nothing to do;
- AzureML and SageMaker: `deepspeed.init_distributed`'s auto_mpi_discovery maps their variables
  itself (comm.py `in_aml` / `in_dlts` / `in_aws_sm` and their `patch_*_env` functions), so we
  leave them to it;
- any other MPI or Slurm start without a launcher: DeepSpeed's only mapping is `mpi_discovery`,
  which needs mpi4py (not a dependency of apt_ds), overwrites an exported MASTER_ADDR and
  MASTER_PORT with rank 0's first `hostname -I` address and port 29500, and does not read
  Slurm's variables. `deepspeed --launcher openmpi/slurm` starts the script straight under
  mpirun/srun and relies on that same discovery. So OpenMPI (`OMPI_COMM_WORLD_*`) and Slurm
  (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`) are mapped here, without mpi4py; other MPIs
  (`PMI_SIZE`: MPICH, Intel MPI) are left to DeepSpeed's discovery when mpi4py is installed.
With more than one rank MASTER_ADDR and MASTER_PORT must then be exported by the job script.
Otherwise a plain `python script.py` gets a 1-rank group on 127.0.0.1.
"""

from __future__ import annotations

import importlib.util
import socket
from typing import Callable, Mapping

from apt_ds.distributed.errors import DeepSpeedConfigError


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _has_mpi4py() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def deepspeed_maps_platform(environ: Mapping[str, str]) -> str | None:
    """The platform whose variables `deepspeed.init_distributed` maps itself, or None: the same
    tests as deepspeed/comm/comm.py (`in_aml() and not in_dlts()`, `in_aws_sm()`), on `environ`
    (tests/distributed/test_ds_config.py checks they agree with the installed DeepSpeed)."""
    if "AZUREML_EXPERIMENT_ID" in environ and "DLTS_JOB_ID" not in environ:
        return "AzureML"
    if "SM_TRAINING_ENV" in environ:
        return "SageMaker"
    return None


# (launcher, rank, world size, local rank) variables, in order of preference.
LAUNCHER_VARS = (
    ("OpenMPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


def launcher_env(environ: Mapping[str, str], free_port: Callable[[], int] = _free_port,
                 has_mpi4py: Callable[[], bool] = _has_mpi4py) -> dict[str, str]:
    """The variables to add to `environ` before `torch.distributed` is initialized (pure).

    - RANK or WORLD_SIZE already set (deepspeed, torchrun, a job script): nothing.
    - AzureML / SageMaker: nothing (DeepSpeed maps them, see the module docstring).
    - OpenMPI (`mpirun`) or Slurm (`srun`, one task per rank): RANK / WORLD_SIZE / LOCAL_RANK
      from their variables; with more than one rank MASTER_ADDR and MASTER_PORT must be set
      (Slurm: `export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)`),
      else DeepSpeedConfigError. One rank: 127.0.0.1 and a free port unless given.
    - another MPI with PMI_SIZE > 1: nothing when mpi4py is installed (DeepSpeed's
      mpi_discovery), else DeepSpeedConfigError (each process would train alone).
    - nothing of the above (plain `python script.py`): a 1-rank group on 127.0.0.1.
    """
    if "RANK" in environ or "WORLD_SIZE" in environ or deepspeed_maps_platform(environ):
        return {}

    def local_default() -> dict[str, str]:
        return {"MASTER_ADDR": environ.get("MASTER_ADDR") or "127.0.0.1",
                "MASTER_PORT": environ.get("MASTER_PORT") or str(free_port())}

    for launcher, rank_key, size_key, local_key in LAUNCHER_VARS:
        if rank_key not in environ or size_key not in environ:
            continue
        values = {}
        for key in (rank_key, size_key, local_key):
            raw = environ.get(key, "0" if key == local_key else None)
            try:
                values[key] = int(raw)
            except (TypeError, ValueError):
                raise DeepSpeedConfigError(f"{launcher} launch: {key}={raw!r} is not an integer") from None
        rank, size, local = values[rank_key], values[size_key], values[local_key]
        if size < 1 or not 0 <= rank < size or not 0 <= local < size:
            raise DeepSpeedConfigError(f"{launcher} launch: inconsistent {rank_key}={rank}, {size_key}={size}, "
                                       f"{local_key}={local}")
        if size > 1 and local_key not in environ:
            raise DeepSpeedConfigError(f"{launcher} launch with {size_key}={size} but {local_key} is unset")
        out = {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local)}
        if size == 1:
            return out | local_default()
        missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(key)]
        if missing:
            hint = "$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)" if launcher == "Slurm" else "<host of rank 0>"
            raise DeepSpeedConfigError(
                f"{launcher} launch with {size_key}={size}: {' and '.join(missing)} not set; export MASTER_ADDR={hint} "
                f"and MASTER_PORT=<free port> (same on every task) before starting the tasks")
        return out
    if _pmi_size(environ) > 1:
        if has_mpi4py():
            return {}  # deepspeed.init_distributed's mpi_discovery
        raise DeepSpeedConfigError(
            f"MPI launch with PMI_SIZE={environ['PMI_SIZE']}: install mpi4py (DeepSpeed then finds the ranks), "
            f"start through `deepspeed --launcher mpich` (or impi), or export RANK, WORLD_SIZE, LOCAL_RANK, "
            f"MASTER_ADDR and MASTER_PORT")
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": environ.get("MASTER_PORT") or str(free_port())}


# Where this rank's local index is read, in order: what torch and DeepSpeed use, then the launchers'
# own (DeepSpeed's engine falls back on OpenMPI's too) for a process group a caller started.
LOCAL_INDEX_VARS = ("LOCAL_RANK", *(local_key for *_, local_key in LAUNCHER_VARS))


def local_device_index(environ: Mapping[str, str], device_count: int, device_name: str = "cuda",
                       visible_vars: tuple[str, ...] = ("CUDA_VISIBLE_DEVICES",)) -> int | None:
    """The accelerator device index of this rank: its local rank, or None while that is not known (pure).

    Every launcher apt-ds supports gives a rank all of its node's devices and LOCAL_RANK as the
    index to use; a task that sees fewer devices than its local rank (Slurm's --gpus-per-task=1,
    which hides the others) is refused with what to change."""
    key = next((k for k in LOCAL_INDEX_VARS if environ.get(k)), None)
    if key is None:
        return None
    raw = environ[key]
    try:
        index = int(raw)
    except ValueError:
        raise DeepSpeedConfigError(f"{key}={raw!r} is not an integer") from None
    if not 0 <= index < device_count:
        shown = "".join(f" ({v}={environ[v]})" for v in visible_vars if v in environ)
        raise DeepSpeedConfigError(
            f"{key}={index}, but this process sees {device_count} {device_name} device(s){shown}: each rank uses the "
            f"device of its local rank, so every rank needs all of its node's devices visible (with Slurm, ask for "
            f"them per node, e.g. --gpus-per-node, not --gpus-per-task=1)")
    return index


def _pmi_size(environ: Mapping[str, str]) -> int:
    value = environ.get("PMI_SIZE", "")
    return int(value) if value.isdigit() else 0


def launch_world_size(environ: Mapping[str, str]) -> int:
    """The world size this launch will have, known before the process group exists (for
    precheck_config): WORLD_SIZE, or what `launcher_env` or DeepSpeed's discovery will set."""
    if deepspeed_maps_platform(environ) and "WORLD_SIZE" not in environ:
        return int(environ.get("OMPI_COMM_WORLD_SIZE", 1))  # what both of DeepSpeed's patches read
    mapped = {**environ, **launcher_env(environ, free_port=lambda: 0, has_mpi4py=lambda: True)}
    return int(mapped.get("WORLD_SIZE") or _pmi_size(environ) or 1)
