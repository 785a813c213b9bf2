"""T5 (v1.0 ReLU and v1.1 gated FFN) through its description (apt_ds.models.t5): an encoder
stack and a decoder stack, each decoder block two unit layers (self-attention; cross-attention
with the FFN). Exact parameter counts; masked == shrunk logits with heads (the relative position
bias of each stack read per kept head: apt_ds.algorithm.position_bias), FFN neurons and hidden
channels pruned per layer, on padded batches; salience counting each side's own tokens; APTrainer
training a seq2seq batch stream to its density."""

from __future__ import annotations

import json
import math

import pytest
import torch

from apt_ds.algorithm.pruner import AdaptivePruner, GradualMasker, KeepDecision
from apt_ds.algorithm.state import APTModel
from apt_ds.algorithm.units import ModelShape
from apt_ds.config import APTConfig, TrainConfig
from apt_ds.models import FAMILIES, SEQ2SEQ, family_for

# v1.0: a ReLU FFN, the decoder output scaled by d_model ** -0.5; v1.1: a gated-GELU FFN, unscaled (its
# config.json says tie_word_embeddings false, which transformers 5 reads as "do not scale")
VARIANTS = {"v1.0": dict(feed_forward_proj="relu"), "v1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)}


def tiny_t5(variant: str, seed: int = 0, **overrides):
    """A random T5ForConditionalGeneration with random norm weights and bias tables (ones and zeros
    would hide a norm or bias taken from the wrong channels or heads)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(**{**dict(vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
                                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, **VARIANTS[variant],
                                relative_attention_num_buckets=8, relative_attention_max_distance=16), **overrides})
    model = T5ForConditionalGeneration(config).eval()
    if not config.scale_decoder_outputs:  # v1.1's own LM head (transformers 5 ties it at construction)
        model.lm_head.weight = torch.nn.Parameter(torch.randn(config.vocab_size, config.d_model) * 0.05)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.uniform_(0.5, 1.5)
            elif "relative_attention_bias" in name:
                param.normal_()
    return model


def seq2seq_batch(batch: int = 3, source: int = 9, target: int = 6, seed: int = 1) -> dict:
    """Inputs and targets padded at the end (pad 0 = T5's decoder start), labels -100 there."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, 96, (batch, source), generator=generator)
    labels = torch.randint(2, 96, (batch, target), generator=generator)
    attention_mask, decoder_mask = torch.ones_like(input_ids), torch.ones_like(labels)
    attention_mask[1, source - 3:], decoder_mask[2, target - 2:] = 0, 0
    input_ids[attention_mask == 0] = 0
    labels[decoder_mask == 0] = -100
    decoder_input_ids = torch.cat([torch.zeros(batch, 1, dtype=torch.long), labels[:, :-1].clamp_min(0)], dim=1)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "decoder_input_ids": decoder_input_ids,
            "decoder_attention_mask": decoder_mask, "labels": labels}


def _logits(model, batch):
    with torch.no_grad():
        return model(**{k: v for k, v in batch.items() if k != "labels"}).logits


def test_t5_is_a_seq2seq_family_of_its_own():
    family = family_for("t5")
    assert "t5" in SEQ2SEQ and "t5" not in FAMILIES  # no tiny-t5 built-in, GGUF or lm-eval as a causal LM
    assert [kind.side for kind in family.kinds] == ["input", "input", "target", "target", "target"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_parameter_count_is_exact(variant):
    model = tiny_t5(variant)
    shape = ModelShape.from_model(model)
    assert shape == ModelShape.from_config(model.config)
    assert shape.total_params() == sum(p.numel() for p in model.parameters())  # v1.0's LM head is `shared`
    assert shape.tied_embeddings == (variant == "v1.0")
    kinds = [layer.kind for layer in shape.layers]
    assert len(kinds) == 2 + 3 + 3 and [layer.ffn for layer in shape.layers][2:5] == [0, 0, 0]  # decoder self-attentions


@pytest.mark.parametrize("variant", VARIANTS)
def test_shrink_matches_masked_model_with_heads_neurons_and_hidden_pruned(variant):
    """Every unit layer keeps its own heads (the first layer of each stack loses some too, so the
    bias table's columns must follow the heads, not the first layer), neurons and hidden channels."""
    model = tiny_t5(variant)
    batch = seq2seq_batch()
    stock = _logits(model, batch)
    state = APTModel(model, APTConfig.for_steps(100, target_density=0.5), seed=0)
    torch.testing.assert_close(_logits(model, batch), stock)  # the head-bias hooks read every head: as stock
    generator = torch.Generator().manual_seed(3)
    groups = [torch.rand(layer.num_kv_groups, generator=generator) > 0.4 for layer in state.shape.layers]
    for index, kept in enumerate(groups):
        kept[index % 4] = True  # at least one head, not always the same
        kept[(index + 1) % 4] = False  # and a different one gone in each layer
    neurons = [torch.rand(layer.ffn, generator=generator) > 0.4 for layer in state.shape.layers]
    decision = KeepDecision(groups, neurons, torch.rand(state.shape.hidden, generator=generator) > 0.3, 0)
    GradualMasker.snap(state.masks, decision)
    masked = _logits(model, batch)
    state.shrink(decision)
    shrunk = _logits(model, batch)
    assert (masked - stock).abs().max() > 0.1  # the pruning changed the function
    torch.testing.assert_close(shrunk, masked, rtol=1e-5, atol=1e-5)
    assert ModelShape.from_model(model) == state.shape and state.density() < 0.8
    assert sum(p.numel() for p in model.parameters() if not p.requires_grad) < state.original_shape.total_params()


def test_salience_counts_each_sides_own_tokens():
    """Encoder sites average over the input's real tokens, decoder sites over the target's."""
    model = tiny_t5("v1.1")
    state = APTModel(model, APTConfig.for_steps(100, target_density=0.5), seed=0)
    batch = seq2seq_batch()
    state.salience.enabled = True
    out = model(**{k: v for k, v in batch.items() if k != "labels"})
    torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).backward()
    counted = state.salience.tokens.tolist()
    assert counted == [int(batch["attention_mask"].sum()), int(batch["decoder_attention_mask"].sum())]
    state.salience.end_step()
    scores = [*state.salience.group_scores, *state.salience.neuron_scores, state.salience.hidden_scores]
    assert all(torch.isfinite(s).all() for s in scores) and all(float(s.sum()) > 0 for s in state.salience.group_scores)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_non_uniform_decision_reaches_its_density(variant):
    model = tiny_t5(variant)
    state = APTModel(model, APTConfig.for_steps(100, target_density=0.4), seed=0)
    generator = torch.Generator().manual_seed(5)
    scores = lambda n: torch.rand(n, generator=generator)  # noqa: E731
    decision = AdaptivePruner(APTConfig.for_steps(100, target_density=0.4)).decide(
        state.shape, [scores(l.num_kv_groups) for l in state.shape.layers], [scores(l.ffn) for l in state.shape.layers],
        scores(state.shape.hidden), 0.4 * state.original_shape.block_params(), state.original_shape)
    state.shrink(decision)
    assert 0.3 < state.density() <= 0.4
    assert torch.isfinite(_logits(model, seq2seq_batch())).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_uniform_decision_ties_each_stacks_self_attention_heads(tmp_path, variant):
    """Uniform mode: every attention keeps as many heads and every FFN as many neurons (one T5Config
    says them), the self-attentions of a stack the SAME heads (stock T5 adds its first layer's bias
    to all of them); the count is exact. Compacted, the bias tables are cut to those heads and a
    stock T5ForConditionalGeneration loads the export with the shrunk model's logits (its bias routed)."""
    from transformers import T5ForConditionalGeneration

    from apt_ds.algorithm.position_bias import shared_table_layers
    from apt_ds.export.merge import compact_model
    from apt_ds.export.writer import stock_loadable, write_export

    model = tiny_t5(variant, num_decoder_layers=2)
    config = APTConfig.for_steps(100, target_density=0.5, uniform=True)
    state = APTModel(model, config, seed=0)
    generator = torch.Generator().manual_seed(7)
    scores = lambda n: torch.rand(n, generator=generator, dtype=torch.float64)  # noqa: E731
    decision = AdaptivePruner(config).decide(
        state.shape, [scores(l.num_kv_groups) for l in state.shape.layers], [scores(l.ffn) for l in state.shape.layers],
        scores(state.shape.hidden), 0.5 * state.original_shape.block_params(), state.original_shape)
    kept = decision.kept_shape(state.shape)
    assert kept.uniform and len({l.num_q_heads for l in kept.layers}) == 1 and kept.layers[0].num_q_heads < 4
    assert decision.params == kept.block_params() <= 0.5 * state.original_shape.block_params()
    readers = shared_table_layers(state.shape)
    assert [len(members) for members in readers] == [2, 2]  # the encoder's, the decoder's self-attentions
    for members in readers:
        assert all(torch.equal(decision.groups[i], decision.groups[members[0]]) for i in members)
    state.shrink(decision)
    batch = seq2seq_batch()
    live = _logits(model, batch)
    compact = compact_model(model, state)
    assert stock_loadable(state.shape) and state.shape.heads == kept.layers[0].num_q_heads
    write_export(compact, state.shape, tmp_path / "hf", torch.float32)
    stock = T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert not {"apt_layer_shapes", "apt_bias_heads", "apt_bias_head_index"} & set(saved)
    torch.testing.assert_close(_logits(stock, batch), live, rtol=1e-4, atol=1e-4)


def test_apt_trains_a_seq2seq_stream_to_its_density():
    """One process: the task loss on the target, salience, events, rank growth and distillation
    on the decoder blocks; the run ends at its density with finite losses."""
    from apt_ds.training.trainer import APTrainer

    model = tiny_t5("v1.1")
    steps = 12
    apt = APTConfig.for_steps(steps, target_density=0.5, adapter_rank=4)
    trainer = APTrainer(model, apt, TrainConfig(steps=steps, micro_batch_size=3, lr=1e-2, warmup_steps=1, log_every=1))

    def stream():
        seed = 0
        while True:
            seed += 1
            yield seq2seq_batch(seed=seed)

    trainer.train(stream())
    losses = [r["loss"] for r in trainer.history if "loss" in r]
    assert len(losses) == steps and all(math.isfinite(loss) for loss in losses)
    assert abs(trainer.state.density() - 0.5) < 0.05
    adapted = {name.split(".")[0] for name in trainer.state.adapters}
    assert adapted == {"encoder", "decoder"}  # q/v adapters in both stacks, the cross-attention's included
    assert any("EncDecAttention" in name for name in trainer.state.adapters)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_base_loads_as_transformers_loads_it(tmp_path, variant):
    """Read tensor by tensor (as a pruning run reads its base): v1.1's own LM head kept (transformers
    5 ties every T5 config, and unties a checkpoint whose head differs), v1.0's tied to `shared`."""
    from transformers import T5ForConditionalGeneration

    from apt_ds.io.fingerprint import check_base_head
    from apt_ds.io.modeling import load_model

    tiny_t5(variant).save_pretrained(tmp_path / "base")
    check_base_head(tmp_path / "base")
    ours, stock = load_model(tmp_path / "base", mmap=False), T5ForConditionalGeneration.from_pretrained(tmp_path / "base")
    torch.testing.assert_close(_logits(ours, seq2seq_batch()), _logits(stock.eval(), seq2seq_batch()))
    assert (ours.lm_head.weight is ours.shared.weight) == (variant == "v1.0")


@pytest.mark.parametrize("variant", VARIANTS)
def test_an_export_with_every_head_kept_loads_and_gives_the_live_logits(tmp_path, variant):
    """Neurons and hidden channels pruned (27 of 32: not a multiple of the 4 heads, which T5's d_kv
    does not need), every head kept: the bias tables keep their width and no routing is recorded."""
    import json

    from apt_ds.export.merge import compact_model
    from apt_ds.export.writer import write_export
    from apt_ds.io.modeling import load_pretrained

    model = tiny_t5(variant)
    state = APTModel(model, APTConfig.for_steps(100, target_density=0.5), seed=0)
    generator = torch.Generator().manual_seed(7)
    hidden = torch.zeros(32, dtype=torch.bool)
    hidden[torch.randperm(32, generator=generator)[:27]] = True
    decision = KeepDecision([torch.ones(l.num_kv_groups, dtype=torch.bool) for l in state.shape.layers],
                            [torch.rand(l.ffn, generator=generator) > 0.3 for l in state.shape.layers], hidden, 0)
    state.shrink(decision)
    live = _logits(model, seq2seq_batch())
    write_export(compact_model(model, state), state.shape, tmp_path / "hf", torch.float32)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["d_model"] == 27 and config["num_heads"] == 4 and "apt_bias_head_index" not in config
    torch.testing.assert_close(_logits(load_pretrained(tmp_path / "hf"), seq2seq_batch()), live, rtol=1e-5, atol=1e-5)


def test_training_from_an_export_with_heads_pruned_is_refused(tmp_path):
    """Its recorded heads index the original tables, not the export's: an APTModel over it would
    read the wrong columns, so it is refused (launch/train.py says so in one line too)."""
    from apt_ds.export.merge import compact_model
    from apt_ds.export.writer import write_export
    from apt_ds.io.modeling import load_pretrained

    model = tiny_t5("v1.1")
    state = APTModel(model, APTConfig.for_steps(100, target_density=0.5), seed=0)
    # each layer keeps other heads than the one before: the bias stays routed (the same ones would be cut)
    groups = [torch.tensor([True, False, True, True]).roll(i) for i in range(len(state.shape.layers))]
    state.shrink(KeepDecision(groups, [torch.ones(l.ffn, dtype=torch.bool) for l in state.shape.layers],
                              torch.ones(32, dtype=torch.bool), 0))
    write_export(compact_model(model, state), state.shape, tmp_path / "hf", torch.float32)
    with pytest.raises(ValueError, match="loaded from an export with heads pruned per layer"):
        APTModel(load_pretrained(tmp_path / "hf"), APTConfig.for_steps(100, target_density=0.5))
