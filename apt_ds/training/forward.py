"""The supervised forward of a training step: logits only where a label is learned, the
distillation step's teacher and student passes, and activation checkpointing. Shared by
`APTrainer` and the baselines.

Three tasks, told apart by the batch: a causal LM's labels are (batch, seq), a label per token
(-100 where none is learned); a sequence classifier's (an encoder's) are (batch,), one class a
row, whose logits are (batch, classes) and whose loss is the cross-entropy over the rows; a
seq2seq model's (T5's) batch holds `decoder_input_ids` (the target shifted right), and its labels
(batch, target) are the target itself, each position predicting its own label.
"""

from __future__ import annotations

import torch


def classifies(labels: torch.Tensor) -> bool:
    """A label a row (a sequence classifier's), not a label a token."""
    return labels.dim() == 1


def is_seq2seq(batch: dict) -> bool:
    """An encoder-decoder's batch: its decoder reads the target shifted right."""
    return "decoder_input_ids" in batch


def supervised_token_count(batch: dict) -> int:
    """Tokens the causal-LM loss averages over (labels are shifted by one); rows, for a classifier;
    target tokens, for a seq2seq model."""
    labels = batch["labels"]
    unshifted = classifies(labels) or is_seq2seq(batch)
    return int((labels != -100).sum()) if unshifted else int((labels[:, 1:] != -100).sum())


def supervised_positions(batch: dict) -> torch.Tensor | None:
    """Positions whose next token is supervised in some row of the batch (read them on the host:
    on a GPU `nonzero` waits for the device); None for a classifier (one logit row a sequence) and
    a seq2seq model (its logits are the target's)."""
    labels = batch["labels"]
    if classifies(labels) or is_seq2seq(batch):
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
    if classifies(labels) or is_seq2seq(batch):
        out = positions_forward(forward, batch, None, **kwargs)
        logits = out.logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return out, loss, labels != -100
    targets = labels[:, 1:]  # position i predicts token i + 1
    if positions is None:
        positions = supervised_positions(batch)
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
    valid = valid_positions(batch)
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


def valid_positions(batch: dict) -> torch.Tensor:
    """The real positions of the sequence the distilled blocks run over (a seq2seq model's: the target)."""
    if is_seq2seq(batch):
        return batch.get("decoder_attention_mask", torch.ones_like(batch["decoder_input_ids"])).bool()
    return batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()


def valid_token_count(batch: dict) -> int:
    """The real tokens of `valid_positions`."""
    key = ("decoder_attention_mask", "decoder_input_ids") if is_seq2seq(batch) else ("attention_mask", "input_ids")
    mask = batch.get(key[0])
    return int(mask.sum()) if mask is not None else batch[key[1]].numel()


def has_padding(batch: dict) -> bool:
    """A padded position on either side of the batch (host numbers: the salience then weighs tokens)."""
    return any(batch[mask].numel() > int(batch[mask].sum()) for mask in ("attention_mask", "decoder_attention_mask")
               if mask in batch)
