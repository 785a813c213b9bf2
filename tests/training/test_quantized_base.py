"""A quantized frozen base (--base-quant nf4/fp4/int8, bitsandbytes on the CPU) in one process:
it loads quantized tensor by tensor, trains, prunes to its density (non-uniform and uniform),
grows ranks, resumes bit for bit, and exports merged into the original weights with the live
quantized model's eval loss within 2%; the masked and the shrunk quantized model agree exactly
(and within the re-quantization error in the layout before 2026-12-07); bad input is one line."""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import (
    TRAIN_FAST,
    Crash,
    assert_resumed_as_uninterrupted,
    check_against_probe,
    micro_batches,
    random_batch,
    random_kept,
    set_binary_masks,
    tiny_family,
)

from apt_ds import APTConfig, APTrainer, TrainConfig
from apt_ds.algorithm.masks import UnitMasks
from apt_ds.algorithm.quant import BaseQuant, QuantizationError, dequantize, is_quantized, storage_bytes
from apt_ds.algorithm.shrink import shrink_model
from apt_ds.algorithm.units import ModelShape
from apt_ds.cli.export import main as export_main
from apt_ds.cli.train import main as train_main
from apt_ds.config import ConfigError
from apt_ds.export import merge
from apt_ds.io.quantized import load_quantized, projection_modules, quantize_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from test_distributed import EVAL, exported_eval_loss  # noqa: E402

pytest.importorskip("bitsandbytes")
METHODS = ["nf4", "fp4", "int8"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs with one torch thread (see conftest.one_thread)."""


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method, tied", [("nf4", True), ("fp4", False), ("int8", False)])
def test_a_safetensors_base_loads_quantized_as_the_model_in_memory_quantizes(tmp_path, method, tied):
    """Streamed from the files tensor by tensor: the same codes as quantizing the loaded model,
    every projection quantized, everything else in the base dtype (a tied head: the embedding)."""
    model = tiny_family("qwen2", tied=tied)
    model.save_pretrained(tmp_path / "base")
    quant = BaseQuant(method)
    streamed = load_quantized(tmp_path / "base", quant, torch.device("cpu"))
    in_memory = quantize_model(tiny_family("qwen2", tied=tied), quant)
    assert (streamed.lm_head.weight is streamed.model.embed_tokens.weight) == tied
    for (name, a, _), (_, b, _) in zip(projection_modules(streamed), projection_modules(in_memory)):
        assert is_quantized(a.weight) and torch.equal(dequantize(a.weight), dequantize(b.weight)), name
        assert torch.equal(a.bias, b.bias) if a.bias is not None else b.bias is None
    quantized = {f"{name}.weight" for name, _, _ in projection_modules(streamed)}
    for name, param in streamed.named_parameters():
        assert is_quantized(param) == (name in quantized) and (name in quantized or param.dtype == torch.float32), name
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(streamed(ids).logits, in_memory(ids).logits, rtol=0, atol=0)


def test_nf4_with_double_quantization_stores_about_half_a_byte_per_parameter():
    """The projections of a model whose widths are whole 4-bit blocks (hidden 256, FFN 512)."""
    model = quantize_model(tiny_family("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=64), BaseQuant("nf4"))
    stored = sum(storage_bytes(linear.weight) for _, linear, _ in projection_modules(model))
    count = sum(linear.in_features * linear.out_features for _, linear, _ in projection_modules(model))
    assert 0.5 <= stored / count <= 0.53


# widths that are whole 4-bit blocks of 64: rows of every projection, and 64-wide heads of o_proj's input
BLOCK_SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cut", ["heads", "neurons", "units"])
def test_masked_and_shrunk_agree_exactly(method, cut):
    """Every cut keeps the codes on a base whose widths are whole blocks: KV groups (whole blocks
    of q/k/v^T's columns and o_proj's), FFN neurons (rows of gate/up and of down^T), hidden
    channels (rows of q/k/v^T and o_proj; in gate/up's and down^T's columns the blocks stay
    with the kept channels' positions). The shrunk model computes what the masked one did."""
    gap, quantization_gap = _masked_vs_shrunk(BaseQuant(method), cut)
    assert quantization_gap > 1e-3 and gap < 1e-5, (gap, quantization_gap)


@pytest.mark.parametrize("method", ["nf4", "fp4"])
def test_the_layout_before_pruned_axis_rows_requantized_neurons_and_hidden_channels(method):
    """What runs of the layout before 2026-12-07 trained on (their exports still compute it): FFN
    neurons and hidden channels cut blocks of down_proj's and every input projection's rows, which
    were quantized again from the original weights, and the logits moved by a share of what
    quantizing the base moved them (measured on SmolLM2: as much as quantizing itself,
    benchmarks/requant_cost.py)."""
    gap, quantization_gap = _masked_vs_shrunk(BaseQuant(method, pruned_axis_rows=False), "units")
    assert 0.01 * quantization_gap < gap < quantization_gap, (gap, quantization_gap)


def _masked_vs_shrunk(quant: BaseQuant, cut: str):
    dense, model = tiny_family("qwen2", **BLOCK_SHAPES), quantize_model(tiny_family("qwen2", **BLOCK_SHAPES), quant)
    shape, batch = ModelShape.from_model(model), random_batch(length=20)
    groups, neurons, hidden = random_kept(shape, seed=7)
    if cut in ("heads", "neurons"):
        hidden = torch.arange(shape.hidden)
    if cut == "heads":
        neurons = [torch.arange(layer.ffn) for layer in shape.layers]
    logits = {}
    for name, m in (("dense", dense), ("quantized", model)):
        masks = UnitMasks(shape)
        masks.install(m)
        set_binary_masks(masks, shape, groups, neurons, hidden)
        with torch.no_grad():
            logits[name] = m(**batch).logits
    new_shape, _ = shrink_model(model, shape, groups, neurons, hidden)
    masks.reset(new_shape)
    with torch.no_grad():
        shrunk = model(**batch).logits
    assert ModelShape.from_model(model) == new_shape
    return (shrunk - logits["quantized"]).abs().max(), (logits["dense"] - logits["quantized"]).abs().max()


def test_merge_and_compact_and_plain_lora_on_a_quantized_base(in_tmp, tmp_path):
    """merge_and_compact dequantizes what has no adapter; --method lora is plain QLoRA."""
    from apt_ds.export.merge import merge_and_compact

    apt = APTConfig.for_steps(8, target_density=0.6)
    trainer = APTrainer(quantize_model(tiny_family("llama"), BaseQuant("nf4")), apt,
                        TrainConfig(steps=8, warmup_steps=1, base_quant="nf4"), out_dir=tmp_path / "m", progress=False)
    trainer.train(micro_batches())
    ids = random_batch(length=12)["input_ids"]
    with torch.no_grad():
        live = trainer.model(ids).logits
        compact = merge_and_compact(trainer)
        assert not any(is_quantized(p) for p in compact.parameters())
        torch.testing.assert_close(compact(ids).logits, live, rtol=1e-4, atol=1e-4)
    lora = tmp_path / "lora"
    assert train_main([*TRAIN_FAST, "--method", "lora", "--base-quant", "nf4", *EVAL, "--eval-examples", "8",
                       "--save-eval-probe", "--out", str(lora)]) == 0
    assert _metrics(lora)[-1]["density"] == 1.0
    # no pruning: stored as the checkpoint holds it (transformers' layout, bitsandbytes' kernels)
    assert json.loads((lora / "checkpoint" / "apt_state.json").read_text())["run_info"]["quant_layout"] == "as-stored"
    assert export_main([str(lora), "--out", str(tmp_path / "lora-hf")]) == 0
    check_against_probe(lora, tmp_path / "lora-hf")


def test_a_run_made_through_the_api_records_its_layout_and_exports_as_it_computed(tmp_path, tokenizer):
    """APTrainer on a model quantized by the caller (as benchmarks/_quality_worker.py trains), no
    run_info given: the trainer reads the layout off the model, so the streamed export quantizes
    the base again as the run held it and gives the live model's logits. A model quantized
    otherwise than TrainConfig.base_quant says is refused before training."""
    from apt_ds.export.merge import export_run

    tiny_family("qwen2", vocab=len(tokenizer), **BLOCK_SHAPES).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(str(tmp_path / "base"))
    quant, apt = BaseQuant("nf4"), APTConfig.for_steps(8, target_density=0.6)
    model = load_quantized(tmp_path / "base", quant, torch.device("cpu"))
    with pytest.raises(ConfigError, match="stored nf4 but TrainConfig.base_quant is 'none'"):
        APTrainer(model, apt, TrainConfig(steps=8, warmup_steps=1), progress=False)
    trainer = APTrainer(model, apt, TrainConfig(steps=8, warmup_steps=1, base_quant="nf4"), out_dir=tmp_path / "run",
                        progress=False, run_info={"model": str(tmp_path / "base"), "tokenizer": str(tmp_path / "base")})
    trainer.train(micro_batches())
    meta = json.loads((tmp_path / "run" / "checkpoint" / "apt_state.json").read_text())
    assert meta["run_info"]["quant_layout"] == "pruned-axis-rows" and meta["run_info"]["base_dtype"] == "float32"
    ids = random_batch(length=12, vocab=len(tokenizer))["input_ids"]
    with torch.no_grad():
        live = trainer.model(ids).logits
    export_run(tmp_path / "run", tmp_path / "hf", dtype="fp32")
    from apt_ds.io.modeling import load_pretrained

    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(tmp_path / "hf")(ids).logits, live, rtol=0, atol=1e-4)


@pytest.mark.parametrize("method", METHODS)
def test_a_stopped_quantized_run_resumes_bit_for_bit(tmp_path, method):
    """The base is quantized again from the same weights on resume, and the shrinks replayed on
    it: the same codes, so the same losses as the uninterrupted run."""
    steps, crash = 20, 10
    apt = APTConfig.for_steps(steps, target_density=0.6, distill_num_blocks=1)
    train = TrainConfig(steps=steps, grad_accum_steps=2, checkpoint_every=crash, warmup_steps=2, lr=2e-3, base_quant=method)

    def model():
        return quantize_model(tiny_family("qwen3"), BaseQuant(method))

    reference = APTrainer(model(), apt, train, out_dir=tmp_path / "whole", progress=False)
    reference.train(micro_batches())
    crashed = APTrainer(model(), apt, train, out_dir=tmp_path / "a", progress=False)
    with pytest.raises(Crash):
        crashed.train(micro_batches(crash_at=crash * train.grad_accum_steps))
    resumed = APTrainer(model(), apt, train, out_dir=tmp_path / "b", progress=False)
    resumed.resume(tmp_path / "a" / "checkpoint")
    resumed.train(micro_batches())
    assert resumed.state.shape != resumed.state.original_shape
    assert_resumed_as_uninterrupted(resumed, reference, crash, steps)


@pytest.mark.parametrize("args, message", [
    (["--base-quant", "int8", "--deepspeed", str(Path(__file__).resolve().parents[2] / "ds_configs" / "zero3.json")],
     "int8 cannot be partitioned under ZeRO-3"),
    (["--base-quant", "nf4", "--base-dtype", "fp16"], "fp16"),
])
def test_what_cannot_be_quantized_is_one_line_before_anything_is_written(in_tmp, tmp_path, capsys, args, message):
    capsys.readouterr()
    assert train_main([*TRAIN_FAST, *args, "--out", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # nothing else: no library's warning before it
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_bitsandbytes_missing_or_fp16_compute_on_a_cpu_is_one_line(in_tmp, tmp_path, capsys, monkeypatch):
    """The install hint (bitsandbytes cached as missing for this test only), and fp16 compute on a CPU as
    an API caller can ask for it (the CLI refuses --base-dtype fp16 on a CPU first)."""
    from apt_ds.algorithm.quant import bitsandbytes
    from apt_ds.io.quantized import check_quantizable_base

    with pytest.raises(QuantizationError, match="fp16 compute needs a GPU"):
        check_quantizable_base("tiny", BaseQuant("nf4", compute_dtype=torch.float16), None, torch.device("cpu"))
    bitsandbytes.cache_clear()
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes raises ImportError
    try:
        capsys.readouterr()
        assert train_main([*TRAIN_FAST, "--base-quant", "nf4", "--out", str(tmp_path / "run")]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "--base-quant needs bitsandbytes: pip install 'bitsandbytes>=0.50,<1'" in lines[0], lines
        assert not (tmp_path / "run").exists()
    finally:
        bitsandbytes.cache_clear()


def test_a_model_quantized_otherwise_than_the_config_says_is_refused():
    apt = APTConfig.for_steps(8, target_density=0.6)
    model = quantize_model(tiny_family("llama"), BaseQuant("nf4", double_quant=False))
    with pytest.raises(ConfigError, match="double_quant=False but TrainConfig.double_quant is True"):
        APTrainer(model, apt, TrainConfig(steps=8, warmup_steps=1, base_quant="nf4"), progress=False)
    with pytest.raises(ConfigError, match="stored nf4 but TrainConfig.base_quant is 'fp4'"):
        APTrainer(model, apt, TrainConfig(steps=8, warmup_steps=1, base_quant="fp4", double_quant=False), progress=False)


def test_a_run_of_another_layout_is_not_resumed(in_tmp, tmp_path, capsys):
    """A pruning run stored before 2026-12-07 (run_info without quant_layout: as the checkpoint
    holds it, cut blocks re-quantized) cannot be resumed bit for bit: one line from the CLI, a
    CheckpointError from APTrainer.resume; a model quantized in another layout than the run's too."""
    from apt_ds.io.checkpoint import CheckpointError

    run = tmp_path / "run"
    assert train_main([*TRAIN_FAST, "--base-quant", "nf4", "--checkpoint-every", "4", "--out", str(run)]) == 0
    state = run / "checkpoint" / "apt_state.json"
    meta = json.loads(state.read_text())
    del meta["run_info"]["quant_layout"]
    state.write_text(json.dumps(meta))
    capsys.readouterr()
    assert train_main([*TRAIN_FAST, "--base-quant", "nf4", "--checkpoint-every", "4", "--steps", "12", "--resume",
                       "--out", str(run)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "stored its quantized base as-stored" in errors[0], errors
    apt = APTConfig.for_steps(8, target_density=0.6)
    trainer = APTrainer(quantize_model(tiny_family("llama"), BaseQuant("nf4")), apt,
                        TrainConfig(steps=8, warmup_steps=1, base_quant="nf4"), progress=False)
    with pytest.raises(CheckpointError, match="the model to resume it is stored pruned-axis-rows"):
        trainer.resume(run / "checkpoint")


def test_an_architecture_apt_ds_does_not_know_is_one_line_with_base_quant(in_tmp, tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=97)).save_pretrained(tmp_path / "gpt2")
    capsys.readouterr()
    assert train_main([*TRAIN_FAST, "--base-quant", "nf4", "--model", str(tmp_path / "gpt2"), "--out",
                       str(tmp_path / "run")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "gpt2" in errors[0], errors
    assert not (tmp_path / "run").exists()


def test_zero3_refuses_a_projection_width_that_is_not_whole_blocks_before_reading_a_tensor():
    """Float-held codes of a re-quantized cut would not fit their storage: refused in one line, and
    before the first tensor is read (the source below has none)."""
    from apt_ds.distributed.zero_init import quantize_partitioned
    from apt_ds.io.quantized import projection_weights

    model = tiny_family("llama")  # hidden 64: k/v stored as W^T are 32 wide (2 KV heads of 16)
    quant = BaseQuant("nf4", storage=torch.float32)
    with pytest.raises(QuantizationError, match="needs every projection's stored width to be a multiple of 64"):
        quantize_partitioned(model, projection_weights(model), {}, quant, torch.device("cpu"))


def test_zero3_refuses_such_a_width_from_the_config_before_the_model_loads(tmp_path):
    """The run's check reads config.json alone (the directory below has no weights): a ZeRO-3 launch
    is refused before zero.Init builds anything; under ZeRO-2, and without pruning (as-stored
    rows: the input widths, 64 here), the same model is accepted."""
    from apt_ds.io.quantized import check_quantizable_base

    tiny_family("llama", intermediate_size=128).config.save_pretrained(tmp_path)
    quant = BaseQuant("nf4", storage=torch.float32)
    with pytest.raises(QuantizationError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight has 32: use a ZeRO-2"):
        check_quantizable_base(str(tmp_path), quant, 3, torch.device("cpu"))
    check_quantizable_base(str(tmp_path), quant, 2, torch.device("cpu"))
    check_quantizable_base(str(tmp_path), BaseQuant("nf4", pruned_axis_rows=False, storage=torch.float32), 3,
                           torch.device("cpu"))


def test_a_gguf_base_is_not_quantized_again(in_tmp, tmp_path, capsys):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(64))
    capsys.readouterr()
    assert train_main([*TRAIN_FAST, "--base-quant", "int8", "--model", str(gguf), "--out", str(tmp_path / "run")]) == 2
    assert "is a GGUF file" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_resume_refuses_another_base_quant(in_tmp, tmp_path, capsys):
    run = tmp_path / "run"
    assert train_main([*TRAIN_FAST, "--base-quant", "nf4", "--out", str(run)]) == 0
    for flags, change in ((["--base-quant", "int8"], "base_quant: nf4 -> int8 (pass --base-quant nf4)"),
                          (["--base-quant", "nf4", "--double-quant", "false"], "double_quant: True -> False"),
                          (["--base-quant", "nf4", "--base-dtype", "bf16"], "draws other codes under the trained "
                                                                            "adapters (pass --base-dtype fp32)")):
        capsys.readouterr()
        assert train_main([*TRAIN_FAST, *flags, "--out", str(run), "--resume"]) == 2
        assert change in capsys.readouterr().err


# (--base-quant, shape flags, base): each method once, a uniform run, the streamed and the in-memory export
RUNS = [("nf4", [], "directory"), ("fp4", ["--uniform"], "tiny-mha"), ("int8", [], "tiny"),
        ("fp4", ["--base-dtype", "bf16"], "tiny")]  # bf16 compute, as on a GPU by default


@pytest.mark.parametrize("method, flags, base", RUNS, ids=["-".join([m, b, *(f.lstrip("-") for f in flags)]) for m, flags, b in RUNS])
def test_a_run_trains_prunes_grows_and_exports_both_merges(in_tmp, tmp_path, tokenizer, method, flags, base):
    """By default the export quantizes the original weights again, shrinks them to the kept units
    once (the codes do not depend on the order of the shrinks) and merges into their dequantized
    values: its logits and greedy tokens are the live quantized model's. Merged into the original
    weights instead, it is not, and its eval loss stays within 2% of the live model's."""
    model = base
    if base == "directory":  # streamed: read from the files tensor by tensor, at load and at export
        tiny_family("qwen2", vocab=len(tokenizer)).save_pretrained(tmp_path / "base")
        tokenizer.save_pretrained(str(tmp_path / "base"))
        model = str(tmp_path / "base")
    run = tmp_path / "run"
    assert train_main([*TRAIN_FAST, "--model", model, *flags, "--base-quant", method, "--target-density", "0.6", *EVAL,
                       "--eval-examples", "8", "--save-eval-probe", "--out", str(run)]) == 0
    steps, final = [m for m in _metrics(run) if not m.get("final")], _metrics(run)[-1]
    assert final["density"] <= 0.6 + 1e-9 and steps[-1]["total_rank"] > steps[0]["total_rank"]
    record = json.loads((run / "run.json").read_text())
    assert record["train_config"]["base_quant"] == method and record["quant_layout"] == "pruned-axis-rows"
    assert export_main([str(run), "--out", str(tmp_path / "hf")]) == 0  # the default for a quantized run
    check_against_probe(run, tmp_path / "hf", atol=2e-2 if "bf16" in flags else 1e-4)  # bf16: the merge rounds
    if base == "directory":  # GGUF goes through the same tensor stream: the very merged weights
        _gguf_holds_the_hf_exports_weights(run, tmp_path / "hf", tmp_path / "gg")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in config and ("--uniform" not in flags or "apt_layer_shapes" not in config)
    with mock.patch.object(merge, "export_run", partial(merge.export_run, merge_into="original")):
        exported = exported_eval_loss(run, tmp_path / "original", 8)
    assert abs(exported - final["eval_loss"]) <= 0.02 * final["eval_loss"], (exported, final["eval_loss"])
    with pytest.raises(AssertionError):  # the original weights: not what the run computed with
        check_against_probe(run, tmp_path / "original")


def _gguf_holds_the_hf_exports_weights(run: Path, hf: Path, out: Path) -> None:
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    assert export_main([str(run), "--out", str(out), "--format", "gguf", "--dtype", "fp32"]) == 0
    tensors = {t.name: t for t in gguf.GGUFReader(str(next(out.glob("*.gguf")))).tensors}
    exported = {}
    for path in hf.glob("*.safetensors"):
        exported.update(load_file(str(path)))
    for layer in range(2):  # not rotated by llama.cpp's q/k permutation: compared as they are
        for role, module in (("ffn_down", "mlp.down_proj"), ("ffn_gate", "mlp.gate_proj"), ("attn_v", "self_attn.v_proj")):
            expected = exported[f"model.layers.{layer}.{module}.weight"]
            got = torch.from_numpy(tensors[f"blk.{layer}.{role}.weight"].data.copy()).reshape(expected.shape)
            torch.testing.assert_close(got, expected.float(), rtol=0, atol=0)


def test_merge_into_dequantized_needs_a_quantized_run(trained_runs, tmp_path, capsys):
    capsys.readouterr()
    assert export_main([str(trained_runs / "nonuniform"), "--out", str(tmp_path / "hf"), "--merge-into", "dequantized"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "full-precision base" in errors[0] and not (tmp_path / "hf").exists()
