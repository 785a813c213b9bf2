"""Self-distillation: teacher mode (snapshot adapters, no masks), transform layer, the loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import random_batch, tiny_llama

from apt_ds.algorithm.adapters import add_adapters, find_adapters, merge_adapters
from apt_ds.algorithm.distill import (
    TRANSFORM_ATTR,
    SelfDistiller,
    attach_transform,
    relative_squared_error,
    student_adapters,
)
from apt_ds.algorithm.masks import UnitMasks
from apt_ds.algorithm.salience import SalienceCollector
from apt_ds.algorithm.shrink import slice_linear
from apt_ds.algorithm.units import ModelShape
from apt_ds.config import APTConfig

TARGETS = ("q_proj", "v_proj", "down_proj")


def _set_b(adapters, seed, std=0.05):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in sorted(adapters):
            adapters[name].lora_B.copy_(std * torch.randn(adapters[name].lora_B.shape, generator=gen))


def _student(kind="gqa"):
    model = tiny_llama(kind)
    adapters = add_adapters(model, TARGETS, rank=4, alpha=8.0, seed=0)
    attach_transform(model, model.config.hidden_size, rank=2, alpha=4.0, seed=0)
    return model, adapters


def test_teacher_mode_uses_snapshot_and_no_masks():
    model, adapters = _student("gqa")
    _set_b(adapters, seed=1)
    distiller = SelfDistiller(APTConfig(), num_layers=2)
    distiller.snapshot(model)
    _set_b(adapters, seed=2)  # the student trains on after the snapshot
    shape = ModelShape.from_model(model)
    masks = UnitMasks(shape)
    masks.install(model)
    masks.kv_group[0] = torch.tensor([1.0, 0.0])
    masks.ffn_neuron[1][::3] = 0.3
    masks.hidden[::5] = 0.0
    masks.refresh()
    salience = SalienceCollector(shape, beta=0.85, use_kurtosis=False)
    salience.install(model)

    # reference: an unmasked model with the snapshot's adapter weights
    reference, ref_adapters = _student("gqa")
    _set_b(ref_adapters, seed=1)
    batch = random_batch()
    with torch.no_grad():
        expected_teacher = reference(**batch).logits
        student = model(**batch).logits
        with distiller.teacher_mode(model, [masks, salience], []):
            assert not masks.enabled and not salience.enabled
            assert all(a.use_teacher for a in student_adapters(model).values())
            teacher = model(**batch).logits
        after = model(**batch).logits
    torch.testing.assert_close(teacher, expected_teacher, rtol=0, atol=1e-6)
    assert (student - expected_teacher).abs().max() > 1e-3  # student is masked and has other adapters
    torch.testing.assert_close(after, student, rtol=0, atol=0)  # everything restored
    assert masks.enabled and salience.enabled
    assert not any(a.use_teacher for a in student_adapters(model).values())
    assert float(salience.tokens) == 0  # no salience collected from the teacher (no_grad + disabled)


def test_teacher_mode_restores_switches_on_error():
    model, _ = _student("mha")
    masks = UnitMasks(ModelShape.from_model(model))
    masks.enabled = True
    distiller = SelfDistiller(APTConfig(), num_layers=2)
    with pytest.raises(RuntimeError):
        with distiller.teacher_mode(model, [masks], [0]):
            raise RuntimeError("boom")
    assert masks.enabled
    assert not any(a.use_teacher for a in student_adapters(model).values())


def test_transform_is_identity_at_init_and_not_a_student_adapter():
    model, adapters = _student("gqa_tied")
    transform = getattr(model, TRANSFORM_ATTR)
    x = torch.randn(2, 5, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(transform(x), x, rtol=0, atol=0)
    assert set(student_adapters(model)) == set(adapters)
    assert not any(n.startswith(TRANSFORM_ATTR) for n in student_adapters(model))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {f"{TRANSFORM_ATTR}.lora_A", f"{TRANSFORM_ATTR}.lora_B"} <= trainable
    # no hidden x hidden identity matrix is held: the transform's only tensors are its adapter's
    assert transform.weight is None
    assert {n for n, _ in transform.named_parameters()} == {"lora_A", "lora_B"}
    with pytest.raises(ValueError, match="distillation transform"):  # refused before any layer is merged
        merge_adapters(model)
    assert set(find_adapters(model)) == set(adapters) | {TRANSFORM_ATTR}


def test_transform_follows_its_adapter_and_shrinks_with_the_hidden_channels():
    """y = x + s B A x whatever B holds; cut to kept channels it is the cut function (no weight)."""
    model, _ = _student("gqa_tied")
    transform = getattr(model, TRANSFORM_ATTR)
    hidden = model.config.hidden_size
    with torch.no_grad():
        transform.lora_B.normal_(0, 0.1)
    x = torch.randn(3, hidden)

    def reference(inputs):
        return inputs + transform.scaling * (inputs @ transform.lora_A.T @ transform.lora_B.T)

    torch.testing.assert_close(transform(x), reference(x))
    torch.testing.assert_close(x @ transform.merged_weight().T, reference(x), rtol=1e-5, atol=1e-5)
    kept = torch.tensor([0, 2, 3])
    masked = torch.zeros_like(x)
    masked[:, kept] = x[:, kept]  # the cut channels carry nothing: the full transform's output there
    expected = reference(masked)[:, kept]
    change = slice_linear(transform, kept, kept, TRANSFORM_ATTR)
    assert (transform.in_features, transform.out_features) == (3, 3) and transform.weight is None
    assert set(change) == {f"{TRANSFORM_ATTR}.lora_A", f"{TRANSFORM_ATTR}.lora_B"}
    torch.testing.assert_close(transform(x[:, kept]), expected)


def _passes(distiller, model, batch, layers, teacher_layers=None):
    """(teacher output, student output) of one batch, their sampled layers kept as the trainer does."""
    with distiller.teacher_mode(model, [], layers if teacher_layers is None else teacher_layers):
        teacher = model(**batch)
    with distiller.student_mode(model, layers):
        student = model(**batch)
    return teacher, student


def test_distill_loss_is_zero_for_identical_outputs_and_positive_otherwise():
    model, adapters = _student("gqa")
    _set_b(adapters, seed=3)
    distiller = SelfDistiller(APTConfig(), num_layers=2)
    distiller.snapshot(model)  # the teacher's adapters are the student's
    batch = random_batch()
    valid = batch["attention_mask"].bool()
    with torch.no_grad():
        teacher, student = _passes(distiller, model, batch, [0, 1])
        assert float(distiller.loss(model, student, teacher, [0, 1], valid)) == pytest.approx(0.0, abs=1e-7)
        _set_b(adapters, seed=4)
        teacher, student = _passes(distiller, model, batch, [0, 1])
        assert float(distiller.loss(model, student, teacher, [0, 1], valid)) > 1e-6


@pytest.mark.parametrize("layer", [0, 1])  # 1 is the last layer of the 2-layer model
def test_distill_loss_formula(layer):
    """kl_weight * KL(student || teacher) * T^2 (the spec's direction) + mse_weight * relative MSE
    of the sampled layer's OUTPUT; for the last layer that is its pre-norm output, not the
    final-normed state transformers returns as hidden_states[-1]."""
    cfg = APTConfig(distill_kl_weight=0.3, distill_mse_weight=0.7, distill_temperature=0.5)
    model, adapters = _student("gqa")
    distiller = SelfDistiller(cfg, num_layers=2)
    batch = random_batch(batch=3, length=7)
    valid = torch.ones(3, 7, dtype=torch.bool)
    valid[1, 4:] = False
    outputs = []
    hook = model.model.layers[layer].register_forward_hook(lambda m, a, out: outputs.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        _set_b(adapters, seed=5)
        distiller.snapshot(model)  # the teacher's adapters
        with distiller.teacher_mode(model, [], [layer]):
            teacher = model(**batch)
        _set_b(adapters, seed=6)
        with distiller.student_mode(model, [layer]):
            student = model(**batch)
        transform = getattr(model, TRANSFORM_ATTR)
        transform.lora_B.normal_(0, 0.01)  # transform no longer the identity
        got = distiller.loss(model, student, teacher, [layer], valid)
        hook.remove()
        final_normed = model(**batch, output_hidden_states=True).hidden_states[-1]
        T = 0.5
        s_logp, t_logp = F.log_softmax(student.logits / T, -1), F.log_softmax(teacher.logits / T, -1)
        kl = (s_logp.exp() * (s_logp - t_logp)).sum(-1)[valid].mean() * T**2
        reverse = (t_logp.exp() * (t_logp - s_logp)).sum(-1)[valid].mean() * T**2
        t_h, s_h = outputs
        mse = ((transform(s_h) - t_h).pow(2).mean(-1) / t_h.pow(2).mean(-1))[valid].mean()
    torch.testing.assert_close(got, 0.3 * kl + 0.7 * mse, rtol=1e-5, atol=1e-8)
    assert float(kl) > 0 and float(mse) > 0
    assert abs(float(kl - reverse)) > 1e-4 * float(kl)  # the direction is observable here
    assert teacher.hidden_states is None and student.hidden_states is None  # no pass returns every layer's state
    if layer == 1:
        assert not torch.allclose(s_h, final_normed)  # hidden_states[-1] is after the final norm


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_student_layer_outputs_carry_gradient_and_checkpointing_changes_nothing(checkpointing):
    """The student's kept outputs are the graph's own tensors: the MSE trains the student's adapters
    and the transform. Under activation checkpointing nothing is kept after the loss, no hook is
    left on the layers, and the gradients are those without it."""
    from apt_ds.training.forward import enable_activation_checkpointing

    grads = {}
    for checkpoint in (False, checkpointing):
        model, adapters = _student("gqa")
        if checkpoint:
            enable_activation_checkpointing(model)
        distiller = SelfDistiller(APTConfig(distill_kl_weight=0.0, distill_mse_weight=1.0), num_layers=2)
        batch = random_batch(batch=2, length=6)
        _set_b(adapters, seed=7)
        distiller.snapshot(model)
        _set_b(adapters, seed=8)
        with torch.no_grad(), distiller.teacher_mode(model, [], [0, 1]):
            teacher = model(**batch)
        with distiller.student_mode(model, [0, 1]):
            student = model(**batch)
        hooks = [len(layer._forward_hooks) for layer in model.model.layers]
        loss = distiller.loss(model, student, teacher, [0, 1], batch["attention_mask"].bool())
        loss.backward()
        assert not any(distiller._kept.values())  # nothing kept after the loss, nor by the recompute
        assert [len(layer._forward_hooks) for layer in model.model.layers] == hooks
        grads[checkpoint] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert any(n.startswith(TRANSFORM_ATTR) for n in grads[False])
    assert any(float(g.abs().max()) > 0 for n, g in grads[False].items() if "lora_A" in n and not n.startswith(TRANSFORM_ATTR))
    assert grads[checkpointing].keys() == grads[False].keys()
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[checkpointing][name], grad, rtol=1e-5, atol=1e-7)


def test_layer_hooks_are_removed_and_outputs_dropped_when_a_forward_fails():
    model, _ = _student("gqa")
    distiller = SelfDistiller(APTConfig(), num_layers=2)
    batch = random_batch(batch=2, length=5)
    with torch.no_grad():
        model(**batch, output_hidden_states=True)  # transformers' own output hooks, installed on first use
    hooks_before = [len(layer._forward_hooks) for layer in model.model.layers]

    def fail(module, args, output):
        raise RuntimeError("planted")

    planted = model.model.layers[1].register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="planted"), torch.no_grad(), distiller.teacher_mode(model, [], [0, 1]):
        model(**batch)
    with pytest.raises(RuntimeError, match="planted"), distiller.student_mode(model, [0, 1]):
        model(**batch)
    planted.remove()
    assert [len(layer._forward_hooks) for layer in model.model.layers] == hooks_before
    assert not any(distiller._kept.values())  # layer 0's outputs, kept before the failures, are not held on to
    with pytest.raises(IndexError), distiller.teacher_mode(model, [], [0, 5]):  # no layer 5: layer 0's hook goes too
        pass
    assert [len(layer._forward_hooks) for layer in model.model.layers] == hooks_before


def test_a_layer_that_was_not_kept_is_a_clear_error():
    model, _ = _student("gqa")
    distiller = SelfDistiller(APTConfig(), num_layers=2)
    batch = random_batch(batch=2, length=5)
    valid = torch.ones(2, 5, dtype=torch.bool)
    with torch.no_grad():
        teacher, student = _passes(distiller, model, batch, [0, 1], teacher_layers=[0])
        with pytest.raises(ValueError, match=r"teacher's output of layer 1 was not kept: .*teacher_mode"):
            distiller.loss(model, student, teacher, [0, 1], valid)
        teacher, student = _passes(distiller, model, batch, [0], teacher_layers=[0, 1])
        with pytest.raises(ValueError, match=r"student's output of layer 1 was not kept: .*student_mode"):
            distiller.loss(model, student, teacher, [0, 1], valid)
        assert not any(distiller._kept.values())  # a failed loss drops what was kept
        _passes(distiller, model, batch, [0, 1])  # kept, but no loss read them
        teacher, student = _passes(distiller, model, batch, [0, 1], teacher_layers=[0])
        with pytest.raises(ValueError, match="teacher's output of layer 1 was not kept"):  # not the stale one
            distiller.loss(model, student, teacher, [0, 1], valid)


def test_hidden_state_error_is_relative_to_each_teacher_token():
    """A 1000x "massive activation" token with the same relative error as the others weighs
    the same; with a plain MSE it would carry ~10^6 times their weight."""
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(2, 5, 16, generator=gen)
    teacher[:, 0] *= 1000.0
    student = teacher * 1.1  # 10% error on every token
    per_token = relative_squared_error(student, teacher)
    assert per_token.shape == (2, 5)
    torch.testing.assert_close(per_token, torch.full((2, 5), 0.01))
    plain = (student - teacher).pow(2).mean(-1)
    assert float(plain[:, 0].mean() / plain[:, 1:].mean()) > 1e5
    moved = student.clone()
    moved[:, 2] += 0.5 * teacher[:, 2].pow(2).mean(-1, keepdim=True).sqrt()  # error of half the token's RMS
    assert float(relative_squared_error(moved, teacher)[0, 2]) > float(per_token[0, 2]) + 0.1


def test_zero_teacher_token_at_a_padded_position_stays_finite():
    teacher = torch.randn(1, 4, 8)
    teacher[0, 3] = 0.0  # a padded position can be all zeros
    student = (3e4 * torch.randn(1, 4, 8)).requires_grad_()  # massive-activation sized
    valid = torch.tensor([[True, True, True, False]])
    loss = (relative_squared_error(student, teacher) * valid.float()).sum()
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(student.grad).all()
    assert float(student.grad[0, 3].abs().max()) == 0.0


def test_sample_layers_one_per_block():
    cfg = APTConfig(distill_num_blocks=4)
    distiller = SelfDistiller(cfg, num_layers=10, seed=3)
    blocks = [list(b) for b in torch.arange(10).tensor_split(4)]
    seen = set()
    for _ in range(50):
        layers = distiller.sample_layers()
        assert len(layers) == 4
        assert all(layer in block for layer, block in zip(layers, blocks))
        seen.update(layers)
    assert seen == set(range(10))  # every layer gets sampled
    again = SelfDistiller(cfg, num_layers=10, seed=3)
    first = SelfDistiller(cfg, num_layers=10, seed=3).sample_layers()
    assert again.sample_layers() == first  # deterministic per seed
    assert SelfDistiller(cfg, num_layers=2).sample_layers() == [0, 1]  # fewer layers than blocks
