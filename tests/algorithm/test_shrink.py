"""Unit masks, and physical removal of masked units (same logits, exact parameter count)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CONFIGS, random_batch, random_kept, set_binary_masks, tiny_llama

from apt_ds.algorithm.adapters import add_adapters
from apt_ds.algorithm.edits import apply_edits
from apt_ds.algorithm.masks import UnitMasks
from apt_ds.algorithm.pruner import GradualMasker, KeepDecision
from apt_ds.algorithm.shrink import compact_columns, group_channels, shrink_model
from apt_ds.algorithm.units import LayerShape, ModelShape

ADAPTER_TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")


def _adapted_model(kind: str, seed: int = 0):
    model = tiny_llama(kind, seed=seed)
    adapters = add_adapters(model, ADAPTER_TARGETS, rank=4, alpha=8.0, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.lora_B.copy_(0.05 * torch.randn(adapter.lora_B.shape, generator=gen))
    return model, adapters


def _counted_params(model) -> int:
    """Unique parameters (tied weights once), without adapters."""
    return sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)


# ---- masks ---------------------------------------------------------------------------------------

def test_all_ones_masks_change_nothing_and_disabled_masks_are_skipped():
    model = tiny_llama("gqa")
    batch = random_batch()
    with torch.no_grad():
        reference = model(**batch).logits
    shape = ModelShape.from_model(model)
    masks = UnitMasks(shape)
    masks.install(model)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, reference, rtol=0, atol=0)
        set_binary_masks(masks, shape, *random_kept(shape, seed=0))
        masked = model(**batch).logits
        masks.enabled = False
        torch.testing.assert_close(model(**batch).logits, reference, rtol=0, atol=0)
        masks.enabled = True
        masks.remove()
        torch.testing.assert_close(model(**batch).logits, reference, rtol=0, atol=0)
    assert (masked - reference).abs().max() > 1e-3


def test_group_mask_zeroes_exactly_its_query_heads():
    """Group k of a GQA layer = query heads k*g .. k*g+g-1 (HF repeat_kv order)."""
    model = tiny_llama("gqa")
    batch = random_batch()
    shape = ModelShape.from_model(model)
    layer, g, dh = shape.layers[0], shape.layers[0].group_size, shape.layers[0].head_dim
    masks = UnitMasks(shape)
    masks.install(model)
    masks.kv_group[0] = torch.tensor([1.0, 0.0])
    masks.refresh()
    with torch.no_grad():
        masked = model(**batch).logits
        masks.remove()
        o_proj = model.model.layers[0].self_attn.o_proj
        o_proj.weight[:, 1 * g * dh : 2 * g * dh] = 0  # query heads 2, 3 feed these columns
        direct = model(**batch).logits
    torch.testing.assert_close(masked, direct, rtol=1e-5, atol=1e-5)
    q_ch, kv_ch = group_channels(torch.tensor([1]), group_size=g, head_dim=dh)
    assert q_ch.tolist() == list(range(g * dh, 2 * g * dh))
    assert kv_ch.tolist() == list(range(dh, 2 * dh))
    assert layer.num_kv_groups == 2


def test_fractional_masks_scale_units():
    model = tiny_llama("mha")
    batch = random_batch()
    shape = ModelShape.from_model(model)
    masks = UnitMasks(shape)
    masks.install(model)
    masks.ffn_neuron[1] = torch.full((shape.layers[1].ffn,), 0.5)
    masks.refresh()
    assert not masks.is_binary()
    with torch.no_grad():
        half = model(**batch).logits
        masks.remove()
        model.model.layers[1].mlp.down_proj.weight.mul_(0.5)
        direct = model(**batch).logits
    torch.testing.assert_close(half, direct, rtol=1e-5, atol=1e-5)


def test_mask_state_dict_round_trip():
    shape = ModelShape.from_model(tiny_llama("gqa_tied"))
    masks = UnitMasks(shape)
    set_binary_masks(masks, shape, *random_kept(shape, seed=4))
    assert masks.is_binary()
    other = UnitMasks(shape)
    other.load_state_dict(masks.state_dict())
    assert torch.equal(other.hidden, masks.hidden)
    assert all(torch.equal(a, b) for a, b in zip(other.kv_group, masks.kv_group))
    assert all(torch.equal(a, b) for a, b in zip(other.ffn_neuron, masks.ffn_neuron))
    assert other._hidden_active  # refresh() ran


def test_gradual_masker_moves_then_snaps():
    shape = ModelShape.from_model(tiny_llama("gqa"))
    masks = UnitMasks(shape)
    groups, neurons, hidden = random_kept(shape, seed=2)
    decision = KeepDecision(
        [torch.zeros(l.num_kv_groups, dtype=torch.bool).index_fill_(0, g, True) for l, g in zip(shape.layers, groups)],
        [torch.zeros(l.ffn, dtype=torch.bool).index_fill_(0, n, True) for l, n in zip(shape.layers, neurons)],
        torch.zeros(shape.hidden, dtype=torch.bool).index_fill_(0, hidden, True), 0,
    )
    masker = GradualMasker(0.25)
    masker.step_toward(masks, decision)
    leaving = ~decision.hidden
    assert torch.allclose(masks.hidden[leaving], torch.tensor(0.75))
    assert bool((masks.hidden[decision.hidden] == 1).all())
    for _ in range(5):
        masker.step_toward(masks, decision)
    assert bool((masks.hidden[leaving] == 0).all())  # clamped at 0
    masks.hidden[leaving] = 0.5  # a returning unit moves back up
    flipped = decision.hidden.clone()
    flipped[leaving.nonzero()[0]] = True
    masker.step_toward(masks, KeepDecision(decision.groups, decision.neurons, flipped, 0))
    assert float(masks.hidden[leaving.nonzero()[0]]) == pytest.approx(0.75)
    GradualMasker.snap(masks, decision)
    assert masks.is_binary()
    assert torch.equal(masks.hidden.bool(), decision.hidden)
    assert all(torch.equal(m.bool(), k) for m, k in zip(masks.ffn_neuron, decision.neurons))


# ---- shrink == mask ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
@pytest.mark.parametrize("prune_hidden", [True, False])
def test_shrink_matches_masked_model(kind, prune_hidden):
    model, adapters = _adapted_model(kind)
    batch = random_batch()
    shape = ModelShape.from_model(model)
    groups, neurons, hidden = random_kept(shape, seed=7, prune_hidden=prune_hidden)
    masks = UnitMasks(shape)
    masks.install(model)
    with torch.no_grad():
        unmasked = model(**batch).logits
        set_binary_masks(masks, shape, groups, neurons, hidden)
        masked = model(**batch).logits
        masked_gen = model.generate(batch["input_ids"][:2, :6], attention_mask=batch["attention_mask"][:2, :6],
                                    max_new_tokens=5, do_sample=False)
    assert (masked - unmasked).abs().max() > 1e-3  # the masks really remove something
    old_lora = {name: (a.lora_A.detach().clone(), a.lora_B.detach().clone()) for name, a in adapters.items()}

    new_shape, change = shrink_model(model, shape, groups, neurons, hidden)
    masks.reset(new_shape)  # all ones again: inactive

    with torch.no_grad():
        shrunk = model(**batch).logits
    torch.testing.assert_close(shrunk, masked, rtol=0, atol=1e-5)

    # shapes and parameter counts
    assert ModelShape.from_model(model) == new_shape
    assert ModelShape.from_config(model.config) == new_shape
    assert [l.num_kv_groups for l in new_shape.layers] == [len(g) for g in groups]
    assert [l.ffn for l in new_shape.layers] == [len(n) for n in neurons]
    assert new_shape.hidden == len(hidden)
    assert _counted_params(model) == new_shape.total_params() < shape.total_params()
    cfg = TINY_CONFIGS[kind]
    attn0 = model.model.layers[0].self_attn
    assert attn0.q_proj.weight.shape == (len(groups[0]) * shape.layers[0].group_size * attn0.head_dim, len(hidden))
    assert attn0.num_key_value_groups == cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    if kind == "gqa_tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight

    # adapters: sliced to the kept units; the returned edits reproduce them from the old tensors
    for name, adapter in adapters.items():
        assert adapter.lora_A.shape[1] == adapter.in_features and adapter.lora_B.shape[0] == adapter.out_features
        assert adapter.teacher_A.shape == adapter.lora_A.shape and adapter.teacher_B.shape == adapter.lora_B.shape
        old_a, old_b = old_lora[name]
        new_a = apply_edits(old_a, change.get(f"{name}.lora_A", []))
        new_b = apply_edits(old_b, change.get(f"{name}.lora_B", []))
        assert torch.equal(new_a, adapter.lora_A.detach()) and torch.equal(new_b, adapter.lora_B.detach())
    assert all(".lora_" in key for key in change)
    assert len(change) > 0

    # generation still works, and greedy tokens match the masked model
    with torch.no_grad():
        generated = model.generate(batch["input_ids"][:2, :6], attention_mask=batch["attention_mask"][:2, :6],
                                   max_new_tokens=5, do_sample=False)
    assert generated.shape == (2, 11)
    assert torch.equal(generated, masked_gen)


def test_shrunk_model_still_trains():
    model, adapters = _adapted_model("gqa")
    shape = ModelShape.from_model(model)
    shrink_model(model, shape, *random_kept(shape, seed=3))
    loss = model(**random_batch()).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(a.lora_A.grad is not None and a.lora_A.grad.shape == a.lora_A.shape for a in adapters.values())


def test_shrink_twice_composes():
    """Two successive shrinks equal one shrink to the composed kept set (indices are relative)."""
    model_a, _ = _adapted_model("gqa_tied", seed=1)
    model_b, _ = _adapted_model("gqa_tied", seed=1)
    batch = random_batch()
    shape = ModelShape.from_model(model_a)
    first = random_kept(shape, seed=11)
    mid_shape, _ = shrink_model(model_a, shape, *first)
    second = random_kept(mid_shape, seed=12)
    final_a, _ = shrink_model(model_a, mid_shape, *second)
    composed = ([f[s] for f, s in zip(first[0], second[0])], [f[s] for f, s in zip(first[1], second[1])],
                first[2][second[2]])
    final_b, _ = shrink_model(model_b, shape, *composed)
    assert final_a == final_b
    with torch.no_grad():
        torch.testing.assert_close(model_a(**batch).logits, model_b(**batch).logits, rtol=0, atol=1e-5)


def _decision_for(shape: ModelShape, seed: int) -> KeepDecision:
    gen = torch.Generator().manual_seed(seed)
    return KeepDecision([torch.rand(l.num_kv_groups, generator=gen) < 0.5 for l in shape.layers],
                        [torch.rand(l.ffn, generator=gen) < 0.5 for l in shape.layers],
                        torch.rand(shape.hidden, generator=gen) < 0.5, 0)


def test_gradual_masker_moves_every_mask_as_one_layer_at_a_time_would():
    shape = ModelShape(40, (LayerShape(3, 2, 8, 50), LayerShape(1, 2, 8, 7), LayerShape(4, 1, 8, 90)), 61, False)
    masks, decision, step = UnitMasks(shape), _decision_for(shape, seed=3), 0.3
    gen = torch.Generator().manual_seed(4)
    for mask in masks.tensors():
        mask.copy_(torch.rand(mask.shape, generator=gen))  # somewhere inside a decay window
    masks.refresh()

    def moved(mask, keep):  # the per-mask rule
        return torch.where(keep, (mask + step).clamp(max=1.0), (mask - step).clamp(min=0.0))

    expected = [moved(m, k) for m, k in zip(masks.tensors(), [decision.hidden, *decision.groups, *decision.neurons])]
    GradualMasker(step).step_toward(masks, decision)
    assert all(torch.equal(a, b) for a, b in zip(masks.tensors(), expected))
    assert [m.shape for m in masks.tensors()] == [e.shape for e in expected]


def test_gradual_masker_work_does_not_grow_with_the_layers(monkeypatch):
    """On a GPU each operation is a kernel launch: one update over all masks, not one per layer and kind."""
    from benchmarks._common import dispatched_operations

    counts = []
    for layers in (2, 8):
        shape = ModelShape(32, tuple(LayerShape(2, 2, 8, 24) for _ in range(layers)), 61, False)
        masks = UnitMasks(shape)
        monkeypatch.setattr(masks, "refresh", lambda: None)  # its own reads are per mask, on purpose
        decision = _decision_for(shape, seed=layers)
        counts.append(dispatched_operations(lambda: GradualMasker(0.25).step_toward(masks, decision), views=False))
    assert counts[0] == counts[1] <= 8


def test_gradual_masker_refuses_a_decision_for_other_shapes():
    from apt_ds.algorithm.pruner import PruningError

    shape = ModelShape(40, (LayerShape(3, 2, 8, 50), LayerShape(1, 2, 8, 7)), 61, False)
    other = ModelShape(40, (LayerShape(1, 2, 8, 50), LayerShape(3, 2, 8, 7)), 61, False)  # the same total
    with pytest.raises(PruningError, match="do not match"):
        GradualMasker(0.25).step_toward(UnitMasks(shape), _decision_for(other, seed=0))


@pytest.mark.parametrize("rows, cols, kept, block", [(10, 7, 3, 3), (1000, 64, 50, 128), (5, 4, 4, 2), (9, 6, 1, 4)])
def test_compact_columns_keeps_columns_in_the_matrix_own_storage(rows, cols, kept, block):
    """The embedding's hidden channels kept under ZeRO-3 without a second full matrix: the result
    is matrix[:, index], in the same storage (unsorted indices too)."""
    generator = torch.Generator().manual_seed(rows)
    matrix = torch.randn(rows, cols, generator=generator)
    index = torch.randperm(cols, generator=generator)[:kept]
    expected = matrix[:, index].clone()
    result = compact_columns(matrix, index, rows_per_block=block)
    assert torch.equal(result, expected)
    assert result.untyped_storage().data_ptr() == matrix.untyped_storage().data_ptr()
