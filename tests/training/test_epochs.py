"""Epochs, as every trainer reports them (apt_ds.training.epochs): the start line's counts, the
warning where packing multiplies the epochs, and --epochs, which sets the steps from the data."""

from __future__ import annotations

import json
import math

import datasets
import pytest
from conftest import TRAIN_FAST, interrupted_at

from apt_ds.cli.train import main as train_main
from apt_ds.config import TrainConfig
from apt_ds.io.data import TruncationStats, tokenize_dataset
from apt_ds.training.epochs import count_data, data_stats, packing_warning, start_line, start_lines, steps_for_epochs

SHORT_ROWS = [{"text": f"good movie {i}"} for i in range(40)]  # 40 rows the tiny tokenizer packs into a few blocks
INSTRUCTIONS = [{"instruction": f"Say the number {i}.", "input": "", "output": f"The number is {i}."} for i in range(12)]


def _records(rows) -> datasets.Dataset:
    """As a JSONL file loads: every row has every field (from_list would keep the first row's only)."""
    fields = sorted({name for row in rows for name in row})
    return datasets.Dataset.from_list([{name: row.get(name) for name in fields} for row in rows])


def _counts(rows, tokenizer, max_seq_len=32, pack=True):
    records, stats = _records(rows), TruncationStats()
    examples = tokenize_dataset(records, tokenizer, max_seq_len, pack=pack, stats=stats)
    return count_data(records, examples, pack, stats.to_dict()), examples


def test_the_start_line_of_packed_text_counts_blocks_and_epochs(tokenizer):
    counts, examples = _counts(SHORT_ROWS, tokenizer)
    blocks = len(examples)
    assert (counts.rows, counts.text_rows, counts.examples, counts.packed) == (40, 40, blocks, True) and blocks < 40
    assert start_line(counts, 150, 8, 32) == (f"data: 40 rows -> {blocks} examples (text rows packed into blocks of 32 "
                                              f"tokens); 150 steps x 8 sequences = 1,200 sequences = {1200 / blocks:.1f} epochs")


def test_the_start_line_of_instruction_data_has_one_example_a_row(tokenizer):
    counts, _ = _counts(INSTRUCTIONS, tokenizer, max_seq_len=64)
    assert (counts.rows, counts.text_rows, counts.examples, counts.packed) == (12, 0, 12, False)
    assert start_line(counts, 6, 4, 64, epochs_given=2.0) == \
        "data: 12 rows -> 12 examples; 6 steps x 4 sequences = 24 sequences = 2.0 epochs (--epochs 2)"
    assert packing_warning(counts, 600, 4, 64) is None  # 200 epochs, but not of packing's making


def test_mixed_data_counts_what_no_pack_would_make(tokenizer):
    """Text rows packed beside instruction rows (one example each), a row with no usable text and one
    whose response alone exceeds --max-seq-len: the counts --no-pack would give are exact."""
    rows = SHORT_ROWS + INSTRUCTIONS + [{"instruction": "x", "output": ""}, {"instruction": "y", "output": "long " * 80}]
    counts, examples = _counts(rows, tokenizer, max_seq_len=32)
    unpacked = tokenize_dataset(_records(rows), tokenizer, 32, pack=False)
    assert counts.examples_unpacked == len(unpacked) == 40 + 12
    assert counts.text_blocks == len(examples) - 12 and counts.packed


def test_the_warning_names_no_pack_where_packing_multiplies_the_epochs(tokenizer):
    counts, examples = _counts(SHORT_ROWS, tokenizer)
    blocks = len(examples)
    train = TrainConfig(steps=150, micro_batch_size=2, grad_accum_steps=2, max_seq_len=32)  # 2 x 2 x 2 ranks a step
    lines = start_lines(counts, train, world_size=2, epochs_given=None)
    assert lines[0].startswith(f"data: 40 rows -> {blocks} examples (text rows packed") and "150 steps x 8 sequences" in lines[0]
    assert lines[1] == (f"warning: 40 text rows were packed into {blocks} blocks of 32 tokens, so 150 steps are "
                        f"{1200 / blocks:.1f} epochs; --no-pack keeps one example per row (40 examples, 30.0 epochs)")
    assert data_stats(counts, train, world_size=2, epochs_given=None) == {
        "rows": 40, "text_rows": 40, "examples": blocks, "packed": True, "global_batch": 8, "steps": 150,
        "epochs": round(1200 / blocks, 4), "epochs_given": None}


def test_no_warning_where_packing_does_not_multiply_the_epochs(tokenizer):
    counts, examples = _counts(SHORT_ROWS, tokenizer)
    assert packing_warning(counts, len(examples) // 2, 1, 32) is None  # half an epoch: nothing is repeated
    assert packing_warning(counts, 40, 8, 32) is not None
    unpacked, _ = _counts(SHORT_ROWS, tokenizer, pack=False)  # --no-pack: one example a row
    assert not unpacked.packed and packing_warning(unpacked, 40, 8, 32) is None
    long_rows, _ = _counts([{"text": " ".join(["good movie"] * 40)} for _ in range(4)], tokenizer)
    assert long_rows.examples > long_rows.text_rows and packing_warning(long_rows, 40, 8, 32) is None  # more blocks than rows
    given = start_lines(counts, TrainConfig(steps=40, max_seq_len=32), world_size=1, epochs_given=2.0)
    assert len(given) == 1 and given[0].endswith("(--epochs 2)")  # --epochs chose its epochs: packing only lowered the steps


def test_steps_for_epochs_round_up_on_the_decimal_as_typed():
    assert steps_for_epochs(2, 600, 8) == 150 and steps_for_epochs(2.0, 75, 8) == 19
    assert steps_for_epochs(0.5, 75, 8) == 5  # 4.6875 steps: the last one partly into the next pass
    assert steps_for_epochs(0.1, 30, 3) == 1  # float arithmetic would make it 1.0000000000000002, so 2


def _write_short_rows(path):
    path.write_text("".join(json.dumps(row) + "\n" for row in SHORT_ROWS))
    return str(path)


def test_a_run_says_its_epochs_and_records_them(tmp_path, capsys):
    data = _write_short_rows(tmp_path / "short.jsonl")
    assert train_main([*TRAIN_FAST, "--data", data, "--out", str(tmp_path / "run")]) == 0
    stats = json.loads((tmp_path / "run" / "run.json").read_text())["data_stats"]
    blocks = stats["examples"]
    lines = capsys.readouterr().err.splitlines()
    assert (f"data: 40 rows -> {blocks} examples (text rows packed into blocks of 32 tokens); 8 steps x 2 sequences = "
            f"16 sequences = {16 / blocks:.1f} epochs") in lines
    assert any(line.startswith("warning: 40 text rows were packed") and "--no-pack" in line for line in lines)
    assert stats == {"rows": 40, "text_rows": 40, "examples": blocks, "packed": True, "global_batch": 2, "steps": 8,
                     "epochs": round(16 / blocks, 4), "epochs_given": None}


def test_a_run_on_instruction_data_says_one_example_a_row(tmp_path, capsys):
    assert train_main([*TRAIN_FAST, "--out", str(tmp_path / "run")]) == 0  # the shipped demo: instruction rows
    stats = json.loads((tmp_path / "run" / "run.json").read_text())["data_stats"]
    err = capsys.readouterr().err
    assert (stats["rows"], stats["examples"], stats["packed"]) == (1500, 1500, False)
    assert "data: 1,500 rows -> 1,500 examples; 8 steps x 2 sequences = 16 sequences = 0.011 epochs\n" in err
    assert "--no-pack" not in err


def test_epochs_set_the_steps_and_the_schedule_and_a_resume_keeps_them(tmp_path, monkeypatch, capsys):
    from apt_ds.training.trainer import APTrainer

    data = _write_short_rows(tmp_path / "short.jsonl")
    flags = ["--epochs", "2.5", "--max-seq-len", "32", "--micro-batch-size", "2", "--checkpoint-every", "4", "--data", data]
    real_step = APTrainer._train_step
    monkeypatch.setattr(APTrainer, "_train_step", interrupted_at(5))
    assert train_main([*flags, "--out", str(tmp_path / "run")]) == 130
    monkeypatch.setattr(APTrainer, "_train_step", real_step)
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    blocks, steps = record["data_stats"]["examples"], record["train_config"]["steps"]
    assert steps == math.ceil(2.5 * blocks / 2) and steps > 5
    assert record["apt_config"]["pruning_end_step"] == round(0.5 * steps)  # the schedule follows the steps
    assert record["train_config"]["warmup_steps"] == max(1, steps // 20)
    assert record["data_stats"]["epochs_given"] == 2.5 and record["data_stats"]["epochs"] == round(steps * 2 / blocks, 4)
    err = capsys.readouterr().err
    assert f"{steps} steps x 2 sequences = {2 * steps} sequences = {2 * steps / blocks:.1f} epochs (--epochs 2.5)" in err
    assert "warning: 40 text rows" not in err
    # another --epochs would make other steps: one line, after the data is read
    assert train_main([*flags[2:], "--epochs", "4", "--resume", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --resume: --epochs 4 makes {math.ceil(4 * blocks / 2)} steps of {blocks} examples at 2 "
                   f"sequences a step, and the run has {steps}: pass the --epochs it was started with, or --steps {steps}")
    assert train_main([*flags, "--resume", "--out", str(tmp_path / "run")]) == 0
    state = json.loads((tmp_path / "run" / "checkpoint" / "apt_state.json").read_text())
    assert state["step"] == steps and state["finished"]


@pytest.mark.parametrize("argv, line", [
    (["--epochs", "2", "--steps", "100"], "error: --epochs 2 sets the steps from the data and --steps 100 sets them "
                                          "directly: give one of them"),
    (["--epochs", "0"], "error: --epochs must be a number > 0, got 0.0"),
    (["--epochs", "-1.5"], "error: --epochs must be a number > 0, got -1.5"),
    (["--epochs", "inf"], "error: --epochs must be a number > 0, got inf"),
], ids=["with-steps", "zero", "negative", "infinite"])
def test_bad_epochs_are_one_line(argv, line, tmp_path, capsys):
    assert train_main([*argv, "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == line + "\n"
    assert not (tmp_path / "run").exists()


def test_a_recipe_gives_way_to_the_typed_length(tmp_path, capsys):
    """--epochs typed replaces a recipe's steps, --steps typed a recipe's epochs; a recipe with both is refused."""
    from apt_ds.cli.arguments import build_train_parser, explicit_values
    from apt_ds.cli.recipe import resolve

    recipe = tmp_path / "r.yaml"
    recipe.write_text("steps: 40\n")
    run, apt, _ = resolve(explicit_values(build_train_parser, ["--config", str(recipe), "--epochs", "1.5"]))
    assert run.epochs == 1.5 and apt is None  # the APT config waits for the data's steps
    recipe.write_text("epochs: 3\n")
    run, apt, train = resolve(explicit_values(build_train_parser, ["--config", str(recipe), "--steps", "40"]))
    assert run.epochs is None and train.steps == 40 and apt.pruning_end_step == 20
    recipe.write_text("epochs: 3\nsteps: 40\n")
    assert train_main(["--config", str(recipe), "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == f"error: --config {recipe} sets both epochs and steps: keep one (epochs sets the " \
                                      "steps from the data)\n"
