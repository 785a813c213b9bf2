"""Training data through `datasets`: records -> token ids -> deterministic micro-batches.

Four record formats are accepted, chosen per row:
  * `text`                                plain language modelling, loss on every token;
  * `messages` / `conversations`          a conversation (or `prompt`/`completion` message lists),
                                          rendered with the tokenizer's chat template, loss on the
                                          assistant turns (`apt_ds.io.conversations`);
  * `instruction` (+ `input`) + `output`   a prompt template (`apt_ds.io.templates`: alpaca by
                                          default, chat or none), loss on the response only;
  * `prompt` + `completion`               raw prompt, loss on the completion only.
`train_on_prompt` puts the loss on every token of the supervised formats instead.

Prompt and response are encoded separately and concatenated, so the boundary between
"not learned" and "learned" tokens is exact for every tokenizer; `encode_prompt_response`
is public so that likelihood-based evaluation scores answers with the very same ids.
Records are read by `apt_ds.io.records`, tokenizers loaded (or trained) by `apt_ds.io.tokenizer`.
"""

from __future__ import annotations

import random
from typing import Iterable, Iterator

import torch

from apt_ds.io.classification import text_fields_or_none
from apt_ds.io.conversations import ChatRenderer, encode_conversation, messages_of
from apt_ds.io.errors import DataError
from apt_ds.io.records import USABLE_FIELDS, demo_data_path, load_records  # noqa: F401 - importable from here too
from apt_ds.io.seq2seq import seq2seq_pair
from apt_ds.io.templates import PromptResponse, check_template, format_prompt, instruction_prompt_response  # noqa: F401
from apt_ds.io.truncation import TruncationStats, rows_phrase  # noqa: F401 - TruncationStats importable from here too

IGNORE_INDEX = -100  # label value that torch's cross-entropy (and HF models) skip


# ---------------------------------------------------------------- records -> ids


def split_record(row: dict, template: str = "alpaca", tokenizer=None) -> PromptResponse | None:
    """A row as text under `template` (`chat` needs the tokenizer); prompt None means plain text.
    None if unusable."""

    def field(name: str) -> str:
        value = row.get(name)
        return "" if value is None else str(value)

    if field("text").strip():
        return PromptResponse(None, field("text"))
    if field("instruction").strip() and field("output").strip():
        return instruction_prompt_response(field("instruction"), field("input"), field("output"), template, tokenizer)
    if field("completion").strip():  # an empty prompt is allowed: loss on the whole completion
        return PromptResponse(field("prompt"), field("completion"))
    return None


def prompt_and_answer(row: dict, template: str = "alpaca", tokenizer=None) -> PromptResponse:
    """(prompt, answer, framed) of a labelled row, either format; the evaluator scores answers after
    exactly the prompt training saw. The answer is the row's own: under the chat template, a label is
    scored without the end of turn, as training's EOS is not scored either. ValueError for plain-text
    or unusable rows."""
    pair = split_record(row, template, tokenizer)
    if pair is None or not pair.prompt:  # no prompt: nothing to score an answer after
        raise ValueError(f"an evaluation row needs 'instruction'/'output' or non-empty 'prompt'/'completion' fields, "
                         f"got {sorted(k for k, v in row.items() if v)}")
    return pair._replace(response=str(row["output"])) if pair.framed else pair


def _special_ids(tokenizer) -> tuple[list[int], list[int]]:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return bos, eos


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def encode_prompt_response(tokenizer, prompt: str, response: str, max_seq_len: int, framed: bool = False) -> dict | None:
    """BOS + prompt + response + EOS, labels -100 on BOS and prompt. None if nothing to learn.
    `framed` (chat template): the text brings its own BOS and end of turn; none are added."""
    prompt_ids, response_ids = _encode(tokenizer, [prompt, response])
    return _join_prompt_response(tokenizer, prompt_ids, response_ids, max_seq_len, framed=framed)


def _join_prompt_response(tokenizer, prompt_ids: list[int], response_ids: list[int], max_seq_len: int,
                          stats: "TruncationStats | None" = None, framed: bool = False, train_on_prompt: bool = False):
    if not response_ids:
        return None
    if framed:  # the template's own BOS stays first when the prompt is cut from the left
        bos = list(prompt_ids[:1]) if prompt_ids and prompt_ids[0] == tokenizer.bos_token_id else []
        prompt_ids, eos = prompt_ids[len(bos):], []
    else:
        bos, eos = _special_ids(tokenizer)
    target = list(response_ids) + eos
    length = len(bos) + len(prompt_ids) + len(target)
    # Too long: drop prompt tokens from the left first, because the answer and the text
    # nearest to it (e.g. the question after a passage) are what the example teaches.
    room = max_seq_len - len(bos) - len(target)
    if room < 1 and prompt_ids:  # the response alone fills the window: a prompt-less row teaches nonsense
        if stats is not None:
            stats.count("dropped", length)
        return None
    if stats is not None and not prompt_ids and room < 0:  # no prompt to shorten: the response is cut at the end
        stats.count("text_cut", length)
    elif stats is not None and room < len(prompt_ids):
        stats.count("prompt_cut", length)
    prompt_ids = list(prompt_ids)[-room:] if room > 0 else []
    input_ids = (bos + prompt_ids + target)[:max_seq_len]
    labels = ([IGNORE_INDEX] * (len(bos) + len(prompt_ids)) + target)[:max_seq_len]
    if train_on_prompt:
        labels = list(input_ids)
    if all(label == IGNORE_INDEX for label in labels):
        return None
    return {"input_ids": input_ids, "labels": labels}


def _text_stream(tokenizer, text_ids: list[int]) -> list[int]:
    bos, eos = _special_ids(tokenizer)
    return bos + list(text_ids) + eos if text_ids else []


def pack_blocks(streams: Iterable[list[int]], max_seq_len: int) -> list[dict]:
    """Concatenate token streams into max_seq_len blocks; the ragged tail is dropped
    unless it is the only block (tiny corpora still train)."""
    flat = [token for stream in streams for token in stream]
    blocks = [flat[i : i + max_seq_len] for i in range(0, len(flat), max_seq_len)]
    if len(blocks) > 1 and len(blocks[-1]) < max_seq_len:
        blocks.pop()
    return [{"input_ids": block, "labels": list(block)} for block in blocks if len(block) >= 2]


def tokenize_dataset(ds, tokenizer, max_seq_len: int, pack: bool, source: str = "dataset",
                     stats: TruncationStats | None = None, template: str = "alpaca", train_on_prompt: bool = False,
                     tokenizer_name: str = "") -> list[dict]:
    """Examples {input_ids, labels} (python int lists). `pack` packs text rows only:
    supervised rows keep one example each so their prompt/response boundary survives.
    `stats` (optional) counts what max_seq_len cut or dropped; `template` formats instruction rows;
    `train_on_prompt` learns the prompts and the non-assistant turns too."""
    if max_seq_len < 2:
        raise DataError(f"{source}: max_seq_len must be >= 2, got {max_seq_len}")
    check_template(template, tokenizer)
    stats = TruncationStats() if stats is None else stats
    pairs, conversations = [], []
    for number, row in enumerate(ds, start=1):
        messages = messages_of(row, number) if not str(row.get("text") or "").strip() else None  # text first
        pair = split_record(row, template, tokenizer) if messages is None else None
        if messages is not None:
            conversations.append((number, messages))
        elif pair is None:
            stats.count_skipped(number)
        else:
            pairs.append(pair)
    if not pairs and not conversations:
        classifier_rows = "label" in ds.column_names and text_fields_or_none(ds.column_names) is not None
        hint = " (rows with 'sentence' and 'label' train an encoder's classifier: give a BERT or RoBERTa --model)" \
            if classifier_rows else ""
        if not hint and seq2seq_pair(ds.column_names):  # load_records takes them: launch/evaluate.py scores them
            hint = f" (rows with {'/'.join(seq2seq_pair(ds.column_names))} are seq2seq rows: they train a T5 --model, " \
                "and launch/evaluate.py scores them with ROUGE)"
        raise DataError(f"{source} has no usable rows: need {USABLE_FIELDS}{hint}")
    texts = [pair.response for pair in pairs if pair.prompt is None]
    supervised = [pair for pair in pairs if pair.prompt is not None]
    text_streams = [_text_stream(tokenizer, ids) for ids in _encode(tokenizer, texts)]
    if pack:
        examples = pack_blocks(text_streams, max_seq_len)
    else:
        examples = [{"input_ids": s[:max_seq_len], "labels": s[:max_seq_len]} for s in text_streams if len(s) >= 2]
        for stream in text_streams:
            if len(stream) > max_seq_len:
                stats.count("text_cut", len(stream))
    prompt_ids = _encode(tokenizer, [pair.prompt for pair in supervised])
    response_ids = _encode(tokenizer, [pair.response for pair in supervised])
    for pair, p_ids, r_ids in zip(supervised, prompt_ids, response_ids):
        example = _join_prompt_response(tokenizer, p_ids, r_ids, max_seq_len, stats, framed=pair.framed,
                                        train_on_prompt=train_on_prompt)
        if example is not None:
            examples.append(example)
    renderer = ChatRenderer(tokenizer, tokenizer_name) if conversations else None
    for number, messages in conversations:
        example = encode_conversation(renderer, messages, number, max_seq_len, train_on_prompt, stats)
        if example is not None:
            examples.append(example)
    if not examples and (stats.dropped or stats.turn_dropped):
        skipped = f"; {stats.skipped} more {rows_phrase(stats.skipped, 'rows')} had no usable text" if stats.skipped else ""
        what = "its response alone exceeds" if stats.dropped else "no reply token fits within"
        raise DataError(f"{source}: every row was dropped: {what} --max-seq-len {max_seq_len} (the longest row has "
                        f"{stats.longest} tokens){skipped}; raise --max-seq-len or shorten the rows")
    if not examples and stats.without_reply:
        raise DataError(f"{source}: no conversation has an assistant turn to learn from ({stats.without_reply} without one)")
    if not examples:
        raise DataError(f"{source}: no row has a token to learn from after tokenization (max_seq_len={max_seq_len})")
    return examples


# ---------------------------------------------------------------- batching


def _seq2seq_targets(targets: list[list[int]], pad_id: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Labels padded with -100 to the longest target, and the decoder's inputs: each target shifted
    right behind the decoder start, which is the pad token in every T5 (apt_ds.training.task checks
    the config says so), and their mask."""
    length = max(len(target) for target in targets)
    labels = torch.full((len(targets), length), IGNORE_INDEX, dtype=torch.long)
    decoder_input_ids = torch.full((len(targets), length), pad_id, dtype=torch.long)
    decoder_attention_mask = torch.zeros((len(targets), length), dtype=torch.long)
    for row, target in enumerate(targets):
        ids = torch.tensor(target, dtype=torch.long)
        labels[row, : len(target)] = ids
        decoder_input_ids[row, 1 : len(target)] = ids[:-1]
        decoder_attention_mask[row, : len(target)] = 1
    return labels, {"decoder_input_ids": decoder_input_ids, "decoder_attention_mask": decoder_attention_mask}


def collate(examples: list[dict], pad_id: int, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded LongTensors; labels are -100 at padding by position (pad may equal EOS). A
    classifier's examples (apt_ds.io.classification: a `label` each) give labels of shape
    (batch,), and their token types padded with 0. Seq2seq examples (apt_ds.io.seq2seq: their
    `target_ids`) give labels of their own length, padded with -100 to the longest target, and the
    decoder's inputs (the targets shifted right) with their mask."""
    length = max(len(example["input_ids"]) for example in examples)
    length = max(length, pad_to or 0)
    classifies = "label" in examples[0]
    targets = "target_ids" in examples[0]
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    types = torch.zeros((len(examples), length), dtype=torch.long) if "token_type_ids" in examples[0] else None
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        input_ids[row, :n] = torch.tensor(example["input_ids"], dtype=torch.long)
        attention_mask[row, :n] = 1
        if types is not None:
            types[row, :n] = torch.tensor(example["token_type_ids"], dtype=torch.long)
        if not classifies and not targets:
            labels[row, :n] = torch.tensor(example["labels"], dtype=torch.long)
    if classifies:
        labels = torch.tensor([example["label"] for example in examples], dtype=torch.long)
    decoder = {}
    if targets:
        labels, decoder = _seq2seq_targets([example["target_ids"] for example in examples], pad_id)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, **decoder, "labels": labels}
    return batch if types is None else {**batch, "token_type_ids": types}


def batches(
    examples: list[dict],
    micro_batch_size: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    start_step: int = 0,
    pad_id: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless micro-batches for `rank`, reshuffled each epoch with seed + epoch.

    The shuffled epochs form one stream; global batch k is its items [k*G, (k+1)*G) with
    G = micro_batch_size * world_size, and rank r takes the r-th slice of it, padded to the
    global batch's longest example. So the rank slices of a global batch concatenate to the
    single-rank batch of size G: results do not depend on how the batch is split. Batches
    cross epoch boundaries instead of dropping a remainder. `start_step` skips micro-batches
    (for resuming) without collating them. The pad id never reaches the loss (mask and
    labels hide it), so the default 0 is safe for any vocabulary.
    """
    if micro_batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"bad batching: micro_batch_size={micro_batch_size}, rank={rank}, world_size={world_size}")
    if not examples:
        raise DataError("no examples to batch")
    n, global_size = len(examples), micro_batch_size * world_size
    orders: dict[int, list[int]] = {}

    def index_at(position: int) -> int:
        epoch = position // n
        if epoch not in orders:
            orders.clear()  # at most two epochs are live at once; keep memory flat
            orders[epoch] = random.Random(seed + epoch).sample(range(n), n)
        return orders[epoch][position % n]

    step = start_step
    while True:
        first = step * global_size
        global_ids = [index_at(position) for position in range(first, first + global_size)]
        pad_to = max(len(examples[i]["input_ids"]) for i in global_ids)
        mine = global_ids[rank * micro_batch_size : (rank + 1) * micro_batch_size]
        yield collate([examples[i] for i in mine], pad_id=pad_id, pad_to=pad_to)
        step += 1
