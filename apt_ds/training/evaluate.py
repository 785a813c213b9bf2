"""Task and efficiency measurements: label accuracy by likelihood, loss, decode speed, size.

Accuracy scores every allowed answer by the summed log-probability of its tokens after the
prompt (the same tokenization training used) and counts an exact match of the best one with
the gold label. Efficiency numbers are meant to be reported as ratios to a baseline measured
in the same process (see benchmarks/).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from apt_ds.distributed.placement import move_batch
from apt_ds.io.data import IGNORE_INDEX, collate, encode_prompt_response, prompt_and_answer
from apt_ds.io.templates import check_template
from apt_ds.training.attention_kernels import training_attention_kernels
from apt_ds.training.forward import classifies, supervised_forward, supervised_positions


@torch.no_grad()
def label_accuracy(model, tokenizer, rows: list[dict], labels: list[str], max_seq_len: int = 256, batch_size: int = 8,
                   template: str = "alpaca") -> float:
    """Fraction of labelled rows (instruction/input/output or prompt/completion) whose most
    likely label equals the row's answer; instruction rows are prompted with `template`, as in training."""
    check_template(template, tokenizer)
    model.eval()
    pad_id = tokenizer.pad_token_id or 0
    correct = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        scores = torch.stack([_label_logprob(model, tokenizer, chunk, label, max_seq_len, pad_id, template)
                              for label in labels], 1)
        predicted = scores.argmax(1)
        gold = torch.tensor([labels.index(prompt_and_answer(row, template, tokenizer).response) for row in chunk])
        correct += int((predicted == gold).sum())
    return correct / max(1, len(rows))


def _label_logprob(model, tokenizer, rows, label: str, max_seq_len: int, pad_id: int,
                   template: str = "alpaca") -> torch.Tensor:
    examples = []
    for row in rows:
        pair = prompt_and_answer(row, template, tokenizer)
        example = encode_prompt_response(tokenizer, pair.prompt, label, max_seq_len, framed=pair.framed)
        # Score the label tokens only, not the EOS that training appends (a chat turn's end is not
        # added to a label at all: `framed`).
        labels = list(example["labels"])
        if tokenizer.eos_token_id is not None and labels and labels[-1] == tokenizer.eos_token_id:
            labels[-1] = IGNORE_INDEX
        examples.append({"input_ids": example["input_ids"], "labels": labels})
    batch = collate(examples, pad_id=pad_id)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    targets = batch["labels"][:, 1:]
    mask = targets != IGNORE_INDEX
    logprobs = F.log_softmax(logits, -1).gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return (logprobs * mask).sum(1)


@torch.no_grad()
def decode_speed(model, batch_size: int, prompt_len: int = 64, new_tokens: int = 32, repeats: int = 3, vocab: int | None = None) -> dict:
    """Prompt-processing and decode tokens/s with the KV cache (greedy), median of repeats."""
    model.eval()
    vocab = vocab or model.config.vocab_size
    ids = torch.randint(0, vocab, (batch_size, prompt_len), generator=torch.Generator().manual_seed(0))
    prefill, decode = [], []
    for _ in range(repeats + 1):  # first round warms up
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        t_prefill = time.perf_counter() - start
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(new_tokens):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t_decode = time.perf_counter() - start
        prefill.append(batch_size * prompt_len / t_prefill)
        decode.append(batch_size * new_tokens / t_decode)
    return {
        "prefill_tokens_per_s": statistics.median(prefill[1:]),
        "decode_tokens_per_s": statistics.median(decode[1:]),
        "decode_ms_per_token": 1000 * batch_size / statistics.median(decode[1:]),
    }


def parameter_bytes(model) -> int:
    seen, total = set(), 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel() * param.element_size()
    return total


def directory_bytes(path: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def mean_token_loss(trainer, batches: list[dict]) -> float:
    """A trainer's mean token loss over `batches`, summed over ranks before dividing; with the
    training steps' attention kernels (the final evaluation runs after the loop) and salience off."""
    return eval_metrics(trainer, batches)["eval_loss"]


@torch.no_grad()
def eval_metrics(trainer, batches: list[dict]) -> dict[str, float]:
    """`eval_loss` (mean_token_loss) and, for a classifier, `eval_accuracy`: the share of held-out
    rows whose largest logit is their label, summed over ranks before dividing."""
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, supervised count, correct rows
    salience = trainer.state.salience
    was_enabled, salience.enabled = salience.enabled, False
    classifier = bool(batches) and classifies(batches[0]["labels"])
    with training_attention_kernels(trainer.train_config.cudnn_attention):
        for batch in batches:
            positions = supervised_positions(batch)
            batch = move_batch(batch, trainer.device)
            out, loss, supervised = supervised_forward(trainer.backend.forward_no_grad, batch, positions, use_cache=False)
            tokens = int(supervised.sum())
            correct = int((out.logits.argmax(-1) == batch["labels"]).sum()) if classifier else 0
            if tokens:
                totals += torch.tensor([float(loss) * tokens, float(tokens), correct], dtype=torch.float64)
    salience.enabled = was_enabled
    totals = trainer.backend.all_reduce_sum(totals)
    metrics = {"eval_loss": float(totals[0] / totals[1].clamp_min(1))}
    if classifier:
        metrics["eval_accuracy"] = float(totals[2] / totals[1].clamp_min(1))
    return metrics
