"""Recipes: YAML files under configs/ that name every knob of a run (torchtune style).

A recipe is a flat mapping of the same field names the flags use (`target_density: 0.7`,
`micro_batch_size: 4`, `deepspeed: ds_configs/zero3.json`); flags typed on the command line
override it. A key set to `null` (`model: null`) must be given on the command line: recipes for
7B models name no local path. JSON is YAML, so the JSON files older runs used still load.

Resolution: field defaults <- recipe <- command line, then the schedule defaults that scale
with `steps` (APTConfig.for_steps) for whatever is still unset; given `epochs` instead, once the
run has read the data and knows its steps (configs_for_steps)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

from apt_ds.cli.arguments import COMMAND_LINE_ONLY, RunArguments
from apt_ds.config import (
    LORA_SETTINGS,
    SCHEDULE_FIELDS,
    APTConfig,
    ConfigError,
    TrainConfig,
    check_field_types,
    check_schedule_fits,
    default_checkpoint_every,
    default_warmup_steps,
    field_error,
)

_CLASSES = (RunArguments, APTConfig, TrainConfig)
RECIPE_PATHS = ("model", "data", "eval_data", "out", "deepspeed")  # RunArguments fields that name files


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


class _DuplicateKey(yaml.YAMLError):
    pass


class _RecipeLoader(yaml.SafeLoader):
    """safe_load's loader, but a key given twice is refused: YAML would keep the last value silently.
    Only the mapping's own plain keys count: a merge key (`<<: *base`) and the keys it brings in
    are YAML's way to override, and other keys are left to safe_load's own checks."""

    def construct_mapping(self, node, deep=False):
        lines: dict[Any, int] = {}
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = self.construct_object(key_node), key_node.start_mark.line + 1
            if key in lines:
                where = f"line {line}" if lines[key] == line else f"lines {lines[key]} and {line}"
                raise _DuplicateKey(f"{key} is given twice ({where}): keep one")
            lines[key] = line
        return super().construct_mapping(node, deep)


def load_recipe(path: str | Path) -> dict[str, Any]:
    """The recipe's values, type-checked; one-line ConfigError for anything wrong in it."""
    try:
        values = yaml.load(Path(path).read_text(), Loader=_RecipeLoader)
    except _DuplicateKey as err:
        raise ConfigError(f"--config {path}: {err}") from None
    except (OSError, ValueError, yaml.YAMLError) as err:  # ValueError: not UTF-8 text
        reason = str(err).replace("\n", " ")
        raise ConfigError(f"cannot read --config {path}: {reason}") from None
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path} must hold a mapping of field names to values, e.g. \"steps: 100\"; "
                          f"it holds a {type(values).__name__}")
    known = set().union(*map(_field_names, _CLASSES)) - set(COMMAND_LINE_ONLY)
    for key in values:
        if key in COMMAND_LINE_ONLY:
            raise ConfigError(f"--config {path}: {key} is a command-line flag only (--{key.replace('_', '-')})")
        if key not in known:
            close = difflib.get_close_matches(str(key).replace("-", "_"), sorted(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"--config {path}: unknown field {key!r}{hint}")
    for key in RECIPE_PATHS:  # "" is no path: a recipe's `data: ""` would otherwise train on the demo data
        if isinstance(values.get(key), str) and not values[key].strip():
            raise ConfigError(f"--config {path}: {key} is empty: give a path, or remove the key for its default")
    values = {k: _float_from_text(k, v) for k, v in values.items()}
    # `~` in a recipe's paths is the home directory, as a shell makes it of a flag's (not a directory named "~")
    values.update({k: os.path.expanduser(v) for k, v in values.items() if k in RECIPE_PATHS and isinstance(v, str)})
    for cls in _CLASSES:
        check_field_types(cls, {k: v for k, v in values.items() if k in _field_names(cls) and v is not None})
    return values


def _float_from_text(name: str, value: Any) -> Any:
    """YAML 1.1 reads `1e-4` (no dot) as text; a float field takes it as the number it means."""
    float_fields = {name for cls in (APTConfig, TrainConfig) for name, kind in typing.get_type_hints(cls).items()
                    if kind is float}
    if name in float_fields and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value  # the type check names the field and the text
    return value


def resolve(given: dict[str, Any]) -> tuple[RunArguments, APTConfig | None, TrainConfig]:
    """Defaults <- recipe (--config) <- the flags in `given`; scaled schedule defaults last.
    A bad value is named as the user gave it: `--steps`, or `steps` in the --config file.
    With --epochs the APT config is None until the data gives the steps (configs_for_steps)."""
    config = given.get("config")
    try:
        recipe = load_recipe(config) if config else {}
    except ConfigError as err:  # a value of the wrong type: its field is one of the recipe's
        raise _as_given(err, typed=(), from_recipe=(err.field,), config=config) from None
    try:
        return _resolve(given, recipe)
    except ConfigError as err:
        raise _as_given(err, typed=given, from_recipe=recipe, config=config) from None


def _as_given(err: ConfigError, typed: Collection[str], from_recipe: Collection[str], config: str | None) -> ConfigError:
    """`err` with its field named where its value came from: typed (`--steps`), the recipe
    (`steps in --config F`), or its default, which another value contradicts (`--rank-cap ... (its
    default; give --rank-cap)`). Errors of no field, or of something else, stay as they are."""
    names = (err.field or "").split("/")  # a check of several fields joins their names
    if err.field is None or not set(names) <= set().union(*map(_field_names, _CLASSES)):
        return err
    flags = "/".join(f"--{name.replace('_', '-')}" for name in names)
    in_recipe = f"in --config {config}"
    if all(name in typed for name in names):
        where, note = flags, ""
    elif all(name in from_recipe for name in names):
        where, note = f"{err.field} {in_recipe}", ""
    elif any(name in typed or name in from_recipe for name in names):
        where, note = f"{flags} (given on the command line and {in_recipe})", ""
    else:
        where, note = flags, f" ({'its default' if len(names) == 1 else 'their defaults'}; give {flags})"
    return ConfigError(f"{where} {err.requirement}{note}", field=err.field, requirement=err.requirement)


def configs_for_steps(given: dict[str, Any], steps: int) -> tuple[APTConfig, TrainConfig]:
    """The configs of a run given `--epochs` once its data says how many steps those are: as if
    `--steps` had been typed instead, so the defaults that scale with the run's length follow it."""
    _, apt, train = resolve({**{k: v for k, v in given.items() if k != "epochs"}, "steps": steps})
    return apt, train


def _one_length(merged: dict[str, Any], given: dict[str, Any], recipe: dict[str, Any], config: str | None) -> dict:
    """--epochs sets the steps from the data, --steps directly: both typed (or both in the recipe) is
    refused; one typed replaces the recipe's other, as a flag overrides a recipe."""
    if "epochs" in given and "steps" in given:
        raise ConfigError(f"--epochs {given['epochs']:g} sets the steps from the data and --steps {given['steps']} sets "
                          "them directly: give one of them")
    if recipe.get("epochs") is not None and recipe.get("steps") is not None:
        raise ConfigError(f"--config {config} sets both epochs and steps: keep one (epochs sets the steps from the data)")
    overridden = "steps" if "epochs" in given else "epochs" if "steps" in given else None
    merged = {k: v for k, v in merged.items() if k != overridden}
    epochs = merged.get("epochs")
    if epochs is not None and not (isinstance(epochs, (int, float)) and math.isfinite(epochs) and epochs > 0):
        raise field_error("RunArguments", "epochs", f"must be a number > 0, got {epochs!r}")
    return merged


def _resolve(given: dict[str, Any], recipe: dict[str, Any]) -> tuple[RunArguments, APTConfig | None, TrainConfig]:
    missing = [k for k, v in recipe.items() if v is None and given.get(k) is None]  # in the recipe's order
    if missing:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in missing)
        raise ConfigError(f"--config {given['config']} leaves {', '.join(missing)} to the command line: give {flags}")
    merged = _one_length({**{k: v for k, v in recipe.items() if v is not None}, **given}, given, recipe, given.get("config"))
    run = RunArguments(**{k: v for k, v in merged.items() if k in _field_names(RunArguments)})
    train_values = {k: v for k, v in merged.items() if k in _field_names(TrainConfig)}
    check_field_types(TrainConfig, train_values)
    if run.epochs is not None:  # the steps come from the data: the run makes both configs once it is read
        return run, None, TrainConfig(**train_values)  # (configs_for_steps); its length until then is a stand-in
    steps = int(train_values.get("steps", TrainConfig.steps))
    train_values.setdefault("checkpoint_every", default_checkpoint_every(steps))
    warmup_given = "warmup_steps" in train_values
    train_values.setdefault("warmup_steps", default_warmup_steps(steps))
    train = TrainConfig(**train_values)
    if warmup_given and train.warmup_steps >= train.steps:
        raise field_error("TrainConfig", "warmup_steps", f"({train.warmup_steps}) must be < steps ({train.steps}): the "
                          "learning rate would never reach --lr; lower the warm-up or raise --steps")
    apt_values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in merged.items() if k in _field_names(APTConfig)}
    check_field_types(APTConfig, apt_values)
    if run.method == "lora":  # its own settings first, so that checks of what LoRA ignores do not refuse it
        apt_values = {**{k: v for k, v in apt_values.items() if k not in SCHEDULE_FIELDS}, **LORA_SETTINGS}
    apt = APTConfig.for_steps(train.steps, **apt_values)
    check_schedule_fits(apt, train)
    if run.method == "lora":
        apt = apt.as_lora()
    return run, apt, train
