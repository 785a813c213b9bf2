"""Validated, JSON round-tripping dataclass configs: the machinery under apt_ds.config.

`help_field` attaches help text and choices that the CLI turns into flags; `_JsonConfig` gives
a config its JSON round trip and one-line type errors for values read from files.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field and the range.
    A check of one field also keeps the field's name and what it requires, so that the command
    line can name the value as the user gave it (`--steps`, or `steps` in a --config file)."""

    def __init__(self, message: str, field: str | None = None, requirement: str | None = None):
        super().__init__(message)
        self.field, self.requirement = field, requirement


def field_error(cls: str, name: str, requirement: str) -> ConfigError:
    return ConfigError(f"{cls}.{name} {requirement}", field=name, requirement=requirement)


def _require(condition: bool, cls: str, name: str, allowed: str, value: Any) -> None:
    if not condition:
        raise field_error(cls, name, f"must be {allowed}, got {value!r}")


def help_field(text: str, choices: tuple | None = None, **kwargs) -> Any:
    """A dataclass field carrying its help text (PEFT style) and allowed values; the CLI reads both."""
    metadata = {"help": text} if choices is None else {"help": text, "choices": choices}  # argparse kwargs as-is
    return field(metadata=metadata, **kwargs)


def _accepted_types(annotation) -> tuple[type, ...] | None:
    """The Python types a field of this annotation accepts from a file (None: not checked)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _accepted_types(members[0]) if len(members) == 1 else None
    if annotation is float:
        return (int, float)
    if annotation in (int, bool, str):
        return (annotation,)
    if annotation in (list, tuple) or typing.get_origin(annotation) in (list, tuple):
        return (list, tuple)
    return None


def check_field_types(cls, values: dict) -> None:
    """One-line errors for wrongly typed values (e.g. "lr": "x" in a --config file), before
    range checks or schedule arithmetic use them; bools are refused where numbers are expected.
    None is accepted where the field is Optional."""
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        if name not in hints:
            continue
        kinds = _accepted_types(hints[name])
        if value is None and type(None) in typing.get_args(hints[name]):
            continue
        if kinds and (not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool))):
            shown = "list" if tuple in kinds else kinds[-1].__name__  # Optional[str] -> str
            raise field_error(cls.__name__, name, f"must be of type {shown}, got {value!r}")


class _JsonConfig:
    """JSON round-trip shared by the config dataclasses."""

    def _check_types(self) -> None:
        check_field_types(type(self), {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    @classmethod
    def from_dict(cls, data: dict):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{cls.__name__}: unknown field(s) {unknown}; known fields: {sorted(known)}")
        values = dict(data)
        for f in dataclasses.fields(cls):
            if f.name in values and isinstance(values[f.name], list):
                values[f.name] = tuple(values[f.name])
        return cls(**values)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path):
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read {cls.__name__} from {path}: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object for {cls.__name__}")
        return cls.from_dict(data)

    @classmethod
    def help_texts(cls) -> dict[str, str]:
        return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}
