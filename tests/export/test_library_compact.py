"""The library's way from a trained APTrainer to the compact model: `apt_ds.merge_and_compact`
(in memory) and `apt_ds.export_run` (files), which must give the model launch/export.py gives."""

from __future__ import annotations

import pytest
import torch
from conftest import random_batch, tiny_llama

from apt_ds import APTConfig, APTrainer, TrainConfig, export_run, load_pretrained, merge_and_compact
from apt_ds.algorithm.adapters import find_adapters

STEPS = 12


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs with one torch thread (see conftest.one_thread)."""


def _trained(out_dir, base_dir=None, **apt):
    model = tiny_llama("gqa")
    if base_dir is not None:
        model.save_pretrained(base_dir)
    trainer = APTrainer(model, APTConfig.for_steps(STEPS, target_density=0.6, **apt),
                        TrainConfig(steps=STEPS, micro_batch_size=2), out_dir=out_dir, progress=False)
    trainer.train(random_batch(batch=2, length=8, seed=i) for i in range(10**6))
    return trainer


@pytest.mark.parametrize("uniform", [False, True])
def test_merge_and_compact_is_the_trained_model_merged_and_smaller(uniform):
    trainer = _trained(None, uniform=uniform, shape_multiple=1)
    batch = random_batch(batch=2, length=8, seed=99)
    trainer.model.eval()
    with torch.no_grad():
        live = trainer.model(input_ids=batch["input_ids"]).logits
    compact = merge_and_compact(trainer)
    with torch.no_grad():
        merged = compact(input_ids=batch["input_ids"]).logits
    assert torch.allclose(merged, live, atol=1e-4), (merged - live).abs().max()
    assert not find_adapters(compact) and not compact.training
    assert sum(p.numel() for p in compact.parameters()) == trainer.state.shape.total_params()
    assert trainer.state.density() < 0.95  # something was pruned


def test_merge_and_compact_equals_the_export_of_the_run(tmp_path):
    trainer = _trained(tmp_path / "run", base_dir=tmp_path / "base")
    export_run(tmp_path / "run", tmp_path / "compact", model_path=tmp_path / "base")
    compact = merge_and_compact(trainer)
    exported = load_pretrained(tmp_path / "compact")
    ids = random_batch(batch=2, length=8, seed=7)["input_ids"]
    with torch.no_grad():
        assert torch.allclose(exported(input_ids=ids).logits, compact(input_ids=ids).logits, atol=1e-5)


def test_a_partitioned_model_is_sent_to_the_export(monkeypatch):
    trainer = _trained(None)
    next(trainer.model.parameters()).ds_id = 0  # what ZeRO-3 marks its partitions with
    with pytest.raises(ValueError, match="ZeRO-3 model is partitioned across ranks: export the run"):
        merge_and_compact(trainer)


def test_a_trainer_stopped_while_masks_decay_is_told_to_train_on():
    trainer = _trained(None)
    trainer.state.masks.hidden[0] = 0.5  # as inside a decay window before an event that drops a channel
    with pytest.raises(ValueError, match="decaying toward the next pruning event: train past it"):
        merge_and_compact(trainer)
