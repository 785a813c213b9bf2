"""The export's --out: what an export may replace, and recovery from killed exports.

An export is written to a hidden `.NAME.tmp-*` directory and renamed into place; `--overwrite`
first renames a previous export to `.NAME.old-*`. `check_export_out` refuses an --out that would
destroy data (anything but a previous export or an empty directory, or a path holding an input);
a kill between the two renames is undone by `recover_interrupted_overwrite`, leftovers of killed
exports are removed by `remove_stale_temporaries`.
"""

from __future__ import annotations

import glob
import json
import re
import shutil
from pathlib import Path

from apt_ds.io.run_dir import check_writable, listing, replaced_folder

REPORT_FILE = "apt_export.json"


def check_export_out(out: Path, overwrite: bool, protected: list[Path] = (), run_dir: Path | None = None) -> None:
    """Refuse an --out that would destroy data: an existing path without --overwrite, and, even
    with it, anything but a previous export (or an empty directory), a path that is or
    contains one of the inputs, or one inside a folder that a run replaces whole (`run_dir`'s, the
    one exported, or any run directory above --out)."""
    recover_interrupted_overwrite(out)
    resolved = out.resolve()
    for path in protected:
        path = Path(path).resolve()
        if resolved == path or resolved in path.parents:
            raise FileExistsError(f"--out {out} is or contains the input {path}; choose another directory")
    folder = replaced_folder(out, (run_dir,) if run_dir else ())  # checkpoint/ at the next --resume, plots/ at a plot, ...
    if folder is not None:
        raise FileExistsError(f"--out {out} is or is inside {folder}, which the run replaces whole (and the export with "
                              f"it); choose a directory outside it")
    if not out.exists() and not out.is_symlink():
        check_writable(out)  # e.g. a parent that is a file: one line naming it, not an OSError from mkdir
        return
    if not out.is_dir() or out.is_symlink():
        raise FileExistsError(f"--out {out} exists and is not a directory; remove it or choose another --out")
    is_export = (out / REPORT_FILE).is_file()
    if not is_export and any(out.iterdir()):  # --overwrite would refuse it too: do not suggest it
        raise FileExistsError(f"--out {out} exists and is not an apt_ds export (no {REPORT_FILE}); choose another --out")
    if not overwrite:
        what = "holds a previous export" if is_export else "exists (empty)"
        raise FileExistsError(f"--out {out} {what}; pass --overwrite to replace it")
    foreign = foreign_entries(out) if is_export else []
    if foreign:  # results, a model card, notes put next to an export: --overwrite would delete them
        raise FileExistsError(f"--out {out} holds an export and also {listing(foreign)}, which an export does not write; "
                              f"move them away or choose another --out")


def foreign_entries(out: Path) -> list[str]:
    """What in a previous export's directory the export did not write. An export's report lists
    its files (`files`); a report from before that list is matched by the exact names an export
    gives its files. Any directory is foreign: an export writes none."""
    try:
        report = json.loads((out / REPORT_FILE).read_text())
    except (OSError, ValueError):
        report = None
    report = report if isinstance(report, dict) else {}
    written = report.get("files")
    if isinstance(written, list):
        ours = set(written).__contains__
    elif isinstance(report.get("file"), str):  # a GGUF export: its report and its one file
        ours = {REPORT_FILE, report["file"]}.__contains__
    else:
        ours = is_export_file_name
    return [e.name for e in sorted(out.iterdir()) if not ours(e.name) or not e.is_file() or e.is_symlink()]


# The names an HF export gives its files (a tokenizer's files as transformers and sentencepiece
# name them): exact, so that a user's notes or own GGUF beside an older export are never matched
_EXPORT_FILES = frozenset({"config.json", "generation_config.json", REPORT_FILE, "model.safetensors",
                           "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                           "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                           "vocab.json", "merges.txt", "vocab.txt"})
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def is_export_file_name(name: str) -> bool:
    """A name an HF export gives one of its files (for reports that do not list their files)."""
    return name in _EXPORT_FILES or _SHARD.fullmatch(name) is not None


def recover_interrupted_overwrite(out: Path) -> None:
    """An overwrite killed between its two renames left the previous export as `.NAME.old-*`
    and no NAME: put the previous export back before anything else happens."""
    if out.exists() or out.is_symlink():
        return
    for old in _hidden_siblings(out, "old") if out.parent.is_dir() else []:
        if (old / REPORT_FILE).is_file() and ((old / "config.json").is_file() or any(old.glob("*.gguf"))):
            old.rename(out)
            return


def _hidden_siblings(out: Path, tag: str) -> list[Path]:
    """`.NAME.<tag>-*` next to `out` (NAME escaped: `e[1]` must not match `.e1.old-*`)."""
    return sorted(out.parent.glob(f".{glob.escape(out.name)}.{tag}-*"))


def remove_stale_temporaries(out: Path) -> None:
    """Leftovers of killed exports to `out` (never a complete previous export: see
    recover_interrupted_overwrite). Exports to the same --out must not run concurrently."""
    for stale in _hidden_siblings(out, "tmp") + _hidden_siblings(out, "old"):
        shutil.rmtree(stale, ignore_errors=True)
