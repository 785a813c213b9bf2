"""The divergence that uniform shape trials can score (APTConfig.uniform_shape_metric="kl",
`shape_trials.divergence_measure`): its positions, its token budget, and the number itself."""

from __future__ import annotations

import pytest
import torch
from conftest import random_batch, tiny_llama

from apt_ds.algorithm.masks import UnitMasks
from apt_ds.algorithm.units import ModelShape
from apt_ds.training.shape_trials import divergence_measure, trial_positions


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs with one torch thread (see conftest.one_thread)."""


def test_trial_positions_cover_real_tokens_and_cap_evenly():
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0  # a shorter row, right-padded
    positions, real = trial_positions(mask, limit=256)
    assert positions.tolist() == list(range(10)) and torch.equal(real, mask.bool())
    positions, real = trial_positions(mask, limit=4)
    assert positions.tolist() == [0, 3, 6, 9] and real.tolist() == [[True] * 4, [True, True, False, False]]
    left = torch.zeros(1, 600, dtype=torch.long)
    left[0, 100:] = 1  # left padding: the positions are among the real ones only
    positions, _ = trial_positions(left, limit=256)
    assert len(positions) == 256 and positions[0] == 100 and positions[-1] == 599


def test_divergence_shares_its_token_budget_over_the_step():
    """The reference it keeps is bounded by the token budget however the step is split."""
    seen = []

    def forward(input_ids, attention_mask, logits_to_keep, use_cache):
        seen.append(len(logits_to_keep))
        return type("Out", (), {"logits": torch.zeros(input_ids.shape[0], len(logits_to_keep), 5)})()

    batches = [{"input_ids": torch.ones(4, 300, dtype=torch.long), "attention_mask": torch.ones(4, 300, dtype=torch.long)}
               for _ in range(2)]
    divergence_measure(forward, batches, lambda t: t, token_budget=1024)
    assert seen == [128, 128]  # 1024 tokens / 2 micro-batches / 4 rows
    seen.clear()
    divergence_measure(forward, batches[:1], lambda t: t, token_budget=1024)
    assert seen == [256]


def test_divergence_is_zero_for_the_current_model_and_grows_with_the_cut():
    """KL(masked || as it was) over the real tokens of every micro-batch: 0 with the masks as they
    were, larger for a larger cut, equal to the divergence computed by hand, padding excluded."""
    model = tiny_llama("gqa")
    masks = UnitMasks(ModelShape.from_model(model))
    masks.install(model)
    batches = [random_batch(batch=3, length=12, seed=s) for s in (1, 2)]
    batches[1]["attention_mask"][0, 9:] = 0
    forward = torch.no_grad()(model)
    measure = divergence_measure(forward, batches, reduce_sum=lambda totals: totals)
    # a second rank's (KL sum, tokens) joins the totals before the division
    other_rank = divergence_measure(forward, batches, reduce_sum=lambda totals: totals + torch.tensor([30.0, 10.0], dtype=torch.float64))
    assert measure() == pytest.approx(0.0, abs=1e-7)
    before = [torch.log_softmax(forward(**{k: v for k, v in b.items() if k != "labels"}).logits.float(), -1) for b in batches]
    masks.ffn_neuron[0][: masks.ffn_neuron[0].numel() // 2] = 0
    masks.refresh()
    small = measure()
    after = [torch.log_softmax(forward(**{k: v for k, v in b.items() if k != "labels"}).logits.float(), -1) for b in batches]
    real = [b["attention_mask"].bool() for b in batches]
    by_hand = sum(float((a.exp() * (a - r)).sum(-1)[m].sum()) for a, r, m in zip(after, before, real)) / sum(int(m.sum()) for m in real)
    assert small == pytest.approx(by_hand, rel=1e-5) and small > 0
    masks.kv_group[1][:] = torch.tensor([1.0, 0.0])
    masks.refresh()
    assert measure() > small
    own = sum(int(m.sum()) for m in real)
    assert other_rank() == pytest.approx((measure() * own + 30.0) / (own + 10), rel=1e-6)
