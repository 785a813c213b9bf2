"""The live run's view of one batch, saved with `--save-eval-probe` so that an export can be
checked against the model it came from (logits and a greedy continuation)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from apt_ds.distributed.placement import move_batch
from apt_ds.io.permissions import make_readable

# What a probe keeps of its batch: a causal LM's or classifier's inputs, and a seq2seq model's decoder inputs
PROBE_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "decoder_input_ids", "decoder_attention_mask")


def live_probe(trainer, batch: dict, new_tokens: int = 20) -> dict[str, torch.Tensor]:
    """The live (masked, possibly sharded) model's logits on `batch` and its greedy
    continuation of the batch's first row, for checking an export against the run.
    Every rank must call it: ZeRO-3 gathers weights inside forward."""
    was_enabled = trainer.state.salience.enabled
    trainer.state.salience.enabled = False
    try:
        inputs = {k: batch[k] for k in PROBE_INPUTS if k in batch}
        inputs = move_batch(inputs, trainer.device)
        logits = trainer.backend.forward_no_grad(**inputs, use_cache=False).logits.float()
        if logits.dim() == 2 or "decoder_input_ids" in inputs:  # a classifier's (batch, classes); a T5's targets
            return {k: v.cpu().contiguous() for k, v in {**inputs, "logits": logits}.items()}
        ids = inputs["input_ids"][:1, : int(batch["attention_mask"][0].sum())]
        step_logits = []  # each greedy step's next-token logits: informative even when argmax repeats
        for _ in range(new_tokens):  # no KV cache: the plain forward the engine runs in training
            last = trainer.backend.forward_no_grad(input_ids=ids, use_cache=False).logits[0, -1].float()
            step_logits.append(last)
            ids = torch.cat([ids, last.argmax().view(1, 1)], 1)
    finally:
        trainer.state.salience.enabled = was_enabled
    probe = {**inputs, "logits": logits, "greedy": ids, "greedy_logits": torch.stack(step_logits)}
    return {k: v.cpu().contiguous() for k, v in probe.items()}


def save_probe(probe: dict[str, torch.Tensor], path: Path) -> None:
    save_file(probe, str(path))
    make_readable(path)  # safetensors writes 0600; the probe is read by whoever checks the export
