"""`launch/train.py`: flags and recipe -> configs -> checks -> the run. No algorithm here."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import sys
import threading
from pathlib import Path

from apt_ds.cli.arguments import RunArguments, build_train_parser, explicit_values
from apt_ds.cli.errors import launcher_rank, report, user_errors
from apt_ds.cli.recipe import configs_for_steps, resolve
from apt_ds.config import LORA_SETTINGS, APTConfig, ConfigError, TrainConfig
from apt_ds.io import run_lock
from apt_ds.io.run_dir import check_out_dir, has_checkpoint, is_run_dir, recover_interrupted_overwrite


def check_batch_flags(run: RunArguments, given: dict) -> None:
    """A recipe's micro_batch_size gives way to --global-batch-size; a --micro-batch-size given on
    the command line beside a global batch (from either) would be ignored without a word."""
    if run.global_batch_size is not None and "micro_batch_size" in given:
        raise ConfigError(f"a global batch size ({run.global_batch_size}) sets the micro-batch size from the rank and "
                          f"accumulation counts, and --micro-batch-size {given['micro_batch_size']} sets it directly: "
                          "give one of them")


LORA_USES = ("adapter_targets", "adapter_rank", "adapter_alpha")  # the APTConfig fields a LoRA run uses


def note_what_lora_ignores(run: RunArguments, given: dict) -> None:
    """--method lora sets its own pruning, growth and distillation settings whatever else is given
    (a recipe's stay, for the baseline of the same recipe); ones typed beside it are said to be unused."""
    apt_only = [f.name for f in dataclasses.fields(APTConfig) if f.name not in LORA_USES]
    typed = [name for name in apt_only if name in given and given[name] != LORA_SETTINGS.get(name)]
    if run.method == "lora" and typed and launcher_rank() == "0":
        from apt_ds.io.checkpoint import as_flag

        flags = ", ".join(as_flag(name, given[name]) for name in typed)
        print(f"note: --method lora does not prune, grow ranks or distill: {flags} not used", file=sys.stderr)


def flag_of(field: str, given: dict) -> str:
    """How to name a setting in an error: the flag typed, or the recipe's field."""
    if field in given or not given.get("config"):
        return f"--{field.replace('_', '-')}"
    return f"--config {given['config']}'s {field}"


def missing_path(field: str, value: str, given: dict) -> str:
    """A recipe's relative path is read from the current directory, as a flag's is (not from the
    recipe's own directory): the message says so, since the file may well sit beside the recipe."""
    from_recipe = field not in given and given.get("config")
    where = f"; a recipe's relative paths are read from the current directory, {Path.cwd()}" \
        if from_recipe and not Path(value).is_absolute() else ""
    return f"{flag_of(field, given)} {value} does not exist{where}"


def check_inputs_early(run: RunArguments, train: TrainConfig, given: dict | None = None) -> None:
    """The checks that need neither a process group nor a model, run before either exists
    (a launch costs minutes on a fresh machine): --out, the model path, the DeepSpeed JSON."""
    if not str(run.out).strip():  # Path("") is ".": the current directory would be taken for the run
        raise ConfigError("--out is empty: give the run directory")
    if run.resume and run.overwrite:
        raise ConfigError("--resume continues the run in --out and --overwrite replaces it: give one of them")
    for flag, value in (("--global-batch-size", run.global_batch_size), ("--eval-examples", run.eval_examples)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    given = {} if given is None else given
    from apt_ds.io.hub import find_dataset

    for field in ("data", "eval_data"):
        value = getattr(run, field)  # a Hub name is in the local cache, or find_dataset says where it looked
        if value and not Path(value).exists() and find_dataset(value, flag_of(field, given)) is None:
            raise ConfigError(missing_path(field, value, given))
    if launcher_rank(bool(run.deepspeed)) == "0":  # one rank holds the run (apt_ds.io.run_lock), repairs a killed --overwrite
        if Path(run.out).absolute().parent.is_dir():  # else nothing can train there yet: prepare_out_dir locks it
            run_lock.acquire(Path(run.out))
        note = recover_interrupted_overwrite(Path(run.out))
        if note:
            print(note, file=sys.stderr)
    check_out_dir(Path(run.out), run.resume, run.overwrite)
    from apt_ds.io.context_length import check_max_seq_len
    from apt_ds.io.modeling import TINY_MODELS, check_model_path, tiny_config

    # a GGUF file's ({} here) is checked once it is read (apt_ds.training.run)
    config = tiny_config(run.model) if run.model in TINY_MODELS else \
        check_model_path(run.model, flag=flag_of("model", given))
    if run.model not in TINY_MODELS and config and not config.get("apt_layer_shapes"):  # before any weight is read
        from apt_ds.algorithm.units import check_supported_config_file

        check_supported_config_file(config)
    note = check_max_seq_len(config, train.max_seq_len, run.model)
    if note and launcher_rank(bool(run.deepspeed)) == "0":
        print(note, file=sys.stderr)
    if run.deepspeed:
        from apt_ds.distributed.ds_config import precheck_config

        precheck_config(run.deepspeed, grad_accum_steps=train.grad_accum_steps, max_grad_norm=train.max_grad_norm,
                        micro_batch_size=None if run.global_batch_size else train.micro_batch_size,
                        base_dtype=train.base_dtype)


def interrupted_note(how: str, out: Path) -> str:
    """What a stopped start leaves to do: resume, start again, or nothing was written."""
    if has_checkpoint(out):
        return f"{how}; --resume continues from the last checkpoint in {out}"
    if is_run_dir(out):
        return f"{how} before the first checkpoint, so there is nothing to resume: the same command with --overwrite starts again"
    return f"{how} before the run wrote anything to {out}"


class Terminated(KeyboardInterrupt):
    """SIGTERM (the deepspeed launcher's Ctrl-C to its ranks, Slurm, docker stop), handled as
    Ctrl-C is: an --overwrite start puts the previous run back, and the run says how to resume."""


@contextlib.contextmanager
def terminate_as_interrupt():
    def stop(signum, frame):
        raise Terminated()

    # Rank 0 alone: it is the one that puts a previous run back; another rank stuck in a collective
    # whose peer died would not get to run a Python handler, and must die at SIGTERM as before.
    if threading.current_thread() is not threading.main_thread() or launcher_rank() != "0":
        yield
        return
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


PATH_FLAGS = ("model", "data", "eval_data", "config", "deepspeed")  # an empty one is a mistake, never "the default"


def check_no_empty_paths(given: dict) -> None:
    """`--data ""` (an unset $DATA in a script) would otherwise train on the demo data without a word."""
    for field in PATH_FLAGS:
        if isinstance(given.get(field), str) and not given[field].strip():
            flag = f"--{field.replace('_', '-')}"
            raise ConfigError(f"{flag} is empty: give the {field.replace('_', ' ')} path, or leave {flag} out for its default")


def main(argv: list[str] | None = None) -> int:
    given = explicit_values(build_train_parser, argv)
    out = given.get("out", RunArguments.out)
    try:
        check_no_empty_paths(given)
        run, apt, train = resolve(given)
        from apt_ds.io.hub import resolve_model
        from apt_ds.io.modeling import model_file

        local_model = resolve_model(run.model, flag_of("model", given))  # a Hub name: its snapshot in the local cache
        model_name = run.model if local_model != run.model else None  # run.json records both
        run = dataclasses.replace(run, model=model_file(local_model))  # a GGUF export's directory: its one file
        check_batch_flags(run, given)
        note_what_lora_ignores(run, given)
        out = run.out
        check_inputs_early(run, train, given)
        from apt_ds.training.heap import import_training_libraries, startup_objects_frozen
        from apt_ds.training.run import run_training

        import_training_libraries(with_deepspeed=bool(run.deepspeed))
        # After the imports, before the model and the engine exist: those must stay visible to
        # the collector, or pruned weights held in an old engine's cycles would outlive events.
        with startup_objects_frozen(), terminate_as_interrupt():
            run_training(run, apt, train, functools.partial(configs_for_steps, given),  # the last: for --epochs
                         model_name=model_name)
    except KeyboardInterrupt as interrupt:  # first: user_errors() imports torch, which it may have left half-imported
        how = "terminated" if isinstance(interrupt, Terminated) else "interrupted"
        if launcher_rank() == "0":  # rank 0 says it (and put the previous run back), once
            print(f"{how} before the new run's first checkpoint; the previous run is back in {out}"
                  if getattr(interrupt, "previous_run_restored", False) else interrupted_note(how, Path(out)), file=sys.stderr)
        return 143 if how == "terminated" else 130
    except user_errors() as err:
        return report(err)
    except OSError as err:  # e.g. the disk filled up while the tokenizer or a metrics line was written
        from apt_ds.io.checkpoint import is_disk_full

        if not is_disk_full(err):
            raise
        return report(f"disk full writing {getattr(err, 'filename', None) or out}: {err.strerror or err}; free space "
                      f"and run again")
    finally:
        run_lock.release(Path(out))
    return 0
