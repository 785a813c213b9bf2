"""launch/train.py's entry point end to end on the built-in tiny model: a run, its metrics, and the
inputs it refuses before writing anything."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import RUN_FLAGS
from conftest import TRAIN_FAST as FAST

from apt_ds.cli.train import main as train_main
from apt_ds.io.metrics import read_metrics

METRIC_FIELDS = {"step", "loss", "task_loss", "distill_loss", "grad_norm", "density", "block_params", "adapter_params",
                 "total_rank", "lr", "step_time_s", "peak_rss_mb", "world_size"}


def test_training_run_reaches_target_and_logs(trained_runs):
    records = read_metrics(trained_runs / "nonuniform" / "metrics.jsonl")
    steps = [r for r in records if not r.get("final")]
    assert METRIC_FIELDS <= set(steps[-1])
    assert steps[-1]["density"] <= 0.6 + 1e-9
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    assert records[-1]["final"] and records[-1]["step"] == 8


def test_existing_out_is_refused_and_untouched(trained_runs, capsys):
    metrics = trained_runs / "nonuniform" / "metrics.jsonl"
    before = metrics.read_bytes()
    assert train_main([*FAST, "--out", str(trained_runs / "nonuniform")]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert metrics.read_bytes() == before


@pytest.mark.parametrize("argv, message", [
    # named as typed: the flag, not the config class's field
    (["--target-density", "0"], "error: --target-density must be in (0, 1], got 0.0"),
    (["--target-density", "1.5"], "--target-density must be in (0, 1], got 1.5"),
    (["--rank-cap", "2"], "--rank-cap must be >= adapter_rank (8), got 2"),
    (["--steps", "3"], "--steps must be >= 4 to warm up, prune and recover, got 3"),
    (["--pruning-end-step", "20"], "--pruning-end-step (20) must be <= steps (8)"),
    # a default that a typed value contradicts: named as the flag to give
    (["--adapter-rank", "128"], "--rank-cap must be >= adapter_rank (128), got 64 (its default; give --rank-cap)"),
    (["--prune-heads", "false", "--prune-neurons", "false", "--prune-hidden", "false"],
     "--prune-heads/--prune-neurons/--prune-hidden must not all be false when prune is true"),
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


def test_failed_start_touches_nothing(trained_runs, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"output": ""}\n')
    before = sorted(p.name for p in (trained_runs / "nonuniform").iterdir())
    assert train_main([*FAST, "--data", str(bad), "--overwrite", "--out", str(trained_runs / "nonuniform")]) == 2
    assert sorted(p.name for p in (trained_runs / "nonuniform").iterdir()) == before  # --overwrite did not delete first
    fresh = tmp_path / "fresh"
    assert train_main([*FAST, "--eval-data", str(tmp_path / "missing.jsonl"), "--out", str(fresh)]) == 2
    assert not fresh.exists()  # a corrected rerun is not refused
    capsys.readouterr()


def test_schedule_overrides_are_checked_against_steps(tmp_path, capsys):
    assert train_main([*FAST, "--pruning-end-step", "100", "--out", str(tmp_path / "a")]) == 2
    assert "--pruning-end-step (100) must be <= steps (8)" in capsys.readouterr().err


def test_global_batch_size_without_deepspeed(tmp_path):
    from apt_ds.cli.arguments import build_train_parser, explicit_values
    from apt_ds.cli.recipe import resolve
    from apt_ds.training.run import make_backend

    run, _, train = resolve(explicit_values(build_train_parser, ["--global-batch-size", "6", "--grad-accum-steps", "2"]))
    _, train = make_backend(run, train)
    assert train.micro_batch_size == 3


def test_a_micro_batch_beside_a_global_batch_is_refused_unless_the_recipe_gave_it(tmp_path):
    """--global-batch-size overrides a recipe's micro_batch_size (the shipped recipes set one); a
    --micro-batch-size on the command line beside a global batch would be ignored, so it is refused."""
    from apt_ds.cli.arguments import build_train_parser, explicit_values
    from apt_ds.cli.recipe import resolve
    from apt_ds.cli.train import check_batch_flags
    from apt_ds.config import ConfigError

    micro, glob = tmp_path / "micro.yaml", tmp_path / "global.yaml"
    micro.write_text("micro_batch_size: 4\n")
    glob.write_text("global_batch_size: 8\n")

    def check(*argv):
        given = explicit_values(build_train_parser, list(argv))
        run, _, _ = resolve(given)
        check_batch_flags(run, given)
        return run

    assert check("--config", str(micro), "--global-batch-size", "8").global_batch_size == 8
    assert check("--micro-batch-size", "2").global_batch_size is None
    for argv in (["--global-batch-size", "8", "--micro-batch-size", "2"], ["--config", str(glob), "--micro-batch-size", "2"]):
        with pytest.raises(ConfigError, match=r"a global batch size \(8\) .* --micro-batch-size 2 sets it directly"):
            check(*argv)


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


def test_pruning_runs_read_weights_into_memory(trained_runs, tmp_path, monkeypatch):
    """`apt-ds train` loads a model directory unmapped when it prunes (mapped pages would stay
    resident after units are removed) and mapped for LoRA, which never frees weights."""
    from conftest import tiny_llama

    import apt_ds.training.run as run

    model_dir = tmp_path / "model"
    tiny_llama("gqa", vocab=512).save_pretrained(str(model_dir))
    for item in (trained_runs / "nonuniform" / "tokenizer").iterdir():
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


def test_a_check_over_typed_and_recipe_values_names_both(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("prune_heads: false\nprune_neurons: false\n")
    assert train_main([*FAST, "--config", str(config), "--prune-hidden", "false", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --prune-heads/--prune-neurons/--prune-hidden (given on the command line and in --config {config})")


def test_lora_is_not_refused_for_settings_only_pruning_and_growth_read(tmp_path):
    """--method lora neither prunes nor grows ranks: no unit kinds to prune, an adapter rank above the
    growth cap."""
    argv = [*FAST, "--method", "lora", "--prune-heads", "false", "--prune-neurons", "false", "--prune-hidden", "false",
            "--adapter-rank", "128", "--out", str(tmp_path / "r")]
    assert train_main(argv) == 0
    assert read_metrics(tmp_path / "r" / "metrics.jsonl")[-1]["total_rank"] == 128 * 2 * 4  # q and v of its 4 layers


def test_a_directory_holding_one_gguf_trains_from_that_file(trained_runs, tmp_path):
    """--model DIR of an apt-ds GGUF export (one .gguf, no config.json) is that file, as for evaluate."""
    from apt_ds.export.pruned import export_pruned
    from apt_ds.io.modeling import build_tiny_model
    from apt_ds.io.tokenizer import load_tokenizer

    meta = json.loads((trained_runs / "uniform" / "checkpoint" / "apt_state.json").read_text())
    tokenizer_dir = trained_runs / "uniform" / "tokenizer"
    model = build_tiny_model(vocab_size=len(load_tokenizer(tokenizer_dir)), seed=meta["train_config"]["seed"])
    config = model.config
    everything = {"groups": [list(range(config.num_key_value_heads))] * config.num_hidden_layers,
                  "neurons": [list(range(config.intermediate_size))] * config.num_hidden_layers,
                  "hidden": list(range(config.hidden_size))}
    export_pruned(model, everything, tmp_path / "base", tokenizer_dir=tokenizer_dir, format="gguf")
    out = tmp_path / "run"
    assert train_main([*FAST, "--model", str(tmp_path / "base"), "--method", "lora", "--out", str(out)]) == 0
    recorded = json.loads((out / "run.json").read_text())["model"]
    assert recorded == str((tmp_path / "base" / "base.gguf").resolve())


def test_eval_data_that_is_the_training_data_gets_a_warning(in_tmp, capsys):
    assert train_main([*RUN_FLAGS, "--eval-data", "./data.jsonl", "--out", "run"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: --eval-data")]
    assert warnings == ["warning: --eval-data ./data.jsonl is the training data (--data): eval_loss will measure how well "
                        "the run fits what it trains on, not how it does on unseen rows"]
