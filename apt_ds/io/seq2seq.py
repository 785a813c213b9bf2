"""Sequence-to-sequence data (T5 on summarization): rows -> encoder input ids and target ids.

A row holds an `input` and a `target` text, or CNN/DailyMail's `article` / `highlights`, or
XSum's `document` / `summary` (the first of these pairs a data set has is read). Each side is
framed by the tokenizer as it frames one sequence (T5's appends </s>; a LLaMA tokenizer starts
with <s>), and a target that this framing does not end with EOS gets one here: the decoder
learns where to stop from it. Each side is cut to its limit with its framing kept, and the rows
cut are counted. The input is read as written: a task prefix T5 expects ("summarize: ") belongs
in the row. A missing, blank or non-text field is refused in one line naming its row.
"""

from __future__ import annotations

from dataclasses import dataclass

from apt_ds.io.classification import TOKENIZE_ROWS
from apt_ds.io.errors import DataError, row_text

# Checked in this order, as classification.PAIR_FIELDS: a data set holding two pairs reads the first
SEQ2SEQ_PAIRS = (("input", "target"), ("article", "highlights"), ("document", "summary"))
_TARGETS = {target for _, target in SEQ2SEQ_PAIRS}
SEQ2SEQ_FIELDS = "'input'/'target' text fields (or CNN/DailyMail's 'article'/'highlights', XSum's 'document'/'summary')"


@dataclass(frozen=True)
class Seq2SeqData:
    """The examples ({"input_ids", "target_ids"}) and how many rows had their input or their
    target cut to its limit."""

    examples: list[dict]
    cut_inputs: int
    cut_targets: int


def seq2seq_family(model: str):
    """The encoder-decoder family (apt_ds.models.SEQ2SEQ: T5) of `--model`, else None."""
    from apt_ds.io.classification import family_among
    from apt_ds.models import SEQ2SEQ

    return family_among(model, SEQ2SEQ)


def seq2seq_pair(columns) -> tuple[str, str] | None:
    """The (input, target) fields of a data set with these columns; None where it has no pair."""
    columns = set(columns)
    return next((pair for pair in SEQ2SEQ_PAIRS if set(pair) <= columns), None)


def seq2seq_fields(columns, source: str) -> tuple[str, str]:
    """The fields a seq2seq row's input and target are read from, or one line saying what is missing."""
    pair = seq2seq_pair(columns)
    if pair is None:
        raise DataError(f"{source} has no seq2seq rows: need {SEQ2SEQ_FIELDS}; found fields {sorted(set(columns))}")
    return pair


def seq2seq_texts(ds, source: str = "data") -> tuple[list[str], list[str]]:
    """The rows' input and target texts as written, each checked (ROUGE scores against the target
    text itself, not its cut token ids)."""
    fields = seq2seq_fields(ds.column_names, source)
    inputs, targets = [], []
    for number, row in enumerate(ds, start=1):
        inputs.append(_text(row, fields[0], number, source))
        targets.append(_text(row, fields[1], number, source))
    return inputs, targets


def _text(row: dict, name: str, number: int, source: str) -> str:
    what = "nothing to learn or to score a generation against" if name in _TARGETS else "nothing for the model to read"
    return row_text(row, name, number, source, "every seq2seq row needs both texts", what)


def tokenize_seq2seq(ds, tokenizer, max_input_len: int, max_target_len: int, source: str = "data") -> Seq2SeqData:
    """The rows of `ds` as seq2seq examples: {"input_ids": [...], "target_ids": [...]}, each side
    framed by the tokenizer's own special tokens, targets ending with EOS, cut to the limits."""
    fields = seq2seq_fields(ds.column_names, source)
    inputs, targets = seq2seq_texts(ds, source)
    specials = tokenizer.num_special_tokens_to_add(pair=False)
    appends_eos = _frame_ends_with_eos(tokenizer)
    if not appends_eos and tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos token to end a seq2seq target with")
    target_frame = specials + (0 if appends_eos else 1)
    for name, limit, frame in (("--max-seq-len", max_input_len, specials), ("--max-target-len", max_target_len, target_frame)):
        if limit < frame + 1:
            raise DataError(f"{source}: {name} {limit} leaves no room for text: the tokenizer's framing takes {frame} "
                            f"tokens; give at least {frame + 1}")
    input_ids, cut_inputs = _framed(tokenizer, inputs, max_input_len)
    # without the tokenizer's own EOS, the body is cut one shorter so the EOS appended here fits
    target_ids, cut_targets = _framed(tokenizer, targets, max_target_len - (not appends_eos))
    if not appends_eos:
        target_ids = [ids + [tokenizer.eos_token_id] for ids in target_ids]
    for name, all_ids, frame in ((fields[0], input_ids, specials), (fields[1], target_ids, target_frame)):
        empty = next((number for number, ids in enumerate(all_ids, start=1) if len(ids) <= frame), None)
        if empty is not None:  # text the tokenizer drops whole (e.g. only characters its normaliser removes)
            raise DataError(f"{source}: row {empty}'s {name!r} gives no tokens but the tokenizer's framing")
    examples = [{"input_ids": i, "target_ids": t} for i, t in zip(input_ids, target_ids)]
    return Seq2SeqData(examples, cut_inputs, cut_targets)


def _frame_ends_with_eos(tokenizer) -> bool:
    """Whether the tokenizer's own framing ends a sequence with EOS (T5's does, LLaMA's does not)."""
    framed = tokenizer("a")["input_ids"]
    return tokenizer.eos_token_id is not None and framed[-1:] == [tokenizer.eos_token_id]


def _framed(tokenizer, texts: list[str], limit: int) -> tuple[list[list[int]], int]:
    """Each text with the tokenizer's special tokens, cut at the end to `limit` as transformers'
    truncation does (the special tokens kept); and how many were cut."""
    framed, cut = [], 0
    for start in range(0, len(texts), TOKENIZE_ROWS):
        batch = texts[start:start + TOKENIZE_ROWS]
        framed += [list(ids) for ids in tokenizer(batch, truncation=True, max_length=limit)["input_ids"]]
        cut += sum(length > limit for length in tokenizer(batch, return_length=True)["length"])
    return framed, cut
