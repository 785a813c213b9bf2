"""apt_ds.algorithm.kl: the distillation KL from logits, chunked, with a closed-form gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from apt_ds.algorithm.kl import kl_divergence_from_logits


def plain_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """The formula the distiller used before: both log-softmaxes whole, autograd through all of it."""
    log_p = F.log_softmax(student.float() / temperature, -1)
    log_q = F.log_softmax(teacher.float() / temperature, -1)
    return (log_p.exp() * (log_p - log_q)).sum()


def logits(rows: int, vocabulary: int, seed: int, dtype=torch.float64, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocabulary, generator=generator, dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("chunk_elements", [1 << 24, 7 * 50, 50, 1])  # one chunk; 7 rows; a row each; below one row
def test_value_and_gradient_equal_the_plain_formula_for_any_chunking(chunk_elements):
    student, teacher = logits(23, 50, 0).requires_grad_(), logits(23, 50, 1)
    reference_student = student.detach().clone().requires_grad_()
    got = kl_divergence_from_logits(student, teacher, temperature=2 / 3, chunk_elements=chunk_elements)
    expected = plain_kl(reference_student, teacher, 2 / 3)
    torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=1e-6)
    (got * 1.7).backward()
    (expected * 1.7).backward()
    torch.testing.assert_close(student.grad, reference_student.grad, rtol=1e-4, atol=1e-5)  # fp32 work in both


def test_gradient_passes_gradcheck_in_float64():
    # the forward sums in fp32 by design; gradcheck checks the backward against finite differences of a float64 copy
    student, teacher = logits(5, 7, 2).requires_grad_(), logits(5, 7, 3)

    def in_float64(x):
        log_p = F.log_softmax(x / 0.5, -1)
        return (log_p.exp() * (log_p - F.log_softmax(teacher / 0.5, -1))).sum()

    analytic = torch.autograd.grad(kl_divergence_from_logits(student, teacher, 0.5, chunk_elements=14), student)[0]
    numeric = torch.autograd.grad(in_float64(student), student)[0]
    torch.testing.assert_close(analytic, numeric, rtol=1e-5, atol=1e-7)
    assert torch.autograd.gradcheck(in_float64, (student,))  # the reference itself is right


def test_gradient_keeps_the_logits_dtype_and_the_teacher_gets_none():
    student = logits(6, 40, 4, dtype=torch.bfloat16).requires_grad_()
    teacher = logits(6, 40, 5, dtype=torch.bfloat16).requires_grad_()
    kl_divergence_from_logits(student, teacher, 1.0).backward()
    assert student.grad.dtype == torch.bfloat16 and teacher.grad is None
    reference = student.detach().clone().requires_grad_()
    plain_kl(reference, teacher.detach(), 1.0).backward()
    torch.testing.assert_close(student.grad.float(), reference.grad.float(), rtol=2e-2, atol=1e-3)


def test_identical_logits_give_zero_and_no_gradient():
    x = logits(4, 9, 6).requires_grad_()
    value = kl_divergence_from_logits(x, x.detach(), 1.3)
    value.backward()
    assert abs(value.item()) < 1e-6 and float(x.grad.abs().max()) < 1e-6


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for backward while `fn` runs."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return total


def test_saves_one_logits_sized_tensor_for_backward():
    """The point of the module: the plain formula keeps four (rows x vocabulary) fp32 tensors for
    backward (2 MiB here); this keeps the gradient, in the logits' dtype (0.25 MiB)."""
    student = logits(64, 2048, 7, dtype=torch.bfloat16).requires_grad_()
    teacher = logits(64, 2048, 8, dtype=torch.bfloat16)
    logits_bytes = student.numel() * student.element_size()
    assert saved_bytes(lambda: kl_divergence_from_logits(student, teacher, 2 / 3)) == logits_bytes
    assert saved_bytes(lambda: plain_kl(student, teacher, 2 / 3)) == 8 * logits_bytes



def test_no_gradient_is_computed_under_no_grad(monkeypatch):
    import apt_ds.algorithm.kl as kl

    asked = []
    original = kl._chunk_kl
    monkeypatch.setattr(kl, "_chunk_kl", lambda *args: asked.append(args[-1]) or original(*args))
    student, teacher = logits(4, 9, 11).requires_grad_(), logits(4, 9, 12)
    with torch.no_grad():
        value = kl_divergence_from_logits(student, teacher, 0.5)
    kl_divergence_from_logits(student.detach(), teacher, 0.5)
    assert asked == [False, False] and value.grad_fn is None
    kl_divergence_from_logits(student, teacher, 0.5).backward()
    assert asked == [False, False, True] and student.grad is not None


def test_fp16_logits_keep_an_fp32_gradient_for_the_loss_scale():
    """fp16 training scales the loss (DeepSpeed's dynamic loss scale): a gradient rounded to fp16
    before the scale would flush its small entries to zero (868 of these 64,000 would be)."""
    student = logits(16, 4000, 13, dtype=torch.float16, scale=6.0).requires_grad_()
    teacher = logits(16, 4000, 14, dtype=torch.float16, scale=6.0)
    assert saved_bytes(lambda: kl_divergence_from_logits(student, teacher, 2.0)) == 4 * student.numel()
    (kl_divergence_from_logits(student, teacher, 2.0) * 1024.0).backward()
    reference = student.detach().double().requires_grad_()
    (plain_kl(reference, teacher.double(), 2.0).double() * 1024.0).backward()
    assert student.grad.dtype == torch.float16
    assert int(((student.grad == 0) & (reference.grad != 0)).sum()) == 0
    rounded_first = (reference.grad / 1024.0).half().double() * 1024.0  # what an fp16 kept gradient would give
    assert int(((rounded_first == 0) & (reference.grad != 0)).sum()) > 100
    error = ((student.grad.double() - reference.grad).abs().sum() / reference.grad.abs().sum()).item()
    assert error < 1e-3


def test_a_second_derivative_is_refused_rather_than_silently_zero():
    student, teacher = logits(3, 5, 15).requires_grad_(), logits(3, 5, 16)
    weight = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)  # a larger graph around the KL
    (gradient,) = torch.autograd.grad(kl_divergence_from_logits(student, teacher) * weight, student, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gradient.sum().backward()


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="two \\(rows, vocabulary\\) logit tensors of one shape"):
        kl_divergence_from_logits(torch.zeros(3, 4), torch.zeros(3, 5))


def test_backward_twice_with_a_retained_graph_accumulates_the_same_gradient():
    student, teacher = logits(6, 11, 9).requires_grad_(), logits(6, 11, 10)
    value = kl_divergence_from_logits(student, teacher, 0.7, chunk_elements=22)
    value.backward(retain_graph=True)
    once = student.grad.clone()
    (value * 3).backward()  # the kept gradient is scaled, not changed in place
    torch.testing.assert_close(student.grad, 4 * once)
