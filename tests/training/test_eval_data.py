"""--eval-data that is not held out: the same file, or rows shared with --data, is named in a warning."""

from __future__ import annotations

import json

import datasets

from apt_ds.training.eval_data import overlap_warning


def _rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return datasets.Dataset.from_list(rows)


def test_the_same_file_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    records = _rows(tmp_path / "d.jsonl", [{"text": "a"}])
    warning = overlap_warning("d.jsonl", records, "./d.jsonl", records)  # spelled differently, the same file
    assert warning.startswith("warning: --eval-data ./d.jsonl is the training data (--data)")


def test_shared_rows_are_counted_on_the_fields_training_reads(tmp_path):
    train = _rows(tmp_path / "train.jsonl", [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(50)])
    # the same rows with an id column and an empty input, which training reads as no input; one new row
    held = _rows(tmp_path / "eval.jsonl", [{"id": i, "instruction": f"q{i}", "input": None, "output": f"a{i}"} for i in (3, 7)]
                 + [{"id": 99, "instruction": "new", "input": None, "output": "b"}])
    warning = overlap_warning(str(tmp_path / "train.jsonl"), train, str(tmp_path / "eval.jsonl"), held)
    assert warning.startswith(f"warning: 2 of the 3 rows of --eval-data {tmp_path / 'eval.jsonl'} are also in --data")


def test_held_out_data_gets_no_warning(tmp_path):
    train = _rows(tmp_path / "train.jsonl", [{"text": f"row {i}"} for i in range(20)])
    held = _rows(tmp_path / "eval.jsonl", [{"text": f"other {i}"} for i in range(5)])
    assert overlap_warning(str(tmp_path / "train.jsonl"), train, str(tmp_path / "eval.jsonl"), held) is None
