"""Loading records: a .json/.jsonl file, a saved `datasets` directory, or a Hugging Face Hub data
set already in the local cache (apt_ds.io.hub), with one-line errors.

Rows keep their fields; `apt_ds.io.data` turns them into token ids.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json
from pathlib import Path

import datasets

from apt_ds.io.classification import LABEL_FIELD, PAIR_FIELDS, SINGLE_FIELDS, text_fields_or_none
from apt_ds.io.errors import DataError
from apt_ds.io.hub import find_dataset, load_hub_dataset
from apt_ds.io.seq2seq import SEQ2SEQ_PAIRS

SCAN_CHUNK_BYTES = 1 << 20  # the UTF-8 check reads a data file in pieces of this size
USABLE_FIELDS = ("a 'text' field, 'instruction'/'output' fields, 'prompt'/'completion' (text or message lists), a "
                 "conversation in 'messages' (role/content) or 'conversations' (ShareGPT from/value), or, for a "
                 "classifier, 'sentence' (or a pair: 'sentence1'/'sentence2', GLUE's 'premise'/'hypothesis', ...) with an integer 'label', "
                 "or, for ROUGE, 'input'/'target' (CNN/DailyMail's 'article'/'highlights', XSum's 'document'/'summary')")
# fields that hold a list of messages (apt_ds.io.conversations); prompt/completion may hold either
MESSAGE_FIELDS = ("messages", "conversations")
# What a causal LM's rows are read from, and a classifier's single text: each must hold text wherever
# it appears (checked at load: {"text": 5} would otherwise train on "5")
TEXT_FIELDS = ("text", "instruction", "input", "output", "prompt", "completion", *MESSAGE_FIELDS, "sentence",
               "sentence1", "sentence2")
# Every field some task reads (the overlap check and the built-in tokenizer's text): GLUE's pair and the
# seq2seq names are checked by the task that reads them (an LM data set may hold a `target` of numbers)
ROW_FIELDS = (*TEXT_FIELDS, *dict.fromkeys(name for names in (SINGLE_FIELDS, *PAIR_FIELDS) for name in names
                                           if name not in TEXT_FIELDS),
              *(name for pair in SEQ2SEQ_PAIRS for name in pair if name != "input"))


def demo_data_path() -> Path:
    """The shipped demo instruction set (see benchmarks/make_demo_data.py)."""
    return Path(__file__).with_name("assets") / "demo.jsonl"


def load_records(path: str | Path, split: str | None = None, flag: str = "--data") -> datasets.Dataset:
    """A .json/.jsonl file, a directory written by `datasets.save_to_disk`, or a Hub name (org/name,
    org/name@revision) of a data set in the local cache. `split`: the split of a DatasetDict (saved
    or from the Hub) to read (None: train where there is one, else the first); a JSON file is one
    split, train. `flag` names the option in errors (--data, --eval-data; its split: FLAG-split)."""
    source = find_dataset(str(path), flag)  # None: a local path (one that exists always wins over a name)
    path = Path(path)
    if source is not None:
        with _quiet_datasets():
            loaded = load_hub_dataset(source)
        label, where = f"dataset {source.name}", f"dataset {source.name} ({source.location})"
    elif not path.exists():
        raise DataError(f"data path {path} does not exist")
    else:
        loaded = _load_saved_dir(path) if path.is_dir() else _load_json_file(path)
        label = f"data file {path.name}"
        where = f"data directory {path}" if path.is_dir() else label
    ds = _one_split(loaded, split, where, flag)
    if len(ds) == 0:
        raise DataError(f"{label} has no rows")
    columns = set(ds.column_names)
    if not ({"text"} <= columns or {"instruction", "output"} <= columns or {"prompt", "completion"} <= columns
            or columns & set(MESSAGE_FIELDS)
            or LABEL_FIELD in columns and text_fields_or_none(columns) is not None
            or any(set(pair) <= columns for pair in SEQ2SEQ_PAIRS)):
        raise DataError(f"{label} has no usable rows: need {USABLE_FIELDS}; found fields {sorted(columns)}")
    _check_text_fields(ds, path, label)
    return ds


def _one_split(loaded: datasets.Dataset | datasets.DatasetDict, split: str | None, where: str, flag: str) -> datasets.Dataset:
    """The split asked for, or one line that lists the splits there are."""
    if isinstance(loaded, datasets.DatasetDict):
        if not loaded:
            raise DataError(f"{where} holds a DatasetDict with no splits")
        if split is None:
            return loaded["train"] if "train" in loaded else loaded[next(iter(loaded))]
        if split not in loaded:
            raise DataError(f"{where} has no split {split!r}; its splits: {', '.join(loaded)} (choose one with {flag}-split)")
        return loaded[split]
    if split not in (None, "train"):  # one data set is the train split, as datasets loads a JSON file
        raise DataError(f"{where} has no splits, so no split {split!r}: {flag}-split is for a Hub data set or a saved "
                        f"DatasetDict (give train, or leave it out)")
    return loaded


def _check_text_fields(ds: datasets.Dataset, path: Path, label: str) -> None:
    """The fields that are read must hold text: {"text": 5} would otherwise train on "5"; message
    fields hold lists of messages (prompt/completion either)."""
    for name in TEXT_FIELDS:
        feature = ds.features.get(name)
        if feature is None or _is_text(feature) and name not in MESSAGE_FIELDS:
            continue
        if name in (*MESSAGE_FIELDS, "prompt", "completion") and _is_message_list(feature):
            continue
        if name in MESSAGE_FIELDS:
            keys = "role and content" if name == "messages" else "from and value"
            raise DataError(f"{label}: field {name!r} must hold lists of messages, objects whose {keys} are text "
                            "in every row (lists of content parts are not read)")
        kind = feature.dtype if isinstance(feature, datasets.Value) else type(feature).__name__.lower()
        where = _first_non_text(path, name) if path.is_file() else ""
        if name == "text" and not where and path.is_file() and _scan_text(path) == "[":  # datasets names a list's items 'text'
            raise DataError(f"{label} is a JSON list of {kind} values: each row must be an object "
                            f"with {USABLE_FIELDS}")
        what = "text mixed with other values" if kind == "json" else f"{kind} values, not text"  # json: mixed types
        raise DataError(f"{label}: field {name!r} holds {what}{where}")


def _is_text(feature) -> bool:
    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string", "null")


def _is_message_list(feature) -> bool:
    """A list of objects whose role and content (or ShareGPT's from and value) are text, as datasets
    types a JSON list of messages; other keys (a turn's weight, tool calls) are not read."""
    inner = getattr(feature, "feature", None)  # datasets.List / Sequence / LargeList
    if not isinstance(inner, dict):
        return False
    return any(all(_is_text(inner[key]) for key in pair) for pair in (("role", "content"), ("from", "value"))
               if set(pair) <= set(inner))


def _first_non_text(path: Path, name: str) -> str:
    """Where the first row whose `name` is neither text nor null is (" (line 3: 5)"), or "" where
    the file cannot say (it was parsed by datasets already: it is valid JSON)."""
    def describe(where: str, row) -> str | None:
        value = row.get(name) if isinstance(row, dict) else None
        if value is None or isinstance(value, str):
            return None
        shown = json.dumps(value, ensure_ascii=False)
        return f" ({where}: {shown if len(shown) <= 40 else shown[:37] + '...'})"

    try:
        if _scan_text(path) == "[":  # datasets has read the whole list already: it fits in memory
            rows = json.loads(path.read_text(encoding="utf-8-sig"))
            return next((where for i, row in enumerate(rows, start=1) if (where := describe(f"row {i}", row))), "")
        with open(path, encoding="utf-8-sig") as lines:  # line by line, up to the first such row
            return next((where for i, line in enumerate(lines, start=1)
                         if line.strip() and (where := describe(f"line {i}", json.loads(line)))), "")
    except (OSError, ValueError, MemoryError):
        return ""


def _load_saved_dir(path: Path) -> datasets.Dataset | datasets.DatasetDict:
    try:
        return datasets.load_from_disk(str(path))
    except IndexError:  # datasets cannot open a saved dataset of no rows (no arrow table to read)
        raise DataError(f"data directory {path} holds a saved dataset with no rows") from None
    except (FileNotFoundError, ValueError) as err:
        raise DataError(f"data directory {path} is not a dataset saved by `datasets` ({err})") from None


def _load_json_file(path: Path) -> datasets.Dataset:
    if path.suffix.lower() not in (".json", ".jsonl"):
        raise DataError(f"data file {path.name} is neither .json nor .jsonl (nor a saved dataset directory)")
    if not _scan_text(path):
        raise DataError(f"data file {path.name} is empty")
    try:
        with _quiet_datasets():
            return datasets.load_dataset("json", data_files=str(path), split="train")
    except Exception as err:  # datasets wraps parser errors in a long generic chain
        if "corresponds to no data" in str(err):  # `[]` or `{}`: valid JSON, no records
            raise DataError(f"data file {path.name} has no rows") from None
        raise DataError(f"data file {path.name} is not valid JSON records: {_json_problem(path, err)}") from None


def _scan_text(path: Path) -> str:
    """The file's first non-blank character ("" when blank), read in chunks so a large file is
    never held whole; bytes that are not UTF-8 would otherwise surface as a UnicodeDecodeError
    from deep inside pyarrow, when the rows are first read."""
    decoder, lines, first = codecs.getincrementaldecoder("utf-8")(), 1, ""
    with open(path, "rb") as stream:
        while True:
            chunk = stream.read(SCAN_CHUNK_BYTES)
            pending = decoder.getstate()[0]  # the end of a character split by the previous chunk: no newline in it
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as bad:
                window = pending + chunk
                line = lines + window[: bad.start].count(b"\n")
                raise DataError(f"data file {path.name} is not UTF-8 text: byte 0x{window[bad.start]:02x} on line {line} "
                                "(re-save it as UTF-8)") from None
            first = first or text.lstrip("\ufeff \t\r\n")[:1]
            lines += chunk.count(b"\n")
            if not chunk:
                return first


@contextlib.contextmanager
def _quiet_datasets():
    """No "Generating train split" bar (a cold cache prints it) and no logged parser error on
    stderr: a bad file gets our one line, which says where the problem is."""
    was_disabled = datasets.utils.are_progress_bars_disabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.utils.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not was_disabled:
            datasets.utils.enable_progress_bars()


def _json_problem(path: Path, err: Exception) -> str:
    """Locate the first bad line ourselves: the datasets error rarely says where."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if text.lstrip().startswith("["):
        try:
            json.loads(text)
        except json.JSONDecodeError as bad:
            return f"line {bad.lineno} column {bad.colno}: {bad.msg}"
    else:
        for number, line in enumerate(io.StringIO(text), start=1):
            try:
                if line.strip():
                    json.loads(line)
            except json.JSONDecodeError as bad:
                return f"line {number}: {bad.msg}"
    cause = err.__cause__ or err
    return str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
