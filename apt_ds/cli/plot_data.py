"""What `apt-ds-plot` draws, read from a run directory: the logged curves and the kept units.

Kept apart from the drawing so that the numbers (a heat map's kept counts, which steps were
pruning events) are tested without rendering anything.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

METRICS_FILE = "metrics.jsonl"
CURVE_KEYS = ("density", "total_rank", "loss", "task_loss", "eval_loss")


class PlotInputError(ValueError):
    """A run directory that cannot be plotted (the message says which and why)."""


@dataclass
class ShapeMatrix:
    """The final shape of a run against its original one: rows are layers, columns the ORIGINAL
    unit indices; 1.0 kept, 0.0 removed, NaN where a layer has no such unit (layers of different
    original widths)."""

    groups: np.ndarray  # layers x max KV groups
    neurons: np.ndarray  # layers x max FFN neurons
    hidden_kept: int
    hidden_total: int
    group_size: int  # query heads per KV group (first layer's), for the axis label

    def kept_counts(self) -> tuple[list[int], list[int]]:
        """(kept KV groups per layer, kept neurons per layer)."""
        return ([int(np.nansum(row)) for row in self.groups], [int(np.nansum(row)) for row in self.neurons])

    def total_counts(self) -> tuple[list[int], list[int]]:
        return ([int(np.sum(~np.isnan(row))) for row in self.groups], [int(np.sum(~np.isnan(row))) for row in self.neurons])


@dataclass
class RunData:
    path: Path
    name: str  # the legend label: the run directory's name
    curves: dict[str, tuple[list[int], list[float]]]  # metric -> (steps, values)
    events: list[int]  # steps of pruning events
    target_density: float | None = None  # None: not a pruning run, or run.json unreadable
    shape: ShapeMatrix | None = None
    notes: list[str] = field(default_factory=list)  # one line each: what was skipped and why


def shape_matrix(original_shape: dict, kept: dict) -> ShapeMatrix:
    """The heat map of `kept` ({"groups": [[...] per layer], "neurons": [...], "hidden": [...]},
    ORIGINAL indices, as in checkpoint/apt_state.json) over `original_shape` (ModelShape.to_dict)."""
    from apt_ds.algorithm.units import ModelShape
    from apt_ds.export.kept import read_kept_record

    try:
        original = ModelShape.from_dict(original_shape)
    except (KeyError, TypeError, ValueError) as err:
        raise PlotInputError(f"original_shape is malformed ({err})") from None
    groups, neurons, hidden = read_kept_record(kept)  # checks form and duplicates
    layers = original.layers
    if len(groups) != len(layers) or len(neurons) != len(layers):
        raise PlotInputError(f"kept-units record has {len(groups)}/{len(neurons)} layers of groups/neurons, "
                             f"the model {len(layers)}")
    group_rows = _rows([ix.tolist() for ix in groups], [layer.num_kv_groups for layer in layers], "KV group")
    neuron_rows = _rows([ix.tolist() for ix in neurons], [layer.ffn for layer in layers], "FFN neuron")
    if hidden.numel() and (int(hidden.min()) < 0 or int(hidden.max()) >= original.hidden):
        raise PlotInputError(f"kept-units record lists a hidden channel outside 0..{original.hidden - 1}")
    group_size = layers[0].group_size if layers else 1
    return ShapeMatrix(group_rows, neuron_rows, int(hidden.numel()), original.hidden, group_size)


def _rows(kept_per_layer: list[list[int]], sizes: list[int], unit: str) -> np.ndarray:
    matrix = np.full((len(sizes), max(sizes, default=0)), np.nan)
    for layer, (kept, size) in enumerate(zip(kept_per_layer, sizes)):
        if any(i < 0 or i >= size for i in kept):
            raise PlotInputError(f"kept-units record lists a {unit} outside 0..{size - 1} in layer {layer}")
        matrix[layer, :size] = 0.0
        matrix[layer, kept] = 1.0
    return matrix


def read_metrics_lines(path: Path) -> tuple[list[dict], str | None]:
    """The records of a metrics.jsonl, and a note when a torn last line (a run killed mid-write,
    or being written right now) was skipped. Anything else unreadable is an error."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise PlotInputError(f"cannot read {path}: {err}") from None
    lines = text.splitlines()
    records, note = [], None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines) and not text.endswith("\n"):
                note = f"{path}: skipped the unfinished last line {number}"
                continue
            raise PlotInputError(f"{path} line {number} is not JSON ({err.msg}); is it a metrics file of apt-ds?") from None
        if not isinstance(record, dict) or type(record.get("step")) is not int:
            raise PlotInputError(f"{path} line {number} is not a metrics record (a JSON object with an integer step)")
        records.append(record)
    if not records:
        raise PlotInputError(f"{path} has no records yet (a run logs one line per step)")
    return records, note


def curves_of(records: list[dict]) -> tuple[dict[str, tuple[list[int], list[float]]], list[int]]:
    """Each metric's (steps, values) and the pruning-event steps. A step logged twice (a resumed
    run's final line repeats the last step) keeps its last value."""
    by_step: dict[str, dict[int, float]] = {key: {} for key in CURVE_KEYS}
    events = set()
    for record in records:
        for key in CURVE_KEYS:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                by_step[key][record["step"]] = float(value)
        if record.get("event") is True:
            events.add(record["step"])
    curves = {key: (sorted(points), [points[s] for s in sorted(points)]) for key, points in by_step.items() if points}
    return curves, sorted(events)


def read_run(path: Path, name: str) -> RunData:
    """Everything `apt-ds-plot` draws for one run. A run without a (complete) checkpoint still
    has its curves: its shape is skipped with a note."""
    from apt_ds.io.checkpoint import CheckpointError, read_meta
    from apt_ds.io.run_dir import RUN_FILE

    if not path.is_dir():
        raise PlotInputError(f"{path} is not a directory (give run directories written by launch/train.py --out)")
    if not (path / METRICS_FILE).is_file():
        raise PlotInputError(f"{path} has no {METRICS_FILE} (is it a run directory written by launch/train.py --out?)")
    records, note = read_metrics_lines(path / METRICS_FILE)
    curves, events = curves_of(records)
    run = RunData(path, name, curves, events, target_density=_target_density(path / RUN_FILE))
    if note:
        run.notes.append(note)
    # checkpoint.old: the previous checkpoint, left by a crash between the two renames of a save
    checkpoint = next((path / d for d in ("checkpoint", "checkpoint.old") if (path / d / "apt_state.json").is_file()), None)
    if checkpoint is None:
        run.notes.append(f"{path}: no checkpoint yet, so no shape heat map for this run")
        return run
    try:
        meta = read_meta(checkpoint)  # its errors name the file
    except CheckpointError as err:
        raise PlotInputError(str(err)) from None
    except (OSError, UnicodeDecodeError) as err:
        raise PlotInputError(f"cannot read {checkpoint / 'apt_state.json'}: {err}") from None
    state_file = checkpoint / "apt_state.json"
    try:
        run.shape = shape_matrix(meta["original_shape"], meta["kept"])
    except KeyError as err:
        raise PlotInputError(f"{state_file} has no {err} entry") from None
    except (CheckpointError, PlotInputError) as err:
        raise PlotInputError(f"{state_file}: {err}") from None
    return run


def _target_density(run_file: Path) -> float | None:
    """The run's target density when it prunes (a dashed line on the density plot). Optional:
    run.json is only decoration here, so an unreadable one draws no line rather than failing."""
    try:
        record = json.loads(run_file.read_text())
        apt = record["apt_config"]
        pruning = record.get("method", "apt") == "apt" and apt.get("prune", True)
        return float(apt["target_density"]) if pruning else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
