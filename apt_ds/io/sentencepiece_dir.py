"""A classic sentencepiece tokenizer directory (`tokenizer.model`, no `tokenizer.json`) as a fast tokenizer.

transformers reads the model (its `SentencePieceExtractor`, through protobuf). A LLaMA-kind model
(BPE with byte fallback, no normalisation, a dummy prefix: LLaMA-1/2, our trained tokenizer) is
loaded as transformers' own `LlamaTokenizer`, which matches sentencepiece's ids. transformers 5
has no generic converter that honours sentencepiece's normaliser (its `SpmConverter` fails on BPE
models and its `TokenizersBackend` fallback adds no dummy prefix), so any other model gets the
`tokenizers` pipeline built here from the model's normaliser settings, with tokenizer_config.json
read by transformers as for any tokenizer.json directory.

Known differences from `SentencePieceProcessor.encode`, both those of transformers' LlamaTokenizer
(so a LLaMA tokenizer gives the same ids whether it comes as tokenizer.model or tokenizer.json):
  * a text that already starts with a space (or "▁") gets no extra dummy-prefix space:
    " hello" is [▁hello] where sentencepiece gives the pieces of "▁▁hello"; decoding drops that
    space, so such a text does not round-trip;
  * special-token strings such as "<s>" in the text become their special ids (sentencepiece
    spells them out), and the text right after one gets no dummy prefix (unless `legacy`).
Beyond LLaMA's kind of model: unigram models may split equal-score alternatives differently, and a
precompiled normalisation (e.g. nmt_nfkc) may drop rare combining marks that sentencepiece keeps.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from apt_ds.io.errors import DataError

SENTENCEPIECE_FILE = "tokenizer.model"
WORD_BOUNDARY = "\u2581"  # sentencepiece's space symbol
# sentencepiece_model.proto enums
SP_UNIGRAM, SP_BPE = 1, 2
SP_MODEL_TYPES = {1: "UNIGRAM", 2: "BPE", 3: "WORD", 4: "CHAR"}
SP_UNKNOWN, SP_CONTROL, SP_USER_DEFINED = 2, 3, 4  # piece types


def load_sentencepiece_dir(path: Path):
    """The tokenizer of a directory holding a sentencepiece tokenizer.model and no tokenizer.json."""
    import sentencepiece as spm

    config = _read_config(path / "tokenizer_config.json")
    try:
        processor = spm.SentencePieceProcessor(model_file=str(path / SENTENCEPIECE_FILE))
    except (RuntimeError, OSError) as err:
        return _load_not_sentencepiece(path, err)
    proto = _read_model(path, processor.get_piece_size())
    trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
    unsupported = [
        f"model type {SP_MODEL_TYPES.get(trainer.model_type, trainer.model_type)}"
        if trainer.model_type not in (SP_UNIGRAM, SP_BPE) else "",
        "treat_whitespace_as_suffix" if trainer.treat_whitespace_as_suffix else "",
        "escape_whitespaces=false" if not normalizer.escape_whitespaces else "",
    ]
    if any(unsupported):
        raise DataError(f"cannot load a tokenizer from {path}: the sentencepiece model uses "
                        f"{', '.join(filter(None, unsupported))}, which cannot be converted; provide a tokenizer.json")
    # tokenizer_config.json first, else the model's own pieces (LlamaTokenizer would assume <unk>, <s>, </s>);
    # BOS yes and EOS no unless the config says otherwise, as LLaMA
    pieces = {name: proto.pieces[index].piece for name, index in
              (("unk", trainer.unk_id), ("bos", trainer.bos_id), ("eos", trainer.eos_id), ("pad", trainer.pad_id))
              if 0 <= index < len(proto.pieces)}
    defaults = {f"{name}_token": piece for name, piece in pieces.items() if config.get(f"{name}_token") is None}
    # passed explicitly: transformers ignores the config's add_bos/eos_token when it loads a tokenizer.json
    defaults.update(add_bos_token=bool(config.get("add_bos_token", "bos" in pieces)),
                    add_eos_token=bool(config.get("add_eos_token", False)))
    if _is_llama_kind(proto, config):
        from transformers import LlamaTokenizer

        tokenizer = _from_pretrained(LlamaTokenizer, path, **defaults)
    else:
        tokenizer = _load_with_pipeline(path, proto, config, defaults)
    _check_declared_ids(tokenizer, config, path)
    return tokenizer


def _load_not_sentencepiece(path: Path, sp_err: Exception):
    """LLaMA-3's original tokenizer.model is tiktoken, not sentencepiece: transformers may read it."""
    from transformers import AutoTokenizer

    try:
        return _from_pretrained(AutoTokenizer, path)
    except Exception as err:
        raise DataError(f"cannot load a tokenizer from {path}: {SENTENCEPIECE_FILE} is not a sentencepiece model "
                        f"({error_cause(sp_err)}) and transformers cannot read it either ({error_cause(err)})") from None


def _read_config(config_file: Path) -> dict:
    try:
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{config_file} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise DataError(f"{config_file} is not a JSON object")
    return config


def _read_model(path: Path, piece_count: int):
    """The model's protobuf message, read by transformers (protobuf is a dependency of apt-ds)."""
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    model_file = path / SENTENCEPIECE_FILE
    try:
        proto = SentencePieceExtractor(str(model_file)).proto
    except ImportError as err:  # only a broken install gets here
        raise DataError(f"cannot read {model_file}: {error_cause(err)}; pip install protobuf") from None
    if len(proto.pieces) != piece_count:
        raise DataError(f"cannot load a tokenizer from {path}: {SENTENCEPIECE_FILE} holds {len(proto.pieces)} pieces "
                        f"where sentencepiece reads {piece_count}")
    return proto


def _is_llama_kind(proto, config: dict) -> bool:
    """Whether transformers' LlamaTokenizer rebuilds exactly this model's pipeline.

    It normalises nothing and adds the dummy prefix to the first piece only; `legacy` (prefix after
    every special token) is not saved with it, so a legacy model goes the generic way to keep it.
    """
    normalizer = proto.normalizer_spec
    return (proto.trainer_spec.model_type == SP_BPE and proto.trainer_spec.byte_fallback
            and not normalizer.precompiled_charsmap and not normalizer.remove_extra_whitespaces
            and normalizer.add_dummy_prefix and config.get("add_prefix_space", True) is not False
            and not config.get("legacy"))


def _load_with_pipeline(path: Path, proto, config: dict, defaults: dict):
    """Any other sentencepiece model: its pipeline as tokenizer.json, loaded with the directory's config."""
    from transformers import TokenizersBackend

    backend = _pipeline(proto, config)
    with tempfile.TemporaryDirectory(prefix="apt-ds-tokenizer-") as converted:
        backend.save(str(Path(converted) / "tokenizer.json"))
        # the generic class keeps this pipeline (a named class such as LlamaTokenizer would rebuild its own)
        local_config = {**config, "tokenizer_class": "TokenizersBackend"}
        (Path(converted) / "tokenizer_config.json").write_text(json.dumps(local_config), encoding="utf-8")
        tokenizer = _from_pretrained(TokenizersBackend, Path(converted), **defaults)
    tokenizer.name_or_path = str(path)
    return tokenizer


def _pipeline(proto, config: dict):
    """A `tokenizers.Tokenizer` that splits as sentencepiece does, from the model's trainer and normaliser specs."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE, Unigram
    from transformers.tokenization_utils_base import generate_merges

    trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
    pieces = [(piece.piece, piece.score, piece.type) for piece in proto.pieces]
    vocab = {piece: index for index, (piece, _, _) in enumerate(pieces)}
    unk = pieces[trainer.unk_id][0] if 0 <= trainer.unk_id < len(pieces) else None
    if trainer.model_type == SP_BPE:
        # a merge's rank is its result's score, as sentencepiece merges the best-scoring pair first
        normal = {piece: score for piece, score, kind in pieces if kind == 1}
        merges = generate_merges(vocab, vocab_scores=normal, skip_tokens=set(vocab) - set(normal))
        backend = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                byte_fallback=trainer.byte_fallback))
    else:
        backend = Tokenizer(Unigram([(piece, score) for piece, score, _ in pieces], unk_id=vocab.get(unk),
                                    byte_fallback=trainer.byte_fallback))

    steps = []
    if normalizer.precompiled_charsmap:  # e.g. nmt_nfkc; LLaMA's "identity" has none
        steps.append(normalizers.Precompiled(normalizer.precompiled_charsmap))
    if normalizer.remove_extra_whitespaces:  # leading, trailing and repeated spaces
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex(r"\A +| +\z"), "")]
    backend.normalizer = normalizers.Sequence(steps) if steps else None
    dummy_prefix = normalizer.add_dummy_prefix and config.get("add_prefix_space", True) is not False
    # "first" (LlamaTokenizer's default) tests the original offset, which a normaliser may have moved
    scheme = ("always" if config.get("legacy") or steps else "first") if dummy_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=WORD_BOUNDARY, prepend_scheme=scheme, split=False)
    steps = [decoders.Replace(WORD_BOUNDARY, " ")] + ([decoders.ByteFallback()] if trainer.byte_fallback else [])
    steps.append(decoders.Fuse())
    if dummy_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the dummy prefix space, as sentencepiece's decode
    backend.decoder = decoders.Sequence(steps)
    # unk and control pieces (<s>, </s>, ...) are special; user-defined ones are matched whole, as sentencepiece does
    backend.add_special_tokens([AddedToken(piece, special=True, normalized=False)
                                for piece, _, kind in pieces if kind in (SP_UNKNOWN, SP_CONTROL)])
    backend.add_tokens([AddedToken(piece, special=False, normalized=False)
                        for piece, _, kind in pieces if kind == SP_USER_DEFINED])
    return backend


def _from_pretrained(cls, path: Path, **kwargs):
    tokenizer = cls.from_pretrained(str(path), trust_remote_code=False, **kwargs)
    # where it was loaded from, which transformers would otherwise save into tokenizer_config.json
    for key in ("is_local", "local_files_only"):
        tokenizer.init_kwargs.pop(key, None)
    return tokenizer


def _check_declared_ids(tokenizer, config: dict, path: Path) -> None:
    """tokenizer_config.json's added_tokens_decoder must agree with the ids the tokenizer gives."""
    for index, token in (config.get("added_tokens_decoder") or {}).items():
        content = str(token.get("content") if isinstance(token, dict) else token)
        if tokenizer.convert_tokens_to_ids(content) != int(index):
            raise DataError(f"cannot load a tokenizer from {path}: tokenizer_config.json puts {content!r} at id {index} "
                            f"but the sentencepiece model gives it id {tokenizer.convert_tokens_to_ids(content)}")


def error_cause(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else repr(err)}"
