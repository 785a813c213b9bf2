"""Hugging Face Hub names (`org/name`, `org/name@revision`) for --model, --data and --eval-data,
resolved offline to what this machine's caches already hold: nothing is downloaded.

A model name is the snapshot directory `hf download org/name` leaves in the Hub cache
(HF_HUB_CACHE, else HF_HOME/hub: `models--org--name/snapshots/<commit>`); a data set name is
either such a snapshot of a dataset repository (`hf download --repo-type dataset org/name`), read
by `datasets`' packaged builders (json, parquet, csv, ...) from its files, or, failing that, what an
earlier online `datasets.load_dataset("org/name")` prepared in HF_DATASETS_CACHE. A local path that
exists always wins over a name. The environment is read at each call, not at import (the
libraries' own constants are fixed when they are first imported).
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from apt_ds.io.errors import DataError
from apt_ds.io.modeling import ModelLoadError

# A name ending like a file is a mistyped path ("data/train.jsonl"), never a repository
FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".arrow", ".gguf", ".safetensors", ".yaml", ".yml", ".txt",
                 ".bin", ".pt")
_NAME = re.compile(r"(?P<repo>[^/@\s]+/[^/@\s]+)(?:@(?P<revision>\S+))?")


@dataclass(frozen=True)
class HubName:
    repo_id: str  # org/name
    revision: str | None  # a branch, tag or commit hash; None: the cache's "main"

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def hub_name(value: str | os.PathLike) -> HubName | None:
    """`value` as a Hub name, or None where it is a local path (one that exists always is) or
    cannot be a repository id."""
    value = str(value)
    if Path(value).exists():
        return None
    match = _NAME.fullmatch(value)
    if match is None or match["repo"].lower().endswith(FILE_SUFFIXES):
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(match["repo"])
    except HFValidationError:  # "..", "--", a leading "-": not a name the Hub accepts
        return None
    return HubName(match["repo"], match["revision"])


def _hf_home() -> str:
    return os.getenv("HF_HOME") or os.path.join(os.getenv("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")


def hub_cache_dir() -> Path:
    """Where `hf download` puts repositories (HF_HUB_CACHE, else HF_HOME/hub), as huggingface_hub.constants computes it."""
    default = os.getenv("HUGGINGFACE_HUB_CACHE") or os.path.join(os.path.expanduser(_hf_home()), "hub")  # the legacy name
    return Path(os.path.expandvars(os.path.expanduser(os.getenv("HF_HUB_CACHE") or default)))


def datasets_cache_dir() -> Path:
    """Where `datasets` prepares data sets (HF_DATASETS_CACHE, else HF_HOME/datasets), as datasets.config computes it."""
    return Path(os.path.expanduser(os.getenv("HF_DATASETS_CACHE") or os.path.join(os.path.expanduser(_hf_home()), "datasets")))


def resolve_model(value: str, flag: str = "--model") -> str:
    """The local path a --model value names: for a Hub name its snapshot in the Hub cache (one line
    saying where it looked and how to fill the cache when it is not there); anything else as given."""
    name = hub_name(value)
    if name is None:
        return value
    snapshot = _snapshot(name, "model", flag, ModelLoadError)
    if snapshot is None:
        raise ModelLoadError(_not_cached(flag, name, "model", [_repo_dir(name, "model")]))
    return str(snapshot)


@dataclass(frozen=True)
class DatasetSource:
    name: HubName
    location: Path  # the snapshot directory, or the data set's directory in the datasets cache
    snapshot: bool  # True: files read by a packaged builder; False: prepared by an earlier load_dataset


def find_dataset(value: str, flag: str = "--data") -> DatasetSource | None:
    """Where a --data name is cached (None: `value` is not a Hub name); DataError naming both caches
    that were searched when it is in neither."""
    name = hub_name(value)
    if name is None:
        return None
    snapshot = _snapshot(name, "dataset", flag, DataError)
    if snapshot is not None:
        return DatasetSource(name, snapshot, snapshot=True)
    from datasets.naming import camelcase_to_snakecase

    org, dataset = name.repo_id.split("/")
    prepared = datasets_cache_dir() / f"{org}___{camelcase_to_snakecase(dataset)}"  # datasets' own naming of it
    if name.revision is None and prepared.is_dir():  # it keeps no revisions: only a plain name can mean it
        return DatasetSource(name, prepared, snapshot=False)
    raise DataError(_not_cached(flag, name, "dataset", [_repo_dir(name, "dataset"), prepared]))


def data_location(value: str) -> str:
    """What run.json records as where --data was read: a local path made absolute, a name's cache directory."""
    source = find_dataset(value)
    return str((source.location if source is not None else Path(value)).resolve())


def load_hub_dataset(source: DatasetSource):
    """Every split of a cached data set (a datasets.DatasetDict), with the network off."""
    import datasets

    cache = str(datasets_cache_dir())
    try:
        with _offline():
            if source.snapshot:  # the repository's files, as the Hub's own loader would read them
                return datasets.load_dataset(str(source.location), cache_dir=cache)
            return datasets.load_dataset(source.name.repo_id, cache_dir=cache)  # datasets finds its prepared copy
    except Exception as err:  # datasets raises many types: no data files, several configs, an unreadable file
        # two lines: "Config name is missing." is followed by the configurations there are
        detail = " ".join(line.strip() for line in str(err).strip().splitlines()[:2]) or type(err).__name__
        cause = err.__cause__  # "An error occurred while generating the dataset" wraps the reason
        if cause is not None and str(cause).strip():
            detail += f" ({str(cause).strip().splitlines()[0]})"
        raise DataError(f"dataset {source.name} ({source.location}) cannot be read: {detail}") from None


@contextlib.contextmanager
def _offline():
    """The libraries' offline switches, on for one load: they read their environment only at import."""
    import datasets.config
    import huggingface_hub.constants

    saved = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def _repo_dir(name: HubName, repo_type: str) -> Path:
    return hub_cache_dir() / f"{repo_type}s--{name.repo_id.replace('/', '--')}"


def _snapshot(name: HubName, repo_type: str, flag: str, error: type[Exception]) -> Path | None:
    """The snapshot directory of `name` in the Hub cache, or None; huggingface_hub reads the refs
    (a branch or tag) or takes a commit hash, and refuses a snapshot it knows to be incomplete."""
    import huggingface_hub.errors
    from huggingface_hub import snapshot_download

    # huggingface_hub 2.x names a snapshot it knows to be partial; older versions return it as it is
    incomplete = getattr(huggingface_hub.errors, "IncompleteSnapshotError", ())
    try:
        return Path(snapshot_download(name.repo_id, repo_type=repo_type, revision=name.revision,
                                      cache_dir=str(hub_cache_dir()), local_files_only=True))
    except incomplete as err:
        raise error(f"{flag} {name}: the cached snapshot {err.snapshot_path} is incomplete (an interrupted download); "
                    f"finish it with `{_download_command(name, repo_type)}` on a machine with internet") from None
    except huggingface_hub.errors.LocalEntryNotFoundError:
        return None


def _not_cached(flag: str, name: HubName, repo_type: str, searched: list[Path]) -> str:
    """One line: what was looked for, where, what is there instead, and how to fill the cache."""
    repo = searched[0]
    if repo.is_dir():
        refs = sorted(str(p.relative_to(repo / "refs")) for p in (repo / "refs").rglob("*") if p.is_file())
        snapshots = sorted(p.name[:12] for p in (repo / "snapshots").glob("*") if p.is_dir())
        where = (f"{repo} holds {name.repo_id} but not revision {name.revision or 'main'} (branches and tags: "
                 f"{', '.join(refs) or 'none'}; snapshots: {', '.join(snapshots) or 'none'})")
    else:
        where = "searched " + " and ".join(str(path) for path in searched)
    return (f"{flag} {name} is not a local path, and the {repo_type} is not in the local Hugging Face cache ({where}); "
            f"nothing is downloaded: run `{_download_command(name, repo_type)}` on a machine with internet, copy its cache "
            f"here (HF_HOME, or HF_HUB_CACHE={hub_cache_dir()}) and run again with HF_HUB_OFFLINE=1")


def _download_command(name: HubName, repo_type: str) -> str:
    kind = " --repo-type dataset" if repo_type == "dataset" else ""
    revision = f" --revision {name.revision}" if name.revision else ""
    return f"hf download{kind} {name.repo_id}{revision}"
