"""Epochs, as every trainer reports them: how many examples the data made (after packing) and how
many passes over them the steps are, said at the start of a run and recorded in run.json's
run_info (`data_stats`); `--epochs` turns it around and gives the steps.

Packing joins short `text` rows into full blocks, so a data set of short rows has far fewer
examples than rows: 600 SST-2 sentences made 75 blocks of 256 tokens, and 150 steps of 8
sequences, which look like 2 passes over the rows, were 16 epochs of the blocks (and the LoRA
baseline ended below the zero-shot model, without a word). Where packing multiplies the epochs
so, a warning names --no-pack."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction

from tqdm.auto import tqdm

from apt_ds.config import APTConfig, ConfigError, TrainConfig
from apt_ds.io.checkpoint import CheckpointError
from apt_ds.io.truncation import LOST_KINDS
from apt_ds.training.resume import global_batch_size

# A packed run past this many epochs repeats its blocks where the rows suggest it would not (a
# little over 1: the last step's batch spills into the next epoch without repeating much).
MANY_EPOCHS = 1.1


@dataclass(frozen=True)
class DataCounts:
    """What the data made: rows read, rows of plain `text`, examples (after packing), whether
    text rows were packed, and the examples one per usable row makes (what --no-pack gives)."""

    rows: int
    text_rows: int
    examples: int
    packed: bool
    examples_unpacked: int

    @property
    def text_blocks(self) -> int:
        """The packed blocks among the examples; the others are the supervised rows', one each."""
        return self.examples - (self.examples_unpacked - self.text_rows)


def count_data(records, examples: list, pack: bool, truncation: dict) -> DataCounts:
    """`records` as read, `examples` as tokenized with `pack`, and `truncation` (TruncationStats.to_dict):
    its rows of LOST_KINDS (no usable text, no reply, a response or first reply beyond --max-seq-len) make
    no example, packed or not; every other row makes one unpacked (apt_ds.io.data.tokenize_dataset)."""
    text_rows = _text_rows(records)
    lost = sum(truncation.get(kind, 0) for kind in LOST_KINDS)
    return DataCounts(rows=len(records), text_rows=text_rows, examples=len(examples), packed=pack and text_rows > 0,
                      examples_unpacked=len(records) - lost)


def _text_rows(records) -> int:
    """Rows read as plain text: a `text` field that is not blank (apt_ds.io.data.split_record's test
    comes first), read from that column alone, in slices (a large data set is not copied whole)."""
    if "text" not in records.column_names:
        return 0
    slices = records.select_columns(["text"]).iter(batch_size=10_000)
    return sum(1 for batch in slices for text in batch["text"] if text is not None and str(text).strip())


def epochs_of(steps: int, global_batch: int, examples: int) -> float:
    return steps * global_batch / examples


def steps_for_epochs(epochs: float, examples: int, global_batch: int) -> int:
    """ceil(epochs x examples / global batch), on the decimal as typed: 0.1 x 30 / 3 is 1 step,
    where float arithmetic makes it 1.0000000000000002 and so 2."""
    return math.ceil(Fraction(repr(epochs)) * examples / global_batch)


def configs_for_epochs(epochs: float, counts: DataCounts, train: TrainConfig, world_size: int, meta: dict | None,
                       configs_for_steps: Callable[[int], tuple[APTConfig, TrainConfig]]) -> tuple[APTConfig, TrainConfig]:
    """The configs of an --epochs run, now that the data says how many steps the epochs are. A
    resume must come out at the run's own steps (its data and global batch were checked already:
    only another --epochs moves them); a finished run keeps its own, whatever its data is now."""
    global_batch = global_batch_size(train, world_size)
    steps = steps_for_epochs(epochs, counts.examples, global_batch)
    what = (f"--epochs {epochs:g} makes {_count(steps, 'step')} of {_count(counts.examples, 'example')} at "
            f"{_count(global_batch, 'sequence')} a step")
    if meta is not None:
        saved = meta["train_config"]["steps"]
        if steps != saved and not meta.get("finished"):
            raise CheckpointError(f"--resume: {what}, and the run has {saved:,}: pass the --epochs it was started "
                                  f"with, or --steps {saved}")
        steps = saved
    try:
        return with_steps(configs_for_steps, steps, train)
    except ConfigError as err:  # e.g. fewer than 4 steps, or a --warmup-steps not below them
        raise ConfigError(f"{what}, and {err}") from None


def with_steps(configs_for_steps: Callable[[int], tuple[APTConfig, TrainConfig]], steps: int,
               train: TrainConfig) -> tuple[APTConfig, TrainConfig]:
    """The configs for a run of `steps` steps, keeping the micro-batch that the backend set from
    --global-batch-size (apt_ds.training.run.make_backend) in `train`."""
    apt, for_steps = configs_for_steps(steps)
    return apt, dataclasses.replace(for_steps, micro_batch_size=train.micro_batch_size)


def data_stats(counts: DataCounts, train: TrainConfig, world_size: int, epochs_given: float | None) -> dict:
    """run_info's `data_stats`: the counts, the global batch and the epochs the steps are."""
    global_batch = global_batch_size(train, world_size)
    return {"rows": counts.rows, "text_rows": counts.text_rows, "examples": counts.examples, "packed": counts.packed,
            "global_batch": global_batch, "steps": train.steps,
            "epochs": round(epochs_of(train.steps, global_batch, counts.examples), 4), "epochs_given": epochs_given}


def start_lines(counts: DataCounts, train: TrainConfig, world_size: int, epochs_given: float | None) -> list[str]:
    """What the run says as it starts to train: the counts and epochs, and a warning where packing
    multiplied the epochs (not for --epochs, which chose its epochs: packing only lowered its steps)."""
    global_batch = global_batch_size(train, world_size)
    lines = [start_line(counts, train.steps, global_batch, train.max_seq_len, epochs_given)]
    warning = None if epochs_given is not None else packing_warning(counts, train.steps, global_batch, train.max_seq_len)
    return lines + ([warning] if warning else [])


def saying(lines: list[str], main: bool, stream: Iterator[dict]) -> Iterator[dict]:
    """`stream`, which says `lines` (on the main rank, to stderr as the other start lines) as its
    first micro-batch is drawn: once training has begun, so that a refusal before it stays one line."""
    if main:
        for line in lines:
            tqdm.write(line, file=sys.stderr)  # above the progress bar, which is drawn by then
    yield from stream


def start_line(counts: DataCounts, steps: int, global_batch: int, max_seq_len: int, epochs_given: float | None = None) -> str:
    """`data: 600 rows -> 75 examples (text rows packed into blocks of 256 tokens); 150 steps x 8
    sequences = 1,200 sequences = 16.0 epochs`, as HF Trainer's Num examples / Num Epochs."""
    packed = f" (text rows packed into blocks of {max_seq_len} tokens)" if counts.packed else ""
    given = f" (--epochs {epochs_given:g})" if epochs_given is not None else ""
    return (f"data: {_count(counts.rows, 'row')} -> {_count(counts.examples, 'example')}{packed}; {steps:,} steps x "
            f"{_count(global_batch, 'sequence')} = {_count(steps * global_batch, 'sequence')} = "
            f"{_epochs(epochs_of(steps, global_batch, counts.examples))} epochs{given}")


def packing_warning(counts: DataCounts, steps: int, global_batch: int, max_seq_len: int) -> str | None:
    """One line where packing made fewer examples than there are text rows and so the steps are
    more than about one epoch, with what --no-pack would make of them; else None."""
    epochs = epochs_of(steps, global_batch, counts.examples)
    if not counts.packed or epochs <= MANY_EPOCHS or counts.text_blocks >= counts.text_rows:
        return None
    unpacked = epochs_of(steps, global_batch, counts.examples_unpacked)
    return (f"warning: {_count(counts.text_rows, 'text row')} {'was' if counts.text_rows == 1 else 'were'} packed into "
            f"{_count(counts.text_blocks, 'block')} of {max_seq_len} tokens, so {steps:,} steps are {_epochs(epochs)} "
            f"epochs; --no-pack keeps one example per row ({_count(counts.examples_unpacked, 'example')}, "
            f"{_epochs(unpacked)} epochs)")


def _count(number: int, word: str) -> str:
    return f"{number:,} {word}{'' if number == 1 else 's'}"


def _epochs(epochs: float) -> str:
    """One decimal, as trainers print it; two significant digits below 0.1 (0.013, not 0.0)."""
    return f"{epochs:.1f}" if epochs >= 0.1 else f"{epochs:.2g}"
