"""KL(student || teacher) between two sets of logits, without vocabulary-sized fp32 copies.

The plain formula (`log_softmax` of both in fp32, then `p * (log p - log q)`) keeps four (tokens
x vocabulary) fp32 tensors for backward, and more in flight: measured on one H200 with a random
LLaMA-2-7B shape (micro-batch 16 x 512 tokens, vocabulary 32,000), the first teacher step raised
the peak allocated memory from 18,211 MiB (APT's own before it; LoRA's 18,163) to 26,541 MiB
(that step also asked the teacher for every hidden state, since changed).

`kl_divergence_from_logits` does the fp32 work in row chunks and, since the gradient is
closed-form (d KL / d z = p * (log p - log q - KL_row) for z = logits / T), computes it in the
same pass when one will be needed, and keeps only it for backward: in the logits' dtype (fp32 for
fp16 logits, whose loss-scaled gradients would underflow), so what it adds to the step's peak is
one logits-sized tensor and one chunk's fp32 temporaries. Its value is the plain formula's,
computed chunk by chunk (the same operations when one chunk holds every row); a bf16 gradient is
rounded before backward scales it, where autograd would round once after. Not twice
differentiable (nothing in apt-ds differentiates a gradient)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 1 << 24  # rows x vocabulary per chunk: 64 MiB per fp32 temporary


def kl_divergence_sum(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) summed over rows, from log-probabilities over the last dimension (the plain
    formula; uniform shape trials compare cached log-probabilities with it, under no_grad)."""
    return (log_p.exp() * (log_p - log_q)).sum()


def _chunks(rows: int, vocabulary: int, chunk_elements: int) -> list[slice]:
    step = max(1, chunk_elements // max(1, vocabulary))
    return [slice(start, min(rows, start + step)) for start in range(0, rows, step)]


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.log_softmax(logits.float() / temperature, -1)


def _chunk_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float, with_gradient: bool):
    """(KL summed over the chunk's rows, its gradient w.r.t. the student's logits or None); a
    function of its own so that one chunk's temporaries are freed before the next chunk's."""
    log_p = _log_probs(student, temperature)
    difference = log_p - _log_probs(teacher, temperature)
    p = log_p.exp_()  # in place: log p is not needed again
    products = p * difference
    if not with_gradient:
        return products.sum(), None
    row_kl = products.sum(-1, keepdim=True)
    return products.sum(), difference.sub_(row_kl).mul_(p).div_(temperature)


class _KLFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student_logits, teacher_logits, temperature: float, chunk_elements: int, with_gradient: bool):
        rows, vocabulary = student_logits.shape
        # The gradient is closed-form, so it is computed here while the probabilities are at
        # hand, and backward only scales it. `with_gradient` says whether one will be asked for:
        # inside forward grad mode is always off, and needs_input_grad ignores torch.no_grad.
        with_gradient = with_gradient and ctx.needs_input_grad[0]
        dtype = torch.float32 if student_logits.dtype == torch.float16 else student_logits.dtype
        gradient = torch.empty(student_logits.shape, dtype=dtype, device=student_logits.device) if with_gradient else None
        total = torch.zeros((), dtype=torch.float32, device=student_logits.device)
        for chunk in _chunks(rows, vocabulary, chunk_elements):
            chunk_total, chunk_gradient = _chunk_kl(student_logits[chunk], teacher_logits[chunk], temperature, with_gradient)
            total = total + chunk_total
            if gradient is not None:
                gradient[chunk] = chunk_gradient  # cast on assignment
        if gradient is not None:
            ctx.save_for_backward(gradient)
        ctx.logits_dtype = student_logits.dtype
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total):
        (gradient,) = ctx.saved_tensors
        return (gradient * grad_total).to(ctx.logits_dtype), None, None, None, None


def kl_divergence_from_logits(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
                              chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Sum over rows of KL(softmax(student / T) || softmax(teacher / T)), in fp32; (rows, vocabulary)
    inputs of any float dtype. The gradient flows to `student_logits` only (the teacher runs
    under no_grad); none is computed under torch.no_grad."""
    if student_logits.shape != teacher_logits.shape or student_logits.dim() != 2:
        raise ValueError(f"expected two (rows, vocabulary) logit tensors of one shape, got "
                         f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}")
    with_gradient = torch.is_grad_enabled() and student_logits.requires_grad
    return _KLFromLogits.apply(student_logits, teacher_logits.detach(), float(temperature), int(chunk_elements),
                               with_gradient)
