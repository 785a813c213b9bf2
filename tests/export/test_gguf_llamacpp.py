"""GGUF export run by llama.cpp itself (xllamacpp: llama.cpp's server in-process, on 127.0.0.1):
the same greedy tokens as transformers on the HF export, log-prob gaps < 1e-3 in F32, and the
same tokenization, for uniform (`llama`) and non-uniform (`deci`) shapes."""

from __future__ import annotations

import json
import socket
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama

from apt_ds.algorithm.units import LayerShape, ModelShape
from apt_ds.cli.export import main as export_main
from apt_ds.cli.train import main as train_main
from apt_ds.export.gguf import ModelTensors, write_gguf
from apt_ds.export.merge import export_run
from apt_ds.io.modeling import load_pretrained

gguf = pytest.importorskip("gguf")
xllamacpp = pytest.importorskip("xllamacpp")

FAST = ["--steps", "12", "--max-seq-len", "32", "--target-density", "0.5", "--micro-batch-size", "2"]
PROMPT = [1, 17, 33, 60, 100, 7, 250, 42]
MORE_PROMPTS = ([1, 90, 12, 301, 5, 77, 140, 9], [1, 400, 3, 58, 211, 26, 99, 180])  # when the first four all fail
GAP = 1e-3  # F32: llama.cpp and transformers differ only in summation order


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LlamaCpp:
    def __init__(self, server, port: int):
        self.server, self.port = server, port

    def greedy(self, ids: list[int], new_tokens: int = 8) -> list[dict]:
        """llama.cpp's greedy continuation of `ids`: per step the token and the top-5 log-probs."""
        reply = self.server.handle_completions({"prompt": ids, "n_predict": new_tokens, "temperature": 0,
                                                "n_probs": 5, "cache_prompt": False})
        return reply["choices"][0]["logprobs"]["content"]

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        body = json.dumps({"content": text, "add_special": add_special, "parse_special": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/tokenize", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read())["tokens"]


@contextmanager
def llama_cpp(path: Path):
    params = xllamacpp.CommonParams()
    params.model.path = str(path)
    params.n_ctx = 64
    params.n_parallel = 1
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = 1
    params.warmup = False
    params.port = _free_port()
    server = xllamacpp.Server(params)
    try:
        yield LlamaCpp(server, params.port)
    finally:
        del server


def _complete_utf8(step: dict) -> bool:
    try:
        bytes(step["bytes"]).decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def assert_same_continuation(gguf_file: Path, hf_model, prompt=PROMPT, gap: float = GAP) -> list[int]:
    # A byte-fallback token that starts a UTF-8 character (>= 0x80) is held back by the server and
    # reported merged with the next token, under one id and one step's log-probs (seen: bytes
    # [0xDE, 'a'] under the id of 'a'): compare the steps before the first such entry (random tiny
    # models pick byte tokens often). Where that leaves under 2 steps, the prompt loses its first or
    # last token or two, or other prompts are tried (which of a random model's continuations starts
    # with a byte token is chance).
    with llama_cpp(gguf_file) as cpp:
        for candidate in (prompt, prompt[1:], prompt[:-1], prompt[2:], *MORE_PROMPTS):
            steps = cpp.greedy(candidate)
            partial = next((i for i, step in enumerate(steps) if not _complete_utf8(step)), len(steps))
            steps = steps[:partial]
            if len(steps) >= 2:
                prompt = candidate
                break
    assert len(steps) >= 2, f"llama.cpp generated a partial UTF-8 character at step {partial}: too few steps to compare"
    tokens = [step["id"] for step in steps]
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([prompt + tokens])).logits[0].double()
    log_probs = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    assert tokens == log_probs.argmax(-1).tolist()  # transformers' greedy choice at every step
    worst = max(abs(top["logprob"] - float(log_probs[i, top["id"]])) for i, step in enumerate(steps)
                for top in step["top_logprobs"])
    assert worst < gap, worst
    return tokens


def _reader(path: Path):
    reader = gguf.GGUFReader(str(path))
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.ggml.")}
    return fields, {t.name: t for t in reader.tensors}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer):
    """Runs on safetensors base models (streamed export): uniform GQA, non-uniform MHA."""
    root = tmp_path_factory.mktemp("gguf")
    made = {}
    for name, kind, extra in (("uniform_gqa", "gqa", ["--uniform"]), ("mha", "mha", [])):
        base = root / f"base_{kind}"
        tiny_llama(kind, vocab=len(tokenizer)).save_pretrained(base)
        tokenizer.save_pretrained(str(base))
        assert train_main([*FAST, "--model", str(base), *extra, "--out", str(root / name)]) == 0
        made[name] = root / name
    return made


@pytest.mark.parametrize("run, arch", [("uniform_gqa", "llama"), ("mha", "deci")])
def test_run_in_llama_cpp_continues_as_transformers(runs, tmp_path, run, arch):
    report = export_run(runs[run], tmp_path / "hf")
    assert export_main([str(runs[run]), "--out", str(tmp_path / "gg"), "--format", "gguf"]) == 0
    gguf_file = tmp_path / "gg" / "gg.gguf"
    assert sorted(p.name for p in (tmp_path / "gg").iterdir()) == ["apt_export.json", "gg.gguf"]
    gguf_report = json.loads((tmp_path / "gg" / "apt_export.json").read_text())
    assert gguf_report["final"] == report["final"] and gguf_report["gguf_architecture"] == arch
    fields, _ = _reader(gguf_file)
    assert fields["general.architecture"] == arch
    layers = report["final"]["layers"]
    if arch == "deci":  # the case under test: per-layer shapes
        assert len({(l["num_kv_groups"], l["ffn"]) for l in layers}) > 1
        assert fields["deci.attention.head_count"] == [l["num_kv_groups"] * l["group_size"] for l in layers]
        assert fields["deci.attention.head_count_kv"] == [l["num_kv_groups"] for l in layers]
        assert fields["deci.feed_forward_length"] == [l["ffn"] for l in layers]
    else:
        assert layers[0]["group_size"] > 1  # GQA
    assert_same_continuation(gguf_file, load_pretrained(tmp_path / "hf"))


def _plain_model(root: Path, tokenizer, kind: str = "gqa") -> Path:
    directory = root / f"plain_{kind}"
    tiny_llama(kind, vocab=len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(str(directory))
    return directory


def test_hidden_not_heads_times_head_dim_from_kept_units(tokenizer, tmp_path):
    """The second export form (--model PLAIN --kept KEPT): hidden pruned to 50 with 4 heads of 16,
    every layer alike: `llama` with key_length 16 and embedding_length 50."""
    plain = _plain_model(tmp_path, tokenizer)
    kept = {"groups": [[0, 1], [0, 1]], "neurons": [list(range(96))] * 2, "hidden": list(range(0, 64))[:50]}
    (tmp_path / "kept.json").write_text(json.dumps(kept))
    for form, extra in (("hf", []), ("gg", ["--format", "gguf"])):
        assert export_main(["--model", str(plain), "--kept", str(tmp_path / "kept.json"),
                            "--out", str(tmp_path / form), *extra]) == 0
    fields, tensors = _reader(tmp_path / "gg" / "gg.gguf")
    assert fields["general.architecture"] == "llama"
    assert fields["llama.embedding_length"] == 50 and fields["llama.attention.key_length"] == 16
    assert list(tensors["blk.0.attn_q.weight"].shape) == [50, 64]  # GGUF order: {n_embd, head_dim * n_head}
    assert_same_continuation(tmp_path / "gg" / "gg.gguf", load_pretrained(tmp_path / "hf"))


def test_zero_padding_to_the_quantization_block_is_exact(tokenizer, tmp_path, monkeypatch):
    """q8_0 pads hidden and FFN widths to multiples of 32 with zero units (the norm weights and eps
    compensate for the longer RMS mean). Written in F32 with the same padding, llama.cpp must still
    continue as transformers does on the unpadded model: hidden 50 -> 64, FFN 40 -> 64 (96 stays),
    through `deci` (per-layer widths) and `llama`. Layers with 0 neurons or 0 KV groups, padded:
    test_layers_without_attention_or_neurons."""
    import apt_ds.export.gguf as gguf_export

    monkeypatch.setitem(gguf_export.BLOCK, "fp32", 32)
    plain = _plain_model(tmp_path, tokenizer)
    for name, neurons in (("deci", [list(range(40)), list(range(96))]), ("llama", [list(range(40))] * 2)):
        kept = {"groups": [[0, 1], [0, 1]], "neurons": neurons, "hidden": list(range(64))[:50]}
        (tmp_path / f"{name}.json").write_text(json.dumps(kept))
        for form, extra in (("hf", []), ("gg", ["--format", "gguf", "--dtype", "fp32"])):
            assert export_main(["--model", str(plain), "--kept", str(tmp_path / f"{name}.json"),
                                "--out", str(tmp_path / name / form), *extra]) == 0
        fields, tensors = _reader(tmp_path / name / "gg" / "gg.gguf")
        assert fields["general.architecture"] == name
        assert fields[f"{name}.embedding_length"] == 64
        assert list(tensors["blk.0.ffn_down.weight"].shape) == [64, 64]  # GGUF order {n_ff, n_embd}: 40 -> 64
        report = json.loads((tmp_path / name / "gg" / "apt_export.json").read_text())
        assert report["zero_padding"]["hidden"] == 14 and report["zero_padding"]["ffn"][0] == 24
        assert_same_continuation(tmp_path / name / "gg" / "gg.gguf", load_pretrained(tmp_path / name / "hf"))


@pytest.mark.parametrize("block", [1, 32])
def test_layers_without_attention_or_neurons(tokenizer, tmp_path, monkeypatch, block):
    """A layer that lost every KV group is written without attention (deci skips it); one that
    lost every neuron but kept attention gets one zero neuron, since deci would drop its
    attention output. Reference: the model with that attention / FFN output zeroed. With block
    32 (q8_0's padding, here in F32) the zero neuron becomes 32 and FFN 96 becomes 96."""
    import apt_ds.export.gguf as gguf_export

    monkeypatch.setitem(gguf_export.BLOCK, "fp32", block)
    model = tiny_llama("gqa", vocab=len(tokenizer), num_hidden_layers=3)
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.model.layers[1].self_attn.o_proj.weight.zero_()
    full = ModelShape.from_model(model)
    layers = list(full.layers)
    layers[0] = LayerShape(layers[0].num_kv_groups, layers[0].group_size, layers[0].head_dim, ffn=0)
    layers[1] = LayerShape(0, layers[1].group_size, layers[1].head_dim, layers[1].ffn)
    shape = ModelShape(full.hidden, tuple(layers), full.vocab, full.tied_embeddings)

    class Pruned(ModelTensors):  # the units of the zeroed parts are gone
        def tensor(self, name):
            assert not name.startswith(("model.layers.0.mlp.", "model.layers.1.self_attn.", "model.layers.1.input_"))
            return super().tensor(name)

    write_gguf(tmp_path / "m.gguf", shape, Pruned(model), model.config, tmp_path / "tok", "fp32")
    fields, tensors = _reader(tmp_path / "m.gguf")
    assert fields["deci.attention.head_count_kv"] == [2, 0, 2] and fields["deci.feed_forward_length"][0] == block
    assert "blk.1.attn_q.weight" not in tensors and "blk.1.attn_norm.weight" not in tensors
    assert_same_continuation(tmp_path / "m.gguf", model)


def test_llama_cpp_tokenizes_as_the_hf_tokenizer(runs, tokenizer, tmp_path):
    assert export_main([str(runs["mha"]), "--out", str(tmp_path / "gg"), "--format", "gguf"]) == 0
    texts = ["hello world", "The quick brown fox jumps over the lazy dog.", "Question: is it 42? Answer: yes",
             "tabs\tand\nnewlines", "accents: café, naïve"]
    with llama_cpp(tmp_path / "gg" / "gg.gguf") as cpp:
        for text in texts:
            assert cpp.tokenize(text) == tokenizer(text)["input_ids"], text


def test_llama3_rope_scaling(tokenizer, tmp_path):
    """LLaMA-3.1's frequency-dependent RoPE scaling: llama.cpp reads it from rope_freqs.weight."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # every regime at head_dim 16
    model = tiny_llama("gqa", vocab=len(tokenizer), rope_parameters=rope)
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    write_gguf(tmp_path / "m.gguf", ModelShape.from_model(model), ModelTensors(model), model.config, tmp_path / "tok",
               "fp32")
    _, tensors = _reader(tmp_path / "m.gguf")
    factors = tensors["rope_freqs.weight"].data
    assert factors.min() == 1.0 and factors.max() == 8.0  # both ends of the scaling are exercised
    assert_same_continuation(tmp_path / "m.gguf", model, prompt=PROMPT + PROMPT)
    # transformers' GGUF reader drops the factors: such a file is no base model here (one line)
    from apt_ds.io.modeling import load_model
    from apt_ds.models import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=r"holds llama3 RoPE factors \(rope_freqs.weight\)"):
        load_model(tmp_path / "m.gguf")
