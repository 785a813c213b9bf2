"""Sequence-classification data (GLUE's shape): rows -> token ids and a class, for an encoder.

A row holds one text (`sentence`, as SST-2, or `text`) or a pair (`sentence1` / `sentence2`, or
GLUE's own column names: MNLI's `premise` / `hypothesis`, QQP's `question1` / `question2`, QNLI's
`question` / `sentence`), and an integer `label` in 0..K-1; K, the classifier's size, is the
largest label + 1. The sequence starts with the token a classifier reads (BERT's [CLS],
RoBERTa's <s>): a tokenizer that frames pairs itself (cls and sep tokens) does, with its token
types; any other is framed here as BOS A EOS (B EOS). Rows cut to max_seq_len are counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from apt_ds.io.errors import DataError, row_text

SINGLE_FIELDS = ("sentence", "text")
# Pairs first: QNLI's `question` / `sentence` is a pair, not SST-2's single `sentence`
PAIR_FIELDS = (("sentence1", "sentence2"), ("premise", "hypothesis"), ("question1", "question2"), ("question", "sentence"))
LABEL_FIELD = "label"
CLASSIFICATION_FIELDS = ("a 'sentence' or 'text' field, or a pair ('sentence1'/'sentence2', 'premise'/'hypothesis', "
                         "'question1'/'question2' or 'question'/'sentence'), with an integer 'label'")


@dataclass(frozen=True)
class ClassificationData:
    """The examples ({"input_ids", "label"} and "token_type_ids" where the tokenizer gives them),
    the number of classes and how many rows were cut to max_seq_len."""

    examples: list[dict]
    num_labels: int
    cut: int


def classifier_family(model: str):
    """The encoder family (apt_ds.models.ENCODERS) of `--model`, a built-in name or a directory,
    from its config.json's model_type; None for a causal LM, a GGUF file, or a path load_model
    refuses in its own words."""
    from apt_ds.models import ENCODERS

    return family_among(model, ENCODERS)


def family_among(model: str, families: dict):
    """The family of `--model` (a built-in name or a directory: its config.json's model_type) if it
    is one of `families`, else None."""
    import json
    from pathlib import Path

    from apt_ds.io.modeling import TINY_MODELS

    if model in TINY_MODELS:
        return families.get(TINY_MODELS[model][0])
    try:
        return families.get(json.loads((Path(model) / "config.json").read_text()).get("model_type"))
    except (OSError, ValueError, AttributeError):
        return None


def text_fields(columns, source: str) -> tuple[str, ...]:
    """The fields a classification row's text is read from: a pair, or one text."""
    columns = set(columns)
    if LABEL_FIELD not in columns:
        raise DataError(f"{source} has no {LABEL_FIELD!r} field: a classifier needs {CLASSIFICATION_FIELDS}; found "
                        f"fields {sorted(columns)}")
    fields = text_fields_or_none(columns)
    if fields is None:
        raise DataError(f"{source} has no text to classify: need {CLASSIFICATION_FIELDS}; found fields {sorted(columns)}")
    return fields


def text_fields_or_none(columns) -> tuple[str, ...] | None:
    """The fields a classification row would be read from (a pair, or one text), else None."""
    columns = set(columns)
    pair = next((pair for pair in PAIR_FIELDS if set(pair) <= columns), None)
    return pair or next(((name,) for name in SINGLE_FIELDS if name in columns), None)


def class_of(value, number: int, source: str) -> int:
    """A row's label as an int >= 0; anything else named with its row."""
    if isinstance(value, float) and value.is_integer():  # datasets reads a column mixing 1 and 0.0 as floats
        raise DataError(f"{source}: row {number} has label {value!r}: labels must be integers 0..K-1 (a column with "
                        f"any decimal label, e.g. 0.0, is read as decimals from its first row on)")
    if isinstance(value, bool) or not isinstance(value, int):
        raise DataError(f"{source}: row {number} has label {value!r}: labels must be integers 0..K-1")
    if value < 0:
        raise DataError(f"{source}: row {number} has label {value}: a negative label marks an unlabelled row (GLUE's "
                        f"test splits); train and evaluate on a split with labels")
    return value


def tokenize_classification(ds, tokenizer, max_seq_len: int, source: str = "data",
                            num_labels: int | None = None) -> ClassificationData:
    """The rows of `ds` as classifier examples. `num_labels`: the classes the model was made for
    (held-out data), which every label must be below; None: the data's own (largest + 1)."""
    fields = text_fields(ds.column_names, source)
    labels = [class_of(row[LABEL_FIELD], number, source) for number, row in enumerate(ds, start=1)]
    classes = max(labels) + 1 if num_labels is None else num_labels
    too_large = next(((n, label) for n, label in enumerate(labels, start=1) if label >= classes), None)
    if too_large is not None:
        raise DataError(f"{source}: row {too_large[0]} has label {too_large[1]}, but the classifier has {classes} classes "
                        f"(labels 0..{classes - 1})")
    if num_labels is None and classes < 2:
        raise DataError(f"{source}: every row has label 0: a classifier needs at least two classes")
    # a row without its text (or with a blank one) would train and score on nothing but the framing
    needs = f"every row needs {' and '.join(repr(f) for f in fields)}"
    texts = [[row_text(row, name, number, source, needs, "nothing to classify") for name in fields]
             for number, row in enumerate(ds, start=1)]
    frames_itself = tokenizer.cls_token_id is not None and tokenizer.sep_token_id is not None
    shortest = (tokenizer.num_special_tokens_to_add(pair=len(fields) == 2) if frames_itself else 1 + len(fields)) + len(fields)
    if max_seq_len < shortest:
        raise DataError(f"{source}: --max-seq-len {max_seq_len} leaves no room for the text: the classifier's framing "
                        f"takes {shortest - len(fields)} tokens; give at least {shortest}")
    if frames_itself:
        examples, cut = _framed_by_tokenizer(tokenizer, texts, max_seq_len)
    else:
        framed = [_framed_here(tokenizer, row_texts, max_seq_len) for row_texts in texts]
        examples, cut = [example for example, _ in framed], sum(was_cut for _, was_cut in framed)
    for example, label in zip(examples, labels):
        example["label"] = label
    return ClassificationData(examples, classes, cut)


TOKENIZE_ROWS = 10_000  # rows a tokenizer call takes at once (fast tokenizers work through a batch in parallel)


def _framed_by_tokenizer(tokenizer, texts: list[list[str]], max_seq_len: int) -> tuple[list[dict], int]:
    """BERT's [CLS] A [SEP] B [SEP] with token types, RoBERTa's <s> A </s></s> B </s>: the
    tokenizer's own framing, truncated longest-first as transformers' pipelines do; and how
    many rows were cut."""
    examples, cut = [], 0
    for start in range(0, len(texts), TOKENIZE_ROWS):
        columns = list(zip(*texts[start:start + TOKENIZE_ROWS]))
        encoded = tokenizer(*columns, truncation=True, max_length=max_seq_len)
        lengths = tokenizer(*columns, truncation=False, return_length=True)["length"]
        cut += sum(length > max_seq_len for length in lengths)
        for row, ids in enumerate(encoded["input_ids"]):
            example = {"input_ids": list(ids)}
            if "token_type_ids" in encoded:
                example["token_type_ids"] = list(encoded["token_type_ids"][row])
            examples.append(example)
    return examples, cut


def _framed_here(tokenizer, texts: list[str], max_seq_len: int) -> tuple[dict, bool]:
    """BOS A EOS (B EOS) for a tokenizer without cls/sep tokens (the tiny sentencepiece one):
    the text pieces cut longest-first to fit."""
    if tokenizer.bos_token_id is None or tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has neither cls/sep nor bos/eos tokens to frame a classifier's input with")
    pieces = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    room = max_seq_len - 1 - len(pieces)  # BOS, and an EOS after each piece
    was_cut = sum(len(p) for p in pieces) > room
    while sum(len(p) for p in pieces) > room:
        longest = max(range(len(pieces)), key=lambda i: len(pieces[i]))
        pieces[longest] = pieces[longest][:-1]
    ids = [tokenizer.bos_token_id]
    for piece in pieces:
        ids += [*piece, tokenizer.eos_token_id]
    return {"input_ids": ids}, was_cut
