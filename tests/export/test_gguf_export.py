"""GGUF export: dtypes, a byte-level BPE tokenizer with special tokens and chat template, the
guarantees of the HF export (one-line errors, nothing overwritten, atomic), and the pruner
never producing a layer shape that llama.cpp's deci graph mis-runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama

from apt_ds.algorithm.pruner import AdaptivePruner
from apt_ds.algorithm.units import ModelShape
from apt_ds.cli.export import main as export_main
from apt_ds.config import APTConfig
from apt_ds.export import gguf as gguf_export

gguf = pytest.importorskip("gguf")
pytest.importorskip("xllamacpp")

from test_gguf_llamacpp import _reader, llama_cpp  # noqa: E402

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _kept_all(tmp_path: Path, layers: int = 2) -> Path:
    kept = {"groups": [[0, 1]] * layers, "neurons": [list(range(96))] * layers, "hidden": list(range(64))}
    (tmp_path / "kept.json").write_text(json.dumps(kept))
    return tmp_path / "kept.json"


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("plain") / "model"
    tiny_llama("gqa", vocab=len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.mark.parametrize("dtype, matrix_type", [("fp16", "F16"), ("bf16", "BF16"), ("q8_0", "Q8_0")])
def test_dtypes(plain, tmp_path, dtype, matrix_type):
    assert export_main(["--model", str(plain), "--kept", str(_kept_all(tmp_path)), "--out", str(tmp_path / "g"),
                        "--format", "gguf", "--dtype", dtype]) == 0
    _, tensors = _reader(tmp_path / "g" / "g.gguf")
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == matrix_type
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"  # norms stay F32, as llama.cpp's converter
    with llama_cpp(tmp_path / "g" / "g.gguf") as cpp:
        assert len(cpp.greedy([1, 5, 9], new_tokens=3)) == 3


def test_an_out_named_like_a_gguf_file_holds_that_file(plain, tmp_path, capsys):
    """--out m.gguf: the directory m.gguf holds m.gguf (not m.gguf.gguf) and the report; apt-ds's
    loaders refuse a non-uniform ('deci') file in one line, naming the HF export instead."""
    from apt_ds.io.modeling import UnsupportedModelError, load_model
    from apt_ds.io.tokenizer import load_tokenizer

    kept = {"groups": [[0, 1], [0]], "neurons": [list(range(96)), list(range(64))], "hidden": list(range(64))}
    (tmp_path / "kept.json").write_text(json.dumps(kept))
    assert export_main(["--model", str(plain), "--kept", str(tmp_path / "kept.json"), "--out", str(tmp_path / "m.gguf"),
                        "--format", "gguf"]) == 0
    assert sorted(p.name for p in (tmp_path / "m.gguf").iterdir()) == ["apt_export.json", "m.gguf"]
    assert f"to {tmp_path / 'm.gguf' / 'm.gguf'}" in capsys.readouterr().err
    with pytest.raises(UnsupportedModelError, match="architecture 'deci'.*give the HF export of the same model"):
        load_model(tmp_path / "m.gguf" / "m.gguf")
    with pytest.raises(UnsupportedModelError, match="tokenizer path .* architecture 'deci'"):
        load_tokenizer(tmp_path / "m.gguf" / "m.gguf")


def test_q8_0_pads_pruned_widths_instead_of_falling_back_to_f16(plain, tmp_path):
    """Pruned widths (hidden 50, FFN 40) are padded to 32-blocks: every matrix is Q8_0 (llama.cpp's
    converter would write these as F16, and a pruned Q8_0 file came out larger than the dense one)."""
    kept = {"groups": [[0, 1]] * 2, "neurons": [list(range(40))] * 2, "hidden": list(range(50))}
    (tmp_path / "kept.json").write_text(json.dumps(kept))
    assert export_main(["--model", str(plain), "--kept", str(tmp_path / "kept.json"), "--out", str(tmp_path / "g"),
                        "--format", "gguf", "--dtype", "q8_0"]) == 0
    fields, tensors = _reader(tmp_path / "g" / "g.gguf")
    matrices = {t.tensor_type.name for name, t in tensors.items() if len(t.shape) == 2}
    assert matrices == {"Q8_0"}
    assert fields["llama.embedding_length"] == 64 and fields["llama.feed_forward_length"] == 64
    with llama_cpp(tmp_path / "g" / "g.gguf") as cpp:
        assert len(cpp.greedy([1, 5, 9], new_tokens=3)) == 3


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "q8_0"], "--format gguf"),
    (["--format", "onnx"], "invalid choice"),
])
def test_bad_options_give_one_line(plain, tmp_path, capsys, argv, message):
    try:
        code = export_main(["--model", str(plain), "--kept", str(_kept_all(tmp_path)), "--out", str(tmp_path / "g"), *argv])
    except SystemExit as exit_info:  # argparse's own check (choices), one line too
        code = exit_info.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "g").exists()


def test_existing_out_needs_overwrite_and_a_failed_export_leaves_nothing(plain, tmp_path, capsys, monkeypatch):
    argv = ["--model", str(plain), "--kept", str(_kept_all(tmp_path)), "--out", str(tmp_path / "g"), "--format", "gguf"]
    assert export_main(argv) == 0
    before = (tmp_path / "g" / "g.gguf").read_bytes()
    assert export_main(argv) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert export_main([*argv, "--dtype", "fp16", "--overwrite"]) == 0  # a previous GGUF export is replaced
    assert (tmp_path / "g" / "g.gguf").read_bytes() != before

    def die(path, *args, **kwargs):
        path.write_bytes(b"GGUF half written")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_export, "write_gguf", die)
    assert export_main([*argv[:-4], "--out", str(tmp_path / "new"), "--format", "gguf"]) == 130  # one line, no traceback
    assert "did not finish" in capsys.readouterr().err
    assert not (tmp_path / "new").exists() and not list(tmp_path.glob(".new.tmp-*"))


def _byte_level_bpe(directory: Path, vocab_size: int) -> None:
    """A SmolLM2-style tokenizer: byte-level BPE, each digit alone, ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from apt_ds.io.data import demo_data_path

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(demo_data_path().read_text().splitlines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))


def test_byte_level_bpe_tokenizer_special_tokens_and_chat_template(tmp_path):
    from apt_ds.io.tokenizer import load_tokenizer

    _byte_level_bpe(tmp_path / "model", 400)
    tokenizer = load_tokenizer(tmp_path / "model")
    model = tiny_llama("gqa", vocab=len(tokenizer))
    model.save_pretrained(tmp_path / "model")
    assert export_main(["--model", str(tmp_path / "model"), "--kept", str(_kept_all(tmp_path)),
                        "--out", str(tmp_path / "g"), "--format", "gguf"]) == 0
    reader = gguf.GGUFReader(str(tmp_path / "g" / "g.gguf"))
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "smollm"
    assert fields["tokenizer.chat_template"] == CHAT_TEMPLATE
    assert fields["tokenizer.ggml.eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    texts = ["hello world", "in 2024 there were 1234 apples", "<|im_start|>user\nhi<|im_end|>", "  two  spaces"]
    with llama_cpp(tmp_path / "g" / "g.gguf") as cpp:
        for text in texts:
            assert cpp.tokenize(text, add_special=False) == tokenizer(text, add_special_tokens=False)["input_ids"], text
    # No continuation compared here: this vocabulary's tokens are mostly single bytes >= 0x80, and
    # llama.cpp's server holds back (and misreports the log-probs of) tokens that end mid-character.


def test_unknown_bpe_pre_tokenizer_is_refused_in_one_line(tmp_path, capsys):
    _byte_level_bpe(tmp_path / "model", 400)
    spec = json.loads((tmp_path / "model" / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    (tmp_path / "model" / "tokenizer.json").write_text(json.dumps(spec))
    tiny_llama("gqa", vocab=len(spec["model"]["vocab"])).save_pretrained(tmp_path / "model")
    capsys.readouterr()
    assert export_main(["--model", str(tmp_path / "model"), "--kept", str(_kept_all(tmp_path)),
                        "--out", str(tmp_path / "g"), "--format", "gguf"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]  # not the load's progress bar
    assert len(errors) == 1 and errors[0].startswith("error:") and "pre-tokenizer" in errors[0]
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize("uniform", [False, True])
def test_pruner_keeps_a_neuron_wherever_attention_is_kept(uniform):
    """deci skips the FFN of a layer with FFN width 0 and, with it, that layer's attention
    output: the pruner keeps at least one neuron and one KV group per layer, even when a
    layer's neurons are worthless and the budget is tight."""
    shape = ModelShape.from_model(tiny_llama("gqa"))
    pruner = AdaptivePruner(APTConfig(uniform=uniform))
    groups = [torch.rand(l.num_kv_groups) + 1 for l in shape.layers]
    neurons = [torch.full((l.ffn,), 1e-12) if i == 0 else torch.rand(l.ffn) + 1 for i, l in enumerate(shape.layers)]
    hidden = torch.rand(shape.hidden) + 1
    for density in (0.3, 0.2, 0.12):
        decision = pruner.decide(shape, groups, neurons, hidden, density * shape.block_params())
        for kv, ffn in zip(decision.groups, decision.neurons):
            assert int(kv.sum()) >= 1 and int(ffn.sum()) >= 1


def test_q8_0_writes_o_proj_rows_that_fill_no_block_as_f16(tokenizer, tmp_path):
    """o_proj's rows are kept heads x head_dim and cannot be padded: one MHA head of 16 kept gives
    rows of 16, written as F16 (was a QuantError traceback); everything else stays Q8_0."""
    plain = tmp_path / "mha"
    tiny_llama("mha", vocab=len(tokenizer)).save_pretrained(plain)
    tokenizer.save_pretrained(str(plain))
    kept = {"groups": [[0], [1, 2]], "neurons": [list(range(96))] * 2, "hidden": list(range(64))}
    (tmp_path / "kept.json").write_text(json.dumps(kept))
    assert export_main(["--model", str(plain), "--kept", str(tmp_path / "kept.json"), "--out", str(tmp_path / "g"),
                        "--format", "gguf", "--dtype", "q8_0"]) == 0
    _, tensors = _reader(tmp_path / "g" / "g.gguf")
    assert tensors["blk.0.attn_output.weight"].tensor_type.name == "F16"  # rows of 16
    assert tensors["blk.1.attn_output.weight"].tensor_type.name == "Q8_0"  # rows of 32
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "Q8_0"
    with llama_cpp(tmp_path / "g" / "g.gguf") as cpp:
        assert len(cpp.greedy([1, 5, 9], new_tokens=3)) == 3
