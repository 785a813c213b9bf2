"""Prune-then-tune baseline: one-shot Taylor pruning hits the target density, the pruned
model is a plain LLaMA (no leftover adapters or hooks), and LoRA tuning of it trains."""

from __future__ import annotations

import pytest
import torch
from conftest import random_batch, tiny_llama

from apt_ds import APTConfig, TrainConfig
from apt_ds.algorithm.adapters import APTAdapter
from apt_ds.algorithm.units import ModelShape
from apt_ds.training import baselines
from apt_ds.training.baselines import one_shot_prune, prune_then_tune


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs with one torch thread (see conftest.one_thread)."""


def _calibration(n: int = 3):
    return [random_batch(batch=4, length=16, seed=500 + i) for i in range(n)]


def _stream(start: int = 0):
    i = start
    while True:
        yield random_batch(batch=4, length=16, seed=1000 + i)
        i += 1


@pytest.mark.parametrize("kind", ["gqa", "gqa_tied"])
@pytest.mark.parametrize("uniform", [False, True])
def test_one_shot_prune_hits_target_and_leaves_plain_llama(kind, uniform, monkeypatch):
    model = tiny_llama(kind, hidden_size=96, intermediate_size=128) if kind == "gqa" else tiny_llama(kind)
    original = ModelShape.from_model(model)
    target = 0.6
    releases = []
    monkeypatch.setattr(baselines, "release_free_heap", lambda: releases.append(1) or True)
    result = one_shot_prune(model, _calibration(), target, APTConfig(uniform=uniform))
    assert releases == [1]  # the shrink's freed heap goes back to the OS, as after APT's events
    shape = ModelShape.from_model(model)
    assert shape == result.shape
    kept = shape.block_params()
    budget = target * original.block_params()
    assert kept <= budget
    # never below the target by more than the largest single unit's cost
    largest_unit = max(original.hidden_cost(), max(original.group_cost(l) for l in original.layers))
    assert kept >= budget - largest_unit
    assert result.density == pytest.approx(kept / original.block_params())
    assert result.decision.removes_anything()
    if uniform:
        assert shape.uniform
    # a plain model: no adapters, no hooks, nothing trainable, no stale grads
    assert not any(isinstance(m, APTAdapter) for m in model.modules())
    assert all(not p.requires_grad and p.grad is None for p in model.parameters())
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    batch = random_batch(batch=2, length=10, seed=3)
    with torch.no_grad():
        out = model(**batch)
    assert torch.isfinite(out.loss)


def test_one_shot_scores_are_first_order_taylor():
    """Units with larger |X * dL/dX| survive: pruning FFN neurons only, the kept neurons of
    each layer are exactly the top ones by the hand-computed Taylor score (summed factors)."""
    model = tiny_llama("gqa")
    batches = _calibration(2)
    acts = {}

    def pre_hook(index):
        def hook(module, args):
            x = args[0]
            x.retain_grad()
            acts.setdefault(index, []).append(x)
        return hook

    reference = tiny_llama("gqa")
    for p in reference.parameters():
        p.requires_grad_(False)
    reference.model.embed_tokens.weight.requires_grad_(True)  # anything upstream, so X carries grad
    handles = [layer.mlp.down_proj.register_forward_pre_hook(pre_hook(i)) for i, layer in enumerate(reference.model.layers)]
    reference.train()
    for batch in batches:
        reference(**batch).loss.backward()
    for h in handles:
        h.remove()
    expected = []
    for i in range(len(reference.model.layers)):
        act = sum(x.detach().abs().sum((0, 1)) for x in acts[i])
        grad = sum(x.grad.abs().sum((0, 1)) for x in acts[i])
        expected.append(act.double() * grad.double())

    config = APTConfig(prune_heads=False, prune_hidden=False)
    result = one_shot_prune(model, batches, 0.8, config)
    for layer, flags in enumerate(result.decision.neurons):
        kept = int(flags.sum())
        top = set(torch.argsort(expected[layer], descending=True)[:kept].tolist())
        assert set(flags.nonzero().flatten().tolist()) == top


def test_prune_then_tune_trains_at_target(tmp_path):
    model = tiny_llama("gqa", hidden_size=96, intermediate_size=128)
    original = ModelShape.from_model(model)
    steps = 20
    apt = APTConfig.for_steps(steps)
    train = TrainConfig(steps=steps, micro_batch_size=4, lr=3e-2, warmup_steps=1, seed=0)
    fixed = random_batch(batch=4, length=16, seed=7)

    def same_batch():
        while True:
            yield {k: v.clone() for k, v in fixed.items()}

    trainer, pruned = prune_then_tune(model, _calibration(), same_batch(), 0.7, apt, train, out_dir=tmp_path / "run")
    assert pruned.density <= 0.7
    assert pruned.density == pytest.approx(0.7, abs=0.05)
    # the LoRA phase keeps the pruned shape and actually learns
    assert ModelShape.from_model(model) == pruned.shape
    assert trainer.state.shape.block_params() / original.block_params() == pytest.approx(pruned.density)
    losses = [r["loss"] for r in trainer.history if "loss" in r]
    assert len(losses) == steps
    assert losses[-1] < losses[0] - 0.4, losses  # ln(97) = 4.57 at the start
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    assert trainer.state.total_rank() == 8 * 2 * len(original.layers)  # no rank growth in the baseline


def test_one_shot_scores_with_dropout_off_whatever_the_random_state():
    """A BERT checkpoint keeps its config's dropout (0.1); scoring with it on made the calibration
    loss, the scores and so prune-then-tune's cut differ from one process to the next (measured on
    MiniLM SST-2). Scoring runs in eval mode, as apt-ds trains: the same cut whatever the RNG says,
    and the model's own mode is given back."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from test_encoders import encoder_batch, tiny_encoder

    batches = [{**encoder_batch("bert", seed=s), "labels": torch.tensor([0, 1, 1, 0])} for s in (1, 2)]
    results = []
    for rng_seed in (0, 1):
        model = tiny_encoder("bert", hidden_dropout_prob=0.5, attention_probs_dropout_prob=0.5).train()
        torch.manual_seed(rng_seed)
        results.append(one_shot_prune(model, batches, 0.6))
        assert model.training  # given back as it came
    (first, second) = results
    assert first.calibration_loss == second.calibration_loss
    assert [g.tolist() for g in first.decision.groups] == [g.tolist() for g in second.decision.groups]
    assert [n.tolist() for n in first.decision.neurons] == [n.tolist() for n in second.decision.neurons]
    assert first.decision.hidden.tolist() == second.decision.hidden.tolist()
