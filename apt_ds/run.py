"""Wiring of a training run: backend, run directory, tokenizer, model, data, trainer.

Kept apart from cli.py so the CLI stays argument parsing only, and apart from trainer.py so
the loop knows nothing about files, tokenizers or launchers.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from .backend import LocalBackend
from .checkpoint import CheckpointError, read_meta
from .cli import prepare_out_dir
from .config import APTConfig, ConfigError, TrainConfig
from .data import (
    batches, collate, demo_data_path, load_records, load_tokenizer, tokenize_dataset, train_sentencepiece_tokenizer,
)
from .modeling import TINY_MODEL, build_tiny_llama, load_model
from .trainer import APTrainer

TOKENIZER_DIR = "tokenizer"
RUN_FILE = "run.json"


def make_backend(args, train: TrainConfig):
    if not args.deepspeed:
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            raise ConfigError("several ranks were launched but --deepspeed was not given; pass a ds_configs/*.json")
        return LocalBackend(), train
    from .zero import DeepSpeedBackend

    backend = DeepSpeedBackend(args.deepspeed, micro_batch_size=train.micro_batch_size)
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


def _tokenizer_and_model(args, out: Path, backend, texts: list[str] | None, seed: int):
    tokenizer_dir = out / TOKENIZER_DIR
    if args.model == TINY_MODEL:
        if not (tokenizer_dir / "tokenizer_config.json").is_file():
            if backend.is_main():
                train_sentencepiece_tokenizer(texts, tokenizer_dir, vocab_size=512)
            backend.barrier()
        tokenizer = load_tokenizer(tokenizer_dir)
        model = build_tiny_llama(vocab_size=len(tokenizer), seed=seed)
    else:
        tokenizer = load_tokenizer(args.model)
        model = load_model(args.model)
        if backend.is_main() and not tokenizer_dir.exists():
            tokenizer.save_pretrained(str(tokenizer_dir))
    return tokenizer, model


def _texts_for_tokenizer(records) -> list[str]:
    texts = []
    for row in records.select(range(min(len(records), 5000))):
        texts.append(" ".join(str(row.get(k) or "") for k in ("text", "instruction", "input", "output", "prompt", "completion")))
    return texts


def run_training(args, apt: APTConfig, train: TrainConfig) -> dict:
    backend, train = make_backend(args, train)
    out = Path(args.out)
    prepare_out_dir(out, args.resume, args.overwrite, backend.is_main())
    backend.barrier()
    if args.resume:
        meta = read_meta(out / "checkpoint")
        if meta["run_info"].get("model") != args.model:
            raise CheckpointError(
                f"--resume: {out} was trained from --model {meta['run_info'].get('model')}, not {args.model}"
            )
    data_path = args.data or str(demo_data_path())
    records = load_records(data_path)
    tokenizer, model = _tokenizer_and_model(args, out, backend, _texts_for_tokenizer(records), train.seed)
    examples = tokenize_dataset(records, tokenizer, train.max_seq_len, pack=not args.no_pack, source=data_path)
    pad_id = tokenizer.pad_token_id or 0
    eval_batches = _eval_batches(args, tokenizer, train, backend, pad_id)
    run_info = {"model": args.model, "data": data_path, "tokenizer": TOKENIZER_DIR, "method": args.method,
                "deepspeed": args.deepspeed, "world_size": backend.world_size}
    if backend.is_main() and not args.resume:
        (out / RUN_FILE).write_text(json.dumps({**run_info, "apt_config": apt.to_dict(), "train_config": train.to_dict()}, indent=1))
    trainer = APTrainer(model, apt, train, backend=backend, out_dir=out, eval_batches=eval_batches, run_info=run_info)
    if args.resume:
        trainer.resume(out / "checkpoint")
    stream = batches(examples, train.micro_batch_size, train.seed, rank=backend.rank, world_size=backend.world_size, pad_id=pad_id)
    final = trainer.train(stream)
    if backend.is_main():
        print(json.dumps(final))
    return final


def _eval_batches(args, tokenizer, train: TrainConfig, backend, pad_id: int) -> list[dict]:
    if not args.eval_data:
        return []
    records = load_records(args.eval_data)
    examples = tokenize_dataset(records, tokenizer, train.max_seq_len, pack=False, source=args.eval_data)
    examples = examples[: args.eval_examples]
    # Every rank must run the same number of forwards (ZeRO-3 gathers are collective).
    examples = examples[: len(examples) - len(examples) % backend.world_size]
    if not examples:
        raise ConfigError(f"--eval-data {args.eval_data}: fewer usable examples than ranks ({backend.world_size})")
    mine = examples[backend.rank :: backend.world_size]
    size = train.micro_batch_size
    return [collate(mine[i : i + size], pad_id=pad_id) for i in range(0, len(mine), size)]
