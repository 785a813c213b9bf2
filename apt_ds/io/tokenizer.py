"""Tokenizers: load any supported tokenizer (always with a pad token) or train a small one.

`load_tokenizer` takes a Hugging Face tokenizer directory, a classic sentencepiece
`tokenizer.model` directory (LLaMA-1/2) or a .gguf file. The sentencepiece model is converted
here, by reading its protobuf fields directly (`sentencepiece_to_fast`), because transformers'
own conversion needs protobuf. `train_sentencepiece_tokenizer` makes the tokenizer of the
built-in tiny model. Problems are `DataError`s, as for the data itself, so that the CLI
reports both the same way.
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from typing import Iterable, Iterator

from apt_ds.io.data import DataError

SENTENCEPIECE_FILE = "tokenizer.model"
TOKENIZER_FILES = ("tokenizer.json", SENTENCEPIECE_FILE, "tokenizer_config.json", "tekken.json", "vocab.json",
                   "vocab.txt")


def load_tokenizer(path: str | Path):
    """An HF tokenizer directory or a .gguf file; always with a pad token. No remote code.

    A directory with a sentencepiece `tokenizer.model` but no `tokenizer.json` (the classic
    LLaMA-1/2 layout) is converted here by `sentencepiece_to_fast`: transformers' own conversion
    needs protobuf and, without it, fails with a misleading tiktoken error.
    """
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.exists():
        raise DataError(f"tokenizer path {path} does not exist")
    if path.is_file() and path.suffix != ".gguf":
        raise DataError(f"tokenizer path {path} is a file: give the directory holding the tokenizer files, "
                        "or a .gguf file")
    try:
        if path.is_file():
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)
        elif (path / SENTENCEPIECE_FILE).is_file() and not (path / "tokenizer.json").is_file():
            tokenizer = _load_sentencepiece_dir(path)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except DataError:
        raise
    except Exception as err:  # transformers raises OSError, ValueError, JSONDecodeError, ImportError, Exception...
        if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
            found = ", ".join(sorted(item.name for item in path.iterdir())[:8]) or "nothing"
            raise DataError(f"tokenizer directory {path} holds no tokenizer files (tokenizer.json or a sentencepiece "
                            f"{SENTENCEPIECE_FILE}, usually with tokenizer_config.json); found: {found}") from err
        raise DataError(f"cannot load a tokenizer from {path}: {_cause(err)}") from err
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            raise DataError(f"tokenizer {path} has no pad, eos or unk token to pad with; name one in its "
                            "tokenizer_config.json (e.g. \"eos_token\")")
        tokenizer.pad_token = fallback
    return tokenizer


def _cause(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else repr(err)}"


def _load_sentencepiece_dir(path: Path):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    model = (path / SENTENCEPIECE_FILE).read_bytes()
    config_file = path / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{config_file} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise DataError(f"{config_file} is not a JSON object")
    try:
        spm.SentencePieceProcessor(model_proto=model)
    except RuntimeError as sp_err:
        # Not sentencepiece (LLaMA-3's original tokenizer.model is tiktoken): transformers may read it.
        try:
            return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        except Exception as err:
            raise DataError(f"cannot load a tokenizer from {path}: {SENTENCEPIECE_FILE} is not a sentencepiece model "
                            f"({_cause(sp_err)}) and transformers cannot read it either ({_cause(err)})") from err
    try:
        return sentencepiece_to_fast(model, config)
    except DataError as err:
        raise DataError(f"cannot load a tokenizer from {path}: {err}") from None


# sentencepiece ModelProto numbers (sentencepiece_model.proto), read without protobuf
SP_UNIGRAM, SP_BPE = 1, 2
SP_NORMAL, SP_UNKNOWN, SP_CONTROL, SP_USER_DEFINED = 1, 2, 3, 4  # piece types; 5 unused, 6 byte
SP_MODEL_TYPES = {1: "UNIGRAM", 2: "BPE", 3: "WORD", 4: "CHAR"}
WORD_BOUNDARY = "\u2581"  # sentencepiece's space symbol


def _proto_fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) pairs of one protobuf message: ints for varints, bytes otherwise."""
    pos = 0

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            if pos >= len(buf):
                raise ValueError("truncated protobuf varint")
            byte = buf[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while pos < len(buf):
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            yield field, varint()
            continue
        size = {1: 8, 5: 4}.get(wire)
        if wire == 2:
            size = varint()
        elif size is None:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos + size > len(buf):
            raise ValueError("truncated protobuf field")
        yield field, buf[pos : pos + size]
        pos += size


def _read_sentencepiece(model: bytes) -> tuple[list[tuple[str, float, int]], dict, dict, dict]:
    """(pieces as (piece, score, type), trainer spec, normalizer spec, special ids) of a sentencepiece model.

    The specs map field numbers to values; absent fields take the proto defaults at the call site.
    Special ids are unk/bos/eos/pad, -1 when the model has none. Raises ValueError for bytes that
    sentencepiece itself does not accept as a model.
    """
    import sentencepiece as spm

    try:
        processor = spm.SentencePieceProcessor(model_proto=model)
    except RuntimeError as err:
        raise ValueError(f"sentencepiece cannot parse it: {str(err).strip()[:200]}") from None
    pieces, trainer, normalizer = [], {}, {}
    for field, value in _proto_fields(model):
        if field == 1:
            piece = dict(_proto_fields(value))
            score = struct.unpack("<f", piece[2])[0] if 2 in piece else 0.0
            pieces.append((piece.get(1, b"").decode("utf-8"), score, piece.get(3, SP_NORMAL)))
        elif field == 2:
            trainer = dict(_proto_fields(value))
        elif field == 3:
            normalizer = dict(_proto_fields(value))
    if not pieces or len(pieces) != processor.get_piece_size():
        raise ValueError(f"it holds {len(pieces)} pieces where sentencepiece reads {processor.get_piece_size()}")
    special_ids = {"unk": processor.unk_id(), "bos": processor.bos_id(), "eos": processor.eos_id(),
                   "pad": processor.pad_id()}
    return pieces, trainer, normalizer, special_ids


def sentencepiece_to_fast(model: bytes, config: dict | None = None):
    """A `tokenizers`-backed transformers tokenizer equivalent to a sentencepiece model; no protobuf.

    `model` is the bytes of a BPE or unigram sentencepiece model (e.g. LLaMA-1/2's tokenizer.model);
    `config` is an optional tokenizer_config.json dict, whose special tokens, add_bos_token/add_eos_token
    (default: BOS yes, EOS no, as LLaMA), `legacy`, `add_prefix_space`, padding side, maximum length
    and chat template are honoured. Special tokens default to the model's unk/bos/eos/pad pieces.

    Encoding equals `SentencePieceProcessor.encode(text)` for ordinary text, with two known
    differences, both those of transformers' own LlamaTokenizer (so a LLaMA tokenizer gives the
    same ids whether it comes as tokenizer.model or as tokenizer.json):
      * a text that already starts with a space (or "▁") gets no extra "dummy prefix" space:
        " hello" is [▁hello], where sentencepiece gives the pieces of "▁▁hello"; decoding drops
        that space, so such a text does not round-trip;
      * special-token strings such as "<s>" in the text become their special ids (sentencepiece
        spells them out), and the text right after one gets no dummy prefix (unless `legacy`).
    Beyond LLaMA's kind of model (BPE, identity normalisation): unigram models may split
    equal-score alternatives differently ("###" as # ## rather than ## #), and a precompiled
    normalisation (e.g. nmt_nfkc) may drop rare combining marks that sentencepiece keeps.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE, Unigram
    from transformers import LlamaTokenizer, TokenizersBackend
    from transformers.tokenization_utils_base import generate_merges

    try:
        pieces, trainer, normalizer, special_ids = _read_sentencepiece(model)
    except ValueError as err:
        raise DataError(f"not a sentencepiece model: {err}") from None
    config = dict(config or {})
    model_type = trainer.get(3, SP_UNIGRAM)
    unsupported = [
        f"model type {SP_MODEL_TYPES.get(model_type, model_type)}" if model_type not in (SP_UNIGRAM, SP_BPE) else "",
        "treat_whitespace_as_suffix" if trainer.get(24, 0) else "",
        "escape_whitespaces=false" if not normalizer.get(5, 1) else "",
    ]
    if any(unsupported):
        raise DataError(f"sentencepiece model uses {', '.join(filter(None, unsupported))}, which cannot be converted; "
                        f"provide a tokenizer.json")
    byte_fallback = bool(trainer.get(35, 0))
    vocab = {piece: index for index, (piece, _, _) in enumerate(pieces)}
    special_pieces = {name: pieces[index][0] for name, index in special_ids.items() if 0 <= index < len(pieces)}
    if model_type == SP_BPE:
        # a merge's rank is its result's score, as sentencepiece merges the best-scoring pair first
        normal = {piece: score for piece, score, kind in pieces if kind == SP_NORMAL}
        merges = generate_merges(vocab, vocab_scores=normal, skip_tokens=set(vocab) - set(normal))
        backend = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=special_pieces.get("unk"), fuse_unk=True,
                                byte_fallback=byte_fallback))
    else:
        backend = Tokenizer(Unigram([(piece, score) for piece, score, _ in pieces],
                                    unk_id=vocab.get(special_pieces.get("unk")), byte_fallback=byte_fallback))

    steps = []
    if normalizer.get(2):  # precompiled charsmap (e.g. nmt_nfkc); LLaMA's "identity" has none
        steps.append(normalizers.Precompiled(normalizer[2]))
    if normalizer.get(4, 1):  # remove_extra_whitespaces: leading, trailing and repeated spaces
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex(r"\A +| +\z"), "")]
    backend.normalizer = normalizers.Sequence(steps) if steps else None
    dummy_prefix = bool(normalizer.get(3, 1)) and config.get("add_prefix_space", True) is not False
    # "first" (LlamaTokenizer's default) tests the original offset, which a normaliser may have moved
    scheme = ("always" if config.get("legacy") or steps else "first") if dummy_prefix else "never"
    # LlamaTokenizer rebuilds exactly this pipeline when it reloads a saved tokenizer.json (it does not
    # save `legacy`); any other pipeline is kept by the generic TokenizersBackend
    llama_like = model_type == SP_BPE and byte_fallback and scheme == "first" and not steps
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=WORD_BOUNDARY, prepend_scheme=scheme, split=False)
    steps = [decoders.Replace(WORD_BOUNDARY, " ")]
    if byte_fallback:
        steps.append(decoders.ByteFallback())
    steps.append(decoders.Fuse())
    if dummy_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the dummy prefix space, as sentencepiece's decode
    backend.decoder = decoders.Sequence(steps)
    # unk and control pieces (<s>, </s>, ...) are special; user-defined ones are matched whole, as sentencepiece does
    backend.add_special_tokens([AddedToken(piece, special=True, normalized=False)
                                for piece, _, kind in pieces if kind in (SP_UNKNOWN, SP_CONTROL)])
    backend.add_tokens([AddedToken(piece, special=False, normalized=False)
                        for piece, _, kind in pieces if kind == SP_USER_DEFINED])
    declared = _declared_added_tokens(config)
    for index, token in sorted(declared.items()):
        if index >= len(pieces):  # appended to the sentencepiece vocabulary (e.g. a new <pad>), in id order
            (backend.add_special_tokens if token.special else backend.add_tokens)([token])

    kwargs = {}
    for name in ("unk", "bos", "eos", "pad"):  # tokenizer_config.json first, else the model's own piece
        value = config.get(f"{name}_token")
        value = value.get("content") if isinstance(value, dict) else value
        if value or name in special_pieces:
            kwargs[f"{name}_token"] = str(value or special_pieces[name])
    kwargs["add_bos_token"] = bool(config.get("add_bos_token", "bos_token" in kwargs))
    kwargs["add_eos_token"] = bool(config.get("add_eos_token", False))
    for key in ("model_max_length", "padding_side", "truncation_side", "clean_up_tokenization_spaces", "chat_template"):
        if config.get(key) is not None:
            kwargs[key] = config[key]
    tokenizer = (LlamaTokenizer if llama_like else TokenizersBackend)(tokenizer_object=backend, **kwargs)
    for index, token in declared.items():
        if tokenizer.convert_tokens_to_ids(token.content) != index:
            raise DataError(f"tokenizer_config.json puts {token.content!r} at id {index} but the sentencepiece "
                            f"model gives it id {tokenizer.convert_tokens_to_ids(token.content)}")
    return tokenizer


def _declared_added_tokens(config: dict) -> dict:
    """tokenizer_config.json's added_tokens_decoder as {id: AddedToken}."""
    from tokenizers import AddedToken

    declared = {}
    for index, token in (config.get("added_tokens_decoder") or {}).items():
        token = token if isinstance(token, dict) else {"content": str(token)}
        flags = {key: bool(token[key]) for key in ("single_word", "lstrip", "rstrip", "normalized", "special")
                 if key in token}
        declared[int(index)] = AddedToken(str(token["content"]), **flags)
    return declared


SPECIAL_PIECES = {"unk": (0, "<unk>"), "bos": (1, "<s>"), "eos": (2, "</s>"), "pad": (3, "<pad>")}


def train_sentencepiece_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 512):
    """Train a small LLaMA-style (BPE + byte fallback) tokenizer and load it like any other.

    Writes tokenizer.model (the sentencepiece model) and tokenizer.json/tokenizer_config.json.
    The fast tokenizer is built from the sentencepiece model by `sentencepiece_to_fast`, because
    transformers' own conversion of tokenizer.model needs protobuf, and
    `LlamaTokenizer(vocab_file=...)` silently encodes to empty lists.
    """
    import sentencepiece as spm

    lines = [line for text in texts for line in str(text).splitlines() if line.strip()]
    if not lines:
        raise DataError("cannot train a tokenizer: no non-empty text given")
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
        raise DataError(f"sentencepiece training failed (vocab_size={vocab_size}; byte fallback needs "
                        f">= 260 + distinct characters): {str(err).strip().splitlines()[-1]}") from None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.model").write_bytes(model.getvalue())
    sentencepiece_to_fast(model.getvalue()).save_pretrained(str(out_dir))
    tokenizer = load_tokenizer(out_dir)
    # Leading whitespace is skipped: a text that already starts with a space gets no extra
    # dummy-prefix space, but decoding strips one (see `sentencepiece_to_fast`).
    _check_round_trip(tokenizer, [line.lstrip() for line in lines[:20]], out_dir)
    return tokenizer


def _check_round_trip(tokenizer, samples: list[str], where: Path) -> None:
    for sample in samples:
        ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
        if not ids or tokenizer.decode(ids) != sample:
            raise DataError(f"tokenizer written to {where} does not round-trip {sample[:40]!r} (ids {ids[:8]})")
