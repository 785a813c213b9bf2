"""Each new family in one process distils, grows ranks, and a run stopped mid-pruning (after a checkpoint whose shapes are
already pruned) and resumed ends exactly as the uninterrupted run: the same kept units, ranks and
masks, the same losses step by step, the same trained adapters. Non-uniform and uniform, since a
uniform run's shape trials and its stock-class shapes take another path through the shrink."""

from __future__ import annotations

import json

import pytest
from conftest import Crash, assert_resumed_as_uninterrupted, micro_batches, tiny_family

from apt_ds import APTConfig, APTrainer, TrainConfig
from apt_ds.models import FAMILIES

STEPS, CRASH_STEP = 24, 12  # events at steps 2..12: the step-12 checkpoint is pruned, pruning goes on after it
NEW_FAMILIES = [name for name in FAMILIES if name != "llama"]  # LLaMA's: tests/training/test_trainer.py


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs with one torch thread (see conftest.one_thread)."""


def _configs(uniform: bool):
    apt = APTConfig.for_steps(STEPS, target_density=0.6, distill_num_blocks=1, uniform=uniform)
    train = TrainConfig(steps=STEPS, grad_accum_steps=2, checkpoint_every=CRASH_STEP, warmup_steps=3, lr=2e-3)
    return apt, train


@pytest.mark.parametrize("uniform", [False, True], ids=["non-uniform", "uniform"])
@pytest.mark.parametrize("model_type", NEW_FAMILIES)
def test_a_stopped_run_resumes_to_the_uninterrupted_one(tmp_path, model_type, uniform):
    apt, train = _configs(uniform)
    reference = APTrainer(tiny_family(model_type), apt, train, out_dir=tmp_path / "whole", progress=False)
    reference.train(micro_batches())

    crashed = APTrainer(tiny_family(model_type), apt, train, out_dir=tmp_path / "a", progress=False)
    with pytest.raises(Crash):
        crashed.train(micro_batches(crash_at=CRASH_STEP * train.grad_accum_steps))
    meta = json.loads((tmp_path / "a" / "checkpoint" / "apt_state.json").read_text())
    assert meta["step"] == CRASH_STEP and meta["shape"] != meta["original_shape"]

    resumed = APTrainer(tiny_family(model_type), apt, train, out_dir=tmp_path / "b", progress=False)
    resumed.resume(tmp_path / "a" / "checkpoint")
    assert type(resumed.model).__name__ == FAMILIES[model_type].causal_lm_class
    resumed.train(micro_batches())
    assert_resumed_as_uninterrupted(resumed, reference, CRASH_STEP, STEPS)
    steps = [r for r in reference.history if "loss" in r]
    assert any(r["distill_loss"] > 0 for r in steps)  # the family distils ...
    assert steps[-1]["total_rank"] > steps[0]["total_rank"]  # ... and grows its adapters' ranks
    assert resumed.state.shape.block_params() < 0.75 * resumed.state.original_shape.block_params()
    assert resumed.state.shape.uniform or not uniform
