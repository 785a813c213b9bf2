"""How decaying masks enter the forward: the RMSNorm over kept channels, the factors made once per
mask update, and what install / remove leave behind (the masks' effect on units: test_shrink.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import random_batch, tiny_llama

from apt_ds.algorithm.masks import UnitMasks
from apt_ds.algorithm.units import ModelShape
from apt_ds.training.forward import enable_activation_checkpointing


def _decay(masks: UnitMasks, value: float, seed: int = 0) -> None:
    """A block of every kind partly decayed in every layer, as inside a decay window."""
    gen = torch.Generator().manual_seed(seed)
    for group_mask, neuron_mask in zip(masks.kv_group, masks.ffn_neuron):
        group_mask[-1:] = value
        neuron_mask[-16:] = value * torch.rand(16, generator=gen)
    masks.hidden[-8:] = value * torch.rand(8, generator=gen)
    masks.refresh()


def _masked_model(kind: str = "gqa"):
    model = tiny_llama(kind)
    masks = UnitMasks(ModelShape.from_model(model))
    masks.install(model)
    return model, masks


def test_norms_average_over_the_kept_channels_only():
    """Each RMSNorm divides sum(x^2) by the kept channels' mask sum, not by the width."""
    model, masks = _masked_model()
    _decay(masks, 0.5)
    norm = model.model.norm
    seen = {}
    handle = norm.register_forward_hook(lambda module, args, output: seen.update(x=args[0], y=output))
    with torch.no_grad():
        model(**random_batch())
    handle.remove()
    x = seen["x"].double()
    expected = norm.weight.double() * x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / masks.hidden.double().sum()
                                                      + norm.variance_epsilon)
    torch.testing.assert_close(seen["y"].double(), expected, rtol=1e-5, atol=1e-6)
    plain = norm.weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    assert (seen["y"].double() - plain).abs().max() > 1e-3  # the width's mean would differ


def test_remove_gives_the_norms_their_own_forward_back():
    model = tiny_llama("gqa")
    batch = random_batch()
    norms = [model.model.norm] + [n for layer in model.model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    with torch.no_grad():
        reference = model(**batch).logits
    masks = UnitMasks(ModelShape.from_model(model))
    masks.install(model)
    masks.install(model)  # idempotent: the second install does not wrap the first one's forward
    assert all("forward" in norm.__dict__ for norm in norms)
    _decay(masks, 0.5)
    masks.remove()
    assert not any("forward" in norm.__dict__ for norm in norms)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, reference, rtol=0, atol=0)


def test_a_mask_update_replaces_what_the_hooks_multiply_by():
    """Factors are kept between forwards; a refresh after editing the masks makes them anew."""
    model, masks = _masked_model()
    batch = random_batch()
    with torch.no_grad():
        _decay(masks, 0.9)
        model(**batch)
        _decay(masks, 0.2, seed=1)
        updated = model(**batch).logits
    fresh, fresh_masks = _masked_model()
    _decay(fresh_masks, 0.2, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(updated, fresh(**batch).logits, rtol=0, atol=0)


def test_factors_made_under_inference_mode_do_not_break_a_later_backward():
    model, masks = _masked_model()
    with torch.inference_mode():
        _decay(masks, 0.5)  # a mask update under inference_mode, too
        model(**random_batch())
    batch = random_batch()
    model(**batch).loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_factors_are_made_per_dtype():
    """A forward in another dtype gets factors in that dtype, not the first forward's."""
    model, masks = _masked_model()
    _decay(masks, 0.5)
    batch = random_batch()
    with torch.no_grad():
        model(**batch)
        model.to(torch.bfloat16)
        logits = model(**batch).logits
    fresh, fresh_masks = _masked_model()
    fresh.to(torch.bfloat16)
    _decay(fresh_masks, 0.5)
    with torch.no_grad():
        expected = fresh(**batch).logits
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_masks_removed_out_of_order_say_so():
    """Masks installed over other masks (or under another wrapper of the norm's forward) must be
    removed first: removing the ones beneath would drop the routing of the ones on top."""
    model = tiny_llama("gqa")
    shape = ModelShape.from_model(model)
    beneath, on_top = UnitMasks(shape), UnitMasks(shape)
    beneath.install(model)
    on_top.install(model)
    with pytest.raises(RuntimeError, match="replaced after these masks were installed"):
        beneath.remove()
    on_top.remove()
    beneath.remove()
    assert "forward" not in model.model.norm.__dict__


@pytest.mark.parametrize("dtype, before", [(torch.float32, 113), (torch.bfloat16, 148)])
def test_decaying_masks_add_few_operations_to_a_checkpointed_step(dtype, before):
    """On a GPU every operation is a kernel launch the host pays for, in every layer of every step of
    a decay window. Per layer, in forward, recompute and backward: a multiplication at o_proj's and
    down_proj's inputs and at their two outputs, and the norms' one extra division: 37 in all here, in
    either dtype (`before`: the count when every norm was computed twice and the hooks cast and
    expanded the masks on every call; in bf16 casts made per call would also break the bound)."""
    model, masks = _masked_model()
    model.to(dtype)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from _common import dispatched_operations

    enable_activation_checkpointing(model)  # the CLI's: each layer's forward runs again in backward
    batch = random_batch()

    def step() -> None:
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    idle = dispatched_operations(step, views=False)
    _decay(masks, 0.5)
    step()
    extra = dispatched_operations(step, views=False) - idle
    assert 0 < extra <= 20 * len(model.model.layers) + 4 < before
