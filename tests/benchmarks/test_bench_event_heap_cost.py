"""benchmarks/event_heap_cost.py: where a pruning event's heap release goes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks.event_heap_cost as event_heap_cost
from apt_ds.training import trainer as trainer_module

ROOT = Path(__file__).resolve().parents[2]


def test_an_event_collection_walks_only_what_training_made(tmp_path):
    release = trainer_module.release_free_heap
    out = tmp_path / "result.json"
    result = event_heap_cost.main(["--device", "cpu", "--scale", "small", "--work", str(tmp_path), "--steps", "12",
                                   "--json", str(out)])
    assert trainer_module.release_free_heap is release  # the wrapper is taken off again
    assert json.loads(out.read_text()) == result
    assert result["exit_code"] == 0 and len(result["events"]) == 3  # the short schedule's events at steps 4, 6, 8
    for event in result["events"]:  # start-up's objects (imports, the tokenized data) are frozen: not walked
        assert event["frozen_objects"] > event["tracked_objects"]
        assert event["gc_collect_s"] >= 0 and event["malloc_trim_s"] >= 0


def test_objects_frozen_before_apt_ds_starts_do_not_turn_its_freeze_off(tmp_path):
    """As on the H200's image: a few objects frozen at start-up (the CLI used to freeze nothing then)."""
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "benchmarks/event_heap_cost.py", "--device", "cpu", "--scale", "small",
                    "--work", str(tmp_path), "--steps", "8", "--frozen-before", "--json", str(out)],
                   cwd=ROOT, check=True, capture_output=True)
    result = json.loads(out.read_text())
    assert 0 < result["frozen_at_start"] < 50_000 and len(result["events"]) == 3
    assert all(event["frozen_objects"] > 10 * event["tracked_objects"] for event in result["events"])


def test_frozen_before_cannot_be_asked_for_too_late(capsys):
    if event_heap_cost.FROZEN_AT_START:
        pytest.skip("this process froze objects before importing the script")
    with pytest.raises(SystemExit):
        event_heap_cost.main(["--device", "cpu", "--work", "/nonexistent", "--frozen-before"])
    assert "read when the script starts" in capsys.readouterr().err
