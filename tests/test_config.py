"""APTConfig / TrainConfig validation, JSON round-trip, and rejection of non-LLaMA models."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import tiny_llama
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from apt_ds import APTConfig, APTrainer, ConfigError, ModelShape, TrainConfig, UnsupportedModelError
from apt_ds.config import ADAPTER_TARGETS

# ---- invalid values name their field ---------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(target_density=0.0), "target_density"),
        (dict(target_density=-0.3), "target_density"),
        (dict(target_density=1.0001), "target_density"),
        (dict(target_density=2.0), "target_density"),
        (dict(pruning_start_step=50, pruning_end_step=40), "pruning_end_step"),
        (dict(pruning_start_step=50, pruning_end_step=50), "pruning_end_step"),
        (dict(adapter_rank=16, rank_cap=8), "rank_cap"),
        (dict(adapter_targets=("q_proj", "qkv_proj")), "adapter_targets"),
        (dict(adapter_targets=("lm_head",)), "adapter_targets"),
        (dict(adapter_targets=()), "adapter_targets"),
        (dict(num_pruning_events=0), "num_pruning_events"),
        (dict(salience_beta=1.0), "salience_beta"),
        (dict(mask_decay_step=0.0), "mask_decay_step"),
        (dict(prune_heads=False, prune_neurons=False, prune_hidden=False), "prune_heads"),
    ],
)
def test_apt_config_rejects_invalid_values_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        APTConfig(**kwargs)
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)  # ConfigError is a ValueError subclass


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(steps=0), "steps"),
        (dict(grad_accum_steps=0), "grad_accum_steps"),
        (dict(micro_batch_size=0), "micro_batch_size"),
        (dict(lr=0.0), "lr"),
        (dict(max_seq_len=1), "max_seq_len"),
        (dict(max_grad_norm=-1.0), "max_grad_norm"),
        (dict(max_grad_norm=float("inf")), "max_grad_norm"),
        (dict(max_grad_norm=float("nan")), "max_grad_norm"),
        (dict(lr="x"), "TrainConfig.lr must be of type float, got 'x'"),
        (dict(steps=None), "TrainConfig.steps must be of type int"),
        (dict(steps=True), "TrainConfig.steps must be of type int"),
    ],
)
def test_train_config_rejects_invalid_values_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**kwargs)


def test_valid_edge_values_are_accepted():
    assert APTConfig(target_density=1.0).target_density == 1.0
    assert APTConfig(adapter_rank=8, rank_cap=8).rank_cap == 8
    cfg = APTConfig(adapter_targets=list(ADAPTER_TARGETS))
    assert cfg.adapter_targets == ADAPTER_TARGETS  # normalised to a tuple


def test_for_steps_gives_a_consistent_schedule():
    cfg = APTConfig.for_steps(40, target_density=0.5)
    assert cfg.target_density == 0.5
    assert 0 < cfg.pruning_start_step < cfg.pruning_end_step <= 40
    assert 1 <= cfg.num_pruning_events <= cfg.pruning_end_step - cfg.pruning_start_step
    with pytest.raises(ConfigError):
        APTConfig.for_steps(3)


def test_as_lora_turns_off_everything_but_adapters():
    lora = APTConfig(adapter_targets=("q_proj", "k_proj"), adapter_rank=4).as_lora()
    assert (lora.prune, lora.grow_ranks, lora.distill, lora.target_density) == (False, False, False, 1.0)
    assert lora.adapter_targets == ("q_proj", "k_proj") and lora.adapter_rank == 4


# ---- JSON round-trip -------------------------------------------------------------------------

def test_apt_config_json_round_trip(tmp_path):
    cfg = APTConfig(
        target_density=0.55, pruning_start_step=3, pruning_end_step=33, num_pruning_events=5, uniform=True,
        adapter_targets=("q_proj", "v_proj", "down_proj"), adapter_rank=4, rank_cap=16, count_embeddings=True,
    )
    path = tmp_path / "apt.json"
    cfg.save(path)
    json.loads(path.read_text())  # plain JSON
    loaded = APTConfig.load(path)
    assert loaded == cfg
    assert isinstance(loaded.adapter_targets, tuple)
    assert APTConfig.from_dict(cfg.to_dict()) == cfg
    assert APTConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_train_config_json_round_trip(tmp_path):
    cfg = TrainConfig(steps=17, micro_batch_size=3, grad_accum_steps=4, lr=3e-4, seed=9, checkpoint_every=5)
    cfg.save(tmp_path / "train.json")
    assert TrainConfig.load(tmp_path / "train.json") == cfg
    assert dataclasses.asdict(TrainConfig.from_dict(cfg.to_dict())) == dataclasses.asdict(cfg)


def test_json_load_rejects_unknown_fields_and_bad_values(tmp_path):
    path = tmp_path / "apt.json"
    path.write_text(json.dumps({"target_density": 0.5, "not_a_knob": 1}))
    with pytest.raises(ConfigError, match="not_a_knob"):
        APTConfig.load(path)
    path.write_text(json.dumps({"target_density": 1.5}))
    with pytest.raises(ConfigError, match="target_density"):
        APTConfig.load(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError):
        APTConfig.load(path)


# ---- unsupported models ------------------------------------------------------------------------

def _tiny_gpt2():
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=50, n_positions=32))


def _llama_with_bias():
    cfg = LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, attention_bias=True,
    )
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("factory", [_tiny_gpt2, _llama_with_bias])
def test_non_llama_models_raise_unsupported(factory):
    model = factory()
    with pytest.raises(UnsupportedModelError):
        ModelShape.from_model(model)
    with pytest.raises(UnsupportedModelError):
        APTrainer(model, APTConfig.for_steps(10), TrainConfig(steps=10), progress=False)


def test_llama_with_bias_config_rejected_and_plain_llama_accepted():
    with pytest.raises(UnsupportedModelError, match="bias"):
        ModelShape.from_config(_llama_with_bias().config)
    shape = ModelShape.from_model(tiny_llama("gqa"))
    assert shape.hidden == 64 and len(shape.layers) == 2
    assert shape.layers[0].num_kv_groups == 2 and shape.layers[0].group_size == 2


def test_trainer_rejects_gpt2_before_touching_it():
    model = _tiny_gpt2()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(UnsupportedModelError):
        APTrainer(model, APTConfig.for_steps(10), TrainConfig(steps=10), progress=False)
    after = dict(model.named_parameters())
    assert set(after) == set(before)
    assert all(torch.equal(before[n], after[n]) for n in before)
