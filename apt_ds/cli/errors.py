"""The errors a user can cause, printed as one `error: ...` line with exit status 2.
Anything else is a bug and keeps its traceback."""

from __future__ import annotations

import os
import sys

from apt_ds.config import ConfigError


def user_errors() -> tuple[type[BaseException], ...]:
    # Imported here: each module's error class comes with its module, and `--help` should not pay for torch.
    from apt_ds.algorithm.pruner import PruningError
    from apt_ds.algorithm.units import UnsupportedModelError
    from apt_ds.distributed.errors import DeepSpeedConfigError
    from apt_ds.io.checkpoint import CheckpointError
    from apt_ds.io.data import DataError
    from apt_ds.io.modeling import ModelLoadError
    from apt_ds.io.weights import WeightsError

    return (ConfigError, FileExistsError, CheckpointError, DataError, ModelLoadError, PruningError,
            UnsupportedModelError, DeepSpeedConfigError, WeightsError)


def launcher_rank() -> str:
    """This process's global rank as its launcher set it, before the process group exists: RANK
    (deepspeed, torchrun), else mpirun's, srun's or another MPI's own variable (apt_ds maps those to
    RANK later, apt_ds.distributed.launcher_env); "0" alone."""
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMI_RANK"):
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
