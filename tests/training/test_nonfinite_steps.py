"""A diverged run never passes silently: NaN/inf steps are skipped and counted, several in a row
stop the run, decisions refuse NaN scores, and a NaN checkpoint never replaces a good one
(docs/RELIABILITY.md, "A run that diverges"). The command-line cases: tests/cli/test_divergence_cli.py."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_batch, tiny_llama, tree_digest

from apt_ds.algorithm.finite import NonFiniteError
from apt_ds.config import APTConfig, TrainConfig
from apt_ds.distributed.backend import LocalBackend
from apt_ds.training.divergence import DivergenceGuard, is_bad_step
from apt_ds.training.trainer import APTrainer


def _batches(n: int = 200):
    return iter(random_batch(seed=i) for i in range(n))


def _trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("fused", [False, True])  # fused: the GPU route (found_inf), run here on the CPU kernel
def test_a_step_with_a_nan_gradient_leaves_weights_and_adam_state_alone(fused):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    backend = LocalBackend(fused=fused)
    backend.attach(model, 1e-2, lambda step: 1.0, 0.0, 1, max_grad_norm=1.0)
    model(torch.randn(2, 4)).sum().backward()
    backend.step()
    assert not backend.step_skipped
    weights = _trainable(model)
    state = {k: v.clone() for k, v in backend.optimizer.state[model.weight].items()}
    (model(torch.randn(2, 4)).sum() * float("nan")).backward()
    backend.step()
    assert backend.step_skipped and math.isnan(backend.grad_norm)
    assert backend.optimizer_steps == 2  # it counts: the schedules move on
    for name, value in _trainable(model).items():
        assert torch.equal(value, weights[name]), name
    after = backend.optimizer.state[model.weight]
    for key, value in state.items():
        assert torch.equal(after[key], value), key  # the fused kernel un-counts its step too
    model(torch.randn(2, 4)).sum().backward()
    backend.step()
    assert not backend.step_skipped and not torch.equal(model.weight, weights["weight"])


def test_a_run_driven_to_nan_stops_with_its_last_good_checkpoint_intact_and_resumable(tmp_path):
    train = TrainConfig(steps=12, lr=1e6, checkpoint_every=4, warmup_steps=1)
    trainer = APTrainer(tiny_llama("gqa"), APTConfig.for_steps(12, target_density=0.6), train, out_dir=tmp_path,
                        progress=False)
    with pytest.raises(NonFiniteError, match=r"the run diverged: steps \d+-\d+ \(3 in a row; --max-skipped-steps 3\)") as err:
        trainer.train(_batches())
    message = str(err.value)
    assert "\n" not in message and "--lr 1e+06" in message and "the last good checkpoint, step 4" in message
    stopped_at = trainer.step
    assert 4 < stopped_at < 12
    skipped = [r for r in trainer.history if r.get("skipped")]
    assert len(skipped) == 3 and skipped[-1]["step"] == stopped_at  # the stopping step is on the record
    # Nothing NaN was written anywhere: every tensor of every checkpoint file is finite.
    from safetensors.torch import load_file

    files = sorted((tmp_path / "checkpoint").rglob("*.safetensors"))
    assert files and all(torch.isfinite(t).all() for f in files for t in load_file(str(f)).values() if t.is_floating_point())
    # The kept checkpoint resumes (here with a learning rate that does not diverge) and finishes. It is
    # finite, not good: it holds the update of the step before the first NaN (lr 1e6), whose weights
    # still overflow on some batches, so a few more steps may be skipped: on the record, never applied.
    sane = TrainConfig(steps=12, lr=1e-3, checkpoint_every=4, warmup_steps=1)
    resumed = APTrainer(tiny_llama("gqa"), APTConfig.for_steps(12, target_density=0.6), sane, out_dir=tmp_path, progress=False)
    resumed.resume(tmp_path / "checkpoint")
    assert resumed.step == 4
    final = resumed.train(_batches())
    assert final["step"] == 12 and final["skipped_steps"] < 3
    assert all(torch.isfinite(p).all() for p in _trainable(resumed.model).values())


def test_one_bad_batch_is_skipped_and_left_out_of_the_scores():
    """A single NaN step (a corrupt batch) costs one update, not the run: the next steps train on,
    and salience and adapter importance are those of the good steps alone."""
    apt = APTConfig.for_steps(10, target_density=0.6)
    trainer = APTrainer(tiny_llama("gqa"), apt, TrainConfig(steps=10, warmup_steps=1), progress=False)
    poisoned_step = 3
    layer = trainer.model.model.layers[0].mlp

    def poison(module, args, output):
        return output * float("nan") if trainer.step == poisoned_step - 1 and torch.is_grad_enabled() else output

    handle = layer.register_forward_hook(poison)
    before, after = {}, {}
    original_step = trainer._train_step

    def watched(batches):
        poisoned = trainer.step == poisoned_step - 1
        before.update(_trainable(trainer.model) if poisoned else {})
        record = original_step(batches)
        after.update(_trainable(trainer.model) if poisoned else {})
        return record

    trainer._train_step = watched
    final = trainer.train(_batches())
    handle.remove()
    assert final["step"] == 10 and final["skipped_steps"] == 1
    record = next(r for r in trainer.history if r["step"] == poisoned_step)
    assert record["skipped"] is True and not math.isfinite(record["loss"])
    assert all(not r.get("skipped") for r in trainer.history if r.get("step") != poisoned_step)
    assert before and all(torch.equal(after[name], value) for name, value in before.items())  # no update applied
    s = trainer.state.salience
    assert all(torch.isfinite(t).all() for t in [*s.group_scores, *s.neuron_scores, s.hidden_scores])
    assert all(math.isfinite(v) for v in trainer.tuner.importance_values().values())


def test_an_empty_micro_batch_is_zero_and_a_nan_loss_is_not():
    empty = random_batch(seed=1)
    empty["labels"] = torch.full_like(empty["labels"], -100)
    trainer = APTrainer(tiny_llama("gqa"), APTConfig.for_steps(4, prune=False), TrainConfig(steps=4, grad_accum_steps=2),
                        progress=False)
    trainer.train(iter([empty, random_batch(seed=2)] * 4))
    assert all(math.isfinite(r["task_loss"]) and not r.get("skipped") for r in trainer.history if "task_loss" in r)
    assert is_bad_step({"loss": float("nan"), "task_loss": float("nan"), "distill_loss": 0.0, "grad_norm": 1.0}, False)
    assert is_bad_step({"loss": 1.0, "task_loss": 1.0, "distill_loss": 0.0, "grad_norm": float("inf")}, False)
    assert is_bad_step({"loss": 1.0, "task_loss": 1.0, "distill_loss": 0.0, "grad_norm": 1.0}, True)
    assert not is_bad_step({"loss": 1.0, "task_loss": 1.0, "distill_loss": 0.0, "grad_norm": None}, False)


def test_the_guard_counts_bad_steps_in_a_row_and_warns_of_a_blow_up_once(capsys):
    guard = DivergenceGuard(TrainConfig(max_skipped_steps=2))

    def step(n, skipped=False, grad_norm=1.0, loss=5.0):
        return guard.observe({"step": n, "loss": loss, "task_loss": loss, "grad_norm": grad_norm,
                              **({"skipped": True} if skipped else {})})

    assert step(1) is None and step(2, skipped=True) is None and step(3) is None  # not in a row
    assert step(4, grad_norm=5e3) is None and step(5, grad_norm=9e3) is None
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 1 and "step 4: the gradient norm 5e+03 is 5e+03x the first step's" in warnings[0]
    assert step(6, skipped=True) is None
    stop = step(7, skipped=True, grad_norm=float("nan"), loss=float("nan"))
    assert isinstance(stop, NonFiniteError) and "steps 6-7 (2 in a row" in str(stop) and guard.total == 3


def test_a_decision_on_nan_scores_is_refused():
    apt = APTConfig.for_steps(8, target_density=0.6)
    trainer = APTrainer(tiny_llama("gqa"), apt, TrainConfig(steps=8), progress=False)
    s = trainer.state.salience
    layers = trainer.state.shape.layers
    s.group_scores = [torch.ones(l.num_kv_groups) for l in layers]
    s.neuron_scores = [torch.ones(l.ffn) for l in layers]
    s.hidden_scores = torch.ones(trainer.state.shape.hidden)
    trainer._decide(apt.pruning_end_step, {})  # finite: decided
    s.neuron_scores[1][3] = float("nan")
    with pytest.raises(NonFiniteError, match=r"the pruning decision for step \d+ refused: FFN-neuron scores of layer 1 "
                                             r"\(1 of \d+ values NaN or inf\) is not finite"):
        trainer._decide(apt.pruning_end_step, {})


def test_rank_growth_on_nan_importance_is_refused():
    trainer = APTrainer(tiny_llama("gqa"), APTConfig.for_steps(8, target_density=0.6), TrainConfig(steps=8), progress=False)
    names = sorted(trainer.state.adapters)
    trainer.tuner.importance = {name: 1.0 for name in names}
    trainer.tuner.importance[names[1]] = float("nan")
    with pytest.raises(NonFiniteError, match=f"rank growth refused: the importance of 1 adapter\\(s\\), {names[1]} first"):
        trainer.tuner.plan_growth(trainer.state.adapters, 2.0)


@pytest.mark.parametrize("poison", ["adapter", "moment", "salience", "teacher", "importance"])
def test_a_nan_checkpoint_is_not_written_and_the_previous_one_stays(tmp_path, poison):
    trainer = APTrainer(tiny_llama("gqa"), APTConfig.for_steps(4, target_density=0.6), TrainConfig(steps=4), out_dir=tmp_path,
                        progress=False)
    trainer.train(_batches(4))  # its final checkpoint, step 4
    digest = tree_digest(tmp_path)
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if p.requires_grad)
    adapter_name, adapter = next(iter(trainer.state.adapters.items()))
    with torch.no_grad():
        if poison == "adapter":
            param.view(-1)[0] = float("nan")
        elif poison == "moment":
            trainer.backend.optimizer.state[param]["exp_avg_sq"].view(-1)[0] = float("inf")
        elif poison == "salience":
            trainer.state.salience.hidden_scores.view(-1)[0] = float("nan")
        elif poison == "teacher":
            adapter.teacher_A.view(-1)[0] = float("nan")
        else:
            trainer.tuner.importance = {**trainer.tuner.importance, adapter_name: float("nan")}
    bad = {"adapter": name, "moment": "an Adam moment of the optimizer", "salience": "salience hidden",
           "teacher": f"{adapter_name}.teacher_A", "importance": "the adapter tuner's importance"}[poison]
    with pytest.raises(NonFiniteError, match=rf"the step-4 checkpoint was not written: {bad}.* is not finite.*the previous "
                                             r"checkpoint \(step 4\) is kept: --resume continues from it"):
        trainer.save()
    assert tree_digest(tmp_path) == digest
