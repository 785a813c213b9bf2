"""The supervised forward of a training step: logits only where a label is learned, the
distillation step's teacher and student passes, and activation checkpointing. Shared by
`APTrainer` and the baselines.

Two tasks, told apart by the labels' shape: a causal LM's are (batch, seq), a label per token
(-100 where none is learned); a sequence classifier's (an encoder's) are (batch,), one class a
row, whose logits are (batch, classes) and whose loss is the cross-entropy over the rows.
"""

from __future__ import annotations

import torch


def classifies(labels: torch.Tensor) -> bool:
    """A label a row (a sequence classifier's), not a label a token."""
    return labels.dim() == 1


def supervised_token_count(batch: dict) -> int:
    """Tokens the causal-LM loss averages over (labels are shifted by one); rows, for a classifier."""
    labels = batch["labels"]
    return int((labels != -100).sum()) if classifies(labels) else int((labels[:, 1:] != -100).sum())


def supervised_positions(labels: torch.Tensor) -> torch.Tensor | None:
    """Positions whose next token is supervised in some row of the batch (read them on the host:
    on a GPU `nonzero` waits for the device); None for a classifier (one logit row a sequence)."""
    if classifies(labels):
        return None
    return (labels[:, 1:] != -100).any(0).nonzero().squeeze(1)


def supervised_forward(forward, batch: dict, positions: torch.Tensor | None = None, **kwargs):
    """Forward that projects onto the vocabulary only at positions predicting a supervised label.

    Instruction data supervises a few response tokens per row; the (positions x vocab) logits,
    their softmax and their gradient are then a large share of a small model's step (SmolLM2:
    a 49k vocabulary). Positions are the union over the batch (a 1D `logits_to_keep`, which
    every supported transformers version accepts), so the gradient is exactly that of the full
    causal-LM loss. `positions`: `supervised_positions(labels)` computed ahead (on the host).
    Returns (model output whose logits are (batch, kept, vocab), mean task loss, boolean
    (batch, kept) mask of the supervised entries).
    """
    labels = batch["labels"]
    if classifies(labels):
        out = positions_forward(forward, batch, None, **kwargs)
        loss = torch.nn.functional.cross_entropy(out.logits.float(), labels, ignore_index=-100)
        return out, loss, labels != -100
    targets = labels[:, 1:]  # position i predicts token i + 1
    if positions is None:
        positions = supervised_positions(labels)
    positions = positions.to(labels.device, non_blocking=True)
    out = positions_forward(forward, batch, positions, **kwargs)
    kept_targets = targets[:, positions]
    mask = kept_targets != -100
    logits = out.logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), kept_targets.reshape(-1),
                                             ignore_index=-100)
    return out, loss, mask


def positions_forward(forward, batch: dict, positions: torch.Tensor | None, **kwargs):
    """The model output with logits only at `positions` (the teacher's pass: no loss, so no fp32
    copy of its logits for a cross-entropy nobody reads); None: a classifier's logits."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if positions is None:
        return forward(**inputs, **kwargs)
    positions = positions.to(batch["input_ids"].device, non_blocking=True)
    return forward(**inputs, logits_to_keep=positions, **kwargs)


def distilled_forward(backend, distiller, model, switches, batch: dict, positions: torch.Tensor):
    """(mean task loss, distillation KL token sum, MSE token sum) of one micro-batch: the teacher
    pass (no_grad, `switches` off), then the student's, each keeping the sampled layers' outputs."""
    layers = distiller.sample_layers()
    with distiller.teacher_mode(model, switches, layers):
        teacher = positions_forward(backend.forward_no_grad, batch, positions)
    with distiller.student_mode(model, layers):
        student, loss, supervised = supervised_forward(backend.forward, batch, positions)
    valid = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    # The logit KL is taken where the task loss is: positions that predict a supervised label
    # (the response of instruction data; every real token of text data).
    kl_sum, mse_sum = distiller.loss_sums(model, student, teacher, layers, valid, supervised)
    return loss, kl_sum, mse_sum


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer in backward, non-reentrant (transformers >= 5 renamed the API)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()  # transformers checkpoints only in training mode (LLaMA has no dropout to switch on)


def valid_token_count(batch: dict) -> int:
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()
