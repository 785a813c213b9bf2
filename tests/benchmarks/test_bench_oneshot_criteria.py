"""benchmarks/oneshot_criteria.py: each criterion cuts a model to the density in one shot, and the
structured Wanda score is what its docstring says."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import random_batch, tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import oneshot_criteria

from apt_ds.algorithm.units import ModelShape


def _batches():
    batches = [random_batch(batch=3, length=10, seed=s) for s in (1, 2)]
    for batch in batches:
        batch["attention_mask"][0, 7:] = 0  # padding must not count
        batch["labels"][:, :5] = -100  # a response: the first half unsupervised
    return batches


def test_wanda_sp_scores_are_input_norms_times_column_sums():
    model = tiny_llama("gqa")
    batches = _batches()
    groups, neurons = oneshot_criteria.wanda_sp_scores(model, batches)
    layer = model.model.layers[1]
    seen = []
    handle = layer.mlp.down_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    handle.remove()
    real = torch.cat([x[m.bool()] for x, m in zip(seen, (b["attention_mask"] for b in batches))])
    expected = real.norm(dim=0) * layer.mlp.down_proj.weight.abs().sum(0)
    torch.testing.assert_close(neurons[1], expected, rtol=1e-4, atol=1e-6)
    assert [g.shape[0] for g in groups] == [2, 2] and all(g.min() > 0 for g in groups)


@pytest.mark.parametrize("criterion", oneshot_criteria.CRITERIA)
def test_each_criterion_cuts_to_the_density_and_the_model_still_runs(criterion):
    model = tiny_llama("gqa", intermediate_size=256)
    before = ModelShape.from_model(model)
    shape = oneshot_criteria.prune(model, criterion, 0.6, _batches())
    assert shape == ModelShape.from_model(model)
    assert 0.5 <= shape.block_params() / before.block_params() <= 0.6
    assert shape.uniform or not criterion.endswith("_uniform")
    if criterion.startswith("wanda"):
        assert shape.hidden == before.hidden  # hidden channels are kept: the score has none for them
    assert not any(p.requires_grad for p in model.parameters())
    logits = model(**{k: v for k, v in _batches()[0].items() if k != "labels"}).logits
    assert torch.isfinite(logits).all()
