"""What marks a directory as an apt-ds run: its run.json, naming an APT and a training config.

A module of its own, with no imports from apt_ds: the model loader asks it too (a run directory
given where a model is expected), and the run directory's module imports the tokenizer's.
"""

from __future__ import annotations

import json
from pathlib import Path

RUN_FILE = "run.json"


def is_run_dir(path: Path) -> bool:
    try:
        record = json.loads((Path(path) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "apt_config" in record and "train_config" in record
