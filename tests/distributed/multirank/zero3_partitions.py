"""ZeRO-3 memory checks, run by tests/distributed/test_zero3_partitions.py on 2 ranks:

    deepspeed --num_gpus 2 tests/distributed/multirank/zero3_partitions.py --model DIR --out result.json

Each rank loads the model partitioned (apt_ds.distributed.zero_init), trains APT through a pruning event
(shrink + rank growth), and records: its partition bytes after loading and after the event
against the full model's bytes; whether any parameter holds full data outside a gather; and,
at every partitioning of new parameters during the event, how many parameter elements of the
whole model were unpartitioned at that moment (one module's worth at most, if shrinks handle
one module at a time). Rank 0 also records the losses, decisions and ranks for comparison
with a one-process run.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from apt_ds.config import APTConfig, TrainConfig  # noqa: E402
from apt_ds.distributed.zero import DeepSpeedBackend  # noqa: E402
from apt_ds.distributed.zero_init import build_partitioned_model, partition_bytes  # noqa: E402
from apt_ds.training.trainer import APTrainer  # noqa: E402

STEPS, SEQ, BATCH = 6, 16, 2


def configs() -> tuple[APTConfig, TrainConfig]:
    apt = APTConfig.for_steps(STEPS, target_density=0.5, pruning_start_step=1, pruning_end_step=4, num_pruning_events=2,
                              distill=True)
    train = TrainConfig(steps=STEPS, micro_batch_size=BATCH, lr=1e-2, warmup_steps=1, max_seq_len=SEQ, seed=3)
    return apt, train


def batches(vocab: int, rank: int, world: int):
    """The global batch of each step split over ranks (the same data for any world size)."""
    step = 0
    while True:
        gen = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, vocab, (BATCH * 2, SEQ), generator=gen)
        mine = ids.reshape(2, BATCH, SEQ)[rank] if world == 2 else ids
        yield {"input_ids": mine, "attention_mask": torch.ones_like(mine), "labels": mine.clone()}
        step += 1


def stale_partition_bytes(model) -> int:
    """Partition bytes still held by ZeRO-3 parameters that are no longer in the model (replaced
    by a shape change; DeepSpeed's parameters sit in reference cycles, so only an explicit release
    frees them before the next garbage collection)."""
    current = {id(p) for p in model.parameters()}
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.nn.Parameter) and hasattr(obj, "ds_tensor") and id(obj) not in current:
            storage = obj.ds_tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def largest_module_partition_bytes(model) -> int:
    return max(sum(p.ds_tensor.untyped_storage().nbytes() for p in m.parameters(recurse=False) if hasattr(p, "ds_tensor"))
               for m in model.modules())


def unpartitioned_elements(model) -> int:
    return sum(p.numel() for p in model.parameters() if not hasattr(p, "ds_id") or p.data.numel() > 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--full-load", action="store_true", help="load the whole model on every rank and let "
                        "deepspeed.initialize partition it (the path before partitioned loading), for comparison")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    from transformers import AutoConfig

    from apt_ds.io.weights import SafetensorsWeights

    apt, train = configs()
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    backend = DeepSpeedBackend(ds, micro_batch_size=BATCH)
    config = AutoConfig.from_pretrained(args.model)
    weights = SafetensorsWeights(args.model)
    full_bytes = weights.nbytes()
    resolved = backend.resolved_config(config, 1, train.max_grad_norm)
    if args.full_load:
        from apt_ds.io.modeling import load_model

        model = load_model(args.model, mmap=False)
    else:
        model = build_partitioned_model(config, weights, resolved, backend.param_dtype, backend.device)
    result = {"world_size": backend.world_size, "rank": backend.rank, "full_bytes": full_bytes,
              "loaded_bytes": partition_bytes(model), "loaded_unpartitioned": unpartitioned_elements(model),
              "largest_module_partition_bytes": largest_module_partition_bytes(model)}

    adoptions = []
    partition_new = backend.partition_new_params

    def recording_partition(module):
        # Elements not partitioned anywhere in the model right before `module`'s new ones are.
        adoptions.append({"unpartitioned": unpartitioned_elements(model), "stale_bytes": stale_partition_bytes(model),
                          "module": sum(p.numel() for p in module.parameters(recurse=False))})
        partition_new(module)

    backend.partition_new_params = recording_partition
    write_backs = []
    gathered = backend.gathered

    def recording_gathered(params, modifier_rank=0):
        write_backs.append(modifier_rank)
        return gathered(params, modifier_rank=modifier_rank)

    trainer = APTrainer(model, apt, train, backend=backend, progress=False)
    backend.gathered = recording_gathered  # only shape changes call it from here on
    final = trainer.train(batches(config.vocab_size, backend.rank, backend.world_size))
    result.update(
        final_bytes=partition_bytes(model), final_unpartitioned=unpartitioned_elements(model),
        # DeepSpeed's lists of parameters a module uses but does not own outlive engine rebuilds: one
        # naming a replaced (released) parameter would make the next engine gather an empty partition
        external_params=sum(len(getattr(m, "_external_params", {})) for m in model.modules()),
        final_full_bytes=sum(int(torch.Size(p.ds_shape).numel()) * p.element_size() for p in model.parameters()),
        adoptions=adoptions, write_backs=[m for m in write_backs if m is not None],
        losses=[h["task_loss"] for h in trainer.history if "task_loss" in h],
        kept=trainer.state.kept_record(), ranks=trainer.state.ranks(), density=final["density"],
        events=sum(1 for h in trainer.history if h.get("event")),
    )
    Path(f"{args.out}.{'full' if args.full_load else 'partitioned'}.rank{backend.rank}").write_text(json.dumps(result))
    backend.shutdown()


if __name__ == "__main__":
    main()
