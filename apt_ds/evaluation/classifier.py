"""A sequence classifier's accuracy on labelled rows (`launch/evaluate.py EXPORT --data FILE`):
the exported BERT or RoBERTa model (stock transformers or an apt_ds per-layer export), its own
tokenizer, the rows framed as training framed them (apt_ds.io.classification), and the share
whose top logit is their label. lm-evaluation-harness scores causal LMs only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from apt_ds.evaluation.errors import EvaluationError


@dataclass(frozen=True)
class ClassifierRequest:
    model: str
    data: str
    data_split: str | None = None
    limit: int | None = None
    batch_size: int = 32
    max_seq_len: int = 512
    device: str | None = None


def is_classifier(model: str) -> bool:
    """`model` is a directory whose config names an encoder family (BERT, RoBERTa)."""
    from apt_ds.io.classification import classifier_family

    return classifier_family(model) is not None


@torch.no_grad()
def classifier_accuracy(request: ClassifierRequest) -> dict:
    """{"accuracy", "rows", "classes", "model", "data"} of `request`'s model on its data."""
    from apt_ds.io.classification import tokenize_classification
    from apt_ds.io.context_length import known_positions
    from apt_ds.io.data import collate, load_records
    from apt_ds.io.modeling import load_pretrained
    from apt_ds.io.tokenizer import load_tokenizer

    model = load_pretrained(request.model, dtype=torch.float32)
    device = torch.device(request.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(device).eval()
    classes = model.config.num_labels
    records = load_records(request.data, split=request.data_split, flag="--data")
    tokenizer = load_tokenizer(request.model)
    known = known_positions(model.config.to_dict())  # RoBERTa's start after its padding index
    max_seq_len = min(request.max_seq_len, known[0]) if known else request.max_seq_len
    examples = tokenize_classification(records, tokenizer, max_seq_len, request.data, classes).examples
    examples = examples[: request.limit] if request.limit else examples
    if not examples:
        raise EvaluationError(f"--data {request.data}: no rows to score")
    correct = 0
    pad_id = tokenizer.pad_token_id or 0
    for start in range(0, len(examples), request.batch_size):
        batch = collate(examples[start : start + request.batch_size], pad_id=pad_id)
        labels = batch.pop("labels")
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
        correct += int((logits.argmax(-1).cpu() == labels).sum())
    return {"model": str(Path(request.model).resolve()), "data": request.data, "rows": len(examples), "classes": classes,
            "accuracy": correct / len(examples)}
