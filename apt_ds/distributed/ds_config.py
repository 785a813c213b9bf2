"""DeepSpeed config and launcher environment: everything `DeepSpeedBackend` settles before
an engine exists. Pure functions of their inputs, no deepspeed import, so they are tested
without a process group.

`load_ds_config` reads the JSON (or copies a dict), `resolve_config` fills the values the
trainer owns and refuses contradictions, `precheck_config` runs those checks before any process
group exists. DeepSpeed's monitor sections (`tensorboard`, `wandb`, `csv_monitor`, `comet`)
pass through untouched (checked against DeepSpeed's own model when the engine is built:
apt_ds.distributed.zero_monitor).

Decisions (measured with deepspeed 0.19.8, torch 2.13 CPU, gloo):
- "auto" is accepted for `bf16.enabled` (bf16 on an accelerator that supports it, never on
  DeepSpeed's CPU accelerator, where bf16 matmul gradients ran ~9x slower than fp32 here),
  `fp16.enabled` (off), both decided by `--base-dtype` when it is given (the engine's precision
  IS the base weights' dtype; a JSON value that contradicts it is refused), the three batch sizes (set from the trainer) and the ZeRO bucket sizes (from the
  model's hidden size), `stage3_max_live_parameters` / `stage3_max_reuse_distance` (by where the
  weights are gathered: `GATHERED_KEPT`), and for `gradient_clipping` (the trainer's max_grad_norm, which a
  number in the JSON may only repeat; always written, 0 included, because DeepSpeed's own
  default is to clip at 1.0). Careful: DeepSpeed itself silently reads
  `"bf16": {"enabled": "auto"}` as False; only `resolve_config` resolves it. Any other "auto"
  is refused.
- ZeRO stages 1, 2 and 3 are supported; stage 0 is refused (its optimizer keeps no fp32
  masters to carry across a shape change).
- An "optimizer" or "scheduler" section is dropped with a warning: the backend always steps a
  client `torch.optim.AdamW` with a `LambdaLR` (see apt_ds.distributed.zero), and with `offload_optimizer`
  `zero_force_ds_cpu_optimizer: false` is set so that DeepSpeed accepts that client optimizer.

The launcher variables (`launcher_env`) live in apt_ds.distributed.launcher_env.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
from pathlib import Path
from typing import Mapping

from apt_ds.distributed.errors import DeepSpeedConfigError
from apt_ds.distributed.launcher_env import launch_world_size

logger = logging.getLogger(__name__)


def load_ds_config(config: dict | str | os.PathLike) -> tuple[dict, str]:
    """Return (a private copy of the config dict, a name for messages)."""
    if isinstance(config, dict):
        return copy.deepcopy(config), "<dict>"
    path = Path(config)
    if not path.is_file():
        raise DeepSpeedConfigError(f"DeepSpeed config {path}: file not found")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DeepSpeedConfigError(
            f"DeepSpeed config {path}: invalid JSON at line {err.lineno} column {err.colno}: {err.msg}") from None
    except (UnicodeDecodeError, OSError) as err:
        raise DeepSpeedConfigError(f"DeepSpeed config {path}: cannot read it as UTF-8 JSON text ({err})") from None
    if not isinstance(data, dict):
        raise DeepSpeedConfigError(
            f"DeepSpeed config {path}: top level must be a JSON object, got {type(data).__name__}")
    return data, str(path)


def _is_auto(value) -> bool:
    return isinstance(value, str) and value.lower() == "auto"


_WARNED: dict[int, tuple[dict, set[str]]] = {}  # id of a user's config dict -> (that dict, sections warned about)


def resolve_config(user: dict, *, grad_accum_steps: int, world_size: int, micro_batch_size: int | None = None,
                   max_grad_norm: float = 0.0, bf16_supported: bool = True, hidden_size: int | None = None,
                   source: str = "<dict>", base_dtype: str = "auto", on_cpu: bool = False) -> dict:
    """Fill "auto" values and batch sizes; refuse contradictions. Pure function of its inputs.

    "auto" bucket sizes follow the Hugging Face integration: reduce_bucket_size = hidden²,
    stage3_prefetch_bucket_size = 0.9·hidden², stage3_param_persistence_threshold = 10·hidden.
    "auto" stage3_max_live_parameters / stage3_max_reuse_distance: `GATHERED_KEPT` (see there)."""
    cfg = copy.deepcopy(user)

    def fail(msg: str):
        raise DeepSpeedConfigError(f"DeepSpeed config {source}: {msg}")

    for section in ("optimizer", "scheduler"):
        if section in cfg and section in _WARNED.get(id(user), (None, ()))[1]:
            cfg.pop(section)
        elif section in cfg:
            # a backend resolves its dict at validation and at each engine build: warned once per dict,
            # which is kept so that its id is not reused by another run's config
            _WARNED.setdefault(id(user), (user, set()))[1].add(section)
            logger.warning("DeepSpeed config %s: ignoring its %r section %s; apt_ds uses torch AdamW + LambdaLR with "
                           "lr / weight decay / schedule from the APT config", source, section,
                           json.dumps(cfg.pop(section)))
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict):
        fail(f"zero_optimization must be an object such as {{\"stage\": 3}}, got {zero!r}")
    _resolve_batch_sizes(cfg, grad_accum_steps, world_size, micro_batch_size, fail)
    _resolve_clipping(cfg, max_grad_norm, fail)
    _resolve_precision(cfg, base_dtype, bf16_supported and not on_cpu, fail)
    _resolve_zero(cfg, hidden_size, fail, on_cpu)
    leftover = _auto_paths(cfg)
    if leftover:
        fail(f"\"auto\" is not supported for {', '.join(leftover)}; give a value")
    return cfg


def precheck_config(config: str | os.PathLike, *, grad_accum_steps: int, micro_batch_size: int | None,
                    max_grad_norm: float, base_dtype: str = "auto", environ: Mapping[str, str] = os.environ) -> None:
    """Everything `resolve_config` can refuse before a process group or a model exists, so a bad
    JSON (a ZeRO stage 7, a contradicting clipping value) costs seconds, not a distributed start.
    The world size comes from the launcher's variables; values that need the model ("auto"
    bucket sizes) are checked again, for real, when the engine is built."""

    user, source = load_ds_config(config)
    user = {k: v for k, v in user.items() if k not in ("optimizer", "scheduler")}  # warned about once, later
    world_size = launch_world_size(environ)
    resolve_config(user, grad_accum_steps=grad_accum_steps, world_size=world_size, micro_batch_size=micro_batch_size,
                   max_grad_norm=max_grad_norm, hidden_size=_ANY_HIDDEN_SIZE, source=source, base_dtype=base_dtype)
    from apt_ds.distributed.zero_monitor import monitor_config_problem

    problem = monitor_config_problem(user)  # a missing tensorboard/wandb package, a malformed section
    if problem:
        raise DeepSpeedConfigError(f"DeepSpeed config {source}: {problem}")


_ANY_HIDDEN_SIZE = 64  # stands in for the model's hidden size in precheck_config


def engine_dtype(cfg: dict) -> str:
    """The precision a resolved config trains in: bf16, fp16 or fp32."""
    if (cfg.get("bf16") or cfg.get("bfloat16") or {}).get("enabled") is True:
        return "bf16"
    return "fp16" if (cfg.get("fp16") or {}).get("enabled") is True else "fp32"


def resolve_precision(user: dict, base_dtype: str = "auto", *, on_cpu: bool, bf16_supported: bool = True,
                      source: str = "<dict>") -> str:
    """The dtype (bf16, fp16, fp32) an engine of this config trains and keeps base weights in,
    known before any model exists (the model is loaded straight into it). Pure."""
    def fail(msg: str):
        raise DeepSpeedConfigError(f"DeepSpeed config {source}: {msg}")

    cfg = copy.deepcopy(user)
    _resolve_precision(cfg, base_dtype, bf16_supported and not on_cpu, fail)
    return engine_dtype(cfg)


def _resolve_precision(cfg: dict, base_dtype: str, bf16_by_default: bool, fail) -> None:
    """Settle the bf16/fp16 sections: "auto" follows --base-dtype when given, else bf16 where
    `bf16_by_default` (an accelerator with bf16, not the CPU); an explicit value must agree
    with --base-dtype. A --base-dtype the JSON does not mention adds its section."""
    if "bfloat16" in cfg and "bf16" not in cfg:  # DeepSpeed's older spelling
        cfg["bf16"] = cfg.pop("bfloat16")
    for key in ("bf16", "fp16"):
        section = cfg.get(key)
        if section is not None and not isinstance(section, dict):
            fail(f"{key} must be an object such as {{\"enabled\": true}}, got {section!r}")
        if isinstance(section, dict) and _is_auto(section.get("enabled")):
            section["enabled"] = (base_dtype == key) if base_dtype != "auto" else (key == "bf16" and bf16_by_default)
    if cfg.get("fp16", {}).get("enabled") is True and cfg.get("bf16", {}).get("enabled") is True:
        fail("fp16 and bf16 are both enabled")
    if base_dtype in ("auto", engine_dtype(cfg)):
        return
    explicit = [key for key in ("bf16", "fp16") if cfg.get(key, {}).get("enabled") is True]
    if explicit:
        fail(f"{explicit[0]}.enabled=true contradicts --base-dtype {base_dtype}; set it to \"auto\" or drop --base-dtype")
    if base_dtype in ("bf16", "fp16"):
        cfg.setdefault(base_dtype, {})["enabled"] = True


def _resolve_clipping(cfg: dict, max_grad_norm: float, fail) -> None:
    """The trainer owns the clipping bound; the JSON may only repeat it. Always written, 0 too:
    DeepSpeed's own default is 1.0, so leaving the key out would clip where the trainer does not."""
    clipping = cfg.get("gradient_clipping")
    if clipping is not None and not _is_auto(clipping):
        if isinstance(clipping, bool) or not isinstance(clipping, (int, float)):
            fail(f"gradient_clipping={clipping!r} is not a number (use \"auto\", omit it, or set --max-grad-norm)")
        if float(clipping) != float(max_grad_norm):
            fail(f"gradient_clipping={clipping} contradicts the trainer's max_grad_norm={max_grad_norm} "
                 f"(use \"auto\", omit it, or set --max-grad-norm)")
    if max_grad_norm > 0 and cfg.get("zero_optimization", {}).get("compute_grad_norm") is False:
        fail(f"zero_optimization.compute_grad_norm=false cannot clip gradients (max_grad_norm={max_grad_norm}); "
             f"remove it or pass --max-grad-norm 0")
    cfg["gradient_clipping"] = float(max_grad_norm)


def _resolve_batch_sizes(cfg: dict, gas: int, world_size: int, micro_batch_size: int | None, fail) -> None:
    """The trainer owns gas and (via the constructor) the micro batch; the JSON may only agree."""
    def given(key):
        value = cfg.get(key)
        if value is None or _is_auto(value):
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fail(f"{key}={value!r} is not a positive integer (use \"auto\" or omit it)")
        return value

    gas_user, micro_user, train_user = (given(k) for k in (
        "gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size"))
    if gas_user is not None and gas_user != gas:
        fail(f"gradient_accumulation_steps={gas_user} contradicts the trainer's --grad-accum-steps {gas} (pass "
             f"--grad-accum-steps {gas_user}, or use \"auto\" or omit it)")
    if micro_batch_size is not None and micro_user is not None and micro_user != micro_batch_size:
        fail(f"train_micro_batch_size_per_gpu={micro_user} contradicts the trainer's --micro-batch-size {micro_batch_size} "
             f"(its default unless given); pass --micro-batch-size {micro_user}, or use \"auto\" or omit it")
    micro = micro_batch_size or micro_user
    if micro is None and train_user is not None:
        if train_user % (gas * world_size):
            fail(f"train_batch_size={train_user} is not divisible by gradient_accumulation_steps*world_size="
                 f"{gas}*{world_size}")
        micro = train_user // (gas * world_size)
    micro = micro or 1  # only feeds DeepSpeed's sample counters: the trainer makes the batches
    if train_user is not None and train_user != micro * gas * world_size:
        fail(f"train_batch_size={train_user} != micro {micro} * gradient_accumulation_steps {gas} "
             f"* world size {world_size}")
    cfg.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas,
               train_batch_size=micro * gas * world_size)


# "auto" stage3_max_live_parameters and stage3_max_reuse_distance, by where the weights are gathered.
# On a GPU: DeepSpeed's defaults (the Hugging Face examples' 1e9): a weight gathered in the forward
# stays for its reuse in the backward, up to 1e9 parameters (2 GB per rank in bf16), which saves
# gathering the last layers twice. On the CPU accelerator: 0, every gathered weight is released
# after use: host memory is the limit there, and 1e9 kept fp32 parameters (4 GB per rank) killed
# a 2-rank 3B run on a 24 GB machine (docs/BENCHMARKS_HISTORY.md, "LLaMA scale").
GATHERED_KEPT = {"gpu": 1_000_000_000, "cpu": 0}


def _resolve_zero(cfg: dict, hidden_size: int | None, fail, on_cpu: bool = False) -> None:
    if "zero_optimization" not in cfg:  # DeepSpeed's default is stage 0, which apt-ds cannot use: say what is missing
        import difflib

        close = difflib.get_close_matches("zero_optimization", [str(key) for key in cfg], n=1)
        fail("has no zero_optimization section (stage 1, 2 or 3)" + (f"; did you mean {close[0]!r}?" if close else ""))
    zero = cfg.setdefault("zero_optimization", {})  # an object: checked in resolve_config
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        fail(f"zero_optimization.stage must be 1, 2 or 3 (got {stage!r}); shape changes carry ZeRO's fp32 masters")
    by_hidden = {"reduce_bucket_size": lambda h: h * h, "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
                 "stage3_param_persistence_threshold": lambda h: 10 * h}
    for key, rule in by_hidden.items():
        if _is_auto(zero.get(key)):
            if not hidden_size:
                fail(f"zero_optimization.{key} is \"auto\" but the model config has no hidden_size")
            zero[key] = rule(hidden_size)
    for key in ("stage3_max_live_parameters", "stage3_max_reuse_distance"):
        if _is_auto(zero.get(key)):
            zero[key] = GATHERED_KEPT["cpu" if on_cpu else "gpu"]
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key)
        if section is not None and not isinstance(section, dict):
            fail(f"zero_optimization.{key} must be an object such as {{\"device\": \"cpu\"}}, got {section!r}")
    if _offloads(zero, "offload_optimizer"):
        if cfg.get("zero_force_ds_cpu_optimizer") is True:
            fail("offload_optimizer with the client torch AdamW needs \"zero_force_ds_cpu_optimizer\": false")
        cfg["zero_force_ds_cpu_optimizer"] = False


def _offloads(zero: dict, key: str) -> bool:
    """Whether zero_optimization's `key` section (offload_param / offload_optimizer) moves
    something off the device; an object or absent (checked in _resolve_zero)."""
    return (zero.get(key) or {}).get("device", "none") not in ("none", None)


def single_rank_zero3_warning(cfg: dict, world_size: int, device_type: str) -> str | None:
    """A note for ZeRO-3 on one GPU without offload: nothing is partitioned, every step pays for
    the per-module gathers anyway (measured on one H200: a 7B step took 4x a one-process step)."""
    zero = cfg.get("zero_optimization") or {}
    offloaded = _offloads(zero, "offload_param") or _offloads(zero, "offload_optimizer")
    if world_size != 1 or zero.get("stage") != 3 or offloaded or device_type == "cpu":
        return None
    return ("warning: ZeRO-3 on a single rank partitions nothing but still gathers every module's weights each "
            "step: on one H200 a 7B step took 4x a one-process step (docs/BENCHMARKS.md, \"On a GPU\"). If the "
            "model fits on the device, run without --deepspeed; ZeRO-3 pays off across ranks or with offload.")


def warn_single_rank_zero3(cfg: dict, world_size: int, device_type: str, main_rank: bool = True) -> None:
    warning = single_rank_zero3_warning(cfg, world_size, device_type)
    if warning and main_rank:
        print(warning, file=sys.stderr)


def _auto_paths(node, prefix="") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _auto_paths(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if _is_auto(node) else []
