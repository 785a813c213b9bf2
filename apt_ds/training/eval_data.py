"""The held-out data (--eval-data): its batches, and a warning when it is not held out.

eval_loss steers nothing in APT, but it is what users read to judge a pruned model: measured on
rows the run trains on, it reports memorisation as quality. The same file, or rows that also
appear in --data (compared on the fields training reads, so that extra columns do not hide a
copy), are named in one warning with the count.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from apt_ds.config import ConfigError, TrainConfig
from apt_ds.io.classification import tokenize_classification
from apt_ds.io.data import TruncationStats, collate, load_records, tokenize_dataset
from apt_ds.io.hub import data_location
from apt_ds.io.records import ROW_FIELDS
from apt_ds.io.seq2seq import seq2seq_family, tokenize_seq2seq

_HASH_BATCH = 10_000


def held_out_batches(args, tokenizer, train: TrainConfig, backend, pad_id: int, train_records, data_path: str,
                     num_labels: int | None = None) -> list[dict]:
    """This rank's share of the held-out examples as micro-batches ([] without --eval-data); a
    classifier's (`num_labels` classes) when given."""
    if not args.eval_data:
        return []
    split = args.eval_data_split or args.data_split
    records = load_records(args.eval_data, split=split, flag="--eval-data")
    warning = overlap_warning(data_path, train_records, args.eval_data, records, same_split=split == args.data_split)
    if warning and backend.is_main():
        print(warning, file=sys.stderr)
    truncation = TruncationStats()
    if num_labels is not None:
        examples = tokenize_classification(records, tokenizer, train.max_seq_len, args.eval_data, num_labels).examples
    elif seq2seq_family(args.model) is not None:
        examples = tokenize_seq2seq(records, tokenizer, train.max_seq_len, args.max_target_len, args.eval_data).examples
    else:
        examples = tokenize_dataset(records, tokenizer, train.max_seq_len, pack=False, source=args.eval_data,
                                    stats=truncation, template=train.template, train_on_prompt=train.train_on_prompt)
    warning = truncation.message(args.eval_data, train.max_seq_len)
    if warning and backend.is_main():
        print(warning, file=sys.stderr)
    examples = examples[: args.eval_examples]
    # Every rank must run the same number of forwards (ZeRO-3 gathers are collective).
    examples = examples[: len(examples) - len(examples) % backend.world_size]
    if not examples:
        raise ConfigError(f"--eval-data {args.eval_data}: fewer usable examples than ranks ({backend.world_size})")
    mine = examples[backend.rank :: backend.world_size]
    size = train.micro_batch_size
    return [collate(mine[i : i + size], pad_id=pad_id) for i in range(0, len(mine), size)]


def overlap_warning(data_path: str, train_records, eval_path: str, eval_records, same_split: bool = True) -> str | None:
    """A warning when the eval data is the training data, or shares rows with it; else None.
    `same_split`: both are read at the same split (another split of one data set is other data)."""
    if same_split and data_location(data_path) == data_location(eval_path):
        other_split = "" if Path(eval_path).is_file() else "; --eval-data-split reads another split of it"
        return (f"warning: --eval-data {eval_path} is the training data (--data): eval_loss will measure how well the run "
                f"fits what it trains on, not how it does on unseen rows{other_split}")
    held_out = set(row_digests(eval_records))
    shared = {digest for digest in row_digests(train_records) if digest in held_out}
    if not shared:
        return None
    rows = sum(1 for digest in row_digests(eval_records) if digest in shared)
    return (f"warning: {rows} of the {len(eval_records)} rows of --eval-data {eval_path} are also in --data {data_path}: "
            f"eval_loss on them measures fitting, not unseen rows; remove them from one of the two files")


def row_digests(records):
    """One digest per row of the fields training reads, batch by batch (a large --data is never held as Python rows)."""
    fields = [name for name in ROW_FIELDS if name in records.column_names]  # a field one file lacks reads as empty
    for start in range(0, len(records), _HASH_BATCH):
        batch = records[start : start + _HASH_BATCH]
        size = len(batch[fields[0]])
        for values in zip(*(batch[name] if name in batch else [None] * size for name in ROW_FIELDS)):
            yield hashlib.blake2b("\x1f".join("" if v is None else str(v) for v in values).encode(), digest_size=16).digest()
