"""Wiring of a training run: backend, run directory, tokenizer, model, data, trainer.

Kept apart from cli.py so the CLI stays argument parsing only, and apart from trainer.py so
the loop knows nothing about files, tokenizers or launchers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch

from apt_ds.algorithm.reachable import check_model_target
from apt_ds.config import APTConfig, ConfigError, TrainConfig
from apt_ds.distributed.backend import LocalBackend
from apt_ds.distributed.placement import check_fits, configure_host_threads, resolve_base_dtype, resolve_device
from apt_ds.distributed.split_work import parts_from_every_rank
from apt_ds.distributed.zero_monitor import monitor_into_run, resume_csv_files
from apt_ds.io.atomic import write_text_atomic
from apt_ds.io.checkpoint import read_meta
from apt_ds.io.checkpoint_save import repair_finished_run
from apt_ds.io.context_length import check_max_seq_len
from apt_ds.io.data import TruncationStats, batches, demo_data_path, load_records
from apt_ds.io.fingerprint import combine_fingerprint_parts, file_fingerprint_part, model_fingerprint
from apt_ds.io.hub import data_location
from apt_ds.io.modeling import TINY_MODELS, build_tiny_model, load_model
from apt_ds.io.quantized import (
    base_quant_of,
    check_quantizable_base,
    load_quantized,
    quantization_record,
    quantize_model,
)
from apt_ds.io.run_dir import (
    RUN_FILE,
    check_out_dir,
    discard,
    is_run_dir,
    prepare_out_dir,
    previous_run_back_on_failure,
)
from apt_ds.training import epochs, resume
from apt_ds.training.eval_data import held_out_batches
from apt_ds.training.heap import freeze_prepared_data, large_allocations_returned, release_free_heap
from apt_ds.training.probe import live_probe, save_probe
from apt_ds.training.run_tokenizer import TOKENIZER_DIR, prepare_tokenizer, texts_for_tokenizer
from apt_ds.training.task import check_task, tokenize_for_task
from apt_ds.training.trainer import APTrainer

logger = logging.getLogger(__name__)

PROBE_FILE = "eval_probe.safetensors"


def make_backend(args, train: TrainConfig):
    """The backend and the training config it implies; also the host threads per rank."""
    backend, train = _make_backend(args, train)
    resolve_base_dtype(train.base_dtype, backend.device)  # e.g. fp16 asked on a CPU: refused here
    if getattr(backend, "param_dtype", None) == torch.float16 and backend.device.type == "cpu":
        raise ConfigError(f"DeepSpeed config {args.deepspeed}: fp16 is not supported on CPU (no fp16 kernels); "
                          "set \"fp16\": {\"enabled\": false} or use bf16")
    configure_host_threads(backend.device)
    if getattr(backend, "zero_stage_requested", 0) == 3:  # measured there; other paths gather nothing
        large_allocations_returned(backend.device)  # gathered weights freed to the OS, not the heap (heap.py)
    return backend, train


def base_dtype_of(backend, train: TrainConfig):
    """The dtype the frozen base weights are loaded in: the engine's precision under DeepSpeed."""
    return getattr(backend, "param_dtype", None) or resolve_base_dtype(train.base_dtype, backend.device)


def _make_backend(args, train: TrainConfig):
    if not args.deepspeed:
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            raise ConfigError("several ranks were launched but --deepspeed was not given; pass a ds_configs/*.json")
        if args.global_batch_size:
            if args.global_batch_size % train.grad_accum_steps:
                raise ConfigError(f"--global-batch-size {args.global_batch_size} is not divisible by "
                                  f"grad_accum_steps ({train.grad_accum_steps})")
            train = dataclasses.replace(train, micro_batch_size=args.global_batch_size // train.grad_accum_steps)
        return LocalBackend(resolve_device(train.device)), train
    from apt_ds.distributed.zero import DeepSpeedBackend

    backend = DeepSpeedBackend(args.deepspeed, micro_batch_size=train.micro_batch_size, base_dtype=train.base_dtype)
    if args.global_batch_size:
        per_step = backend.world_size * train.grad_accum_steps
        if args.global_batch_size % per_step:
            raise ConfigError(
                f"--global-batch-size {args.global_batch_size} is not divisible by world_size ({backend.world_size}) "
                f"x grad_accum_steps ({train.grad_accum_steps}); pick a multiple of {per_step}"
            )
        train = dataclasses.replace(train, micro_batch_size=args.global_batch_size // per_step)
        backend.micro_batch_size = train.micro_batch_size
    return backend, train


def _model(args, tokenizer, train: TrainConfig, prunes: bool, backend, check_fingerprint, num_labels=None):
    """The model in the base dtype and its fingerprint, which `check_fingerprint` sees as soon as it
    is known: for a safetensors directory before the weights are read (minutes for a 70B model).
    Under ZeRO-3 the model is partitioned from the first byte (apt_ds.distributed.zero_init). Otherwise a
    run that prunes reads the weights into memory rather than mapping the file: mapped pages
    would stay resident after pruning (apt_ds.io.modeling.load_model)."""
    dtype = base_dtype_of(backend, train)
    quant = base_quant_of(train, dtype, prunes, zero3=_partitions_weights(backend))
    if args.model in TINY_MODELS:
        model = build_tiny_model(vocab_size=len(tokenizer), seed=train.seed, variant=args.model)
        fingerprint = model_fingerprint(model)
        check_fingerprint(fingerprint)
        if _partitions_weights(backend):  # tiny: its full state dict is the source of the partitions
            return _partitioned(backend, model.config, model.state_dict(), dtype, train, quant), fingerprint
        model = model.to(dtype)
        return (quantize_model(model.to(backend.device), quant) if quant.enabled else model), fingerprint
    path = Path(args.model)
    if path.is_dir():
        from apt_ds.io.weights import SafetensorsWeights

        # Chunk by chunk (the same for every base dtype). It reads every byte of the model (140 GB at
        # 70B): each rank reads its own share and all combine them, so the job reads the model once.
        parts = parts_from_every_rank(backend, lambda rank, ranks: file_fingerprint_part(path, rank, ranks))
        fingerprint = combine_fingerprint_parts(parts)
        check_fingerprint(fingerprint)
        if _partitions_weights(backend):  # quantized or not, partitioned tensor by tensor as it loads
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(path))
            if num_labels is not None:
                config.num_labels = num_labels  # an encoder's classifier: the data's classes
            return _partitioned(backend, config, SafetensorsWeights(path), dtype, train, quant), fingerprint
        if quant.enabled:  # quantized tensor by tensor as it loads (apt_ds.io.quantized)
            return load_quantized(path, quant, backend.device), fingerprint
        return load_model(path, dtype=dtype, mmap=not prunes, num_labels=num_labels, seed=train.seed), fingerprint
    if _partitions_weights(backend):
        logger.warning("%s: a GGUF file is loaded whole on every rank before ZeRO-3 partitions it; convert it to a "
                       "safetensors directory to load partitions only", path)
    model = load_model(path, dtype=dtype)
    fingerprint = model_fingerprint(model)
    check_fingerprint(fingerprint)
    return model, fingerprint


def _check_model_fits(args, train: TrainConfig, backend) -> None:
    """A clear error instead of the OOM killer when a safetensors model's base weights alone cannot
    fit, from its headers: before the data is tokenized (the data comes before the model:
    apt_ds.training.heap), and so before any weight is read."""
    path = Path(args.model)
    if args.model in TINY_MODELS or not path.is_dir():
        return
    from apt_ds.io.weights import SafetensorsWeights

    dtype, count = base_dtype_of(backend, train), SafetensorsWeights(path).numel()
    partitions = backend.world_size if _partitions_weights(backend) else 1
    per_rank = count * dtype.itemsize // partitions
    hint = ("use more ranks" if partitions > 1 else "use ZeRO-3 (--deepspeed ds_configs/zero3.json) over several ranks")
    if dtype == torch.float32:
        hint += ", or --base-dtype bf16"
    count_text = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
    what = f"--model {path} ({count_text} parameters in {str(dtype).replace('torch.', '')})"
    check_fits(per_rank, backend.device, what, hint)
    if backend.device.type != "cpu" and partitions == 1:  # every local rank reads it into host memory first
        check_fits(per_rank, torch.device("cpu"), what + " read into host memory by each rank on this node", hint)


def _partitions_weights(backend) -> bool:
    return getattr(backend, "zero_stage_requested", 0) == 3


def _partitioned(backend, config, source, dtype, train: TrainConfig, quant):
    from apt_ds.distributed.zero_init import build_partitioned_model

    ds_config = backend.resolved_config(config, train.grad_accum_steps, train.max_grad_norm)
    return build_partitioned_model(config, source, ds_config, dtype, backend.device, quant if quant.enabled else None,
                                   seed=train.seed)


def run_training(args, apt: APTConfig | None, train: TrainConfig, configs_for_steps=None,
                 model_name: str | None = None) -> dict:
    """With --epochs (`args.epochs`) the steps come from the data: `apt` is None and `train`'s length
    a stand-in until `configs_for_steps(steps)` (apt_ds.cli.recipe) makes both, once the data is read.
    `model_name`: the Hub name args.model was resolved from (apt_ds.io.hub), recorded beside it."""
    check_task(args, train, apt)  # before a backend (and DeepSpeed) starts
    backend, train = make_backend(args, train)
    result = _run_on(backend, args, apt, train, configs_for_steps, model_name)
    backend.shutdown()  # only after success: a rank that failed has nobody to wait for
    return result


def _run_on(backend, args, apt: APTConfig | None, train: TrainConfig, configs_for_steps=None,
            model_name: str | None = None) -> dict:
    out = Path(args.out)
    check_out_dir(out, args.resume, args.overwrite)  # fail early; nothing is touched yet
    zero_stage = getattr(backend, "zero_stage_requested", None) if args.deepspeed else None
    prunes = apt.prune if apt is not None else args.method != "lora"  # apt is None until --epochs sets the steps
    dtype = base_dtype_of(backend, train)  # --epochs changes the run's length later, never its dtype
    dtype_name = str(dtype).removeprefix("torch.")
    check_quantizable_base(args.model, base_quant_of(train, dtype, prunes), zero_stage, backend.device)
    if getattr(args, "save_eval_probe", False) and not args.eval_data:
        raise ConfigError("--save-eval-probe needs --eval-data (the probe is the first eval batch)")
    meta = read_meta(resume.checkpoint_to_resume(out)) if args.resume else None
    # Validate every input before writing anything into --out.
    data_path = args.data or str(demo_data_path())
    if args.epochs is not None and meta is not None:  # the run's own length, which its data must give again (below)
        apt, train = epochs.with_steps(configs_for_steps, meta["train_config"]["steps"], train)
    if meta is not None:  # the command line's settings, before the data is read; the model's after it is built
        # the APT config too, and a finished run's: a changed setting is named, never ignored
        resume.check_resumable_settings(meta, train, data_path, backend.world_size, apt.to_dict(),
                                        resume.checkpoint_to_resume(out), deepspeed=args.deepspeed, method=args.method,
                                        data_split=args.data_split, base_dtype=dtype_name)
    records = load_records(data_path, split=args.data_split)
    with tempfile.TemporaryDirectory(prefix="apt-tokenizer-") as staging:
        tokenizer = prepare_tokenizer(args, out, texts_for_tokenizer(records), train, Path(staging))
        _check_model_fits(args, train, backend)  # before tokenizing what may be a large data set
        truncation = TruncationStats()
        task = tokenize_for_task(args, records, tokenizer, train, data_path, truncation, backend.is_main())
        examples = task.examples
        examples_digest = resume.data_fingerprint(meta, examples, data_path)  # a resume: the same examples as before
        counts = epochs.count_data(records, examples, task.packed, truncation.to_dict())
        if args.epochs is not None:
            apt, train = epochs.configs_for_epochs(args.epochs, counts, train, backend.world_size, meta, configs_for_steps)
        said = epochs.start_lines(counts, train, backend.world_size, args.epochs)  # as training begins (_train)
        warning = truncation.message(data_path, train.max_seq_len)
        if warning and backend.is_main():
            print(warning, file=sys.stderr)
        pad_id = tokenizer.pad_token_id or 0
        eval_batches = held_out_batches(args, tokenizer, train, backend, pad_id, records, data_path, task.num_labels)
        freeze_prepared_data()  # the examples, before the model exists (apt_ds.training.heap)

        def check_model(fingerprint):  # the model the run was trained from; known before its weights are read
            if meta is not None:
                resume.check_resumable_model(meta, args, fingerprint)

        model, fingerprint = _model(args, tokenizer, train, apt.prune, backend, check_model, task.num_labels)
        check_model_target(model, apt)  # before --out is written: else it fails at the first pruning event
        if Path(args.model).is_file():  # a GGUF's context length is known once it is read (the others': cli.train)
            note = check_max_seq_len(model.config.to_dict(), train.max_seq_len, args.model)
            if note and backend.is_main():
                print(note, file=sys.stderr)
        backend.validate(model, train.grad_accum_steps, train.max_grad_norm)  # e.g. DeepSpeed JSON vs TrainConfig
        # Absolute: the run is exported/resumed from other working directories. A Hub name: both.
        model_ref = args.model if args.model in TINY_MODELS else str(Path(args.model).resolve())
        run_info = {"model": model_ref, "model_name": model_name, "data": data_path, "data_split": args.data_split,
                    "tokenizer": TOKENIZER_DIR, "method": args.method, "deepspeed": args.deepspeed,
                    "world_size": backend.world_size, "model_fingerprint": fingerprint, "truncation": truncation.to_dict(),
                    "data_resolved": data_location(data_path), "data_fingerprint": examples_digest,
                    "base_dtype": dtype_name, **({"num_labels": task.num_labels} if task.num_labels else {}),
                    "data_stats": epochs.data_stats(counts, train, backend.world_size, args.epochs),
                    **quantization_record(model, train)}  # a quantized base's layout, in run.json too
        backend.barrier()
        replaced = prepare_out_dir(out, args.resume, args.overwrite, backend.is_main())
        with previous_run_back_on_failure(out, replaced):
            # run.json first: it marks the directory as a run. A resume writes it again only where it
            # is unreadable (the settings were just checked against the checkpoint's).
            if backend.is_main():
                if not (args.resume and is_run_dir(out)):
                    run_record = {**run_info, "apt_config": apt.to_dict(), "train_config": train.to_dict()}
                    write_text_atomic(out / RUN_FILE, json.dumps(run_record, indent=1), temporary=RUN_FILE + ".tmp")
                if not args.resume:
                    tokenizer.save_pretrained(str(out / TOKENIZER_DIR))
            backend.barrier()
    with previous_run_back_on_failure(out, replaced):
        return _train(backend, args, apt, train, out, meta, model, examples, eval_batches, pad_id, run_info, replaced, said)


def _train(backend, args, apt, train, out, meta, model, examples, eval_batches, pad_id, run_info, replaced, said) -> dict:
    monitor_into_run(backend, out)  # before the engine (and its monitor) is built
    trainer = APTrainer(model, apt, train, backend=backend, out_dir=out, eval_batches=eval_batches, run_info=run_info)
    if replaced is not None:  # the previous run goes once the new one can be resumed
        trainer.checkpoint_hooks.append(lambda: discard(replaced))
    start = 0
    if args.resume:
        if meta["finished"]:
            repair_finished_run(trainer, out / "checkpoint")
            if backend.is_main():
                print(f"{out} already finished at step {meta['step']}; nothing to do")
            return {"step": meta["step"], "final": True, "already_finished": True}
        trainer.resume(out / "checkpoint")
        # Position in the example stream, re-expressed in this run's micro-batches (the global
        # batch is unchanged, so this is a whole number of this run's optimizer steps).
        saved = meta["train_config"]
        examples_done = trainer.consumed_micro_batches * saved["micro_batch_size"] * meta["run_info"].get("world_size", 1)
        start = examples_done // (train.micro_batch_size * backend.world_size)
        trainer.consumed_micro_batches = start
        if backend.is_main():
            resume.truncate_metrics(out / "metrics.jsonl", meta["step"])
            resume_csv_files(backend, meta["step"], out)
    stream = epochs.saying(said, backend.is_main(), batches(examples, train.micro_batch_size, train.seed, rank=backend.rank,
                                                            world_size=backend.world_size, pad_id=pad_id, start_step=start))
    release_free_heap()  # what loading freed (file chunks, replaced partitions) goes back to the OS
    final = trainer.train(stream, skip_consumed=False)
    if getattr(args, "save_eval_probe", False) and eval_batches:
        probe = live_probe(trainer, eval_batches[0])  # every rank: ZeRO-3 gathers weights inside forward
        if backend.is_main():
            save_probe(probe, out / PROBE_FILE)
    if backend.is_main():
        print(json.dumps(final))
    return final
