"""Which accelerator device a rank binds to (apt_ds.distributed.zero_comm.init_process_group):
cuda:LOCAL_RANK on every launch, including those where DeepSpeed learns LOCAL_RANK only inside
init_distributed (AzureML, SageMaker, mpi4py) and a caller's own process group. No GPU is needed:
DeepSpeed's accelerator and init_distributed are replaced by recording fakes."""

from __future__ import annotations

import pytest

from apt_ds.distributed import zero_comm
from apt_ds.distributed.ds_config import DeepSpeedConfigError
from apt_ds.distributed.launcher_env import local_device_index


class FakeCudaAccelerator:
    """What init_process_group asks of DeepSpeed's accelerator, on a node with `count` GPUs."""

    def __init__(self, count: int):
        self.count, self.current = count, None
        self.set_calls: list[int] = []

    def device_name(self, index=None):
        return "cuda"

    def device_count(self):
        return self.count

    def visible_devices_envs(self):
        return ["CUDA_VISIBLE_DEVICES"]

    def set_device(self, index):
        self.set_calls.append(index)
        self.current = index


@pytest.fixture
def fake_cuda(monkeypatch):
    """A 4-GPU node whose process group starts as DeepSpeed's would: `discovered` (like
    mpi_discovery or the AzureML patch) is exported inside init_distributed; the device current
    when it starts is what NCCL binds to when no device_id is given."""
    import deepspeed
    import deepspeed.accelerator
    import torch.distributed as dist

    accelerator = FakeCudaAccelerator(4)
    started = {"initialized": False, "discovered": {}, "device_at_init": "unset"}

    def init_distributed(**kwargs):
        started["device_at_init"] = accelerator.current
        for key, value in started["discovered"].items():
            monkeypatch.setenv(key, value)
        started["initialized"] = True

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: accelerator)
    monkeypatch.setattr(deepspeed, "init_distributed", init_distributed)
    monkeypatch.setattr(dist, "is_initialized", lambda: started["initialized"])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID", "PMI_SIZE", "AZUREML_EXPERIMENT_ID",
                "SM_TRAINING_ENV", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(key, raising=False)
    return accelerator, started


def test_local_device_index_is_local_rank_and_refuses_a_missing_device():
    assert local_device_index({"LOCAL_RANK": "3"}, device_count=8) == 3
    assert local_device_index({}, device_count=8) is None  # not known yet: DeepSpeed's discovery may set it
    with pytest.raises(DeepSpeedConfigError, match=r"LOCAL_RANK=3, but this process sees 1 cuda device\(s\) "
                                                   r"\(CUDA_VISIBLE_DEVICES=5\).*--gpus-per-node") as err:
        local_device_index({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "5"}, device_count=1)
    assert "\n" not in str(err.value)
    with pytest.raises(DeepSpeedConfigError, match="LOCAL_RANK='one' is not an integer"):
        local_device_index({"LOCAL_RANK": "one"}, device_count=1)
    # without LOCAL_RANK, the launcher's own local rank (as DeepSpeed's engine reads OpenMPI's)
    assert local_device_index({"OMPI_COMM_WORLD_LOCAL_RANK": "2", "SLURM_LOCALID": "5"}, device_count=8) == 2
    assert local_device_index({"SLURM_LOCALID": "5"}, device_count=8) == 5
    assert local_device_index({"LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, device_count=8) == 1


def test_launcher_started_rank_binds_its_device_before_the_process_group(fake_cuda, monkeypatch):
    accelerator, started = fake_cuda
    for key, value in {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)  # the deepspeed launcher or torchrun
    zero_comm.init_process_group()
    assert started["device_at_init"] == 2  # NCCL's first use finds the rank's own device
    assert accelerator.current == 2


def test_rank_found_by_deepspeeds_discovery_ends_on_its_device(fake_cuda, monkeypatch):
    """AzureML / SageMaker / mpi4py: LOCAL_RANK appears only inside init_distributed. Before the
    fix every such rank stayed on device 0 (whole models on GPU 0 under ZeRO-2, device mismatches
    under ZeRO-3); nothing may be bound to device 0 before it either (a CUDA context per rank)."""
    accelerator, started = fake_cuda
    monkeypatch.setenv("AZUREML_EXPERIMENT_ID", "x")  # launcher_env leaves AzureML to DeepSpeed
    started["discovered"] = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}
    zero_comm.init_process_group()
    assert started["device_at_init"] is None
    assert accelerator.set_calls == [1]


def test_a_callers_own_process_group_still_gets_its_device(fake_cuda, monkeypatch):
    accelerator, started = fake_cuda
    started["initialized"] = True  # e.g. deepspeed.init_distributed() called by the user's script
    monkeypatch.setenv("LOCAL_RANK", "3")
    zero_comm.init_process_group()
    assert accelerator.current == 3


def test_a_callers_own_process_group_under_mpirun_gets_the_mpi_local_rank(fake_cuda, monkeypatch):
    """A script that started the process group itself under mpirun, without exporting LOCAL_RANK:
    DeepSpeed's engine and zero.Init then take OpenMPI's local rank, so the backend must too."""
    accelerator, started = fake_cuda
    started["initialized"] = True
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")
    zero_comm.init_process_group()
    assert accelerator.current == 2


def test_a_rank_without_its_device_is_refused_before_the_process_group(fake_cuda, monkeypatch):
    accelerator, started = fake_cuda
    accelerator.count = 1  # srun --gpus-per-task=1: the task sees one GPU, LOCAL_RANK is its local id
    for key, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1",
                       "CUDA_VISIBLE_DEVICES": "3"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(DeepSpeedConfigError, match="LOCAL_RANK=3, but this process sees 1 cuda device"):
        zero_comm.init_process_group()
    assert not started["initialized"]
