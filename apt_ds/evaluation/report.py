"""What an evaluation leaves: a results table on the terminal and results.json, written whole or
not at all."""

from __future__ import annotations

import json
from pathlib import Path

from apt_ds.evaluation.errors import EvaluationError
from apt_ds.io.atomic import write_text_atomic

# A model that gives one answer on this share of a task's rows (and at least this many rows: on
# fewer, one answer throughout is too often chance) scores that answer's prior, not what it learned
ONE_ANSWER_SHARE = 0.95
ONE_ANSWER_MIN_ROWS = 20


def is_one_sided(share: float, rows: int) -> bool:
    return share >= ONE_ANSWER_SHARE and rows >= ONE_ANSWER_MIN_ROWS


def one_answer_notes(results: dict, requested: list[str]) -> list[str]:
    """A line for each task asked for on which the model gave (nearly) one answer throughout; for a
    group asked for (mmlu), how many of its single tasks (subjects) did."""
    counts, shares = results.get("n-samples", {}), results["apt_ds"]["most_common_answer_share"]
    subtasks = results.get("group_subtasks", {})

    def one_sided(task: str) -> bool:
        return task in shares and is_one_sided(shares[task], counts.get(task, {}).get("effective", 0))

    def singles(name: str) -> list[str]:
        return [leaf for part in subtasks[name] for leaf in singles(part)] if name in subtasks else [name]

    notes = []
    for name in requested:
        if name not in subtasks:
            if one_sided(name):
                notes.append(f"note: {name}: {shares[name]:.0%} of the rows got the same answer; the score is mostly "
                             f"that answer's share of the data")
            continue
        parts = singles(name)
        sided = [part for part in parts if one_sided(part)]
        if sided:
            notes.append(f"note: {name}: {len(sided)} of its {len(parts)} tasks got the same answer on "
                         f"{ONE_ANSWER_SHARE:.0%} or more of their rows (e.g. {sided[0]}); their scores are mostly "
                         f"that answer's share of the data")
    return notes


def check_out_path(out: str | Path, overwrite: bool = False) -> Path:
    """Refused before the (long) evaluation rather than after it. An existing file is replaced
    only with --overwrite and only when it is a previous results file: anything else there is
    the user's."""
    out = Path(out)
    if out.is_dir():
        raise EvaluationError(f"--out {out} is a directory; give a file name such as {out / 'results.json'}")
    if not out.parent.is_dir():
        raise EvaluationError(f"--out {out}: directory {out.parent} does not exist")
    if out.is_symlink():
        raise EvaluationError(f"--out {out} is a symbolic link; give the path it points to, or another --out")
    if out.exists():
        if not is_results_file(out):
            raise EvaluationError(f"--out {out} exists and is not a results file of launch/evaluate.py; choose another --out")
        if not overwrite:
            raise EvaluationError(f"--out {out} holds previous results; pass --overwrite to replace them")
    return out


def is_results_file(path: Path) -> bool:
    if path.is_symlink() or not path.is_file():
        return False
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and "results" in found and "apt_ds" in found


def write_results(results: dict, out: str | Path) -> None:
    """JSON via a temporary file in the same directory and a rename, so a crash or a full disk
    never leaves a truncated results.json. Values JSON cannot hold (dtypes, functions in the
    task configs) are written as their text, as lm-eval's own output does."""
    write_text_atomic(out, json.dumps(results, indent=2, default=_as_text, ensure_ascii=False) + "\n")


def _as_text(value):
    if isinstance(value, set):
        return sorted(value, key=str)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    return str(value)


def table_rows(results: dict, requested: list[str]) -> list[tuple[str, str, float, float | None, int]]:
    """(task, metric, value, stderr, n) for each task asked for, and for a group (mmlu) its own
    score then its direct parts; a group's n is the examples scored in all its tasks. Single
    subjects of a group are left to results.json."""
    scores, subtasks = results["results"], results.get("group_subtasks", {})
    counts = {name: entry["effective"] for name, entry in results.get("n-samples", {}).items()}

    def examples(name: str) -> int:
        return counts[name] if name in counts else sum(examples(child) for child in subtasks.get(name, []))

    def rows_of(name: str, label: str) -> list:
        rows = []
        for key, value in scores.get(name, {}).items():
            metric, _, filter_name = key.partition(",")
            if "," not in key or "_stderr" in metric or not isinstance(value, (int, float)):
                continue
            stderr = scores[name].get(f"{metric}_stderr,{filter_name}")
            rows.append((label if not rows else "", metric if filter_name == "none" else key, float(value),
                         float(stderr) if isinstance(stderr, (int, float)) else None, examples(name)))
        return rows

    rows = []
    for name in requested:
        rows += rows_of(name, name)
        for part in subtasks.get(name, []):
            if part in subtasks:  # a sub-group (mmlu_stem, ...), not a single subject
                rows += rows_of(part, f"  {scores.get(part, {}).get('alias', part).strip(' -')}")
    return rows


def format_table(rows: list) -> str:
    header = ("task", "metric", "value", "stderr", "n")
    cells = [header] + [(task, metric, f"{value:.4f}", "" if stderr is None else f"{stderr:.4f}", str(n))
                        for task, metric, value, stderr, n in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)
