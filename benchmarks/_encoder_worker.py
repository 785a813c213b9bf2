"""The worker of benchmarks/encoder_sst2.py: one method and seed on a sequence classifier, in a
fresh process, so its time and memory readings are its own.

Methods (the paper's encoder comparison):
    full       full fine-tuning: every weight and the new head, AdamW, the run's LR schedule
    lora       apt-ds's LoRA (APTConfig.as_lora(): the same adapters as APT, nothing pruned)
    apt_<d>    APT to density d (heads, neurons and hidden channels; rank growth; distillation)
    ptt_<d>    prune-then-tune: one-shot salience pruning to d on calibration batches, then LoRA

Every method reads the same base (apt_ds.io.modeling.load_model, the classifier head made from
the seed), the same tokenized rows and the same batches in the same order, and trains with
dropout off (as apt-ds trains encoders: docs/FAMILIES.md). After training the model is merged
and compacted, written as an HF export, scored by `launch/evaluate.py`'s own accuracy
(apt_ds.evaluation.classifier) on the held-out rows, and its forward pass over them timed
against the dense base model's, the two alternating in this one process.
"""

from __future__ import annotations

import gc
import shutil
import statistics
import sys
import time
from pathlib import Path

from _common import hardware, read_json, reset_peak_rss, rss_mb, vm_hwm_mb, write_json


def method_spec(name: str) -> dict:
    """`full`, `lora`, `apt_0.4`, `ptt_0.4` -> {"kind", "density"}."""
    if name in ("full", "lora"):
        return {"kind": name, "density": 1.0}
    kind, density = name.split("_")
    if kind not in ("apt", "ptt"):
        raise SystemExit(f"error: unknown method {name!r}: full, lora, apt_<density> or ptt_<density>")
    return {"kind": kind, "density": float(density)}


def train_full(model, stream, train) -> list[dict]:
    """Full fine-tuning with the loss, schedule, clipping and batches apt-ds's trainer uses."""
    import torch

    from apt_ds.training.forward import supervised_forward
    from apt_ds.training.lr_schedule import warmup_cosine

    for param in model.parameters():
        param.requires_grad_(True)
    model.eval()  # dropout off, as apt-ds trains an encoder
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, weight_decay=train.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(train.warmup_steps, train.steps))
    history = []
    for step in range(train.steps):
        started = time.perf_counter()
        loss_sum = 0.0
        for _ in range(train.grad_accum_steps):
            _, loss, _ = supervised_forward(model, next(stream))
            (loss / train.grad_accum_steps).backward()
            loss_sum += float(loss.detach()) / train.grad_accum_steps
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.max_grad_norm)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        history.append({"step": step + 1, "loss": loss_sum, "step_time_s": time.perf_counter() - started})
    for param in model.parameters():
        param.requires_grad_(False)
    return history


def forward_seconds(model, batches: list[dict]) -> float:
    import torch

    started = time.perf_counter()
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    return time.perf_counter() - started


def inference_times(export_dir: Path, dense, batches: list[dict], repeats: int) -> dict:
    """Median forward time over the held-out rows of the export and of the dense base model,
    measured alternately (one warm-up pass each first), and their ratio."""
    from apt_ds.io.modeling import load_pretrained

    exported = load_pretrained(export_dir).eval()
    dense.eval()
    times = {"export": [], "dense": []}
    for model in (exported, dense):
        forward_seconds(model, batches[:1])
    for _ in range(repeats):
        times["export"].append(forward_seconds(exported, batches))
        times["dense"].append(forward_seconds(dense, batches))
    export_s, dense_s = statistics.median(times["export"]), statistics.median(times["dense"])
    return {"inference_export_s": export_s, "inference_dense_s": dense_s, "inference_ratio": export_s / dense_s,
            "inference_repeats": repeats}


def run_worker(spec_path: Path) -> None:
    import torch

    spec = read_json(spec_path)
    torch.set_num_threads(spec["threads"])
    from apt_ds.algorithm.units import ModelShape
    from apt_ds.config import APTConfig, TrainConfig
    from apt_ds.evaluation.classifier import ClassifierRequest, classifier_accuracy
    from apt_ds.export.merge import merge_and_compact
    from apt_ds.export.writer import write_export
    from apt_ds.io.classification import tokenize_classification
    from apt_ds.io.data import batches, collate, load_records
    from apt_ds.io.modeling import load_model
    from apt_ds.io.tokenizer import load_tokenizer
    from apt_ds.training.heap import release_free_heap
    from apt_ds.training.trainer import APTrainer

    run_dir = Path(spec["run_dir"])
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    method = method_spec(spec["method"])
    result = {"method": spec["method"], **method, "seed": spec["seed"], "spec": spec, "hardware": hardware()}
    tokenizer = load_tokenizer(spec["model"])
    tokenizer.save_pretrained(str(run_dir / "tokenizer"))
    pad_id = tokenizer.pad_token_id or 0
    data = tokenize_classification(load_records(spec["train"]), tokenizer, spec["max_seq_len"], source=spec["train"])
    test = tokenize_classification(load_records(spec["test"]), tokenizer, spec["max_seq_len"], source=spec["test"],
                                   num_labels=data.num_labels)
    steps = spec["steps"]
    train = TrainConfig(steps=steps, micro_batch_size=spec["micro_batch_size"], max_seq_len=spec["max_seq_len"],
                        lr=spec["lr_full"] if method["kind"] == "full" else spec["lr"], warmup_steps=max(1, steps // 10),
                        seed=spec["seed"], log_every=1)
    apt = APTConfig.for_steps(steps, target_density=method["density"], adapter_rank=spec["rank"],
                              adapter_alpha=2.0 * spec["rank"], adapter_targets=tuple(spec["adapter_targets"]))
    # as `launch/train.py` loads a base it will prune: tensor by tensor, so cut weights leave memory
    model = load_model(spec["model"], mmap=method["kind"] in ("full", "lora"), num_labels=data.num_labels,
                       seed=spec["seed"])
    original = ModelShape.from_model(model)
    stream = batches(data.examples, train.micro_batch_size, train.seed, pad_id=pad_id)
    release_free_heap()
    result["rss_before_train_mb"] = rss_mb()
    result["peak_reset_supported"] = reset_peak_rss()
    cpu_started, started = time.process_time(), time.perf_counter()
    if method["kind"] == "full":
        history = train_full(model, stream, train)
        compact, shape = model, original
    else:
        config = apt if method["kind"] == "apt" else apt.as_lora()
        if method["kind"] == "ptt":
            from apt_ds.training.baselines import one_shot_prune

            calibration = batches(data.examples, train.micro_batch_size, train.seed + 1000, pad_id=pad_id)
            pruned = one_shot_prune(model, [next(calibration) for _ in range(spec["calibration_batches"])],
                                    method["density"], apt)
            result["calibration_time_s"] = time.perf_counter() - started
            result["one_shot_density"] = pruned.density
        trainer = APTrainer(model, config, train, out_dir=run_dir, progress=False,
                            run_info={"model": spec["model"], "method": spec["method"], "num_labels": data.num_labels})
        trainer.train(stream)
        history = [r for r in trainer.history if "loss" in r]
        result["total_rank"] = trainer.state.total_rank()  # before the merge folds the adapters away
        compact, shape = merge_and_compact(trainer), trainer.state.shape
        del trainer
    result["train_time_s"] = time.perf_counter() - started  # prune-then-tune: its calibration included
    result["train_cpu_s"] = time.process_time() - cpu_started
    result["peak_rss_mb"] = vm_hwm_mb()
    result["final_loss"] = history[-1]["loss"]
    result["step_time_median_s"] = statistics.median(r["step_time_s"] for r in history)
    export_dir = run_dir / "export"
    write_export(compact, shape, export_dir, torch.float32, tokenizer_dir=run_dir / "tokenizer")
    result.update(density=shape.block_params() / original.block_params(), block_params=shape.block_params(),
                  total_params=shape.total_params(), layer_shapes=[[l.num_kv_groups, l.ffn] for l in shape.layers],
                  hidden=shape.hidden)
    del compact, model
    gc.collect()
    scored = classifier_accuracy(ClassifierRequest(str(export_dir), spec["test"], max_seq_len=spec["max_seq_len"]))
    result.update(accuracy=scored["accuracy"], test_rows=scored["rows"])
    dense = load_model(spec["model"], num_labels=data.num_labels, seed=spec["seed"])
    test_batches = [collate(test.examples[i : i + spec["eval_batch_size"]], pad_id=pad_id)
                    for i in range(0, len(test.examples), spec["eval_batch_size"])]
    for batch in test_batches:
        batch.pop("labels")
    result.update(inference_times(export_dir, dense, test_batches, spec["inference_repeats"]))
    write_json(run_dir / "result.json", result)


if __name__ == "__main__":
    run_worker(Path(sys.argv[1]))
