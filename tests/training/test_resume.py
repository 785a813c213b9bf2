"""apt_ds.training.resume: what --resume refuses to change, the prompt template included."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from apt_ds.config import TrainConfig
from apt_ds.io.checkpoint import CheckpointError
from apt_ds.training.resume import check_resumable_model, check_resumable_settings

FINGERPRINT = {"weights_sha": "abc"}


def _meta(train: TrainConfig, **drop) -> dict:
    saved = {k: v for k, v in train.to_dict().items() if k not in drop}
    return {"train_config": saved, "run_info": {"world_size": 1, "data": "d.jsonl", "model_fingerprint": FINGERPRINT}}


def _check(meta: dict, train: TrainConfig) -> None:
    check_resumable_settings(meta, train, "d.jsonl", world_size=1)
    check_resumable_model(meta, SimpleNamespace(model="m"), FINGERPRINT)


def test_resume_refuses_another_template_and_names_the_flag():
    train = TrainConfig(template="none")
    _check(_meta(train), train)
    with pytest.raises(CheckpointError, match=r"changed: template: none -> chat \(pass --template none\)"):
        _check(_meta(train), dataclasses.replace(train, template="chat"))


def test_a_run_saved_before_the_template_field_used_alpaca():
    train = TrainConfig()
    _check(_meta(train, template=True), train)  # alpaca: the prompt those runs were trained with
    with pytest.raises(CheckpointError, match=r"template: alpaca -> chat"):
        _check(_meta(train, template=True), dataclasses.replace(train, template="chat"))


def test_every_changed_setting_is_named_at_once():
    """Global batch, a training setting, the data and the APT config: one error names all four."""
    from apt_ds.config import APTConfig

    train = TrainConfig(steps=16)
    meta = {**_meta(train), "apt_config": APTConfig.for_steps(16).to_dict()}
    changed = dataclasses.replace(train, steps=20, micro_batch_size=train.micro_batch_size * 2)
    with pytest.raises(CheckpointError) as err:
        check_resumable_settings(meta, changed, "other.jsonl", 1, APTConfig.for_steps(16, target_density=0.5).to_dict(), "ckpt")
    message = str(err.value)
    for part in ("must keep the global batch", "steps: 16 -> 20 (pass --steps 16)", "trained on --data d.jsonl, not other.jsonl",
                 "used a different APT config; changed: target_density: 0.7 -> 0.5 (pass --target-density 0.7)"):
        assert part in message, part
    assert "\n" not in message


def test_a_changed_steps_is_named_once():
    """The schedule --steps scales (APTConfig.for_steps) follows it back: naming those fields as well
    would send the user after settings that --steps alone puts right. A changed setting of its own is
    still named."""
    from apt_ds.config import APTConfig

    train = TrainConfig(steps=16)
    meta = {**_meta(train), "apt_config": APTConfig.for_steps(16).to_dict()}
    assert APTConfig.for_steps(40).to_dict() != meta["apt_config"]  # the schedule does follow the length
    longer = dataclasses.replace(train, steps=40)
    with pytest.raises(CheckpointError) as err:
        check_resumable_settings(meta, longer, "d.jsonl", 1, APTConfig.for_steps(40).to_dict(), "ckpt")
    assert str(err.value) == "--resume must use the run's training settings; changed: steps: 16 -> 40 (pass --steps 16)"
    with pytest.raises(CheckpointError) as err:
        check_resumable_settings(meta, longer, "d.jsonl", 1, APTConfig.for_steps(40, prune_heads=False).to_dict(), "ckpt")
    assert str(err.value).endswith("changed: prune_heads: true -> false (pass --prune-heads true)")


def test_a_checkpoint_this_apt_ds_cannot_resume_is_named_alone():
    """A checkpoint without a field this apt-ds has (an older one), or with one it does not know (a
    newer one), cannot be resumed whatever the flags: said at once, with no advice about --steps."""
    from apt_ds.config import APTConfig

    train = TrainConfig(steps=16)
    current = APTConfig.for_steps(40).to_dict()
    older = {k: v for k, v in APTConfig.for_steps(16).to_dict().items() if k != "distill_every"}
    with pytest.raises(CheckpointError) as err:
        check_resumable_settings({**_meta(train), "apt_config": older}, dataclasses.replace(train, steps=40), "d.jsonl", 1,
                                 current, "ckpt")
    assert str(err.value).startswith("checkpoint ckpt was written by an earlier apt-ds without the APT fields ['distill_every']")
    assert "--steps" not in str(err.value)
    newer = {**APTConfig.for_steps(16).to_dict(), "future_knob": 3}
    with pytest.raises(CheckpointError, match=r"with the APT fields \['future_knob'\] that this one does not know"):
        check_resumable_settings({**_meta(train), "apt_config": newer}, train, "d.jsonl", 1, APTConfig.for_steps(16).to_dict(),
                                 "ckpt")
