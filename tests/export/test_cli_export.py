"""End-to-end: launch/train.py's entry point on the built-in tiny model, then export."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from apt_ds.cli.export import main as export_main
from apt_ds.cli.train import main as train_main
from apt_ds.export.merge import export_run, rebuild_trained_model
from apt_ds.io.metrics import read_metrics
from apt_ds.io.modeling import load_pretrained

FAST = ["--steps", "8", "--max-seq-len", "32", "--micro-batch-size", "2", "--warmup-steps", "1"]
METRIC_FIELDS = {"step", "loss", "task_loss", "distill_loss", "grad_norm", "density", "block_params", "adapter_params",
                 "total_rank", "lr", "step_time_s", "peak_rss_mb", "world_size"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    assert train_main([*FAST, "--target-density", "0.6", "--out", str(root / "nonuniform")]) == 0
    assert train_main([*FAST, "--target-density", "0.6", "--uniform", "--out", str(root / "uniform")]) == 0
    return root


def test_training_run_reaches_target_and_logs(runs):
    records = read_metrics(runs / "nonuniform" / "metrics.jsonl")
    steps = [r for r in records if not r.get("final")]
    assert METRIC_FIELDS <= set(steps[-1])
    assert steps[-1]["density"] <= 0.6 + 1e-9
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    assert records[-1]["final"] and records[-1]["step"] == 8


def test_existing_out_is_refused_and_untouched(runs, capsys):
    metrics = runs / "nonuniform" / "metrics.jsonl"
    before = metrics.read_bytes()
    assert train_main([*FAST, "--out", str(runs / "nonuniform")]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert metrics.read_bytes() == before


@pytest.mark.parametrize("argv, message", [
    # named as typed: the flag, not the config class's field
    (["--target-density", "0"], "error: --target-density must be in (0, 1], got 0.0"),
    (["--target-density", "1.5"], "--target-density must be in (0, 1], got 1.5"),
    (["--rank-cap", "2"], "--rank-cap must be >= adapter_rank (8), got 2"),
    (["--steps", "3"], "--steps must be >= 4 to warm up, prune and recover, got 3"),
    (["--pruning-end-step", "20"], "--pruning-end-step (20) must be <= --steps (8)"),
    (["--adapter-targets", "qq_proj"], "adapter_targets"),
    (["--deepspeed", "/nonexistent/ds.json"], "ds.json"),
])
def test_bad_arguments_give_one_line(tmp_path, capsys, argv, message):
    try:
        code = train_main([*FAST, *argv, "--out", str(tmp_path / "r")])
    except SystemExit as exit_info:  # argparse's own check (choices), one line too
        code = exit_info.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("values, message", [
    ({"steps": "x"}, "steps in --config CONFIG must be of type int, got 'x'"),
    ({"pruning_start_step": "5"}, "pruning_start_step in --config CONFIG must be of type int, got '5'"),
    ({"lr": -1}, "lr in --config CONFIG must be > 0, got -1"),
    ({"lr": None}, "leaves lr to the command line: give --lr"),  # null: a recipe's "give it as a flag"
])
def test_mistyped_config_file_values_give_one_line(tmp_path, capsys, values, message):
    config = tmp_path / "c.json"
    config.write_text(json.dumps(values))
    assert train_main([*FAST, "--config", str(config), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert message.replace("CONFIG", str(config)) in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_data_without_usable_rows(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"foo": 1}\n{"bar": 2}\n')
    assert train_main([*FAST, "--data", str(data), "--out", str(tmp_path / "r")]) == 2
    assert "no usable rows" in capsys.readouterr().err


def test_export_matches_training_time_model(runs, tmp_path):
    model, state, _ = rebuild_trained_model(runs / "nonuniform")
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        masked = model(input_ids=ids).logits
    generated = model.generate(ids[:1], max_new_tokens=20, do_sample=False)
    report = export_run(runs / "nonuniform", tmp_path / "out")
    loaded = load_pretrained(tmp_path / "out")
    with torch.no_grad():
        exported = loaded(input_ids=ids).logits
    assert torch.allclose(exported, masked, atol=1e-4)
    assert torch.equal(loaded.generate(ids[:1], max_new_tokens=20, do_sample=False), generated)
    assert generated.shape[1] == ids.shape[1] + 20 or generated[0, -1] == model.generation_config.eos_token_id
    assert report["exported_params"] == report["final"]["total_params"] == sum(p.numel() for p in loaded.parameters())
    assert report["exported_params"] == read_metrics(runs / "nonuniform" / "metrics.jsonl")[-1]["total_params"]
    assert report["final"]["block_params"] < report["original"]["block_params"]


def test_uniform_export_loads_with_stock_transformers(runs, tmp_path):
    assert export_main([str(runs / "uniform"), "--out", str(tmp_path / "u")]) == 0
    model, state, _ = rebuild_trained_model(runs / "uniform")
    ids = torch.randint(0, 500, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    torch.save({"ids": ids, "expected": expected}, tmp_path / "ref.pt")
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'u')!r}).eval()\n"
        f"d = torch.load({str(tmp_path / 'ref.pt')!r}, weights_only=True)\n"
        "out = m(input_ids=d['ids']).logits\n"
        "assert 'apt_ds' not in sys.modules\n"
        "print(float((out - d['expected']).abs().max()))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.strip().splitlines()[-1]) < 1e-4


def test_export_refuses_existing_out_and_missing_checkpoint(runs, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    assert export_main([str(runs / "nonuniform"), "--out", str(tmp_path / "taken")]) == 2
    assert "exists (empty); pass --overwrite to replace it" in capsys.readouterr().err
    assert export_main([str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_export_of_a_missing_run_or_a_file_names_the_problem(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert export_main([str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
    assert f"{tmp_path / 'nothing'} does not exist: give the run directory" in capsys.readouterr().err
    assert export_main([str(tmp_path / "afile"), "--out", str(tmp_path / "x")]) == 2
    assert f"{tmp_path / 'afile'} is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_overwrite_keeps_files_an_export_did_not_write(runs, tmp_path, capsys):
    """Results or a model card saved next to an export are refused by --overwrite, in one line,
    and nothing changes; the export's own files are replaced."""
    out = tmp_path / "e"
    assert export_main([str(runs / "nonuniform"), "--out", str(out)]) == 0
    report = json.loads((out / "apt_export.json").read_text())
    assert sorted(report["files"]) == sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    for added in ("MODEL_CARD.md", "eval"):
        path = out / added
        path.mkdir() if added == "eval" else path.write_text("mine")
        assert export_main([str(runs / "nonuniform"), "--out", str(out), "--overwrite"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"holds an export and also {added}, which an export does not write" in err[0], err
        assert path.exists()
        shutil.rmtree(path) if added == "eval" else path.unlink()
    assert export_main([str(runs / "nonuniform"), "--out", str(out), "--overwrite"]) == 0
    # an export from before reports listed their files: told apart by the names exports give them
    report = json.loads((out / "apt_export.json").read_text())
    del report["files"]
    (out / "apt_export.json").write_text(json.dumps(report))
    for mine in ("notes.txt", "e-Q4_K_M.gguf", "my.model", "tokenizer_notes.txt", "model-card-notes.safetensors"):
        (out / mine).write_text("mine")
        assert export_main([str(runs / "nonuniform"), "--out", str(out), "--overwrite"]) == 2
        assert f"also {mine}" in capsys.readouterr().err
        (out / mine).unlink()
    assert export_main([str(runs / "nonuniform"), "--out", str(out), "--overwrite"]) == 0
    assert f"exported {report['final']['total_params']:,} parameters" in capsys.readouterr().err


def test_weights_that_do_not_fit_the_recorded_shapes_are_one_line(runs, tmp_path):
    from apt_ds.io.modeling import ModelLoadError

    assert export_main([str(runs / "nonuniform"), "--out", str(tmp_path / "e")]) == 0
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    config["apt_layer_shapes"][0]["ffn"] -= 8
    (tmp_path / "e" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"the weights do not fit config.json \(size mismatch"):
        load_pretrained(tmp_path / "e")


def test_resume_of_a_lora_run_without_method_lora_says_so(tmp_path, capsys):
    run = tmp_path / "lora"
    assert train_main([*FAST, "--method", "lora", "--out", str(run)]) == 0
    assert train_main([*FAST, "--resume", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert "(it was trained with --method lora: pass that)" in err and "pass --prune" not in err


def test_resume_of_an_apt_run_with_method_lora_says_so(runs, capsys):
    """--method lora overrides the pruning flags, so naming them would not help: name the method."""
    assert train_main([*FAST, "--method", "lora", "--resume", "--out", str(runs / "nonuniform")]) == 2
    assert capsys.readouterr().err.rstrip().endswith("(it was trained with --method apt: leave out --method lora)")


def test_export_of_a_stopped_run_warns(runs, tmp_path, capsys):
    """A run that did not reach its last step exports its last checkpoint, and says so."""
    run = tmp_path / "run"
    shutil.copytree(runs / "nonuniform", run)
    state = json.loads((run / "checkpoint" / "apt_state.json").read_text())
    state.update(step=4, finished=False)
    (run / "checkpoint" / "apt_state.json").write_text(json.dumps(state))
    assert export_main([str(run), "--out", str(tmp_path / "e")]) == 0
    err = capsys.readouterr().err
    assert "warning: the run stopped at step 4 of 8, so its last checkpoint was exported" in err
    assert "run again with --resume finishes it" in err
    assert json.loads((tmp_path / "e" / "apt_export.json").read_text())["steps"] == 8
    assert export_main([str(runs / "nonuniform"), "--out", str(tmp_path / "f")]) == 0
    assert "warning" not in capsys.readouterr().err


def test_interrupted_export_leaves_nothing(runs, tmp_path, monkeypatch):
    import apt_ds.export.writer as export_module

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        export_run(runs / "nonuniform", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_resume_of_a_finished_run_changes_nothing(runs, capsys):
    metrics = (runs / "nonuniform" / "metrics.jsonl").read_bytes()
    assert train_main([*FAST, "--target-density", "0.6", "--resume", "--out", str(runs / "nonuniform")]) == 0
    assert "already finished" in capsys.readouterr().out
    assert (runs / "nonuniform" / "metrics.jsonl").read_bytes() == metrics
    # a changed APT setting is refused, finished or not, not ignored
    assert train_main([*FAST, "--target-density", "0.5", "--resume", "--out", str(runs / "nonuniform")]) == 2
    err = capsys.readouterr().err
    assert "used a different APT config; changed: target_density: 0.6 -> 0.5 (pass --target-density 0.6)" in err
    assert "already finished" not in err
    assert "--method lora" not in err
    assert (runs / "nonuniform" / "metrics.jsonl").read_bytes() == metrics


def test_resume_with_changed_training_settings_is_refused(runs, capsys):
    assert train_main([*FAST, "--target-density", "0.6", "--seed", "5", "--resume", "--out", str(runs / "nonuniform")]) == 2
    assert "seed: 0 -> 5" in capsys.readouterr().err


def test_resume_of_a_run_from_before_gradient_clipping(runs, tmp_path, capsys):
    """A checkpoint without max_grad_norm was trained unclipped on one process: resuming asks
    for --max-grad-norm 0 instead of silently clipping the rest of the run."""
    old = tmp_path / "old"
    shutil.copytree(runs / "nonuniform", old)
    state = old / "checkpoint" / "apt_state.json"
    meta = json.loads(state.read_text())
    del meta["train_config"]["max_grad_norm"]
    state.write_text(json.dumps(meta))
    assert train_main([*FAST, "--target-density", "0.6", "--resume", "--out", str(old)]) == 2
    assert "max_grad_norm: 0.0 -> 1.0 (pass --max-grad-norm 0.0)" in capsys.readouterr().err
    assert train_main([*FAST, "--target-density", "0.6", "--max-grad-norm", "0", "--resume", "--out", str(old)]) == 0
    assert "already finished" in capsys.readouterr().out


def test_clipping_of_deepspeed_runs_from_before_max_grad_norm(tmp_path):
    from apt_ds.training.run import _clipping_before_max_grad_norm

    own = tmp_path / "ds.json"
    own.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 0.3}))
    default = tmp_path / "default.json"
    default.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert _clipping_before_max_grad_norm({"deepspeed": str(own)}) == 0.3
    assert _clipping_before_max_grad_norm({"deepspeed": str(default)}) == 1.0  # DeepSpeed's default
    assert _clipping_before_max_grad_norm({"deepspeed": str(tmp_path / "gone.json")}) == 1.0
    assert _clipping_before_max_grad_norm({"deepspeed": None}) == 0.0


def test_resume_with_another_split_of_the_global_batch(tmp_path, monkeypatch, capsys):
    """Crash after the step-4 checkpoint, resume with micro 1 x accumulation 2 instead of micro 2:
    same global batch, so the same data and the same decisions as the uninterrupted run. A
    different global batch is refused."""
    from apt_ds.training.trainer import APTrainer

    common = [*FAST, "--target-density", "0.6", "--checkpoint-every", "4"]
    assert train_main([*common, "--out", str(tmp_path / "whole")]) == 0
    real_step = APTrainer._train_step

    def crash_after_step_5(self, batches):
        if self.step == 5:
            raise KeyboardInterrupt
        return real_step(self, batches)

    monkeypatch.setattr(APTrainer, "_train_step", crash_after_step_5)
    assert train_main([*common, "--out", str(tmp_path / "split")]) == 130  # Ctrl-C: one line, no traceback
    assert "interrupted; --resume continues" in capsys.readouterr().err
    monkeypatch.setattr(APTrainer, "_train_step", real_step)
    resplit = [a if a != "2" or common[i - 1] != "--micro-batch-size" else "1" for i, a in enumerate(common)]
    assert train_main([*resplit, "--grad-accum-steps", "3", "--resume", "--out", str(tmp_path / "split")]) == 2
    assert "global batch (2" in capsys.readouterr().err
    assert train_main([*resplit, "--grad-accum-steps", "2", "--resume", "--out", str(tmp_path / "split")]) == 0
    whole, split = (json.loads((tmp_path / r / "checkpoint" / "apt_state.json").read_text()) for r in ("whole", "split"))
    assert split["step"] == whole["step"] == 8
    assert split["kept"] == whole["kept"] and split["ranks"] == whole["ranks"]
    losses = [[r["loss"] for r in read_metrics(tmp_path / r / "metrics.jsonl") if "loss" in r] for r in ("whole", "split")]
    assert len(losses[0]) == len(losses[1]) == 8
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


def test_failed_start_touches_nothing(runs, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"output": ""}\n')
    before = sorted(p.name for p in (runs / "nonuniform").iterdir())
    assert train_main([*FAST, "--data", str(bad), "--overwrite", "--out", str(runs / "nonuniform")]) == 2
    assert sorted(p.name for p in (runs / "nonuniform").iterdir()) == before  # --overwrite did not delete first
    fresh = tmp_path / "fresh"
    assert train_main([*FAST, "--eval-data", str(tmp_path / "missing.jsonl"), "--out", str(fresh)]) == 2
    assert not fresh.exists()  # a corrected rerun is not refused
    capsys.readouterr()


def test_schedule_overrides_are_checked_against_steps(tmp_path, capsys):
    assert train_main([*FAST, "--pruning-end-step", "100", "--out", str(tmp_path / "a")]) == 2
    assert "--pruning-end-step (100) must be <= --steps (8)" in capsys.readouterr().err


def test_global_batch_size_without_deepspeed(tmp_path):
    from apt_ds.cli.arguments import build_train_parser, explicit_values
    from apt_ds.cli.recipe import resolve
    from apt_ds.training.run import make_backend

    run, _, train = resolve(explicit_values(build_train_parser, ["--global-batch-size", "6", "--grad-accum-steps", "2"]))
    _, train = make_backend(run, train)
    assert train.micro_batch_size == 3


def test_sixty_step_default_schedule(tmp_path):
    """The default schedule scales with --steps: warm-up, several events to the target, recovery."""
    out = tmp_path / "r60"
    assert train_main(["--steps", "60", "--max-seq-len", "32", "--micro-batch-size", "2", "--out", str(out)]) == 0
    records = [r for r in read_metrics(out / "metrics.jsonl") if not r.get("final")]
    events = [r for r in records if r["event"]]
    assert len(events) >= 4
    assert all(r["density"] == 1.0 for r in records[:5])  # warm-up
    assert records[-1]["density"] <= 0.7 + 1e-9
    last_event = events[-1]["step"]
    assert last_event <= 45 and all(r["density"] == records[-1]["density"] for r in records if r["step"] > last_event)



def test_resume_from_a_different_model_is_refused(runs, tmp_path, capsys, monkeypatch):
    """...before the weights are read: the fingerprint of a safetensors directory comes from its files."""
    from conftest import tiny_llama

    import apt_ds.training.run as run

    other = tmp_path / "other-model"
    tiny_llama("gqa", vocab=512).save_pretrained(str(other))
    for item in (runs / "nonuniform" / "tokenizer").iterdir():
        shutil.copy2(item, other / item.name)
    state = (runs / "nonuniform" / "checkpoint" / "apt_state.json").read_bytes()
    loads = []
    monkeypatch.setattr(run, "load_model", lambda *args, **kwargs: loads.append(args))
    assert train_main([*FAST, "--target-density", "0.6", "--model", str(other), "--resume", "--out", str(runs / "nonuniform")]) == 2
    err = capsys.readouterr().err
    assert "--resume: --model" in err and "is not the model this run was trained from" in err
    assert loads == []
    assert (runs / "nonuniform" / "checkpoint" / "apt_state.json").read_bytes() == state


def test_resume_without_checkpoint_is_refused(tmp_path, capsys):
    assert train_main([*FAST, "--resume", "--out", str(tmp_path / "fresh")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_export_from_plain_model_and_kept_units(runs, tmp_path):
    """A plain model + the kept-unit record export without a run directory or DeepSpeed, and the
    result computes what the model masked to those units computes."""
    from apt_ds.algorithm.masks import UnitMasks
    from apt_ds.algorithm.units import ModelShape
    from apt_ds.io.modeling import build_tiny_llama
    from apt_ds.io.tokenizer import load_tokenizer

    meta = json.loads((runs / "nonuniform" / "checkpoint" / "apt_state.json").read_text())
    tokenizer = load_tokenizer(runs / "nonuniform" / "tokenizer")
    original = build_tiny_llama(vocab_size=len(tokenizer), seed=meta["train_config"]["seed"])
    original.save_pretrained(str(tmp_path / "plain"))
    tokenizer.save_pretrained(str(tmp_path / "plain"))
    masks = UnitMasks(ModelShape.from_model(original))
    kept = meta["kept"]
    masks.kv_group = [torch.zeros_like(m).index_fill_(0, torch.tensor(k), 1.0) for m, k in zip(masks.kv_group, kept["groups"])]
    masks.ffn_neuron = [torch.zeros_like(m).index_fill_(0, torch.tensor(k), 1.0) for m, k in zip(masks.ffn_neuron, kept["neurons"])]
    masks.hidden = torch.zeros_like(masks.hidden).index_fill_(0, torch.tensor(kept["hidden"]), 1.0)
    masks.refresh()
    masks.install(original)
    ids = torch.randint(0, 500, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = original.eval()(input_ids=ids).logits
    result = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parents[2] / "launch" / "export.py"), "--model",
         str(tmp_path / "plain"), "--kept", str(runs / "nonuniform" / "checkpoint" / "apt_state.json"),
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    exported = load_pretrained(tmp_path / "out")
    report = json.loads((tmp_path / "out" / "apt_export.json").read_text())
    assert report["final"]["total_params"] == sum(p.numel() for p in exported.parameters())
    assert report["final"]["layers"] == meta["shape"]["layers"] and report["final"]["hidden"] == meta["shape"]["hidden"]
    with torch.no_grad():
        assert torch.allclose(exported(input_ids=ids).logits, expected, atol=1e-4)


def test_checkpoint_whose_shapes_contradict_its_config(runs, tmp_path, capsys):

    broken = tmp_path / "broken"
    shutil.copytree(runs / "nonuniform", broken)
    meta_path = broken / "checkpoint" / "apt_state.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"]["hidden"] += 1
    meta_path.write_text(json.dumps(meta))
    assert export_main([str(broken), "--out", str(tmp_path / "x")]) == 2
    assert "contradict" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_export_needs_no_deepspeed(runs, tmp_path):
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from apt_ds.export.merge import export_run\n"
        f"export_run(Path({str(runs / 'nonuniform')!r}), Path({str(tmp_path / 'o')!r}))\n"
        "assert 'deepspeed' not in sys.modules, 'export imported deepspeed'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("uniform", [False, True])
def test_mha_model_directory_run_exports_exactly(runs, tmp_path, uniform):
    """An MHA LLaMA given as a local HF directory: train, export, same logits as training time."""

    from conftest import tiny_llama

    model_dir = tmp_path / "mha"
    tiny_llama("mha", vocab=512).save_pretrained(str(model_dir))
    for item in (runs / "nonuniform" / "tokenizer").iterdir():
        shutil.copy2(item, model_dir / item.name)
    out = tmp_path / "run"
    flags = ["--uniform"] if uniform else []
    assert train_main([*FAST, *flags, "--target-density", "0.6", "--model", str(model_dir), "--out", str(out)]) == 0
    model, _, meta = rebuild_trained_model(out)
    assert meta["shape"]["layers"][0]["group_size"] == 1  # MHA: a KV group is one head
    ids = torch.randint(0, 500, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    export_run(out, tmp_path / "export")
    loaded = load_pretrained(tmp_path / "export")
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, expected, atol=1e-4)
    assert meta["shape"]["hidden"] <= 64 and read_metrics(out / "metrics.jsonl")[-1]["density"] <= 0.6 + 1e-9


def test_torn_metrics_line_and_changed_data_on_resume(tmp_path, capsys):
    from apt_ds.training.run import truncate_metrics

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9}\n{"step": 3, "lo')
    truncate_metrics(metrics, 2)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "some other data for the same run"}\n' * 20)
    out = tmp_path / "run"
    steps = ["--steps", "12", "--max-seq-len", "32", "--micro-batch-size", "2", "--checkpoint-every", "4"]
    assert train_main([*steps, "--out", str(out)]) == 0
    state = json.loads((out / "checkpoint" / "apt_state.json").read_text())
    state["finished"] = False
    (out / "checkpoint" / "apt_state.json").write_text(json.dumps(state))
    assert train_main([*steps, "--data", str(other), "--resume", "--out", str(out)]) == 2
    assert "trained on --data" in capsys.readouterr().err


def test_pruning_runs_read_weights_into_memory(runs, tmp_path, monkeypatch):
    """`apt-ds train` loads a model directory unmapped when it prunes (mapped pages would stay
    resident after units are removed) and mapped for LoRA, which never frees weights."""
    from conftest import tiny_llama

    import apt_ds.training.run as run

    model_dir = tmp_path / "model"
    tiny_llama("gqa", vocab=512).save_pretrained(str(model_dir))
    for item in (runs / "nonuniform" / "tokenizer").iterdir():
        (model_dir / item.name).write_bytes(item.read_bytes())
    calls = []
    real_load = run.load_model

    def spy(path, *args, **kwargs):
        calls.append(kwargs.get("mmap", True))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(run, "load_model", spy)
    for method in ("apt", "lora"):
        argv = [*FAST, "--method", method, "--model", str(model_dir), "--out", str(tmp_path / method)]
        assert train_main(argv) == 0
    assert calls == [False, True]
