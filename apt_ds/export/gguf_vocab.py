"""The tokenizer of a GGUF export: token list, scores and types, merges, special tokens, chat template.

Written as llama.cpp's converter (convert_hf_to_gguf.py) writes them, with gguf-py's readers:
* a sentencepiece `tokenizer.model` (LLaMA-1/2, the built-in tiny model) -> tokenizer model
  "llama", pieces, scores and types from `gguf.SentencePieceVocab`;
* a `tokenizers` byte-level BPE tokenizer.json (SmolLM2, LLaMA-3, Qwen2/2.5/3) -> model "gpt2" with its
  merges; llama.cpp picks its pre-tokenizer (the regexes that split text before BPE) by name,
  so the tokenizer.json's pre-tokenizer must be one whose llama.cpp name we know (`_bpe_pre`);
* a tokenizer.json of a sentencepiece-style BPE (byte fallback; what save_pretrained writes for a
  LLaMA-2 tokenizer, so a run's tokenizer/ has no tokenizer.model) -> model "llama" with scores
  from the merge ranks (`_LlamaBpeJson`).
Special token ids, add_bos/add_eos and the chat template come from `gguf.SpecialVocab`.
"""

from __future__ import annotations

import json
from pathlib import Path

from apt_ds.config import ConfigError

# The pre-tokenizer of LLaMA-3 style tokenizers (a Split on this regex, then ByteLevel without its own regex).
LLAMA3_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
# Qwen2's, Qwen2.5's and Qwen3's (transformers' Qwen2Tokenizer): LLaMA-3's with single digits.
QWEN2_SPLIT = LLAMA3_SPLIT.replace("\\p{N}{1,3}", "\\p{N}")


def add_vocab(writer, tokenizer_dir: Path | None, vocab_size: int) -> str:
    """Add the tokenizer in `tokenizer_dir` to a gguf.GGUFWriter for a model with `vocab_size`
    embedding rows; returns the GGUF tokenizer model written ("llama" or "gpt2")."""
    import gguf

    if tokenizer_dir is None or not Path(tokenizer_dir).is_dir():
        raise ConfigError("a GGUF export needs the tokenizer (llama.cpp reads it from the file); "
                          f"no tokenizer directory at {tokenizer_dir}")
    tokenizer_dir = Path(tokenizer_dir)
    spec = _tokenizer_json(tokenizer_dir)
    model = spec.get("model", {}) if spec else {}
    if (tokenizer_dir / "tokenizer.model").is_file():
        vocab = gguf.SentencePieceVocab(tokenizer_dir)
        kind, merges = "llama", False
    elif model.get("type") == "BPE" and model.get("byte_fallback"):
        vocab = _LlamaBpeJson(tokenizer_dir, spec)
        kind, merges = "llama", False
    elif model.get("type") == "BPE" and (spec.get("decoder") or {}).get("type") == "ByteLevel":
        return _add_byte_level_bpe(writer, tokenizer_dir, spec, vocab_size)
    else:
        raise ConfigError(f"tokenizer in {tokenizer_dir} is neither sentencepiece nor a byte-level BPE "
                          "tokenizer.json; a GGUF export cannot describe it to llama.cpp")
    tokens, scores, types = [], [], []
    for text, score, token_type in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(token_type)
    _pad(tokens, scores, types, vocab_size, tokenizer_dir)
    writer.add_tokenizer_model(kind)
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(tokenizer_dir, load_merges=merges, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    return kind


def _add_byte_level_bpe(writer, tokenizer_dir: Path, spec: dict, vocab_size: int) -> str:
    """As convert_hf_to_gguf's `get_vocab_base`: ids without a token become [PAD<i>] (unused),
    added tokens are control tokens when special, user-defined otherwise."""
    import gguf

    from apt_ds.io.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    reverse = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(max(vocab_size, max(reverse) + 1)):
        if index not in reverse:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(reverse[index])
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[index])
            types.append(gguf.TokenType.NORMAL)
    _pad(tokens, None, types, vocab_size, tokenizer_dir)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_bpe_pre(spec, tokenizer_dir))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    return "gpt2"


class _LlamaBpeJson:
    """A sentencepiece-style BPE known only from its tokenizer.json, for llama.cpp's "llama"
    tokenizer. That tokenizer merges the adjacent pair whose result has the highest score, so a
    token's score is minus the rank of the first merge making it (HF BPE applies the lowest rank
    first); gguf.LlamaHfVocab gives every token -1000, which makes llama.cpp's merges arbitrary."""

    def __init__(self, tokenizer_dir: Path, spec: dict):
        from apt_ds.io.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.merges = spec["model"].get("merges") or []

    def all_tokens(self):
        import re

        import gguf

        scores = {}
        for rank, merge in enumerate(self.merges):
            pair = merge.split(" ", 1) if isinstance(merge, str) else merge
            scores.setdefault("".join(pair), -float(rank))
        reverse = {index: token for token, index in self.tokenizer.get_vocab().items()}
        added, unk = self.tokenizer.added_tokens_decoder, self.tokenizer.unk_token_id
        for index in range(max(reverse) + 1):
            token = reverse.get(index, f"[PAD{index}]")
            if index not in reverse:
                kind = gguf.TokenType.UNUSED
            elif index == unk:
                kind = gguf.TokenType.UNKNOWN
            elif index in added:
                kind = gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED
            elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
                kind = gguf.TokenType.BYTE
            else:
                kind = gguf.TokenType.NORMAL
            yield token.encode("utf-8"), scores.get(token, 0.0), kind


def _bpe_pre(spec: dict, tokenizer_dir: Path) -> str:
    """llama.cpp's name for the tokenizer.json's pre-tokenizer (llama-vocab.cpp's regexes)."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"  # each digit alone, then GPT-2's regex (SmolLM2, StarCoder)
    split = steps[0].get("pattern", {}).get("Regex") if kinds == ["Split", "ByteLevel"] else None
    if split == LLAMA3_SPLIT:
        return "llama-bpe"
    if split == QWEN2_SPLIT:
        return "qwen2"
    raise ConfigError(f"tokenizer in {tokenizer_dir}: its pre-tokenizer ({' + '.join(map(str, kinds))}) has no "
                      "llama.cpp equivalent known here (GPT-2, SmolLM2, LLaMA-3 or Qwen2 style)")


def _pad(tokens: list, scores: list | None, types: list, vocab_size: int, tokenizer_dir: Path) -> None:
    """Embedding rows beyond the tokenizer (a vocabulary padded to a multiple) get unused tokens."""
    import gguf

    if len(tokens) > vocab_size:
        raise ConfigError(f"tokenizer in {tokenizer_dir} has {len(tokens)} tokens but the model only "
                          f"{vocab_size} embedding rows")
    for index in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{index}]")
        types.append(gguf.TokenType.UNUSED)
        if scores is not None:
            scores.append(-1000.0)


def _tokenizer_json(tokenizer_dir: Path) -> dict:
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read {path}: {err}") from None
