"""Tokenizers: load any supported tokenizer (always with a pad token) or train a small one.

`load_tokenizer` takes a Hugging Face tokenizer directory, a classic sentencepiece
`tokenizer.model` directory (LLaMA-1/2; see `apt_ds.io.sentencepiece_dir`) or a .gguf file.
`train_sentencepiece_tokenizer` makes the tokenizer of the built-in tiny model. Problems are
`DataError`s, as for the data itself, so that the CLI reports both the same way.
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path
from typing import Iterable

from apt_ds.io.errors import DataError
from apt_ds.io.sentencepiece_dir import SENTENCEPIECE_FILE, error_cause, load_sentencepiece_dir


def is_tokenizer_file(name: str) -> bool:
    """A file name a tokenizer's save_pretrained writes (a model directory also holds weights and
    a config, which an export replaces and a run directory does not hold)."""
    return (name.startswith(("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "chat_template"))
            or name.endswith(".model"))


TOKENIZER_FILES = ("tokenizer.json", SENTENCEPIECE_FILE, "tokenizer_config.json", "tekken.json", "vocab.json",
                   "vocab.txt")


def load_tokenizer(path: str | Path):
    """An HF tokenizer directory or a .gguf file; always with a pad token. No remote code.

    A directory with a sentencepiece `tokenizer.model` but no `tokenizer.json` (the classic
    LLaMA-1/2 layout) is read by `load_sentencepiece_dir`.
    """
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.exists():
        raise DataError(f"tokenizer path {path} does not exist")
    if path.is_file() and path.suffix != ".gguf":
        raise DataError(f"tokenizer path {path} is a file: give the directory holding the tokenizer files, "
                        "or a .gguf file")
    if path.is_file():
        from apt_ds.io.modeling import check_gguf_architecture

        check_gguf_architecture(path, "tokenizer path")
    try:
        if path.is_file():
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)
        elif (path / SENTENCEPIECE_FILE).is_file() and not (path / "tokenizer.json").is_file():
            tokenizer = load_sentencepiece_dir(path)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except DataError:
        raise
    except Exception as err:  # transformers raises OSError, ValueError, JSONDecodeError, ImportError, Exception...
        if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
            found = ", ".join(sorted(item.name for item in path.iterdir())[:8]) or "nothing"
            raise DataError(f"tokenizer directory {path} holds no tokenizer files (tokenizer.json or a sentencepiece "
                            f"{SENTENCEPIECE_FILE}, usually with tokenizer_config.json); found: {found}") from err
        raise DataError(f"cannot load a tokenizer from {path}: {error_cause(err)}") from err
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            raise DataError(f"tokenizer {path} has no pad, eos or unk token to pad with; name one in its "
                            "tokenizer_config.json (e.g. \"eos_token\")")
        tokenizer.pad_token = fallback
    return tokenizer


SENTENCE_BYTES = 4192  # sentencepiece's max_sentence_length default: longer lines are skipped in training
LINE_PIECE = 1000  # characters: at most 4,000 UTF-8 bytes, under that limit
SPACE_MARK = "\u2581"  # sentencepiece's piece for a space
MERGE_HEADROOM = 256  # pieces for merges where the distinct characters alone exceed the asked vocabulary
SPECIAL_PIECES = {"unk": (0, "<unk>"), "bos": (1, "<s>"), "eos": (2, "</s>"), "pad": (3, "<pad>")}


def train_sentencepiece_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 512):
    """Train a small LLaMA-style (BPE + byte fallback) tokenizer and load it like any other.

    Writes tokenizer.model (the sentencepiece model) with a tokenizer_config.json naming its
    special pieces, reads it as a `LlamaTokenizer` (`load_sentencepiece_dir`: transformers'
    `LlamaTokenizer(vocab_file=...)` would silently encode to empty lists), and saves that as
    tokenizer.json, which every later load reads.
    """
    import sentencepiece as spm

    # sentencepiece skips sentences over 4,192 bytes: only such lines are cut, into pieces it reads (the
    # pieces only train the vocabulary; the data itself is tokenized whole)
    lines = [piece for text in texts for line in str(text).splitlines() if line.strip() for piece in _readable(line)]
    if not lines:
        raise DataError("cannot train a tokenizer: no non-empty text given")
    marked = next((line for line in lines if SPACE_MARK in line), None)
    if marked is not None:  # sentencepiece writes spaces as U+2581 and decodes U+2581 as a space
        at = max(marked.index(SPACE_MARK) - 20, 0)
        raise DataError(f"the data holds U+2581 ('{SPACE_MARK}', in {marked[at:at + 40]!r}), which the built-in model's "
                        f"sentencepiece tokenizer uses for spaces and cannot reproduce: replace it in the data")
    # byte fallback needs 256 byte pieces and the 4 special ones, plus one piece per distinct character:
    # many distinct characters (CJK text) get a larger vocabulary, with room for merges
    needed = len(set().union(*map(set, lines))) + 260
    vocab_size = vocab_size if needed <= vocab_size else needed + MERGE_HEADROOM
    model = io.BytesIO()
    ids = {f"{name}_id": index for name, (index, _) in SPECIAL_PIECES.items()}
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe",
            byte_fallback=True, character_coverage=1.0, hard_vocab_limit=False, split_digits=True,
            # identity normalisation keeps decode(encode(x)) == x, whitespace included
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            num_threads=1, minloglevel=2, **ids,  # one thread: same corpus -> same model bytes
        )
    except RuntimeError as err:
        raise DataError(f"sentencepiece training failed (vocab_size={vocab_size}): "
                        f"{str(err).strip().splitlines()[-1]}") from None
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, "legacy": False,
              **{f"{name}_token": piece for name, (_, piece) in SPECIAL_PIECES.items()}}
    # read in a directory of its own: transformers prefers a tokenizer.json, and out_dir may hold an old one
    with tempfile.TemporaryDirectory(prefix="apt-ds-tokenizer-") as staging:
        (Path(staging) / SENTENCEPIECE_FILE).write_bytes(model.getvalue())
        (Path(staging) / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
        converted = load_sentencepiece_dir(Path(staging))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SENTENCEPIECE_FILE).write_bytes(model.getvalue())
    converted.save_pretrained(str(out_dir))
    tokenizer = load_tokenizer(out_dir)
    # Leading whitespace is skipped: a text that already starts with a space gets no extra
    # dummy-prefix space, but decoding strips one (see `apt_ds.io.sentencepiece_dir`).
    _check_round_trip(tokenizer, [line.lstrip() for line in lines[:20]])
    return tokenizer


def tokenizer_training_texts(records) -> list[str]:
    """What the built-in model's tokenizer is trained on: every text field of the first 5000 rows."""
    texts = []
    for row in records.select(range(min(len(records), 5000))):
        texts.append(" ".join(str(row.get(k) or "") for k in ("text", "instruction", "input", "output", "prompt", "completion")))
    return texts


def _readable(line: str) -> list[str]:
    """`line`, or where sentencepiece would skip it, pieces of LINE_PIECE characters."""
    if len(line.encode("utf-8")) <= SENTENCE_BYTES:
        return [line]
    return [line[at:at + LINE_PIECE] for at in range(0, len(line), LINE_PIECE)]


def _check_round_trip(tokenizer, samples: list[str]) -> None:
    for sample in samples:
        ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
        if not ids or tokenizer.decode(ids) != sample:
            raise DataError(f"the tokenizer trained for the built-in model does not reproduce the text {sample[:40]!r} "
                            f"(ids {ids[:8]}): give --model with a tokenizer of its own")
