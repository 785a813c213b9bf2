"""The errors a user can cause, printed as one `error: ...` line with exit status 2.
Anything else is a bug and keeps its traceback."""

from __future__ import annotations

import os
import sys

from apt_ds.config import ConfigError


def user_errors() -> tuple[type[BaseException], ...]:
    # Imported here: each module's error class comes with its module, and `--help` should not pay for torch.
    from apt_ds.algorithm.finite import NonFiniteError
    from apt_ds.algorithm.pruner import PruningError
    from apt_ds.algorithm.units import UnsupportedModelError
    from apt_ds.distributed.errors import DeepSpeedConfigError
    from apt_ds.io.checkpoint import CheckpointError
    from apt_ds.io.data import DataError
    from apt_ds.io.modeling import ModelLoadError
    from apt_ds.io.weights import WeightsError

    return (ConfigError, FileExistsError, CheckpointError, DataError, ModelLoadError, PruningError,
            UnsupportedModelError, DeepSpeedConfigError, WeightsError, NonFiniteError)


def launcher_rank(deepspeed: bool = False) -> str:
    """This process's rank as its launcher set it, before the process group exists: RANK (deepspeed,
    torchrun), "0" alone. `deepspeed`: the run joins a process group, so mpirun's, srun's or another
    MPI's own variable counts too (apt_ds maps those to RANK later, apt_ds.distributed.launcher_env);
    without --deepspeed every task of such a launch is a one-process run of its own, rank 0."""
    from apt_ds.distributed.launcher_env import LAUNCHER_VARS

    names = ("RANK", *(rank for _, rank, _, _ in LAUNCHER_VARS), "PMI_RANK") if deepspeed else ("RANK",)
    for name in names:
        if os.environ.get(name, "").isdigit():
            return os.environ[name]
    return "0"


def report(err: BaseException | str) -> int:
    """One line, in one write: under the deepspeed launcher every rank may report, and two ranks'
    lines must not run together; a rank other than 0 says which it is."""
    rank = launcher_rank()
    sys.stderr.write(("" if rank == "0" else f"[rank {rank}] ") + f"error: {err}\n")
    sys.stderr.flush()
    return 2
