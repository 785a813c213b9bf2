"""benchmarks/event_heap_cost.py: where a pruning event's heap release goes."""

from __future__ import annotations

import json

import benchmarks.event_heap_cost as event_heap_cost
from apt_ds.training import trainer as trainer_module


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
