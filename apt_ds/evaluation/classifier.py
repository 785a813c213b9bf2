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
    import json

    from apt_ds.models import ENCODERS

    try:
        return json.loads((Path(model) / "config.json").read_text()).get("model_type") in ENCODERS
    except (OSError, ValueError, AttributeError):
        return False


@torch.no_grad()
def classifier_accuracy(request: ClassifierRequest) -> dict:
    """{"accuracy", "rows", "classes", "model", "data"} of `request`'s model on its data."""
    from apt_ds.io.classification import tokenize_classification
    from apt_ds.io.data import collate, load_records
    from apt_ds.io.modeling import load_pretrained
    from apt_ds.io.tokenizer import load_tokenizer

    model = load_pretrained(request.model, dtype=torch.float32)
    device = torch.device(request.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(device).eval()
    classes = model.config.num_labels
    records = load_records(request.data, split=request.data_split, flag="--data")
    tokenizer = load_tokenizer(request.model)
    positions = getattr(model.config, "max_position_embeddings", request.max_seq_len)
    if model.config.model_type == "roberta":  # its positions start after the padding index
        positions -= (model.config.pad_token_id or 0) + 1
    examples = tokenize_classification(records, tokenizer, min(request.max_seq_len, positions), request.data, classes).examples
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
