"""The supervised forward (apt_ds.training.forward): logits only where a label is learned."""

from __future__ import annotations

import pytest
import torch
from conftest import random_batch, tiny_llama

from apt_ds.training.forward import supervised_forward


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs with one torch thread (see conftest.one_thread)."""


@pytest.mark.parametrize("response_only", [True, False])
def test_supervised_forward_matches_full_causal_lm_loss_and_gradient(response_only):
    """Logits only at supervised positions: same loss and same gradients as the full loss."""
    batch = random_batch(batch=3, length=10)
    if response_only:  # a response of different length and place per row, one row right-padded
        labels = torch.full_like(batch["labels"], -100)
        labels[0, 6:] = batch["input_ids"][0, 6:]
        labels[1, 3:5] = batch["input_ids"][1, 3:5]
        labels[2, 8] = batch["input_ids"][2, 8]
        batch["labels"] = labels
        batch["attention_mask"][2, 9:] = 0
    grads = []
    for mode in ("full", "supervised"):
        model = tiny_llama("gqa")
        if mode == "full":
            out = model(**batch)
            loss, kept = out.loss, out.logits.shape[1]
        else:
            out, loss, supervised = supervised_forward(model, batch)
            kept = out.logits.shape[1]
            assert int(supervised.sum()) == int((batch["labels"][:, 1:] != -100).sum())
        loss.backward()
        grads.append((float(loss.detach()), kept, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (full_loss, full_kept, full_grads), (loss, kept, sup_grads) = grads
    assert loss == pytest.approx(full_loss, rel=1e-5)
    assert kept < full_kept if response_only else kept == full_kept - 1
    for name, grad in full_grads.items():
        torch.testing.assert_close(sup_grads[name], grad, atol=1e-6, rtol=1e-4)
