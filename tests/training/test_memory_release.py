"""Memory that pruning frees must leave the process: heap trimming after events, and model
weights read into memory (not file-mapped) for pruning runs."""

from __future__ import annotations

import ctypes.util
import gc
import weakref

import psutil
import pytest
import torch

from apt_ds.io.modeling import build_tiny_model, load_model
from apt_ds.training.heap import release_free_heap, startup_objects_frozen


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


@pytest.mark.skipif(not (ctypes.util.find_library("c") or "").startswith("libc.so"), reason="glibc only (malloc_trim)")
def test_release_free_heap_returns_freed_small_tensors_to_the_os():
    # many small tensors live on the malloc heap (large ones are mmapped and freed anyway);
    # one survivor at the top keeps glibc from shrinking the heap by itself
    chunks = [torch.ones(1024) for _ in range(40_000)]  # ~160 MB in 4 KiB pieces
    survivor = torch.ones(1024)
    del chunks
    before = _rss_mb()
    assert release_free_heap() is True
    after = _rss_mb()
    assert before - after > 50, (before, after)
    assert survivor.sum() == 1024


def test_load_without_mmap_gives_the_same_model(tmp_path):
    model = build_tiny_model(vocab_size=97, seed=3)
    model.save_pretrained(str(tmp_path))
    mapped, read = load_model(tmp_path), load_model(tmp_path, mmap=False)
    for (name, a), (_, b) in zip(mapped.state_dict().items(), read.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.arange(8)[None]
    with torch.no_grad():
        assert torch.equal(mapped(ids).logits, read(ids).logits)


class _Node:
    def __init__(self):
        self.other = self  # a reference cycle: only the cyclic collector frees it


def test_frozen_startup_objects_are_skipped_but_new_cycles_are_collected():
    old, leftover = _Node(), _Node()
    old_ref, leftover_ref = weakref.ref(old), weakref.ref(leftover)
    del leftover  # unreachable before the block: collected on entry, not frozen with the rest
    with startup_objects_frozen():
        assert leftover_ref() is None
        assert gc.get_freeze_count() > 0
        del old
        gc.collect()
        assert old_ref() is not None  # frozen: the collection did not walk it
        new = _Node()
        new_ref = weakref.ref(new)
        del new
        gc.collect()
        assert new_ref() is None  # created inside the block: collected as before
    assert gc.get_freeze_count() == 0
    assert old_ref() is None  # unfrozen and collected when the block ends


def test_objects_frozen_by_someone_else_stay_frozen_and_ours_are_frozen_too():
    """Something that froze objects before (a pre-fork server, an image's start-up) must not turn
    the freeze off: every event's collection would walk all of start-up's objects again."""
    theirs = _Node()
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        late = _Node()  # created after their freeze: ours to hide
        late_ref = weakref.ref(late)
        with startup_objects_frozen():
            assert gc.get_freeze_count() > count
            del late
            gc.collect()
            assert late_ref() is not None  # frozen: the collection did not walk it
        assert late_ref() is None  # the block's end collects the cycles left in it
        assert gc.get_freeze_count() > 0 and not any(o is theirs for o in gc.get_objects())  # theirs stay frozen
    finally:
        gc.unfreeze()
        gc.collect()


def test_an_inner_block_leaves_the_outer_one_freezing():
    from apt_ds.training.heap import freeze_prepared_data

    with startup_objects_frozen():
        with startup_objects_frozen():
            pass
        assert freeze_prepared_data() is True
    assert freeze_prepared_data() is False and gc.get_freeze_count() == 0


def test_the_cli_hides_the_tokenized_data_from_event_collections_but_not_the_model(tmp_path, monkeypatch):
    """Every full collection at a pruning event walks what is not frozen: the tokenized examples
    (a dict and two lists each) are frozen once prepared, the model and its weights are not."""
    import apt_ds.training.trainer as trainer_module
    from apt_ds.cli.train import main
    from apt_ds.training.heap import freeze_prepared_data

    seen = []

    def inspect_then_release():
        tracked = gc.get_objects()  # what a collection walks (frozen objects are not listed)
        seen.append({"examples": sum(1 for o in tracked if type(o) is dict and set(o) == {"input_ids", "labels"}),
                     "parameters": sum(1 for o in tracked if isinstance(o, torch.nn.Parameter))})
        return release_free_heap()

    monkeypatch.setattr(trainer_module, "release_free_heap", inspect_then_release)
    assert main(["--out", str(tmp_path / "run"), "--steps", "8", "--target-density", "0.7", "--max-seq-len", "32",
                 "--checkpoint-every", "0"]) == 0
    assert seen and all(s["examples"] == 0 for s in seen)
    assert all(s["parameters"] > 0 for s in seen)  # the model stays visible: its replaced weights' cycles are found
    assert freeze_prepared_data() is False and gc.get_freeze_count() == 0  # outside the CLI's block: nothing frozen


def test_the_heap_is_trimmed_after_each_of_the_first_steps_after_a_shape_change(monkeypatch):
    """HeapSettling: a shape change arms three trims, one at the end of each following step
    (the holes that the old sizes left in glibc's arenas go back to the OS as the new sizes settle)."""
    from apt_ds.training import heap

    trims = []
    monkeypatch.setattr(heap, "trim_free_heap", lambda: trims.append(1) or True)
    monkeypatch.setattr(heap, "_threshold_fixed", False)
    settling = heap.HeapSettling()
    settling.step_done()
    assert trims == []  # nothing changed shape yet
    settling.shape_changed()
    for _ in range(5):
        settling.step_done()
    assert len(trims) == 3
    monkeypatch.setattr(heap, "_threshold_fixed", True)  # a CPU run under ZeRO-3: every step
    for _ in range(4):
        settling.step_done()
    assert len(trims) == 7


def test_a_training_run_trims_after_the_steps_that_follow_each_event(monkeypatch):
    from conftest import random_batch, tiny_llama

    from apt_ds import APTConfig, APTrainer, TrainConfig
    from apt_ds.training import heap

    trainer = APTrainer(tiny_llama("gqa"), APTConfig.for_steps(16, target_density=0.5), TrainConfig(steps=16),
                        progress=False)
    trimmed_after = []
    monkeypatch.setattr(heap, "_threshold_fixed", False)
    monkeypatch.setattr(heap, "trim_free_heap", lambda: trimmed_after.append(trainer.step) or True)
    trainer.train(random_batch(batch=2, length=8, seed=i) for i in range(10**6))
    events = [r["step"] for r in trainer.history if r.get("event")]
    assert events
    settling = [s for s in trimmed_after if s not in events]  # an event's own release trims too
    expected = sorted({s for e in events for s in range(e + 1, e + 4) if s <= 16} - set(events))
    assert settling == expected
