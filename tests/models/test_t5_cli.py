"""T5 through the commands: launch/train.py on a T5 directory and input/target rows (one process),
stopped and resumed to the uninterrupted run; the export, merged and physically smaller, loads
through apt_ds.load_pretrained with the live run's logits (each layer's heads reading their own
columns of the stacks' relative position bias; v1.0's output scale folded at the pruned hidden
size); launch/evaluate.py gives its ROUGE; what a T5 run cannot do yet is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_t5 import VARIANTS, tiny_t5
from transformers import T5Tokenizer

WORDS = "summarize: the a cat dog sat ran on to mat park".split()


@pytest.fixture(scope="module")
def t5_tokenizer():
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("\u2581" + w, -1.0 - i / 100) for i, w in enumerate(WORDS)]
    return T5Tokenizer(vocab=vocab + [(c, -5.0) for c in "\u2581abcdefghijklmnopqrstuvwxyz.,:"], extra_ids=0)


def _t5_dir(tmp_path, tokenizer, variant: str) -> Path:
    directory = tmp_path / f"t5-{variant}"
    # as many decoder as encoder layers: transformers 5.25's generate fails on T5s with other counts
    # (its cache is made for num_layers), with or without apt-ds
    tiny_t5(variant, vocab_size=len(tokenizer), num_decoder_layers=2).save_pretrained(directory)
    tokenizer.save_pretrained(str(directory))
    return directory


def _summaries(path: Path) -> str:
    rows = [{"input": f"summarize: the {a} {b} on the {c}", "target": f"{a} {b}"}
            for a in ("cat", "dog") for b in ("sat", "ran") for c in ("mat", "park")] * 3
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


T5_TRAIN = ["--steps", "10", "--micro-batch-size", "4", "--max-seq-len", "24", "--max-target-len", "8", "--lr", "1e-2",
            "--warmup-steps", "1", "--target-density", "0.5", "--checkpoint-every", "4", "--eval-examples", "8"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_t5_run_trains_resumes_and_exports_the_live_model(in_tmp, tmp_path, t5_tokenizer, variant, capsys, monkeypatch):
    from conftest import interrupted_at
    from safetensors.torch import load_file

    from apt_ds.cli.evaluate import main as evaluate_main
    from apt_ds.cli.export import main as export_main
    from apt_ds.cli.train import main as train_main
    from apt_ds.io.modeling import load_pretrained
    from apt_ds.training.trainer import APTrainer

    base, data = _t5_dir(tmp_path, t5_tokenizer, variant), _summaries(tmp_path / "sum.jsonl")
    flags = [*T5_TRAIN, "--model", str(base), "--data", data, "--eval-data", data]
    assert train_main([*flags, "--out", "whole", "--save-eval-probe"]) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(final["density"] - 0.5) < 0.05 and final["eval_loss"] > 0
    real_step = APTrainer._train_step
    monkeypatch.setattr(APTrainer, "_train_step", interrupted_at(6))
    assert train_main([*flags, "--out", "cut"]) == 130
    monkeypatch.setattr(APTrainer, "_train_step", real_step)
    assert train_main([*flags, "--resume", "--out", "cut"]) == 0
    whole, resumed = (load_file(f"{run}/checkpoint/trainable.safetensors") for run in ("whole", "cut"))
    assert whole.keys() == resumed.keys() and any("EncDecAttention" in name for name in whole)
    for name, tensor in whole.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-4, atol=1e-5)

    assert export_main(["whole", "--out", "hf"]) == 0
    config = json.loads(Path("hf/config.json").read_text())
    assert config["architectures"] == ["T5ForConditionalGeneration"] and "apt_layer_shapes" in config
    assert config["d_model"] < 32 or config["d_ff"] < 48  # physically smaller, in T5's own config names
    assert not {"hidden_size", "intermediate_size", "num_key_value_heads"} & set(config)
    probe = load_file("whole/eval_probe.safetensors")
    exported = load_pretrained("hf")
    assert sum(p.numel() for p in exported.parameters()) < sum(p.numel() for p in tiny_t5(variant).parameters())
    with torch.no_grad():
        logits = exported(**{k: v for k, v in probe.items() if k != "logits"}).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-4, atol=1e-4)
    assert not Path("gguf").exists()
    assert export_main(["whole", "--out", "gguf", "--format", "gguf"]) == 2  # llama.cpp runs decoders here
    assert "t5 encoder-decoder has no GGUF export" in capsys.readouterr().err
    assert "apt_bias_head_index" in config  # heads pruned per layer: not a base to train from yet
    assert train_main([*T5_TRAIN, "--model", "hf", "--data", data, "--out", "again"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "is a T5 export with heads pruned per layer" in errors[0], errors

    assert evaluate_main(["hf", "--data", data, "--limit", "4", "--max-new-tokens", "6", "--device", "cpu",
                          "--out", "rouge.json"]) == 0
    rouge = json.loads(Path("rouge.json").read_text())["results"]["rouge"]
    assert rouge["rows"] == 4 and all(0 <= rouge[k] <= 100 for k in ("rouge1", "rouge2", "rougeL", "rougeLsum"))


def test_a_uniform_t5_run_exports_a_stock_t5(in_tmp, tmp_path, t5_tokenizer, capsys):
    """--uniform: every attention keeps as many heads, every FFN as many neurons, and each stack's
    self-attentions the same heads, so the export is a stock T5ForConditionalGeneration (its bias
    tables cut to the kept heads, no apt_* keys) with the live run's logits, and a base to train from."""
    from safetensors.torch import load_file
    from transformers import T5ForConditionalGeneration

    from apt_ds.cli.export import main as export_main
    from apt_ds.cli.train import main as train_main

    base, data = _t5_dir(tmp_path, t5_tokenizer, "v1.0"), _summaries(tmp_path / "sum.jsonl")
    # FFN neurons kept: the heads must go, so that the bias tables are cut
    flags = [*T5_TRAIN, "--uniform", "--no-prune-neurons", "--data", data, "--eval-data", data]
    assert train_main([*flags, "--model", str(base), "--out", "run", "--save-eval-probe"]) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(final["density"] - 0.5) < 0.08
    assert export_main(["run", "--out", "hf"]) == 0
    config = json.loads(Path("hf/config.json").read_text())
    assert not [key for key in config if key.startswith("apt_")], config
    assert json.loads(Path("hf/apt_export.json").read_text())["stock_loadable"] is True
    stock = T5ForConditionalGeneration.from_pretrained("hf").eval()
    assert stock.config.num_heads < 4 and stock.config.d_ff == 48
    assert stock.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.embedding_dim == stock.config.num_heads
    probe = load_file("run/eval_probe.safetensors")
    with torch.no_grad():
        logits = stock(**{k: v for k, v in probe.items() if k != "logits"}).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-4, atol=1e-4)
    assert train_main([*T5_TRAIN, "--data", data, "--model", "hf", "--out", "again", "--steps", "4"]) == 0


@pytest.mark.parametrize("flags, named", [
    (["--uniform", "--uniform-shape-metric", "kl"], "--uniform-shape-metric kl"),
    (["--base-quant", "nf4"], "--base-quant"),
    (["--task", "classification"], "--task classification needs an encoder (BERT, RoBERTa)"),
    (["--adapter-targets", "q_proj", "gate_proj"], "--adapter-targets gate_proj: T5 (v1.0, v1.1) layers have no such"),
])
def test_what_a_t5_run_cannot_do_yet_is_refused_in_one_line(in_tmp, tmp_path, t5_tokenizer, capsys, flags, named):
    from apt_ds.cli.train import main as train_main

    base, data = _t5_dir(tmp_path, t5_tokenizer, "v1.0"), _summaries(tmp_path / "sum.jsonl")
    capsys.readouterr()
    assert train_main([*T5_TRAIN, "--model", str(base), "--data", data, *flags, "--out", "run"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and named in errors[0], errors
    assert not Path("run").exists()


# v1.0 (ReLU FFN, tied head) runs whole in one process above; on 2 ranks under ZeRO-3 with -m slow
@pytest.mark.parametrize("stage, variant, uniform", [(2, "v1.1", False), pytest.param(3, "v1.0", False, marks=pytest.mark.slow),
                                                     (3, "v1.1", True)],
                         ids=["zero2-v1.1", "zero3-v1.0", "zero3-v1.1-uniform"])
def test_a_two_rank_zero_t5_run_prunes_exports_and_resumes(tmp_path, t5_tokenizer, stage, variant, uniform):
    """T5 under ZeRO-2 and ZeRO-3 on 2 ranks (CPU accelerator): the same decisions on both ranks,
    the density reached, the export equal to the live run, and a run killed after a pruned
    checkpoint resumes to the uninterrupted one. Under ZeRO-3 T5's FFN reads `wo.weight` outside
    `wo`, which DeepSpeed registers as an external parameter of the FFN: a shrink must unregister
    the replaced one (zero_params.forget_replaced_external) or the next fetch gathers it. Uniform
    (FFN kept, so heads go): the export is a stock T5ForConditionalGeneration."""
    import sys

    from safetensors.torch import load_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    from test_distributed import COMMON, check_identical_and_pruned, ds_config, launch
    from test_families_zero import _killed_then_resumed_as_uninterrupted

    from apt_ds.cli.export import main as export_main
    from apt_ds.io.modeling import load_pretrained

    base, data = _t5_dir(tmp_path, t5_tokenizer, variant), _summaries(tmp_path / "sum.jsonl")
    args = ["--deepspeed", ds_config(tmp_path, stage), *COMMON, "--micro-batch-size", "2", "--checkpoint-every", "6",
            "--max-target-len", "8", "--model", str(base), "--data", data, *(["--uniform", "--no-prune-neurons"] * uniform)]
    out = tmp_path / "run"
    result = launch(2, [*args, "--eval-data", data, "--eval-examples", "8", "--save-eval-probe", "--out", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check_identical_and_pruned(out, 2)
    assert export_main([str(out), "--out", str(tmp_path / "hf")]) == 0
    probe = load_file(str(out / "eval_probe.safetensors"))
    if uniform:
        from transformers import T5ForConditionalGeneration
        exported = T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
        assert exported.config.num_heads < 4
    else:
        exported = load_pretrained(tmp_path / "hf")
    with torch.no_grad():
        logits = exported(**{k: v for k, v in probe.items() if k != "logits"}).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-4, atol=1e-4)
    _killed_then_resumed_as_uninterrupted(tmp_path / "killed", args, reference=out)
