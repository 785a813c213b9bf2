"""The trainer's metrics through DeepSpeed's monitor (TensorBoard, W&B, CSV, Comet).

A DeepSpeed JSON that enables `tensorboard`, `wandb`, `csv_monitor` or `comet` gets every
metrics record the trainer logs written there too, as `apt/<name>` at the record's optimizer
step (numbers only), besides metrics.jsonl; DeepSpeed's own events (`Train/Samples/lr`, timers)
go to the same place, as DeepSpeed users expect.

The backend rebuilds its engine at every shape change, and each engine would build its own
`MonitorMaster`: a new W&B run (`wandb.init` again), a second CSV header in the middle of each
file, a new TensorBoard event file. So the run builds ONE monitor from the resolved config with
DeepSpeed's own classes, engines are built from a config without the monitor sections, and each
new engine is handed the run's monitor.

Where the files go: a section that names no `output_path` (tensorboard, csv_monitor) writes into
the run's own RUN/monitor/, so two runs never append to one file; on --resume the CSV rows after
the checkpoint's step are dropped there and redone, as metrics.jsonl's are (`resume_csv_files`).
"""

from __future__ import annotations

import csv
import importlib.util
import os
from pathlib import Path

MONITOR_SECTIONS = ("tensorboard", "wandb", "csv_monitor", "comet")
PREFIX = "apt/"


def monitor_enabled(config: dict) -> bool:
    return any(isinstance(config.get(key), dict) and config[key].get("enabled") is True for key in MONITOR_SECTIONS)


def without_monitor(config: dict) -> dict:
    """The config an engine is built from: the run's monitor is made once, by `build_monitor`."""
    return {key: value for key, value in config.items() if key not in MONITOR_SECTIONS}


def build_monitor(config: dict):
    """DeepSpeed's MonitorMaster for the config's monitor sections (writers exist on rank 0 only);
    None when no monitor is enabled. Raises ValueError (pydantic's) for a malformed section."""
    if not monitor_enabled(config):
        return None
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.monitor.monitor import MonitorMaster

    return MonitorMaster(get_monitor_config(config))


# The package each monitor imports when it starts (deepspeed/monitor/utils.py, 0.19.8).
MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}


def monitor_config_problem(config: dict) -> str | None:
    """Why DeepSpeed would refuse the monitor sections (one line), checked with its own pydantic
    model and without creating writers; or a missing package of an enabled monitor. None: fine."""
    if not any(key in config for key in MONITOR_SECTIONS):
        return None
    from deepspeed.monitor.config import get_monitor_config

    try:
        get_monitor_config(config)
    except ValueError as err:  # pydantic's ValidationError: first problem only, on one line
        first = err.errors()[0] if hasattr(err, "errors") else {"loc": (), "msg": str(err)}
        return f"{'.'.join(str(part) for part in first['loc'])}: {first['msg']}"
    for key, package in MONITOR_PACKAGES.items():
        if (config.get(key) or {}).get("enabled") is True and importlib.util.find_spec(package) is None:
            return f"{key}.enabled is true but the {package} package is not installed (pip install {package})"
    return None


def metric_events(record: dict) -> list[tuple[str, float, int]]:
    """(`apt/<name>`, value, step) for every number in a metrics record, except the step itself;
    flags (booleans), strings and nested objects are left to metrics.jsonl."""
    step = int(record["step"])
    events = []
    for name, value in record.items():
        if name == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        events.append((PREFIX + name, value, step))
    return events


PATH_SECTIONS = ("tensorboard", "csv_monitor")  # the monitors that write files under output_path
FILE_PREFIX = PREFIX.replace("/", "_")  # csvMonitor's file of an event: its name with "/" as "_"
ENGINE_FILE_PREFIX = "Train_Samples_"  # the engine's events (lr, loss scale, timers), at global_samples
MONITOR_DIR = "monitor"  # RUN/monitor: the default output_path


def monitor_into_run(backend, run_dir: Path) -> None:
    """Point the monitor sections without an output_path at RUN/monitor (DeepSpeed's default, "",
    is the current directory, which every run shares). No-op for a backend without a JSON."""
    config = getattr(backend, "user_config", None)
    for key in PATH_SECTIONS:
        section = (config or {}).get(key)
        if isinstance(section, dict) and section.get("enabled") is True and not section.get("output_path"):
            section["output_path"] = str(Path(run_dir).resolve() / MONITOR_DIR)


def resume_csv_files(backend, step: int, run_dir: Path) -> None:
    """A resumed run redoes the steps after its checkpoint: drop their rows from the CSV files
    (and any header but the first), so each step is in each file once, and let the writer append
    without a second header. Only files inside the run: a folder outside it may be shared with
    other runs, whose rows are not this run's to drop. Rank 0 (the writer) only."""
    from apt_ds.distributed import deepspeed_private as private

    monitor = getattr(backend, "monitor", None)
    folder = private.csv_monitor_dir(monitor) if monitor is not None else None
    if folder is None or not Path(folder).resolve().is_relative_to(Path(run_dir).resolve()):
        return
    started = []
    # apt/<name> rows are at the optimizer step; DeepSpeed's own Train/Samples/<name> at the samples seen
    samples = (getattr(backend, "ds_config", None) or {}).get("train_batch_size")
    last_by_prefix = {FILE_PREFIX: step, ENGINE_FILE_PREFIX: step * samples if samples else None}
    for path in sorted(Path(folder).glob("*.csv")):
        last = next((value for prefix, value in last_by_prefix.items() if path.name.startswith(prefix)), None)
        with path.open(newline="") as handle:
            rows = list(csv.reader(handle))
        if last is None or not rows or rows[0][:1] != ["step"]:
            continue  # not a file whose x-axis is known here, or not one this writer started
        kept = [rows[0]] + [row for row in rows[1:] if row and row[0] != "step" and _step(row[0]) <= last]
        partial = path.with_name(f".{path.name}.tmp")
        with partial.open("w", newline="") as handle:
            csv.writer(handle).writerows(kept)
        os.replace(partial, path)
        started.append(path.stem)
    private.mark_csv_files_started(monitor, started)


def _step(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("inf")  # unreadable: dropped with the redone rows
