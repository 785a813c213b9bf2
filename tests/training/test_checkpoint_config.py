"""Resuming a checkpoint whose APT config differs from the run's, or predates config fields:
the error names the fields (and for fields added later, the flags that reproduce the old
behaviour), and passing them resumes."""

from __future__ import annotations

import json

import pytest
from conftest import random_batch, tiny_llama

from apt_ds import APTConfig, APTrainer, TrainConfig

STEPS = 12


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs with one torch thread (see conftest.one_thread)."""


def _configs():
    apt = APTConfig.for_steps(STEPS, target_density=0.5, distill_num_blocks=1)
    train = TrainConfig(steps=STEPS, grad_accum_steps=2, checkpoint_every=10, warmup_steps=2, lr=2e-3)
    return apt, train


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """The run directory of a short APT run (its checkpoint/ is what the tests edit copies of)."""
    out = tmp_path_factory.mktemp("saved_run")
    apt, train = _configs()
    batches = (random_batch(batch=4, length=16, seed=1000 + i) for i in range(10**6))
    APTrainer(tiny_llama("gqa"), apt, train, out_dir=out, progress=False).train(batches)
    return out


def test_resume_names_config_fields_the_checkpoint_lacks(saved_run, tmp_path):
    """A checkpoint written before a config field existed is refused with that field named."""
    import shutil

    from apt_ds.io.checkpoint import CheckpointError

    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(saved_run / "checkpoint", checkpoint)
    meta = json.loads((checkpoint / "apt_state.json").read_text())
    del meta["apt_config"]["distill_every"]
    (checkpoint / "apt_state.json").write_text(json.dumps(meta))
    apt, train = _configs()
    with pytest.raises(CheckpointError, match=r"\['distill_every'\]"):
        APTrainer(tiny_llama("gqa"), apt, train, progress=False).resume(checkpoint)


def test_resume_of_a_checkpoint_from_before_shape_settings_names_the_values_it_ran_with(saved_run, tmp_path):
    """shape_multiple, uniform_shape_trials and uniform_shape_metric came later; a checkpoint without
    them ran as 1, 1 and task (single units, salience-ranked uniform shapes, trials by the task loss):
    the error names the flags that changed what it did, and passing them resumes. The trial fields
    are asked for only where they mattered (uniform mode; the metric: more than one trial)."""
    import dataclasses
    import shutil

    from apt_ds.io.checkpoint import CheckpointError

    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(saved_run / "checkpoint", checkpoint)
    original = json.loads((checkpoint / "apt_state.json").read_text())

    def write_without(*fields, **changes):
        meta = json.loads(json.dumps(original))
        for field in fields:
            del meta["apt_config"][field]
        meta["apt_config"].update(changes)
        (checkpoint / "apt_state.json").write_text(json.dumps(meta))

    apt, train = _configs()
    write_without("shape_multiple", "uniform_shape_trials", "uniform_shape_metric")  # before all three, not uniform
    with pytest.raises(CheckpointError, match=r"the run predates shape_multiple \(pass --shape-multiple 1\)"):
        APTrainer(tiny_llama("gqa"), apt, train, progress=False).resume(checkpoint)
    resumed = APTrainer(tiny_llama("gqa"), dataclasses.replace(apt, shape_multiple=1), train, progress=False)
    resumed.resume(checkpoint)
    assert resumed.step == original["step"]
    write_without("shape_multiple", "uniform_shape_trials", "uniform_shape_metric", uniform=True)  # the same, uniform
    uniform = dataclasses.replace(apt, uniform=True)
    with pytest.raises(CheckpointError, match=r"predates shape_multiple, uniform_shape_trials \(pass --shape-multiple 1 --uniform-shape-trials 1\)"):
        APTrainer(tiny_llama("gqa"), uniform, train, progress=False).resume(checkpoint)
    legacy = dataclasses.replace(uniform, shape_multiple=1, uniform_shape_trials=1)
    APTrainer(tiny_llama("gqa"), legacy, train, progress=False).resume(checkpoint)
    # written between the two (shape trials by the task loss), by a uniform run whose trials ran
    write_without("uniform_shape_metric", uniform=True)
    with pytest.raises(CheckpointError, match=r"uniform_shape_metric: task -> kl; the run predates uniform_shape_metric \(pass --uniform-shape-metric task\)"):
        APTrainer(tiny_llama("gqa"), dataclasses.replace(uniform, uniform_shape_metric="kl"), train, progress=False).resume(checkpoint)
    resumed = APTrainer(tiny_llama("gqa"), uniform, train, progress=False)  # the default is the task loss
    resumed.resume(checkpoint)
    assert resumed.step == original["step"]
    # the same from a non-uniform run: no trial ran, so the metric is not asked for
    write_without("uniform_shape_metric")
    APTrainer(tiny_llama("gqa"), dataclasses.replace(apt, uniform_shape_metric="kl"), train, progress=False).resume(checkpoint)
