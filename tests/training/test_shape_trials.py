"""Uniform mode's shape chosen by measurement (APTConfig.uniform_shape_trials and
uniform_shape_metric): the candidate shapes, the trial itself, both metrics (the divergence from
the current model, the task loss), their wiring into APT's events, resume and prune-then-tune."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_batch, tiny_llama

from apt_ds import APTConfig, APTrainer, TrainConfig
from apt_ds.algorithm.masks import UnitMasks
from apt_ds.algorithm.pruner import AdaptivePruner, PruningError, uniform_shape_of
from apt_ds.algorithm.units import LayerShape, ModelShape
from apt_ds.config import ConfigError
from apt_ds.io.metrics import read_metrics
from apt_ds.training import shape_trials
from apt_ds.training.baselines import one_shot_prune
from apt_ds.training.shape_trials import choose_by_loss, measure_uniform_shape

SMOLLM2 = ModelShape(576, tuple(LayerShape(3, 3, 64, 1536) for _ in range(30)), 49152, True)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs with one torch thread (see conftest.one_thread)."""


def _scores(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    depth = torch.linspace(1.0, 0.05, 30, dtype=torch.float64)
    return ([torch.rand(3, generator=gen, dtype=torch.float64) * d for d in depth],
            [torch.rand(1536, generator=gen, dtype=torch.float64) * d for d in depth],
            torch.rand(576, generator=gen, dtype=torch.float64))


def _is_uniform(decision) -> bool:
    return (len({int(g.sum()) for g in decision.groups}) == 1 and len({int(n.sum()) for n in decision.neurons}) == 1)


def test_candidates_are_distinct_fitting_shapes_best_first():
    pruner = AdaptivePruner(APTConfig(uniform=True))
    target = 0.7 * SMOLLM2.block_params()
    options = pruner.candidates(SMOLLM2, *_scores(), target, count=4)
    assert len(options) == 4
    assert len({uniform_shape_of(d) for d in options}) == 4
    for decision in options:
        assert _is_uniform(decision) and decision.params <= target
        assert decision.kept_shape(SMOLLM2).block_params() == decision.params
        # pinning a candidate's (KV groups, hidden) reproduces it: the FFN width follows from the budget
        pinned = pruner.decide(SMOLLM2, *_scores(), target, uniform_shape=uniform_shape_of(decision))
        assert pinned.fingerprint() == decision.fingerprint()
    assert options[0].fingerprint() == pruner.decide(SMOLLM2, *_scores(), target).fingerprint()
    # non-uniform mode has one decision whatever the count
    assert len(AdaptivePruner(APTConfig()).candidates(SMOLLM2, *_scores(), target, count=4)) == 1


def test_candidates_use_the_budget_once_the_ffn_is_at_its_current_width():
    """After an event cut the FFN to 1,280 neurons, every smaller hidden size 'fits' with all of
    them; such shapes leave budget unused and must not be candidates (a measured loss chose them
    and a run fell to density 0.03)."""
    shrunk = ModelShape(576, tuple(LayerShape(3, 3, 64, 1280) for _ in range(30)), 49152, True)
    groups, neurons, hidden = _scores()
    target = 0.7 * SMOLLM2.block_params()
    options = AdaptivePruner(APTConfig(uniform=True)).candidates(shrunk, groups, [n[:1280] for n in neurons], hidden,
                                                                  target, original=SMOLLM2, count=1000)
    assert len(options) >= 2
    layer_cost = lambda G, N, D: 30 * D * (G * 512 + 3 * N + 2) + D  # noqa: E731
    for decision in options:
        G, D = uniform_shape_of(decision)
        N = int(decision.neurons[0].sum())
        assert decision.params == layer_cost(G, N, D) <= target
        # no dimension could grow and still fit: hidden by its step of 36, neurons by 32, one KV group
        assert D == 576 or layer_cost(G, N, D + 36) > target
        assert N == 1280 or layer_cost(G, N + 32, D) > target
        assert G == 3 or layer_cost(G + 1, N, D) > target


def test_alternatives_use_the_budget_as_well_as_the_salience_choice():
    """With the FFN at 608 neurons, dropping a KV group frees budget that no dimension can take up
    (a trial chose 2 groups + 608 neurons: density 0.464 for a target of 0.52): such a shape is
    no candidate; the others stay within one FFN block per layer of salience's choice."""
    shrunk = ModelShape(576, tuple(LayerShape(3, 3, 64, 608) for _ in range(30)), 49152, True)
    groups, neurons, hidden = _scores()
    target = 0.52 * SMOLLM2.block_params()
    options = AdaptivePruner(APTConfig(uniform=True)).candidates(shrunk, groups, [n[:608] for n in neurons], hidden,
                                                                  target, original=SMOLLM2, count=1000)
    slack = target - options[0].params
    assert (2, 576) not in {uniform_shape_of(d) for d in options}
    assert all(target - d.params <= slack + 3 * 30 * int(d.hidden.sum()) * 32 for d in options)


def test_pinning_a_shape_that_does_not_fit_is_one_line_error():
    pruner = AdaptivePruner(APTConfig(uniform=True))
    with pytest.raises(PruningError, match="the shape of 3 KV groups and hidden 577"):
        pruner.decide(SMOLLM2, *_scores(), 0.7 * SMOLLM2.block_params(), uniform_shape=(3, 577))


def test_uniform_shape_trials_must_be_positive():
    with pytest.raises(ConfigError, match="uniform_shape_trials"):
        APTConfig(uniform_shape_trials=0)


def test_choose_by_loss_takes_the_lowest_and_restores_decayed_masks():
    pruner = AdaptivePruner(APTConfig(uniform=True))
    options = pruner.candidates(SMOLLM2, *_scores(), 0.7 * SMOLLM2.block_params(), count=3)
    masks = UnitMasks(SMOLLM2)
    masks.hidden[:100] = 0.5  # partly decayed toward an earlier decision
    masks.ffn_neuron[4][:7] = 0.0
    masks.refresh()
    before = masks.state_dict()
    seen = []

    def measure():  # the masks hold exactly one candidate's kept units while it is measured
        seen.append(next(i for i, d in enumerate(options) if torch.equal(masks.hidden, d.hidden.float())
                         and all(torch.equal(m, n.float()) for m, n in zip(masks.ffn_neuron, d.neurons))))
        return [3.0, 1.5, 2.0][len(seen) - 1]

    chosen, trials = choose_by_loss(options, masks, lambda: measure)
    assert seen == [0, 1, 2]
    assert chosen is options[1]
    assert [t["chosen"] for t in trials] == [False, True, False]
    assert [t["salience_rank"] for t in trials] == [0, 1, 2] and trials[1]["loss"] == 1.5
    assert (trials[1]["kv_groups"], trials[1]["hidden"]) == uniform_shape_of(options[1])
    after = masks.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # ties go to the better shape by salience
    chosen, _ = choose_by_loss(options, masks, lambda: lambda: 1.0)
    assert chosen is options[0]


def test_a_nan_loss_never_wins():
    options = AdaptivePruner(APTConfig(uniform=True)).candidates(SMOLLM2, *_scores(), 0.7 * SMOLLM2.block_params(), count=3)
    losses = iter([float("nan"), 2.0, 1.0])
    chosen, trials = choose_by_loss(options, UnitMasks(SMOLLM2), lambda: lambda: next(losses))
    assert chosen is options[2] and trials[0]["loss"] is None
    chosen, _ = choose_by_loss(options, UnitMasks(SMOLLM2), lambda: lambda: float("nan"))
    assert chosen is options[0]  # nothing measured: salience's order


def _stream(crash_at: int | None = None):
    for i in range(10**6):
        if crash_at is not None and i >= crash_at:
            raise KeyboardInterrupt
        yield random_batch(batch=4, length=16, seed=1000 + i)


def _uniform_config(**overrides) -> APTConfig:
    return APTConfig.for_steps(24, target_density=0.5, uniform=True, shape_multiple=1, **overrides)


def test_events_keep_the_shape_measured_best(tmp_path):
    """Measured loss overrides salience: with a 'loss' that rewards the smallest hidden size
    among the candidates, every event keeps that candidate's (KV groups, hidden), the trials are
    measured once per event and logged, and at least one event did not take salience's first."""
    trainer = APTrainer(tiny_llama("gqa"), _uniform_config(uniform_shape_metric="task"), TrainConfig(steps=24), out_dir=tmp_path,
                        progress=False)
    trainer.evaluate = lambda batches=None: float(trainer.state.masks.hidden.sum())
    trainer.train(iter(_stream()))
    records = read_metrics(tmp_path / "metrics.jsonl")
    with_trials = [r for r in records if "shape_trials" in r]  # an event with one candidate logs []
    events = [r for r in records if r.get("event")]
    assert len(with_trials) == len(trainer.uniform_shapes) == trainer.apt_config.num_pruning_events
    overridden = 0
    for record in with_trials:
        trials = record["shape_trials"]
        if not trials:
            continue
        chosen = [t for t in trials if t["chosen"]]
        assert len(chosen) == 1 and chosen[0]["hidden"] == min(t["hidden"] for t in trials)
        overridden += chosen[0]["salience_rank"] > 0
    assert overridden >= 1
    for step, (groups, hidden) in trainer.uniform_shapes.items():
        event = next(r for r in events if r["step"] == step)
        assert event["decision"]
    final_groups, final_hidden = list(trainer.uniform_shapes.values())[-1]
    shape = trainer.state.shape
    assert shape.uniform and (shape.layers[0].num_kv_groups, shape.hidden) == (final_groups, final_hidden)


def test_task_trials_score_the_whole_step_with_the_real_loss(tmp_path):
    """Unpatched: each trial's loss is evaluate() on every micro-batch of the step, as trained
    (the task loss), and the candidates' losses differ (the masks really held each candidate)."""
    trainer = APTrainer(tiny_llama("gqa"), _uniform_config(uniform_shape_metric="task"),
                        TrainConfig(steps=24, micro_batch_size=2, grad_accum_steps=2),
                        out_dir=tmp_path, progress=False)
    calls, real = [], trainer.evaluate

    def recording(batches=None):
        loss = real(batches)
        calls.append((batches, loss))
        return loss

    trainer.evaluate = recording
    trainer.train(iter(_stream()))
    trials = [r["shape_trials"] for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("shape_trials")]
    assert trials and len(calls) == sum(len(t) for t in trials)
    assert all(r["shape_trials_s"] > 0 for r in read_metrics(tmp_path / "metrics.jsonl") if "shape_trials" in r)
    served = [random_batch(batch=4, length=16, seed=1000 + i) for i in range(48)]  # 2 micro-batches per step
    for batches, _ in calls:
        assert len(batches) == 2  # both micro-batches of the step, labels as trained
        first = next(i for i in range(0, 48, 2) if torch.equal(served[i]["input_ids"], batches[0]["input_ids"]))
        assert all(torch.equal(b[key], s[key]) for b, s in zip(batches, served[first:first + 2]) for key in b)
    assert [loss for _, loss in calls] == [t["loss"] for step in trials for t in step]
    assert all(len({t["loss"] for t in step}) == len(step) for step in trials)


@pytest.mark.parametrize("metric", ["kl", "task"])
def test_the_choice_does_not_depend_on_how_the_batch_is_split(metric):
    def halves():
        for batch in _stream():
            yield {k: v[:2] for k, v in batch.items()}
            yield {k: v[2:] for k, v in batch.items()}

    apt = _uniform_config(uniform_shape_metric=metric)
    whole = APTrainer(tiny_llama("gqa"), apt, TrainConfig(steps=24), progress=False)
    whole.train(iter(_stream()))
    split = APTrainer(tiny_llama("gqa"), apt, TrainConfig(steps=24, micro_batch_size=2, grad_accum_steps=2), progress=False)
    split.train(halves())
    assert whole.uniform_shapes and split.uniform_shapes == whole.uniform_shapes
    assert split.state.kept_record() == whole.state.kept_record()


def test_trials_are_logged_whatever_log_every_is(tmp_path):
    trainer = APTrainer(tiny_llama("gqa"), _uniform_config(), TrainConfig(steps=24, log_every=100), out_dir=tmp_path,
                        progress=False)
    trainer.train(iter(_stream()))
    logged = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "shape_trials" in r]
    assert len(logged) == len(trainer.uniform_shapes) == trainer.apt_config.num_pruning_events


def test_a_step_without_supervised_tokens_is_not_measured_by_the_task_loss(tmp_path):
    """No label anywhere in the step: every task loss would read 0, so nothing is measured or
    pinned on it; the event's next decision, on a step with labels, measures. (The divergence needs
    no labels: test_the_divergence_needs_no_labels.)"""
    apt = _uniform_config(uniform_shape_metric="task")
    normal = APTrainer(tiny_llama("gqa"), apt, TrainConfig(steps=24), out_dir=tmp_path / "a", progress=False)
    normal.train(iter(_stream()))
    first = min(r["step"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if "shape_trials" in r)

    def unlabelled_at_first():
        for i, batch in enumerate(_stream()):
            yield {**batch, "labels": torch.full_like(batch["labels"], -100)} if i == first - 1 else batch

    trainer = APTrainer(tiny_llama("gqa"), apt, TrainConfig(steps=24), out_dir=tmp_path / "b", progress=False)
    trainer.train(unlabelled_at_first())
    measured = [r for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if "shape_trials" in r]
    assert measured[0]["step"] == first + 1 and len(measured) == len(trainer.uniform_shapes)
    assert all(t["loss"] > 0 for r in measured for t in r["shape_trials"])


def test_ranks_that_measure_different_shapes_stop_at_once():
    from apt_ds.distributed.backend import LocalBackend

    class SplitBrainBackend(LocalBackend):
        def all_gather_object(self, obj):
            return [obj, (0, 0)] if isinstance(obj, tuple) else [obj]

    trainer = APTrainer(tiny_llama("gqa"), _uniform_config(), TrainConfig(steps=24), backend=SplitBrainBackend(), progress=False)
    with pytest.raises(RuntimeError, match="uniform shapes measured for the event at step"):
        trainer.train(iter(_stream()))


def test_ranks_with_different_candidate_counts_stop_before_any_forward():
    """Whether the trials' forward passes run depends on the candidates: ranks that disagree
    would leave ZeRO-3's collective forward waiting, so the counts are compared first."""
    from apt_ds.distributed.backend import LocalBackend

    class DisagreeingBackend(LocalBackend):
        def all_gather_object(self, obj):
            return [obj, obj + 1] if isinstance(obj, int) else [obj]

    trainer = APTrainer(tiny_llama("gqa"), _uniform_config(), TrainConfig(steps=24), backend=DisagreeingBackend(), progress=False)
    with pytest.raises(RuntimeError, match="uniform shape candidates for the event at step .* differ across ranks"):
        trainer.train(iter(_stream()))


def test_one_trial_is_the_salience_choice(tmp_path):
    trainer = APTrainer(tiny_llama("gqa"), _uniform_config(uniform_shape_trials=1), TrainConfig(steps=24),
                        out_dir=tmp_path, progress=False)
    trainer.train(iter(_stream()))
    assert trainer.uniform_shapes == {}
    assert not any("shape_trials" in r for r in read_metrics(tmp_path / "metrics.jsonl"))


def test_resume_inside_a_decay_window_keeps_the_measured_shape(tmp_path):
    apt, train = _uniform_config(), TrainConfig(steps=24, checkpoint_every=1)
    full = APTrainer(tiny_llama("gqa"), apt, train, progress=False)
    full.train(iter(_stream()))
    event = sorted(full.uniform_shapes)[2]
    crash = event - 1  # measured at the window's first step, before the event
    assert apt.mask_decay_window >= 2 and crash not in full.uniform_shapes
    crashed = APTrainer(tiny_llama("gqa"), apt, train, out_dir=tmp_path, progress=False)
    with pytest.raises(KeyboardInterrupt):
        crashed.train(iter(_stream(crash_at=crash)))
    meta = json.loads((tmp_path / "checkpoint" / "apt_state.json").read_text())
    assert str(event) in meta["uniform_shapes"]
    resumed = APTrainer(tiny_llama("gqa"), apt, train, out_dir=tmp_path, progress=False)
    resumed.resume(tmp_path / "checkpoint")
    assert resumed.uniform_shapes == {k: v for k, v in full.uniform_shapes.items() if k <= event}
    resumed.train(iter(_stream()))
    assert resumed.uniform_shapes == full.uniform_shapes
    assert resumed.state.kept_record() == full.state.kept_record()


@pytest.mark.parametrize("trials, metric", [(1, "kl"), (3, "kl"), (3, "task")])
def test_prune_then_tune_measures_uniform_shapes(trials, metric, monkeypatch):
    from apt_ds.training import baselines

    model = tiny_llama("gqa")
    calibration = [random_batch(batch=4, length=16, seed=s) for s in range(3)]
    for batch in calibration:
        batch["labels"][:, :8] = -100  # a response-only label: measured as trained, not as plain text
    measured, real_forward, real_divergence = [], baselines.supervised_forward, shape_trials.divergence_measure

    def recording(forward, batch, *args, **kwargs):
        if not torch.is_grad_enabled():
            measured.append(batch)
        return real_forward(forward, batch, *args, **kwargs)

    def recording_divergence(forward, batches, *args, **kwargs):
        measured.extend(batches)
        return real_divergence(forward, batches, *args, **kwargs)

    monkeypatch.setattr(baselines, "supervised_forward", recording)
    monkeypatch.setattr(shape_trials, "divergence_measure", recording_divergence)
    config = APTConfig(uniform=True, shape_multiple=1, uniform_shape_trials=trials, uniform_shape_metric=metric)
    result = one_shot_prune(model, calibration, 0.5, config)
    assert result.shape.uniform
    if trials == 1:
        assert result.shape_trials == [] and measured == []
        return
    assert len(result.shape_trials) == 3
    chosen = [t for t in result.shape_trials if t["chosen"]]
    losses = [t["loss"] for t in result.shape_trials]
    assert len(chosen) == 1 and chosen[0]["loss"] == min(losses) and len(set(losses)) == 3
    assert all(loss > 0 for loss in losses)  # every candidate cuts something: none equals the unpruned model
    # the first calibration batch, labels as given: once per trial (task), once for all trials (kl)
    assert len(measured) == (3 if metric == "task" else 1) and all(m is calibration[0] for m in measured)
    assert (result.shape.layers[0].num_kv_groups, result.shape.hidden) == (chosen[0]["kv_groups"], chosen[0]["hidden"])


@pytest.mark.parametrize("metric", ["kl", "task"])
def test_prune_then_tune_with_one_candidate_measures_nothing(metric, monkeypatch):
    from apt_ds.training import baselines

    measured, real_forward, original = [], baselines.supervised_forward, AdaptivePruner.candidates

    def recording(forward, batch, *args, **kwargs):
        if not torch.is_grad_enabled():  # a trial; calibration runs with gradients
            measured.append("task")
        return real_forward(forward, batch, *args, **kwargs)

    monkeypatch.setattr(shape_trials, "divergence_measure", lambda *args, **kwargs: measured.append("kl"))
    monkeypatch.setattr(baselines, "supervised_forward", recording)
    monkeypatch.setattr(AdaptivePruner, "candidates", lambda self, *args, **kwargs: original(self, *args, **kwargs)[:1])
    config = APTConfig(uniform=True, shape_multiple=1, uniform_shape_trials=3, uniform_shape_metric=metric)
    result = one_shot_prune(tiny_llama("gqa"), [random_batch(batch=4, length=16, seed=1)], 0.5, config)
    assert result.shape.uniform and result.shape_trials == [] and measured == []


@pytest.mark.parametrize("metric", ["kl", "task"])
def test_one_candidate_is_taken_without_a_forward_pass(metric):
    """An event with one candidate shape (most events late in a run) measures nothing: no
    reference pass either (over 144 SST-2 steps that pass was most of the divergence's cost)."""
    from apt_ds.algorithm.pruner import KeepDecision

    trainer = APTrainer(tiny_llama("gqa"), _uniform_config(uniform_shape_metric=metric), TrainConfig(steps=24), progress=False)
    trainer.trial_batches = [random_batch(batch=4, length=16, seed=1)]
    calls = []
    trainer.backend.forward_no_grad = lambda **kwargs: calls.append(kwargs)
    trainer.evaluate = lambda batches=None: calls.append(batches)
    shape = trainer.state.shape
    only = KeepDecision([torch.tensor([True] * layer.num_kv_groups) for layer in shape.layers],
                        [torch.ones(layer.ffn, dtype=torch.bool) for layer in shape.layers], torch.ones(shape.hidden, dtype=torch.bool), 0)
    (groups, hidden), trials, _ = measure_uniform_shape(trainer, lambda: [only], event_step=8)
    assert (groups, hidden) == (shape.layers[0].num_kv_groups, shape.hidden) and trials == [] and calls == []


def test_a_bad_metric_is_a_config_error():
    with pytest.raises(ConfigError, match="uniform_shape_metric"):
        APTConfig(uniform_shape_metric="loss")


def test_the_divergence_needs_no_labels(tmp_path):
    """The divergence measures on a step whose rows carry no label at all (text data with
    the labels masked, or a step of prompts only), where the task loss could not."""
    def unlabelled():
        for batch in _stream():
            yield {**batch, "labels": torch.full_like(batch["labels"], -100)}

    trainer = APTrainer(tiny_llama("gqa"), _uniform_config(uniform_shape_metric="kl"), TrainConfig(steps=24), out_dir=tmp_path,
                        progress=False)
    trainer.train(unlabelled())
    measured = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("shape_trials")]
    assert measured and len(trainer.uniform_shapes) == trainer.apt_config.num_pruning_events
    assert all(t["loss"] > 0 for r in measured for t in r["shape_trials"])
