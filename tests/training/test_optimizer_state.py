"""The optimizer across APT's shape changes (one process): the global gradient norm clipped as a
whole, Adam's moments and the LR carried through shrinks and rank growth, and grown entries'
first step no larger than a fresh Adam's."""

from __future__ import annotations

import pytest
import torch
from conftest import random_batch, tiny_llama

from apt_ds import APTConfig
from apt_ds.algorithm.pruner import KeepDecision
from apt_ds.algorithm.shrink import group_channels
from apt_ds.algorithm.state import APTModel
from apt_ds.algorithm.tuner import AdaptiveTuner
from apt_ds.distributed.backend import LocalBackend
from apt_ds.training.lr_schedule import warmup_cosine


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs with one torch thread (see conftest.one_thread)."""


def _global_norm(grads) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads if g is not None])))


@pytest.mark.parametrize("max_grad_norm", [0.0, 1e-3])
def test_local_backend_clips_the_global_gradient_norm(max_grad_norm):
    model = tiny_llama("gqa")
    APTModel(model, APTConfig(adapter_targets=("q_proj", "v_proj"), adapter_rank=4, distill=False), seed=0)
    backend = LocalBackend()
    backend.attach(model, 1e-2, lambda step: 1.0, 0.0, 1, max_grad_norm=max_grad_norm)
    assert backend.grad_norm is None
    stepped = []  # the global norm of the gradients the optimizer actually steps with

    def record(optimizer, args, kwargs):
        stepped.append(_global_norm(p.grad for group in optimizer.param_groups for p in group["params"]))

    hook = backend.optimizer.register_step_pre_hook(record)
    try:
        backend.backward(model(**random_batch(seed=1)).loss)
        unclipped = _global_norm(p.grad for p in model.parameters())
        backend.step()
    finally:
        hook.remove()
    assert backend.grad_norm == pytest.approx(unclipped, rel=1e-5) and unclipped > 1e-2
    assert stepped[0] == pytest.approx(max_grad_norm if max_grad_norm else unclipped, rel=1e-4)


# ---- optimizer state across a shape change (LocalBackend directly) ----------------------------------

def test_adam_state_and_lr_carried_across_shrink_and_growth():
    torch.set_num_threads(1)
    model = tiny_llama("gqa")
    apt = APTConfig(adapter_targets=("q_proj", "v_proj", "o_proj", "down_proj"), adapter_rank=4, distill=False,
                    pruning_start_step=1, pruning_end_step=20, num_pruning_events=2)
    state = APTModel(model, apt, seed=0)
    backend = LocalBackend()
    lr_lambda = warmup_cosine(2, 20)
    backend.attach(model, 1e-2, lr_lambda, 0.0, 1, max_grad_norm=0.0)
    for i in range(3):
        backend.backward(model(**random_batch(seed=i)).loss)
        backend.step()
    shape = state.shape
    old = {n: {k: v.clone() for k, v in backend.optimizer.state[p].items()} for n, p in model.named_parameters()
           if p.requires_grad}
    lr_before = backend.lr
    # drop group 0 of layer 1, a third of the neurons, 5 hidden channels; grow two adapters
    groups = [torch.tensor([0, 1]), torch.tensor([1])]
    neurons = [torch.arange(0, 96, 3), torch.arange(50)]
    hidden = torch.tensor([c for c in range(64) if c not in (3, 17, 18, 40, 63)])
    decision = KeepDecision(
        [torch.zeros(l.num_kv_groups, dtype=torch.bool).index_fill_(0, g, True) for l, g in zip(shape.layers, groups)],
        [torch.zeros(l.ffn, dtype=torch.bool).index_fill_(0, n, True) for l, n in zip(shape.layers, neurons)],
        torch.zeros(shape.hidden, dtype=torch.bool).index_fill_(0, hidden, True), 0,
    )
    tuner = AdaptiveTuner(apt)
    grow = {"model.layers.1.self_attn.q_proj": 7, "model.layers.1.self_attn.o_proj": 6}

    def change_fn():
        change = state.shrink(decision, backend.param_access())
        growth = tuner.grow(state.adapters, grow, torch.Generator().manual_seed(0))
        return {**change, **{k: change.get(k, []) + v for k, v in growth.items()}}

    backend.apply_shape_change(change_fn)
    assert backend.optimizer_steps == 3
    assert backend.lr == pytest.approx(lr_before) and backend.lr == pytest.approx(1e-2 * lr_lambda(3))
    params = dict(model.named_parameters())
    q_ch, _ = group_channels(groups[1], 2, 16)

    def expect(name, fn):
        new = backend.optimizer.state[params[name]]
        for key in ("exp_avg", "exp_avg_sq"):
            fill = float(old[name][key].mean()) if key == "exp_avg_sq" else 0.0  # grown entries: carry_adam_moment
            torch.testing.assert_close(new[key], fn(old[name][key], fill), rtol=0, atol=0)
            assert new[key].shape == params[name].shape
        assert float(new["step"]) == float(old[name]["step"]) == 3.0

    pad_rows = lambda t, n, fill: torch.cat([t, t.new_full((n - t.shape[0], t.shape[1]), fill)], 0)  # noqa: E731
    pad_cols = lambda t, n, fill: torch.cat([t, t.new_full((t.shape[0], n - t.shape[1]), fill)], 1)  # noqa: E731
    p0, p1 = "model.layers.0.", "model.layers.1."
    expect(p0 + "self_attn.q_proj.lora_A", lambda t, f: t[:, hidden])
    expect(p0 + "self_attn.q_proj.lora_B", lambda t, f: t)  # layer 0 keeps both groups
    expect(p1 + "self_attn.q_proj.lora_A", lambda t, f: pad_rows(t[:, hidden], 7, f))
    expect(p1 + "self_attn.q_proj.lora_B", lambda t, f: pad_cols(t[q_ch], 7, f))
    expect(p1 + "self_attn.v_proj.lora_B", lambda t, f: t[16:32])
    expect(p1 + "self_attn.o_proj.lora_A", lambda t, f: pad_rows(t[:, q_ch], 6, f))
    expect(p1 + "self_attn.o_proj.lora_B", lambda t, f: pad_cols(t[hidden], 6, f))
    expect(p0 + "mlp.down_proj.lora_A", lambda t, f: t[:, neurons[0]])
    expect(p1 + "mlp.down_proj.lora_B", lambda t, f: t[hidden])
    nonzero = backend.optimizer.state[params[p1 + "self_attn.q_proj.lora_A"]]["exp_avg"]
    assert bool((nonzero[:4] != 0).any()) and bool((nonzero[4:] == 0).all())
    # and training continues on the rebuilt optimizer
    backend.backward(model(**random_batch(seed=9)).loss)
    backend.step()
    assert backend.optimizer_steps == 4
    assert backend.lr == pytest.approx(1e-2 * lr_lambda(4))


def test_grown_entries_first_step_is_no_larger_than_a_fresh_adams():
    """After many steps Adam's bias correction is ~1; entries grown then (one step count per
    parameter) must not take a first step of (1 - b1) / sqrt(1 - b2) ~ 3.2 x lr with zero moments."""
    from apt_ds.algorithm.edits import Grow

    lr = 1e-2
    weight = torch.nn.Parameter(torch.randn(4, 8))
    model = torch.nn.Module()
    model.weight = weight
    backend = LocalBackend()
    backend.attach(model, lr, lambda step: 1.0, 0.0, 1, max_grad_norm=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):  # bias correction ~1
        backend.backward((model.weight * torch.randn(4, 8, generator=gen)).sum())
        backend.step()

    def change_fn():
        with torch.no_grad():
            model.weight = torch.nn.Parameter(torch.cat([model.weight.detach(), torch.zeros(4, 4)], 1))
        return {"weight": [Grow(1, 12)]}

    backend.apply_shape_change(change_fn)
    before = model.weight.detach().clone()
    backend.backward((model.weight * torch.randn(4, 12, generator=gen)).sum())  # gradients of the usual size
    backend.step()
    first_step = (model.weight.detach() - before)[:, 8:].abs()
    assert float(first_step.max()) <= lr * 1.0001  # a fresh Adam's first step is lr in every entry


# ---- checkpoint resume -------------------------------------------------------------------------------
