"""APTAdapter: wrapping, rank growth (function-preserving), slicing, merging; edit records."""

from __future__ import annotations

import pytest
import torch
from conftest import random_batch, tiny_llama
from torch import nn

from apt_ds.algorithm.adapters import APTAdapter, add_adapters, find_adapters, merge_adapters
from apt_ds.algorithm.edits import Grow, Keep, apply_edits, merge_changes


def _adapter(out_f=24, in_f=40, rank=4, alpha=8.0, seed=0, bias=False) -> tuple[APTAdapter, nn.Linear]:
    torch.manual_seed(seed)
    linear = nn.Linear(in_f, out_f, bias=bias)
    reference = nn.Linear(in_f, out_f, bias=bias)
    reference.load_state_dict(linear.state_dict())
    adapter = APTAdapter.wrap(linear, rank, alpha, torch.Generator().manual_seed(seed))
    return adapter, reference


def _randomize_b(adapter: APTAdapter, seed=1, std=0.5) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape, generator=gen) * std)


def _rel_err(a, b) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def test_wrap_is_in_place_frozen_and_starts_from_the_pretrained_function():
    adapter, reference = _adapter(bias=True)
    weight = adapter.weight
    assert isinstance(adapter, APTAdapter) and isinstance(adapter, nn.Linear)
    assert not adapter.weight.requires_grad and not adapter.bias.requires_grad
    assert adapter.lora_A.requires_grad and adapter.lora_B.requires_grad
    assert adapter.lora_A.shape == (4, 40) and adapter.lora_B.shape == (24, 4)
    assert bool((adapter.lora_A != 0).any()) and bool((adapter.lora_B == 0).all())
    assert adapter.scaling == pytest.approx(8.0 / 4)
    x = torch.randn(5, 40)
    torch.testing.assert_close(adapter(x), reference(x), rtol=0, atol=0)
    assert adapter.weight is weight  # same Parameter object: keys and ZeRO attributes survive
    assert set(adapter.state_dict()) >= {"weight", "bias", "lora_A", "lora_B", "teacher_A", "teacher_B"}
    with pytest.raises(TypeError):
        APTAdapter.wrap(adapter, 2, 4.0)  # already wrapped


def test_forward_is_w_plus_scaled_low_rank_update():
    adapter, reference = _adapter()
    _randomize_b(adapter)
    x = torch.randn(3, 7, 40)
    expected = reference(x) + adapter.scaling * (x @ adapter.lora_A.T) @ adapter.lora_B.T
    torch.testing.assert_close(adapter(x), expected, rtol=1e-5, atol=1e-6)
    assert _rel_err(adapter(x), reference(x)) > 1e-2  # the update is not negligible


@pytest.mark.parametrize("old_rank, new_rank", [(4, 5), (4, 8), (1, 64)])
def test_grow_rank_preserves_output_and_reports_edits(old_rank, new_rank):
    adapter, _ = _adapter(rank=old_rank)
    _randomize_b(adapter)
    adapter.snapshot_teacher()
    old_a, old_b = adapter.lora_A.detach().clone(), adapter.lora_B.detach().clone()
    scaling = adapter.scaling
    x = torch.randn(16, 40, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = adapter(x)
        adapter.use_teacher = True
        teacher_before = adapter(x)
        adapter.use_teacher = False
    edits = adapter.grow_rank(new_rank, torch.Generator().manual_seed(9))
    assert edits == {"lora_A": [Grow(0, new_rank)], "lora_B": [Grow(1, new_rank)]}
    assert adapter.rank == new_rank
    assert adapter.lora_A.shape == (new_rank, 40) and adapter.lora_B.shape == (24, new_rank)
    assert adapter.teacher_A.shape == (new_rank, 40) and adapter.teacher_B.shape == (24, new_rank)
    assert isinstance(adapter.lora_A, nn.Parameter) and adapter.lora_A.requires_grad and adapter.lora_B.requires_grad
    assert adapter.scaling == scaling  # s = alpha / r0 stays constant
    torch.testing.assert_close(adapter.lora_A[:old_rank], old_a, rtol=0, atol=0)
    torch.testing.assert_close(adapter.lora_B[:, :old_rank], old_b, rtol=0, atol=0)
    assert bool((adapter.lora_A[old_rank:] != 0).any())  # new A rows random ...
    assert bool((adapter.lora_B[:, old_rank:] == 0).all())  # ... new B columns zero
    with torch.no_grad():
        after = adapter(x)
        adapter.use_teacher = True
        teacher_after = adapter(x)
    assert _rel_err(after, before) < 1e-6
    assert _rel_err(teacher_after, teacher_before) < 1e-6
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6 * float(before.abs().max()))


def test_grow_rank_to_same_rank_is_a_no_op_and_shrinking_is_refused():
    adapter, _ = _adapter(rank=4)
    a = adapter.lora_A
    assert adapter.grow_rank(4) == {}
    assert adapter.lora_A is a
    with pytest.raises(ValueError):
        adapter.grow_rank(3)


def test_grown_adapter_trains_its_new_entries():
    adapter, _ = _adapter(rank=2)
    _randomize_b(adapter)
    adapter.grow_rank(4, torch.Generator().manual_seed(1))
    adapter(torch.randn(8, 40)).pow(2).sum().backward()
    assert adapter.lora_B.grad is not None and bool((adapter.lora_B.grad[:, 2:] != 0).any())
    assert adapter.weight.grad is None


def test_merged_weight_equals_w_plus_s_b_a():
    adapter, _ = _adapter(rank=6, alpha=12.0)
    _randomize_b(adapter)
    expected = adapter.weight.detach() + adapter.scaling * adapter.lora_B.detach() @ adapter.lora_A.detach()
    torch.testing.assert_close(adapter.merged_weight(), expected, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(adapter.merged_weight(), adapter.weight)


def test_bf16_base_keeps_fp32_adapters_and_merges_into_bf16():
    torch.manual_seed(0)
    linear = nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    adapter = APTAdapter.wrap(linear, 2, 4.0)
    assert adapter.weight.dtype == torch.bfloat16
    assert adapter.lora_A.dtype == adapter.lora_B.dtype == torch.float32  # the trained masters
    assert adapter(torch.randn(3, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16
    _randomize_b(adapter)
    merged = adapter.merged_weight()
    assert merged.dtype == torch.bfloat16
    exact = adapter.weight.float() + adapter.scaling * adapter.lora_B.float() @ adapter.lora_A.float()
    torch.testing.assert_close(merged, exact.to(torch.bfloat16), rtol=0, atol=0)


def test_merge_and_unwrap_gives_plain_linear_with_same_outputs():
    adapter, _ = _adapter(bias=True)
    _randomize_b(adapter)
    adapter.grow_rank(7, torch.Generator().manual_seed(3))
    x = torch.randn(10, 40)
    with torch.no_grad():
        expected = adapter(x)
    linear = adapter.merge_and_unwrap()
    assert type(linear) is nn.Linear
    assert not any(n.startswith(("lora_", "teacher_")) for n, _ in linear.named_parameters())
    assert set(linear.state_dict()) == {"weight", "bias"}
    with torch.no_grad():
        torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-6)


def test_keep_adapter_entries_matches_sliced_output():
    adapter, _ = _adapter(rank=3)
    _randomize_b(adapter)
    out_index, in_index = torch.tensor([0, 3, 7, 20]), torch.tensor([1, 2, 5, 30, 39])
    x = torch.zeros(6, 40)
    x[:, in_index] = torch.randn(6, len(in_index))  # removed inputs are zero, as masks make them
    with torch.no_grad():
        expected = adapter(x)[:, out_index]
    change = adapter.keep_adapter_entries(out_index, in_index)
    assert set(change) == {"lora_A", "lora_B"}
    assert change["lora_A"][0].dim == 1 and torch.equal(change["lora_A"][0].index, in_index)
    assert change["lora_B"][0].dim == 0 and torch.equal(change["lora_B"][0].index, out_index)
    assert adapter.teacher_A.shape == (3, 5) and adapter.teacher_B.shape == (4, 3)
    with torch.no_grad():
        adapter.weight = nn.Parameter(adapter.weight[out_index][:, in_index], requires_grad=False)
        adapter.in_features, adapter.out_features = 5, 4
        torch.testing.assert_close(adapter(x[:, in_index]), expected, rtol=1e-5, atol=1e-6)


def test_teacher_snapshot_is_frozen_copy():
    adapter, _ = _adapter()
    _randomize_b(adapter, seed=1)
    adapter.snapshot_teacher()
    x = torch.randn(4, 40)
    with torch.no_grad():
        snap_out = adapter(x)
        _randomize_b(adapter, seed=2)
        live_out = adapter(x)
        adapter.use_teacher = True
        teacher_out = adapter(x)
    torch.testing.assert_close(teacher_out, snap_out, rtol=0, atol=0)
    assert not torch.allclose(live_out, snap_out)
    assert not adapter.teacher_B.requires_grad


def test_add_adapters_on_llama_targets_and_merge_back():
    model = tiny_llama("gqa")
    batch = random_batch()
    with torch.no_grad():
        reference = model(**batch).logits
    adapters = add_adapters(model, ("q_proj", "v_proj", "down_proj"), rank=4, alpha=8.0)
    assert sorted(adapters) == sorted(
        f"model.layers.{l}.{part}" for l in range(2) for part in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    )
    assert find_adapters(model).keys() == adapters.keys()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.{p}" for n in adapters for p in ("lora_A", "lora_B")}
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, reference, rtol=0, atol=0)  # B = 0
        for a in adapters.values():
            _randomize_b(a, std=0.05)
        adapted = model(**batch).logits
    assert not torch.allclose(adapted, reference, atol=1e-4)
    merge_adapters(model)
    assert find_adapters(model) == {}
    assert not any("lora_" in n for n in model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, adapted, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError):
        add_adapters(tiny_llama("gqa"), ("no_such_proj",), rank=2, alpha=4.0)


# ---- edit records (used to carry optimizer state) -----------------------------------------------

def test_apply_edits_keep_then_grow():
    t = torch.arange(12.0).reshape(3, 4)
    out = apply_edits(t, [Keep(1, torch.tensor([0, 2])), Grow(0, 5)])
    assert out.shape == (5, 2)
    torch.testing.assert_close(out[:3], t[:, [0, 2]])
    assert bool((out[3:] == 0).all())
    fill = torch.full((5, 2), -1.0)
    filled = apply_edits(t, [Keep(1, torch.tensor([0, 2])), Grow(0, 5)], fill=fill)
    torch.testing.assert_close(filled[3:], fill[3:])
    torch.testing.assert_close(filled[:3], t[:, [0, 2]])
    with pytest.raises(ValueError):
        apply_edits(t, [Grow(0, 2)])
    merged = merge_changes({"a": [Keep(0, torch.tensor([1]))]}, {"a": [Grow(0, 3)], "b": [Grow(1, 2)]})
    assert [type(e) for e in merged["a"]] == [Keep, Grow] and list(merged) == ["a", "b"]


def test_wrap_refuses_an_adapter_and_bad_ranks():
    """A second APTrainer on a trained model meets its adapters: said as such; ranks are checked."""
    import pytest
    from torch import nn

    from apt_ds.algorithm.adapters import APTAdapter

    adapter = APTAdapter.wrap(nn.Linear(4, 4), rank=2, alpha=4.0)
    with pytest.raises(TypeError, match="already an APTAdapter: the model has APT adapters on it"):
        APTAdapter.wrap(adapter, rank=2, alpha=4.0)
    for rank, alpha in ((0, 4.0), (-1, 4.0), (2.5, 4.0), (2, 0.0)):
        with pytest.raises(ValueError, match="an adapter needs an integer rank >= 1 and alpha > 0"):
            APTAdapter.wrap(nn.Linear(4, 4), rank=rank, alpha=alpha)
    assert APTAdapter.__doc__ and "APTAdapter.wrap" in APTAdapter.__doc__
    import numpy as np

    assert APTAdapter.wrap(nn.Linear(4, 4), rank=np.int64(2), alpha=4.0).rank == 2  # any integer type
