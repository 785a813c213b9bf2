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
"""

from __future__ import annotations

import importlib.util

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
