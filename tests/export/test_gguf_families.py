"""GGUF exports of every family run by llama.cpp itself (xllamacpp), against transformers on the HF
export of the same units: Qwen2's biases and Qwen3's per-head norms reach the file, each family
gets llama.cpp's own architecture when its loader takes the shape and `deci` otherwise, per-layer
Qwen3 is refused in one line, Mistral's sliding window is named where llama.cpp ignores it, and
Qwen's byte-level BPE tokenizes as in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TRAIN_FAST, tiny_family
from test_gguf_llamacpp import MORE_PROMPTS, PROMPT, _reader, assert_same_continuation, llama_cpp

from apt_ds.cli.export import main as export_main
from apt_ds.cli.train import main as train_main
from apt_ds.io.modeling import load_pretrained

gguf = pytest.importorskip("gguf")
pytest.importorskip("xllamacpp")

# Units kept of the tiny models (2 layers, 2 KV groups of 2 heads of 16, FFN 96, hidden 64)
UNIFORM = {"groups": [[0], [1]], "neurons": [list(range(0, 96, 2))] * 2, "hidden": list(range(64))}
UNIFORM_HIDDEN = dict(UNIFORM, hidden=list(range(50)))  # hidden no longer heads x head_dim
HEADS_AS_HIDDEN = dict(UNIFORM, groups=[[0, 1], [0, 1]])  # every head kept: heads x head_dim == hidden
PER_LAYER = {"groups": [[0, 1], [1]], "neurons": [list(range(40)), list(range(96))], "hidden": list(range(50))}
WINDOW = {"mistral": {"sliding_window": 16}}  # longer than the prompt and its continuation: llama.cpp agrees


def _export_both(root: Path, tokenizer, model_type: str, kept: dict, tied: bool, seed: int = 0, **overrides) -> Path:
    """HF and F32 GGUF exports of the kept units of a tiny random model: root/hf, root/gg/gg.gguf."""
    base = root / "base"
    tiny_family(model_type, seed=seed, vocab=len(tokenizer), tied=tied, **overrides).save_pretrained(base)
    tokenizer.save_pretrained(str(base))
    (root / "kept.json").write_text(json.dumps(kept))
    common = ["--model", str(base), "--kept", str(root / "kept.json"), "--overwrite"]
    assert export_main([*common, "--out", str(root / "hf")]) == 0
    assert export_main([*common, "--out", str(root / "gg"), "--format", "gguf", "--dtype", "fp32"]) == 0
    return root


def _same_continuation_on_some_seed(root: Path, tokenizer, model_type: str, kept: dict, tied: bool, **overrides):
    """A random tiny model's greedy pick is often a lone byte token, which llama.cpp's server
    reports merged with the next one (test_gguf_llamacpp.assert_same_continuation): another seed's
    model is tried when every prompt of one hits that."""
    for seed in range(4):
        _export_both(root, tokenizer, model_type, kept, tied, seed, **overrides)
        try:
            return assert_same_continuation(root / "gg" / "gg.gguf", load_pretrained(root / "hf"))
        except AssertionError as err:
            if "partial UTF-8" not in str(err):
                raise
    pytest.fail("every seed's continuation starts with a partial UTF-8 character")


CASES = [("llama", UNIFORM_HIDDEN, "llama"), ("llama", PER_LAYER, "deci"),
         ("mistral", UNIFORM_HIDDEN, "llama"), ("mistral", PER_LAYER, "deci"),
         ("qwen2", HEADS_AS_HIDDEN, "qwen2"),
         ("qwen2", UNIFORM, "deci"),  # llama.cpp's qwen2 sizes Q by the hidden size: heads pruned, deci
         ("qwen2", UNIFORM_HIDDEN, "deci"),
         ("qwen2", PER_LAYER, "deci"),  # deci adds the q/k/v biases (permuted with their rows)
         ("qwen3", UNIFORM_HIDDEN, "qwen3")]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("model_type, kept, arch", CASES,
                         ids=[f"{m}-{a}-{i}" for i, (m, k, a) in enumerate(CASES)])
def test_each_family_in_llama_cpp_continues_as_transformers(tmp_path, tokenizer, model_type, kept, arch, tied):
    _same_continuation_on_some_seed(tmp_path, tokenizer, model_type, kept, tied, **WINDOW.get(model_type, {}))
    fields, tensors = _reader(tmp_path / "gg" / "gg.gguf")
    assert fields["general.architecture"] == arch
    assert json.loads((tmp_path / "gg" / "apt_export.json").read_text())["gguf_architecture"] == arch
    assert ("output.weight" in tensors) != tied
    for layer, groups in enumerate(kept["groups"]):
        if model_type == "qwen2":  # the biases are written, sliced with their heads
            assert list(tensors[f"blk.{layer}.attn_q.bias"].shape) == [len(groups) * 2 * 16]
            assert list(tensors[f"blk.{layer}.attn_k.bias"].shape) == [len(groups) * 16]
            assert f"blk.{layer}.attn_v.bias" in tensors
        if model_type == "qwen3":  # the per-head norms, whole
            assert list(tensors[f"blk.{layer}.attn_q_norm.weight"].shape) == [16]
            assert list(tensors[f"blk.{layer}.attn_k_norm.weight"].shape) == [16]
    if arch == "deci" and kept is PER_LAYER:
        assert fields["deci.attention.head_count_kv"] == [2, 1] and fields["deci.feed_forward_length"] == [40, 96]


def test_a_trained_qwen2_run_exports_a_gguf_that_continues_as_its_hf_export(tmp_path, tokenizer):
    """The streamed path of a run (not --kept): a non-uniform Qwen2 run to deci, biases included.
    A lone byte token on every prompt says nothing of the file: another seed's run is tried."""
    for seed in range(3):
        root = tmp_path / f"seed{seed}"
        tiny_family("qwen2", seed=seed, vocab=len(tokenizer)).save_pretrained(root / "base")
        tokenizer.save_pretrained(str(root / "base"))
        assert train_main([*TRAIN_FAST, "--target-density", "0.5", "--seed", str(seed), "--model", str(root / "base"),
                           "--out", str(root / "run")]) == 0
        assert export_main([str(root / "run"), "--out", str(root / "hf")]) == 0
        assert export_main([str(root / "run"), "--out", str(root / "gg"), "--format", "gguf", "--dtype", "fp32"]) == 0
        fields, tensors = _reader(root / "gg" / "gg.gguf")
        assert fields["general.architecture"] == "deci" and "blk.0.attn_q.bias" in tensors
        try:
            assert_same_continuation(root / "gg" / "gg.gguf", load_pretrained(root / "hf"))
            return
        except AssertionError as err:
            if "partial UTF-8" not in str(err):
                raise
    pytest.fail("every seed's continuation starts with a partial UTF-8 character")


def test_per_layer_qwen3_is_refused_in_one_line_before_anything_is_written(tmp_path, tokenizer, capsys):
    base = tmp_path / "base"
    tiny_family("qwen3", vocab=len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(str(base))
    (tmp_path / "kept.json").write_text(json.dumps(PER_LAYER))
    capsys.readouterr()
    assert export_main(["--model", str(base), "--kept", str(tmp_path / "kept.json"), "--out", str(tmp_path / "gg"),
                        "--format", "gguf"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "--uniform" in errors[0] and "q/k norms" in errors[0], errors
    assert not (tmp_path / "gg").exists() and not list(tmp_path.glob(".gg.tmp-*"))


def test_a_trained_per_layer_qwen3_run_is_refused_before_reading_its_checkpoint(tmp_path, tokenizer, capsys, monkeypatch):
    import apt_ds.export.merge as merge

    base = tmp_path / "base"
    tiny_family("qwen3", vocab=len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(str(base))
    assert train_main([*TRAIN_FAST, "--target-density", "0.5", "--model", str(base), "--out", str(tmp_path / "run")]) == 0
    monkeypatch.setattr(merge, "_export_streaming", lambda *a, **k: pytest.fail("the run was read"))
    capsys.readouterr()
    assert export_main([str(tmp_path / "run"), "--out", str(tmp_path / "gg"), "--format", "gguf"]) == 2
    assert "train with --uniform" in capsys.readouterr().err


def test_mistral_window_is_named_and_llama_cpp_differs_past_it(tmp_path, tokenizer, capsys):
    """llama.cpp's llama and deci graphs attend to the whole context: with an 8-token window the
    continuation of an 8-token prompt differs from transformers' (the note is true), and the export
    says so; without a window in the config there is no note."""
    capsys.readouterr()
    _export_both(tmp_path / "w8", tokenizer, "mistral", UNIFORM_HIDDEN, tied=False, sliding_window=8)
    err = capsys.readouterr().err
    assert "8-token sliding window" in err and "more than 8 tokens" in err
    report = json.loads((tmp_path / "w8" / "gg" / "apt_export.json").read_text())
    assert len(report["notes"]) == 1 and "8-token" in report["notes"][0]
    with pytest.raises(AssertionError) as differs:
        assert_same_continuation(tmp_path / "w8" / "gg" / "gg.gguf", load_pretrained(tmp_path / "w8" / "hf"),
                                 prompt=PROMPT + MORE_PROMPTS[0])
    assert "partial UTF-8" not in str(differs.value)  # the tokens or log-probs differed, not the comparison failing
    _export_both(tmp_path / "none", tokenizer, "mistral", UNIFORM_HIDDEN, tied=False, sliding_window=None)
    assert json.loads((tmp_path / "none" / "gg" / "apt_export.json").read_text())["notes"] == []


def _qwen_tokenizer(directory: Path, vocab_size: int):
    """A Qwen2-style tokenizer (as transformers' Qwen2Tokenizer builds it): NFC, Qwen's split regex
    (single digits), byte-level BPE, ChatML special tokens, no BOS."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from apt_ds.io.data import demo_data_path

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(demo_data_path().read_text().splitlines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.save_pretrained(str(directory))
    return fast


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_byte_level_bpe_tokenizes_in_llama_cpp_as_in_transformers(tmp_path, model_type):
    """Pre-tokenizer `qwen2`: digits one by one (LLaMA-3's groups up to three would split 2024 as
    one piece), the rest as LLaMA-3's regex."""
    tokenizer = _qwen_tokenizer(tmp_path / "base", 600)
    tiny_family(model_type, vocab=len(tokenizer)).save_pretrained(tmp_path / "base")
    (tmp_path / "kept.json").write_text(json.dumps(UNIFORM))
    assert export_main(["--model", str(tmp_path / "base"), "--kept", str(tmp_path / "kept.json"),
                        "--out", str(tmp_path / "gg"), "--format", "gguf"]) == 0
    fields = {name: field.contents() for name, field in gguf.GGUFReader(str(tmp_path / "gg" / "gg.gguf")).fields.items()}
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "qwen2"
    texts = ["hello world", "in 2024 there were 1234 apples", "<|im_start|>user\nhi<|im_end|>", "  two  spaces",
             "it's done, isn't it?\n\nnext"]
    with llama_cpp(tmp_path / "gg" / "gg.gguf") as cpp:
        for text in texts:
            assert cpp.tokenize(text, add_special=False) == tokenizer(text, add_special_tokens=False)["input_ids"], text


def test_a_qwen2_gguf_is_a_base_model_and_a_qwen3_gguf_is_refused_in_one_line(tmp_path, tokenizer, capsys):
    """transformers reads a Qwen2 GGUF exactly (the logits of apt-ds's own qwen2 file equal its HF
    export's), and a run trains from it as Qwen2; its qwen3 mapping reads no head_dim, so a Qwen3
    GGUF is refused before anything loads instead of failing deep in transformers."""
    import torch

    from apt_ds.io.modeling import load_model

    _export_both(tmp_path / "q2", tokenizer, "qwen2", HEADS_AS_HIDDEN, tied=False)
    from_gguf, from_hf = load_model(tmp_path / "q2" / "gg" / "gg.gguf").eval(), load_pretrained(tmp_path / "q2" / "hf").eval()
    assert type(from_gguf).__name__ == "Qwen2ForCausalLM"
    ids = torch.randint(0, len(tokenizer), (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(from_gguf(ids).logits, from_hf(ids).logits)
    assert train_main([*TRAIN_FAST, "--model", str(tmp_path / "q2" / "gg" / "gg.gguf"), "--out", str(tmp_path / "run")]) == 0
    assert json.loads((tmp_path / "run" / "checkpoint" / "apt_state.json").read_text())["original_shape"]["family"] == "qwen2"

    _export_both(tmp_path / "q3", tokenizer, "qwen3", UNIFORM_HIDDEN, tied=False)
    capsys.readouterr()
    assert train_main([*TRAIN_FAST, "--model", str(tmp_path / "q3" / "gg" / "gg.gguf"), "--out", str(tmp_path / "run3")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "architecture 'qwen3'" in errors[0] and "HF directory" in errors[0], errors
    assert not (tmp_path / "run3").exists()
