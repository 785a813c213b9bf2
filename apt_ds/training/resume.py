"""Resuming a run: which checkpoint to read, what must not change, and the metrics to redo.

A resumed run must keep the global batch, the settings in RESUME_MUST_MATCH, the data and the
model; the split of the global batch (micro batch, gradient accumulation, ranks) may change,
because data order and loss normalisation depend only on the global batch.
"""

from __future__ import annotations

import array
import hashlib
import json
from pathlib import Path

from apt_ds.config import STEP_SCALED_FIELDS, APTConfig, ConfigError, TrainConfig, default_warmup_steps
from apt_ds.io.atomic import write_text_atomic
from apt_ds.io.checkpoint import CheckpointError, check_known_apt_fields, check_same_apt_config
from apt_ds.io.fingerprint import same_model
from apt_ds.io.quantized import quant_layout, saved_quant_layout

RESUME_MUST_MATCH = ("steps", "lr", "warmup_steps", "weight_decay", "max_grad_norm", "max_seq_len", "template", "seed",
                     "base_quant", "double_quant", "train_on_prompt")  # the base's codes: a resume quantizes them again


def quant_layout_problem(meta: dict, apt_config: dict | None) -> str | None:
    """Why a quantized run cannot resume with `apt_config` (None: its own) in this version, or None:
    the base is quantized again on resume, and a run that prunes must hold its codes in the layout
    it trained with (runs before 2026-12-07 that pruned re-quantized cut blocks: not reproducible)."""
    saved = saved_quant_layout(meta)
    if saved is None:
        return None
    prunes = (apt_config if apt_config is not None else meta["apt_config"]).get("prune", True)
    if saved == quant_layout(prunes):
        return None
    return (f"--resume: the run stored its quantized base {saved}, which this version does not train on "
            f"{'with' if prunes else 'without'} pruning; export it as it is (the export reads the layout) or train again")


DTYPE_FLAGS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def quantized_dtype_problem(saved_train: dict, run_info: dict, base_dtype: str | None) -> str | None:
    """A quantized base is quantized again on resume from weights rounded to the base dtype: another
    dtype would draw other codes under the trained adapters (fp32 and bf16 differ by a whole nf4
    level on ~3% of the weights). None when nothing changes or nothing is known."""
    saved = run_info.get("base_dtype")
    if saved_train.get("base_quant", "none") == "none" or base_dtype is None or saved in (None, base_dtype):
        return None
    flag = DTYPE_FLAGS.get(saved, saved)
    return (f"--resume: the run quantized its base from {saved} weights and computes in {saved}; this launch would use "
            f"{base_dtype}, which draws other codes under the trained adapters (pass --base-dtype {flag})")


def global_batch_size(train: dict | TrainConfig, world_size: int) -> int:
    values = train if isinstance(train, dict) else train.to_dict()
    return values["micro_batch_size"] * values["grad_accum_steps"] * world_size


def clipping_before_max_grad_norm(run_info: dict) -> float:
    """What a run saved before max_grad_norm existed clipped at: nothing on one process; under
    DeepSpeed its JSON's gradient_clipping, else DeepSpeed's default 1.0."""
    path = run_info.get("deepspeed")
    if not path:
        return 0.0
    try:
        value = json.loads(Path(path).read_text()).get("gradient_clipping", 1.0)
    except (OSError, ValueError, AttributeError):  # the JSON is gone or changed: assume the default
        return 1.0
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 1.0


def check_resumable_settings(meta: dict, train: TrainConfig, data_path: str, world_size: int,
                             apt_config: dict | None = None, directory: Path | None = None,
                             deepspeed: str | None | bool = False, method: str | None = None,
                             data_split: str | None = None, base_dtype: str | None = None) -> None:
    """What the command line alone decides (global batch, RESUME_MUST_MATCH, data and, given
    `apt_config`, the APT config; given `deepspeed`, the --deepspeed JSON or None, the backend;
    given `method`, --method; given `data_split`, --data-split; given `base_dtype`, the dtype a
    quantized base is quantized from, "float32" etc.): checked before the data is read,
    so a mistyped resume fails in a second, not after tokenizing, and names every setting to fix
    at once, not one per try (but for a value typed equal to the default a changed --steps gives
    it, which the next try names)."""
    if apt_config is not None:  # a checkpoint no flag can resume: nothing else is worth naming
        check_known_apt_fields(meta, apt_config, directory)
    problems = []
    trained_with = meta["run_info"].get("deepspeed")
    if deepspeed is not False and bool(trained_with) != bool(deepspeed):
        # the engine state differs: one process keeps Adam state per tensor, DeepSpeed per ZeRO partition
        problems.append("--resume: the run was trained " + (
            f"under DeepSpeed ({trained_with}); resume it with --deepspeed (any ZeRO stage, any rank count)"
            if trained_with else "in one process, without DeepSpeed; resume it without --deepspeed"))
    saved_train = meta["train_config"]
    saved_world = meta["run_info"].get("world_size", 1)
    before, now = global_batch_size(saved_train, saved_world), global_batch_size(train, world_size)
    if before != now:
        problems.append(
            f"--resume must keep the global batch ({before} = micro {saved_train['micro_batch_size']} x accumulation "
            f"{saved_train['grad_accum_steps']} x {saved_world} ranks), got {now}; set --micro-batch-size/--grad-accum-steps "
            f"(or --global-batch-size {before}) for {world_size} ranks")
    if "max_grad_norm" not in saved_train:
        saved_train = {**saved_train, "max_grad_norm": clipping_before_max_grad_norm(meta["run_info"])}
    # runs saved before these fields used the Alpaca prompt and a full-precision base
    saved_train = {"template": "alpaca", "base_quant": "none", "double_quant": True, "train_on_prompt": False, **saved_train}
    changed = [k for k in RESUME_MUST_MATCH if saved_train.get(k) != getattr(train, k)]
    # A changed --steps also moves what was left to its defaults (the warm-up, APTConfig.for_steps's
    # schedule): naming those too would send the user after settings that --steps alone puts back.
    follows_steps = _defaults_of_both(saved_train, meta["apt_config"], train, apt_config) \
        if "steps" in changed and isinstance(saved_train.get("steps"), int) else ()
    changed = [k for k in changed if k not in follows_steps]
    if changed:
        details = ", ".join(f"{k}: {saved_train.get(k)} -> {getattr(train, k)}" for k in changed)
        flags = " ".join(f"--{k.replace('_', '-')} {saved_train.get(k)}" for k in changed)
        problems.append(f"--resume must use the run's training settings; changed: {details} (pass {flags})")
    info = meta["run_info"]
    layout_problem = quant_layout_problem(meta, apt_config)
    if layout_problem:
        problems.append(layout_problem)
    dtype_problem = quantized_dtype_problem(saved_train, info, base_dtype)
    if dtype_problem:
        problems.append(dtype_problem)
    if info.get("data") != data_path and not _same_path(info.get("data_resolved") or info.get("data"), data_path):
        problems.append(f"--resume: the run was trained on --data {info.get('data')}, not {data_path}")
    if data_split is not None and info.get("data_split") not in (None, data_split):  # runs before the flag recorded none
        problems.append(f"--resume: the run was trained on --data-split {info['data_split']}, not {data_split}")
    if apt_config is not None:
        try:
            check_same_apt_config(meta, apt_config, directory, leave_out=follows_steps, method=method)
        except CheckpointError as err:
            problems.append(str(err))
    if problems:
        raise CheckpointError("; and ".join(problems))


def _defaults_of_both(saved_train: dict, saved_apt: dict, train: TrainConfig, apt_config: dict | None) -> tuple[str, ...]:
    """The settings derived from the run's length (the warm-up and, given `apt_config`, the APT
    fields in STEP_SCALED_FIELDS) that hold their default for that length on both sides."""
    saved = {**saved_apt, "warmup_steps": saved_train.get("warmup_steps")}
    current = {**(apt_config or {}), "warmup_steps": train.warmup_steps}
    given = None if apt_config is None else \
        {k: tuple(v) if isinstance(v, list) else v for k, v in apt_config.items() if k not in STEP_SCALED_FIELDS}
    lengths = (saved_train["steps"], train.steps)
    try:
        then, now = (_length_defaults(steps, given) for steps in lengths)
    except (ConfigError, TypeError):  # e.g. a length too short for a schedule: compare its fields
        then, now = (_length_defaults(steps, None) for steps in lengths)
    return tuple(k for k in then if k in now and saved.get(k) == then[k] and current.get(k) == now[k])


def _length_defaults(steps: int, given_apt: dict | None) -> dict:
    """What a run of `steps` steps takes by default: the warm-up and, given the other APT settings,
    the schedule APTConfig.for_steps derives."""
    defaults = {"warmup_steps": default_warmup_steps(steps)}
    if given_apt is not None:
        derived = APTConfig.for_steps(steps, **given_apt).to_dict()
        defaults.update({k: derived[k] for k in STEP_SCALED_FIELDS})
    return defaults


def _same_path(recorded: str | None, given: str) -> bool:
    """The data file as recorded (resolved, or as typed by runs from before that) and as given
    now: ./d.jsonl is d.jsonl, and so is the path to it from another directory."""
    if recorded is None:
        return False
    try:
        return Path(recorded).resolve() == Path(given).resolve() or Path(recorded).samefile(given)
    except OSError:
        return False


def check_resumable_model(meta: dict, args, fingerprint: dict) -> None:
    """The model's fingerprint: known once the model (or, for a safetensors directory, its files) is read."""
    info = meta["run_info"]
    if not same_model(info.get("model_fingerprint") or {"missing": True}, fingerprint):
        raise CheckpointError(f"--resume: --model {args.model} is not the model this run was trained from ({info.get('model')})")


def data_fingerprint(meta: dict | None, examples: list[dict], data_path: str) -> str:
    """A digest of the tokenized examples (token ids and labels, in order), recorded in run.json; for
    a resume (`meta`) it must equal the run's: the same --data path can hold other rows by now, and
    --no-pack or a tokenizer change makes other examples from the same rows. A resume continues at a
    position in the example stream, which in another stream means other rows seen twice or never."""
    digest = hashlib.sha256()
    for example in examples:
        for key in ("input_ids", "labels", "token_type_ids", "label"):  # a classifier's: its types and class
            if key in example:
                value = example[key]
                digest.update(array.array("q", [value] if isinstance(value, int) else value).tobytes())
                digest.update(b"|")
    fingerprint = f"sha256:{digest.hexdigest()} ({len(examples)} examples)"
    # runs from before it have none; a finished run trains no more, whatever the data now
    recorded = (meta or {}).get("run_info", {}).get("data_fingerprint") if not (meta or {}).get("finished") else None
    if recorded is not None and recorded != fingerprint:
        then = str(recorded).partition(" (")[2].rstrip(")") or "other examples"
        raise CheckpointError(f"--resume: --data {data_path} no longer gives the examples the run was trained on "
                              f"({then} then, {len(examples)} now, or other rows: its contents, --no-pack or the "
                              f"tokenizer changed); restore them, or start a new run with --overwrite")
    return fingerprint


def checkpoint_to_resume(out: Path) -> Path:
    """The checkpoint, or the previous one if a crash interrupted the rename of a new one."""
    current = out / "checkpoint"
    return current if (current / "apt_state.json").is_file() else out / "checkpoint.old"


def truncate_metrics(path: Path, step: int) -> None:
    """Drop lines logged after the checkpoint a resumed run restarts from (they will be redone)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line torn by the crash being resumed from
            continue
        if record.get("step", 0) <= step and not record.get("final"):
            kept.append(line)
    write_text_atomic(path, "".join(line + "\n" for line in kept), temporary=path.with_suffix(".tmp").name)
