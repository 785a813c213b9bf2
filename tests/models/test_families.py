"""Every family (LLaMA, Mistral, Qwen2, Qwen3) through one description: exact parameter counts,
masked == shrunk logits, and a trained run's export == the live model (streamed and in memory,
uniform through stock transformers as the family's own class, non-uniform through
load_pretrained). Tiny random models with GQA, random biases and norm weights (Qwen2's q/k/v
biases, Qwen3's per-head norms) and a Mistral window shorter than the sequences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FAMILY_OVERRIDES, check_against_probe, masked_then_shrunk, random_batch, random_kept, tiny_family

from apt_ds.algorithm.adapters import add_adapters
from apt_ds.algorithm.units import ModelShape
from apt_ds.cli.export import main as export_main
from apt_ds.cli.train import main as train_main
from apt_ds.export import merge
from apt_ds.models import FAMILIES, UnsupportedModelError, family_for

FAMILY_NAMES = list(FAMILY_OVERRIDES)
TRAIN = ["--steps", "8", "--max-seq-len", "32", "--micro-batch-size", "2", "--target-density", "0.6"]
DEMO = str(Path(__file__).resolve().parents[2] / "apt_ds" / "io" / "assets" / "demo.jsonl")
PROBE = ["--eval-data", DEMO, "--eval-examples", "4", "--save-eval-probe"]  # the live model's logits, 32 tokens


def _params(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)  # tied weights once


def test_every_family_has_a_tiny_model_here():
    assert set(FAMILY_NAMES) == set(FAMILIES)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("model_type", FAMILY_NAMES)
def test_parameter_count_is_exact(model_type, tied):
    model = tiny_family(model_type, tied=tied)
    shape = ModelShape.from_model(model)
    assert shape.family == model_type and ModelShape.from_config(model.config) == shape
    assert shape.total_params() == _params(model)
    embeddings = model.model.embed_tokens.weight.numel() * (1 if tied else 2)
    assert shape.block_params() == _params(model) - embeddings


def test_bias_and_head_norm_terms_are_in_the_counts():
    """A KV group of Qwen2 costs its q/k/v bias entries beside its weights; Qwen3's per-head norms
    are a constant of the layer: the pruner's terms come from the same table."""
    llama, qwen2, qwen3 = (ModelShape.from_model(tiny_family(t)) for t in ("llama", "qwen2", "qwen3"))
    layer = llama.layers[0]  # group_size 2, head_dim 16
    assert qwen2.group_cost(layer) - llama.group_cost(layer) == (layer.group_size + 2) * layer.head_dim
    assert qwen3.block_params() - llama.block_params() == len(llama.layers) * 2 * layer.head_dim
    assert qwen2.hidden_cost() == llama.hidden_cost() == qwen3.hidden_cost()


@pytest.mark.parametrize("model_type", FAMILY_NAMES)
def test_shrink_matches_masked_model(model_type):
    model = tiny_family(model_type)
    adapters = add_adapters(model, ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"), rank=4, alpha=8.0, seed=0)
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.lora_B.normal_(0, 0.05)
    shape = ModelShape.from_model(model)
    batch = random_batch(length=20)  # past Mistral's window of 8
    new_shape, _ = masked_then_shrunk(model, shape, batch, random_kept(shape, seed=7), 1e-3)
    assert ModelShape.from_model(model) == new_shape and _params(model) == new_shape.total_params()
    if model_type == "qwen2":
        attention = model.model.layers[0].self_attn
        assert attention.q_proj.bias.shape == (attention.q_proj.out_features,)


def test_a_layer_the_description_does_not_list_is_refused():
    """A LLaMA with biases is another architecture: refused in one line, at the config or the model."""
    with pytest.raises(UnsupportedModelError, match=r"llama with attention_bias=True is not supported"):
        ModelShape.from_model(tiny_family("llama", attention_bias=True))
    model = tiny_family("llama")
    model.model.layers[1].self_attn.q_norm = torch.nn.LayerNorm(16)
    with pytest.raises(UnsupportedModelError, match=r"layer 1 has self_attn.q_norm.bias, which the llama description"):
        ModelShape.from_model(model)


def test_a_refused_config_value_is_named_before_any_weight_is_read(in_tmp, tmp_path, tokenizer, capsys):
    """The weights file is garbage: a refusal from config.json alone comes before it is opened."""
    base = tmp_path / "biased"
    tiny_family("llama", vocab=len(tokenizer), attention_bias=True).save_pretrained(base)
    tokenizer.save_pretrained(str(base))
    (base / "model.safetensors").write_bytes(b"not safetensors")
    capsys.readouterr()
    assert train_main(["--model", str(base), "--steps", "4", "--out", str(tmp_path / "run")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "llama with attention_bias=True is not supported" in errors[0], errors
    assert not (tmp_path / "run").exists()


def _base_dir(tmp_path, tokenizer, model_type: str, tied: bool = False):
    directory = tmp_path / model_type
    tiny_family(model_type, vocab=len(tokenizer), tied=tied).save_pretrained(directory)
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.mark.parametrize("uniform", [False, True], ids=["non-uniform", "uniform"])
@pytest.mark.parametrize("model_type", FAMILY_NAMES)
def test_export_matches_the_live_run(in_tmp, tmp_path, tokenizer, model_type, uniform):
    """Trained, pruned to 0.6 and exported (streamed from the base files): the export gives the
    live run's logits and greedy tokens, loaded as the family's own class; a uniform one in stock
    transformers too. The config keeps what the family needs (Mistral's window)."""
    from transformers import AutoModelForCausalLM

    _base_dir(tmp_path, tokenizer, model_type, tied=model_type == "qwen3")
    assert train_main([*TRAIN, *PROBE, "--model", model_type, "--out", "run", *(["--uniform"] if uniform else [])]) == 0
    assert export_main(["run", "--out", "hf"]) == 0
    check_against_probe(tmp_path / "run", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    family = family_for(model_type)
    assert config["model_type"] == model_type and config["architectures"] == [family.causal_lm_class]
    assert ("apt_layer_shapes" in config) == (not uniform)
    if model_type == "mistral":
        assert config["sliding_window"] == 8
    from apt_ds.io.modeling import load_pretrained

    loaded = load_pretrained(tmp_path / "hf")
    assert type(loaded).__name__ == family.causal_lm_class
    if uniform:
        stock = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
        assert type(stock).__name__ == family.causal_lm_class
        ids = torch.randint(0, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(stock(input_ids=ids).logits, loaded(input_ids=ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_in_memory_export_matches_the_streamed_one(in_tmp, tmp_path, tokenizer, monkeypatch, model_type):
    """Both export paths write the same tensors (biases and per-head norms included)."""
    from safetensors.torch import load_file

    _base_dir(tmp_path, tokenizer, model_type)
    assert train_main([*TRAIN, "--model", model_type, "--out", "run"]) == 0
    assert export_main(["run", "--out", "streamed"]) == 0
    real_export_run = merge.export_run
    monkeypatch.setattr(merge, "export_run", lambda *a, **k: real_export_run(*a, **{**k, "streaming": False}))
    assert export_main(["run", "--out", "in-memory"]) == 0
    streamed = load_file(str(tmp_path / "streamed" / "model.safetensors"))
    in_memory = load_file(str(tmp_path / "in-memory" / "model.safetensors"))
    assert list(streamed) == list(in_memory)
    assert any(name.endswith("q_proj.bias" if model_type == "qwen2" else "q_norm.weight") for name in streamed)
    for name in streamed:
        torch.testing.assert_close(streamed[name], in_memory[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("model_type, extra, arch", [("mistral", [], "deci"), ("qwen2", [], "deci"),
                                                     ("qwen3", ["--uniform"], "qwen3"), ("qwen3", [], None)])
def test_a_run_of_each_family_exports_the_gguf_llama_cpp_runs(in_tmp, tmp_path, tokenizer, capsys, model_type, extra, arch):
    """llama.cpp's architecture for the run's shape (tests/export/test_gguf_families.py runs them);
    a per-layer Qwen3, which no llama.cpp graph runs, is refused in one line naming --uniform."""
    _base_dir(tmp_path, tokenizer, model_type)
    assert train_main([*TRAIN, *extra, "--model", model_type, "--out", "run"]) == 0
    capsys.readouterr()
    code = export_main(["run", "--out", "gguf", "--format", "gguf"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    if arch is None:
        assert code == 2 and len(errors) == 1 and "train with --uniform" in errors[0]
        assert not (tmp_path / "gguf").exists()
    else:
        assert code == 0 and json.loads((tmp_path / "gguf" / "apt_export.json").read_text())["gguf_architecture"] == arch


# Published configs (their config.json values that shape the weights) and the parameter counts
# their model cards and safetensors metadata give.
PUBLISHED = {
    "Llama-3.1-8B": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False), 8_030_261_248),
    "Llama-3.2-3B": ("llama", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                                   num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True), 3_212_749_824),
    "Mistral-7B-v0.3": ("mistral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                        num_key_value_heads=8, vocab_size=32768, tie_word_embeddings=False), 7_248_023_552),
    "Qwen2.5-7B": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False), 7_615_616_512),
    "Qwen3-8B": ("qwen3", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
                 8_190_735_360),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_sizes(name):
    """The unit accounting of a published model equals its published size and its transformers
    model's (built on the meta device: no weights)."""
    model_type, values, published = PUBLISHED[name]
    config_class, model_class = family_for(model_type).classes()
    with torch.device("meta"):
        model = model_class(config_class(**values))
    assert ModelShape.from_model(model).total_params() == _params(model) == published
    assert ModelShape.from_config(model.config).total_params() == published


def test_a_run_from_before_families_were_recorded_still_exports(in_tmp, tmp_path):
    """Checkpoints written before shapes named their family hold LLaMA's shapes without the key."""
    assert train_main([*TRAIN, "--checkpoint-every", "4", "--out", "run"]) == 0
    state_file = tmp_path / "run" / "checkpoint" / "apt_state.json"
    meta = json.loads(state_file.read_text())
    for key in ("original_shape", "shape"):
        assert meta[key].pop("family") == "llama"
    state_file.write_text(json.dumps(meta, indent=1))
    assert export_main(["run", "--out", "hf"]) == 0


@pytest.mark.parametrize("model_type", [name for name in FAMILIES if name != "llama"])  # LLaMA's: tiny_demo.yaml
def test_the_tiny_recipe_of_each_family_trains_prunes_and_exports_its_class(tmp_path, model_type):
    """configs/tiny_<family>.yaml on the built-in tiny-<family> model (no files at all)."""
    from apt_ds.io.modeling import load_pretrained

    recipe = Path(__file__).resolve().parents[2] / "configs" / f"tiny_{model_type}.yaml"
    out = tmp_path / "run"
    assert train_main(["--config", str(recipe), "--steps", "8", "--max-seq-len", "32", "--out", str(out)]) == 0
    assert export_main([str(out), "--out", str(tmp_path / "hf")]) == 0
    report = json.loads((tmp_path / "hf" / "apt_export.json").read_text())
    assert report["final"]["block_params"] < report["original"]["block_params"]  # it pruned
    model = load_pretrained(tmp_path / "hf")
    assert type(model).__name__ == family_for(model_type).causal_lm_class and model.config.model_type == model_type
