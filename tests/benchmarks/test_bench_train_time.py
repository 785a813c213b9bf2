"""benchmarks/train_time.py: whole launch/train.py runs of LoRA and APT, timed one at a time,
on a tiny model saved as an HF directory (the real benchmark's numbers: docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from apt_ds.io.data import demo_data_path
from tests.conftest import tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import train_time


def test_times_both_methods_and_reports_ratios(tmp_path, tokenizer):
    model_dir, task_dir = tmp_path / "model", tmp_path / "task"
    tiny_llama(vocab=len(tokenizer)).save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    task_dir.mkdir()
    shutil.copy(demo_data_path(), task_dir / "train.jsonl")
    out = tmp_path / "train_time.json"
    train_time.main(["--model", str(model_dir), "--task", str(task_dir), "--steps", "8", "--repeats", "2",
                     "--max-seq-len", "32", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [len(result["runs"][m]) for m in ("lora", "apt")] == [2, 2]
    assert all(r["density"] == 1.0 for r in result["runs"]["lora"])
    assert all(r["density"] < 0.8 for r in result["runs"]["apt"])  # APT pruned: the runs are what they say
    for run in result["runs"]["lora"] + result["runs"]["apt"]:
        assert 0 < run["train_time_s"] < run["process_wall_s"]
        assert run["rss_mb"] > 0 and run["peak_rss_mb"] > 0
    loop = result["apt_over_lora"]["train_time_s"]
    assert loop == pytest.approx([a["train_time_s"] / l["train_time_s"] for a, l in zip(result["runs"]["apt"], result["runs"]["lora"])])
    assert result["apt_over_lora_median"]["train_time_s"] == pytest.approx(sum(loop) / 2)


def test_missing_task_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_time.main(["--task", str(tmp_path / "nowhere"), "--json", str(tmp_path / "x.json")])
    assert "train.jsonl not found" in capsys.readouterr().err
