"""Which of `deepspeed_private.PRIVATE_NAMES` a real engine has, run by
tests/distributed/test_deepspeed_private.py (one process, DeepSpeed's CPU accelerator):

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \
        python tests/distributed/multirank/private_probe.py out.json

Builds a ZeRO-2 engine (with optimizer offload: ZeRO-2 sets `_zero_optimizer` only then; and a
CSV monitor) and
a ZeRO-3 engine on a two-layer model, runs one step on each (some internals appear only then),
and writes {owner: {name: present}} before tearing each down.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from apt_ds.distributed.deepspeed_private import PRIVATE_NAMES  # noqa: E402
from apt_ds.distributed.zero import DeepSpeedBackend  # noqa: E402


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.second(torch.relu(self.first(x))).pow(2).mean()


def owners(backend, stage: int) -> dict[str, list]:
    """Each owner of OWNERS as the objects that may carry its names (any of them will do)."""
    engine, params = backend.engine, list(backend.module.parameters())
    if stage in (1, 2):
        return {"engine": [engine], "zero12_optimizer": [engine.optimizer], "zero12_param": params,
                "csv_monitor": [backend.monitor.csv_monitor]}
    from deepspeed.comm import comm

    return {"zero3_optimizer": [engine.optimizer], "zero3_param": params, "comm_module": [comm],
            "zero3_partition": [p.ds_tensor for p in params], "zero3_module": list(backend.module.modules())}


def main(out: Path) -> None:
    torch.manual_seed(0)
    found: dict[str, dict[str, bool]] = {}
    for stage in (2, 3):
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
        if stage == 2:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = {"zero_optimization": zero, "bf16": {"enabled": False}, "train_micro_batch_size_per_gpu": 1}
        if stage == 2:  # the run's monitor, whose CSV writer apt_ds resumes
            config["csv_monitor"] = {"enabled": True, "output_path": str(out.parent / "csv"), "job_name": "probe"}
        backend = DeepSpeedBackend(config)
        backend.attach(Tiny(), 1e-2, lambda step: 1.0, 0.0, 1, max_grad_norm=0.0)
        backend.backward(backend.forward(x=torch.randn(2, 8)))
        backend.step()
        for owner, objects in owners(backend, stage).items():
            for entry in PRIVATE_NAMES:
                if entry.owner == owner:
                    found.setdefault(owner, {})[entry.name] = any(hasattr(obj, entry.name) for obj in objects)
        backend.close()
    out.write_text(json.dumps(found, indent=1))
    backend.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
