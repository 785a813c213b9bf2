"""Command-line entry points (argparse -> configs -> trainer / exporter). No algorithm here."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from apt_ds.config import APTConfig, ConfigError, TrainConfig, check_field_types
from apt_ds.io.run_dir import check_out_dir, recover_interrupted_overwrite

# One-line errors for everything a user can get wrong; anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, FileExistsError)


def _user_errors() -> tuple:
    from apt_ds.io.checkpoint import CheckpointError
    from apt_ds.io.data import DataError
    from apt_ds.distributed.ds_config import DeepSpeedConfigError
    from apt_ds.io.modeling import ModelLoadError
    from apt_ds.algorithm.pruner import PruningError
    from apt_ds.algorithm.units import UnsupportedModelError
    from apt_ds.io.weights import WeightsError

    return (*USER_ERRORS, CheckpointError, DataError, ModelLoadError, PruningError, UnsupportedModelError,
            DeepSpeedConfigError, WeightsError)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line like every other error here (no usage block)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


SCALED_DEFAULTS = {  # fields whose default is derived from --steps (see APTConfig.for_steps / resolve_configs)
    "pruning_start_step": "10%% of --steps",
    "pruning_end_step": "50%% of --steps",
    "num_pruning_events": "about one per 3 steps of the pruning phase, at most 16",
    "mask_decay_window": "the spacing between events - 1",
    "mask_decay_step": "1 / mask-decay-window",
    "distill_every": "4, or less when the pruning phase has under 16 steps",
    "warmup_steps": "5%% of --steps, at least 1",
    "checkpoint_every": "10%% of --steps, at least 10",
}


def _add_dataclass_args(parser: argparse.ArgumentParser, cls, title: str) -> None:
    """One flag per dataclass field (--field-name), help text from the field's metadata."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "").replace("%", "%%")
        default = SCALED_DEFAULTS.get(f.name)
        if default is None:
            default = " ".join(f.default) if isinstance(f.default, tuple) else f.default
        help_text = f"{help_text} (default: {default})"
        if isinstance(f.default, bool):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif isinstance(f.default, tuple):
            group.add_argument(flag, dest=f.name, nargs="+", default=None, help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=type(f.default), default=None, help=help_text,
                               choices=f.metadata.get("choices"))


def build_train_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="launch/train.py",
        description="Fine-tune a LLaMA model with APT: adapters are trained while attention KV groups, FFN neurons "
        "and hidden channels are pruned and physically removed; ends with a smaller model. "
        "Run with plain python (one process) or under the deepspeed launcher with --deepspeed.",
    )
    parser.add_argument("--model", default="tiny", help="local HF model directory, a .gguf file, or 'tiny' "
                        "(built-in random small LLaMA with GQA; default) or 'tiny-mha' (the same with one KV head per query head)")
    parser.add_argument("--data", default=None, help="training data: JSONL/JSON with 'text' or 'instruction'/'input'/'output' "
                        "fields, or a directory saved by `datasets` (default: the shipped demo data)")
    parser.add_argument("--eval-data", default=None, help="held-out data (same formats); eval_loss is logged at each pruning event and at the end")
    parser.add_argument("--out", default="runs/demo", help="run directory: metrics.jsonl, checkpoint/, tokenizer/ (default: runs/demo)")
    parser.add_argument("--deepspeed", default=None, help="DeepSpeed JSON (ds_configs/zero2.json, zero3.json, ...); omit for one process without DeepSpeed")
    parser.add_argument("--method", choices=("apt", "lora"), default="apt", help="apt, or lora: the same adapters with no pruning, no rank growth, no distillation")
    parser.add_argument("--config", default=None, help="JSON file with APTConfig/TrainConfig fields (command-line flags override it)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="replace a previous run in --out (only an apt-ds run "
                        "directory or an empty one; anything else is refused). The old run is kept aside until the new "
                        "one has written its first checkpoint, and put back if the new one fails before that")
    parser.add_argument("--global-batch-size", type=int, default=None, help="sequences per optimizer step over all ranks (sets --micro-batch-size)")
    parser.add_argument("--no-pack", action="store_true", help="do not pack 'text' data into full blocks")
    parser.add_argument("--eval-examples", type=int, default=64, help="examples of --eval-data used per evaluation (default: 64)")
    parser.add_argument("--save-eval-probe", action="store_true", help="after training, write eval_probe.safetensors: the "
                        "live model's logits on the first --eval-data batch and its 20-token greedy continuation of that "
                        "batch's first row, to check an export against the run (needs --eval-data)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    _add_dataclass_args(parser, APTConfig, "APT knobs (schedule defaults scale with --steps)")
    _add_dataclass_args(parser, TrainConfig, "training loop")
    return parser


def resolve_configs(args) -> tuple[APTConfig, TrainConfig]:
    """Defaults <- config file <- command line; APT schedule defaults scale with --steps."""
    file_values: dict = {}
    if args.config:
        try:
            file_values = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as err:  # ValueError: bad JSON, or not UTF-8 text
            raise ConfigError(f"cannot read --config {args.config}: {err}") from None
        if not isinstance(file_values, dict):
            raise ConfigError(f"--config {args.config} must hold a JSON object of APTConfig/TrainConfig fields, "
                              f"e.g. {{\"steps\": 100}}; it holds a {type(file_values).__name__}")
    apt_names = {f.name for f in dataclasses.fields(APTConfig)}
    train_names = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(file_values) - apt_names - train_names)
    if unknown:
        raise ConfigError(f"--config {args.config}: unknown field(s) {unknown}")
    check_field_types(TrainConfig, {k: v for k, v in file_values.items() if k in train_names})
    check_field_types(APTConfig, {k: v for k, v in file_values.items() if k in apt_names})
    cli = {k: v for k, v in vars(args).items() if v is not None}
    merged = {**file_values, **{k: v for k, v in cli.items() if k in apt_names | train_names}}
    train_values = {k: v for k, v in merged.items() if k in train_names}
    steps = int(train_values.get("steps", TrainConfig.steps))
    train_values.setdefault("checkpoint_every", max(10, steps // 10))  # resumable without asking
    train_values.setdefault("warmup_steps", max(1, steps // 20))
    train = TrainConfig(**train_values)
    apt_values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in merged.items() if k in apt_names}
    if args.method == "lora":
        apt_values = {k: v for k, v in apt_values.items() if k not in SCHEDULE_FIELDS}
    apt = APTConfig.for_steps(train.steps, **apt_values)
    if apt.prune and apt.pruning_end_step > train.steps:
        raise ConfigError(
            f"APTConfig.pruning_end_step ({apt.pruning_end_step}) must be <= --steps ({train.steps}): "
            "the run would end before reaching its target density"
        )
    if args.method == "lora":
        apt = apt.as_lora()
    return apt, train


def check_inputs_early(args, train: TrainConfig) -> None:
    """The checks that need neither a process group nor a model, run before either exists
    (a launch costs minutes on a fresh machine): --out, the model path, the DeepSpeed JSON."""
    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the run in --out and --overwrite replaces it: give one of them")
    for flag, value in (("--global-batch-size", args.global_batch_size), ("--eval-examples", args.eval_examples)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--data", args.data), ("--eval-data", args.eval_data)):
        if value and not Path(value).exists():
            raise ConfigError(f"{flag} {value} does not exist")
    if os.environ.get("RANK", "0") == "0":  # one rank repairs what a killed --overwrite left
        note = recover_interrupted_overwrite(Path(args.out))
        if note:
            print(note, file=sys.stderr)
    check_out_dir(Path(args.out), args.resume, args.overwrite)
    from apt_ds.io.modeling import TINY_MODELS, check_model_path

    if args.model not in TINY_MODELS:
        check_model_path(args.model, flag="--model")
    if args.deepspeed:
        from apt_ds.distributed.ds_config import precheck_config

        precheck_config(args.deepspeed, grad_accum_steps=train.grad_accum_steps, max_grad_norm=train.max_grad_norm,
                        micro_batch_size=None if args.global_batch_size else train.micro_batch_size,
                        base_dtype=train.base_dtype)


SCHEDULE_FIELDS = ("pruning_start_step", "pruning_end_step", "num_pruning_events", "mask_decay_window", "mask_decay_step")


def train_main(argv: list[str] | None = None) -> int:
    args = build_train_parser().parse_args(argv)
    try:
        apt, train = resolve_configs(args)
        check_inputs_early(args, train)
        from apt_ds.training.run import run_training

        run_training(args, apt, train)
    except _user_errors() as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted; --resume continues from the last checkpoint in {args.out} (if one was written)", file=sys.stderr)
        return 130
    except OSError as err:  # e.g. the disk filled up while the tokenizer or a metrics line was written
        from apt_ds.io.checkpoint import is_disk_full

        if not is_disk_full(err):
            raise
        print(f"error: disk full writing {getattr(err, 'filename', None) or args.out}: {err.strerror or err}; free space "
              f"and run again", file=sys.stderr)
        return 2
    return 0


def build_export_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="launch/export.py",
        description="Export a run as a merged, physically smaller, dense model (safetensors + config + tokenizer).",
    )
    parser.add_argument("run_dir", nargs="?", help="run directory written by launch/train.py (its checkpoint/ is read)")
    parser.add_argument("--model", default=None, help="with RUN_DIR: the run's base model, when it is no longer at the path "
                        "the run recorded (a moved run). Without RUN_DIR: a plain LLaMA directory (adapters merged or none) "
                        "to prune with --kept")
    parser.add_argument("--kept", default=None, help="with --model: the units to keep, as a JSON of ORIGINAL unit indices "
                        "(a run's checkpoint/apt_state.json, or {groups, neurons, hidden}) or as binary masks over the "
                        "original model in a .safetensors (hidden, kv_group.<i>, ffn_neuron.<i>); needs no DeepSpeed")
    parser.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="dtype of the saved weights")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out that holds a previous export")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (e.g. 500MB, 5GB; default 5GB); "
                        "bigger models are written as shards plus model.safetensors.index.json")
    return parser


def export_main(argv: list[str] | None = None) -> int:
    parser = build_export_parser()
    args = parser.parse_args(argv)
    if args.run_dir and args.kept:
        parser.error("--kept is for exporting a plain model: give either RUN_DIR [--model BASE], or --model and --kept")
    if not args.run_dir and not (args.model and args.kept):
        parser.error("give either RUN_DIR [--model BASE], or --model and --kept")
    try:
        from apt_ds.export.merge import export_pruned, export_run

        if args.run_dir:
            report = export_run(Path(args.run_dir), Path(args.out), dtype=args.dtype, overwrite=args.overwrite,
                                model_path=args.model, max_shard_size=args.max_shard_size)
        else:
            report = export_pruned(*_plain_model_and_kept(args.model, args.kept), Path(args.out), dtype=args.dtype,
                                   tokenizer_dir=Path(args.model), overwrite=args.overwrite, max_shard_size=args.max_shard_size)
    except _user_errors() as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report["final"], indent=1))
    return 0


def _plain_model_and_kept(model_path: str, kept_path: str):
    from apt_ds.io.modeling import load_model

    if kept_path.endswith(".safetensors"):
        from apt_ds.export.merge import kept_from_masks

        kept = kept_from_masks(kept_path)
    else:
        try:
            kept = json.loads(Path(kept_path).read_text())
        except (OSError, ValueError) as err:  # ValueError: bad JSON, or not UTF-8 text
            raise ConfigError(f"cannot read --kept {kept_path}: {err}") from None
    if isinstance(kept, dict) and "kept" in kept:  # a run's checkpoint/apt_state.json
        kept = kept["kept"]
    from apt_ds.export.merge import read_kept_record

    read_kept_record(kept)  # before the (slow) model load
    return load_model(model_path), kept
