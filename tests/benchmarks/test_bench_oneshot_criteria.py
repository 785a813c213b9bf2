"""benchmarks/oneshot_criteria.py: each criterion cuts a model to the density in one shot, and the
structured Wanda score is what its docstring says."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import random_batch, tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import oneshot_criteria

from apt_ds.algorithm.units import ModelShape


def _batches():
    batches = [random_batch(batch=3, length=10, seed=s) for s in (1, 2)]
    for batch in batches:
        batch["attention_mask"][0, 7:] = 0  # padding must not count
        batch["labels"][:, :5] = -100  # a response: the first half unsupervised
    return batches


def test_wanda_sp_scores_are_input_norms_times_column_sums():
    model = tiny_llama("gqa")
    batches = _batches()
    groups, neurons = oneshot_criteria.wanda_sp_scores(model, batches)
    layer = model.model.layers[1]
    seen = []
    handle = layer.mlp.down_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    handle.remove()
    real = torch.cat([x[m.bool()] for x, m in zip(seen, (b["attention_mask"] for b in batches))])
    expected = real.norm(dim=0) * layer.mlp.down_proj.weight.abs().sum(0)
    torch.testing.assert_close(neurons[1], expected, rtol=1e-4, atol=1e-6)
    assert [g.shape[0] for g in groups] == [2, 2] and all(g.min() > 0 for g in groups)


@pytest.mark.parametrize("criterion", oneshot_criteria.CRITERIA)
def test_each_criterion_cuts_to_the_density_and_the_model_still_runs(criterion):
    model = tiny_llama("gqa", intermediate_size=256)
    before = ModelShape.from_model(model)
    shape, _ = oneshot_criteria.prune(model, criterion, 0.6, _batches())
    assert shape == ModelShape.from_model(model)
    assert 0.5 <= shape.block_params() / before.block_params() <= 0.6
    assert shape.uniform or not criterion.endswith("_uniform")
    if criterion.startswith("wanda"):
        assert shape.hidden == before.hidden  # hidden channels are kept: the score has none for them
    assert not any(p.requires_grad for p in model.parameters())
    logits = model(**{k: v for k, v in _batches()[0].items() if k != "labels"}).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("criterion", ["salience", "wanda_sp_uniform"])
def test_reconstruct_brings_each_cut_layer_closer_to_the_uncut_one(criterion):
    """--reconstruct: after the cut, o_proj and down_proj are refit by least squares to the uncut
    layer's output on the calibration tokens, so on those tokens each refit projection misses the
    uncut output by less than the plain cut does (the inputs are the uncut model's)."""
    model = tiny_llama("gqa", intermediate_size=256)
    batches = _batches()
    dense = oneshot_criteria.output_inputs(model, batches)
    cut = tiny_llama("gqa", intermediate_size=256)
    cut.load_state_dict(model.state_dict())
    _, decision = oneshot_criteria.prune(model, criterion, 0.6, batches)
    oneshot_criteria.prune(cut, criterion, 0.6, batches)
    oneshot_criteria.reconstruct(model, decision, dense)
    groups, neurons, hidden = decision.indices()
    layer, compared = 1, 0
    for kind, refit, plain in (("ffn", model.model.layers[layer].mlp.down_proj, cut.model.layers[layer].mlp.down_proj),
                               ("attn", model.model.layers[layer].self_attn.o_proj, cut.model.layers[layer].self_attn.o_proj)):
        gram, weight = dense["grams"][(kind, layer)], dense["weights"][(kind, layer)][hidden]
        kept = neurons[layer] if kind == "ffn" else torch.cat([torch.arange(g * 32, (g + 1) * 32) for g in groups[layer].tolist()])  # 2 heads of 16
        if len(kept) == gram.shape[0]:  # nothing cut here: left as the plain cut left it
            assert torch.equal(refit.weight, plain.weight)
            continue

        def error(w):  # sum over the calibration tokens of |W x - w x_kept|^2, from the Gram matrix
            full = torch.zeros_like(weight)
            full[:, kept] = w.double()
            diff = weight - full
            return float((diff @ gram * diff).sum())

        assert error(refit.weight.detach()) < 0.9 * error(plain.weight.detach())
        compared += 1
    assert compared  # the layer lost some of its inputs
    logits = model(**{k: v for k, v in batches[0].items() if k != "labels"}).logits
    assert torch.isfinite(logits).all()


def test_tune_trains_the_cut_model_and_returns_it_merged(tmp_path, tokenizer):
    """--train-steps: the cut model is LoRA-tuned (its weights move, its shape stays) and comes
    back as a plain model with the adapters merged."""
    import shutil

    from apt_ds.io.data import demo_data_path

    task = tmp_path / "task"
    task.mkdir()
    shutil.copy(demo_data_path(), task / "train.jsonl")
    model = tiny_llama("gqa", vocab=len(tokenizer), intermediate_size=256)
    shape, _ = oneshot_criteria.prune(model, "salience", 0.6, _batches_for(tokenizer, task))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    spec = {"train_steps": 4, "max_seq_len": 32, "micro_batch_size": 2, "lr": 1e-2, "seed": 0, "task_dir": str(task),
            "run_dir": str(tmp_path / "run")}
    tuned, tuned_shape = oneshot_criteria.tune(model, spec, tokenizer)
    assert tuned_shape == shape == ModelShape.from_model(tuned)
    after = dict(tuned.named_parameters())
    assert set(after) == set(before)  # no adapter or distillation module left
    assert any(not torch.equal(after[n], before[n]) for n in before if "q_proj" in n or "v_proj" in n)


def _batches_for(tokenizer, task):
    spec = {"task_dir": str(task), "max_seq_len": 32, "micro_batch_size": 2, "seed": 0, "calibration_batches": 2}
    return oneshot_criteria.calibration_batches(spec, tokenizer)
