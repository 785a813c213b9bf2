"""`apt-ds train --overwrite` replaces only a previous run (or an empty directory); the old run
survives until the new one has a checkpoint, and comes back when the new one fails before that."""

from __future__ import annotations

import shutil

import pytest
from conftest import tree_digest

from apt_ds.cli.train import main as train_main
from apt_ds.training import trainer as trainer_module

FAST = ["--steps", "8", "--max-seq-len", "32", "--micro-batch-size", "2", "--checkpoint-every", "4"]


@pytest.fixture(scope="module")
def previous_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("prev") / "run"
    assert train_main([*FAST, "--out", str(out)]) == 0
    return out


def test_a_directory_of_user_files_is_refused_and_untouched(tmp_path, capsys):
    user = tmp_path / "mydir"
    (user / "notes").mkdir(parents=True)
    (user / "thesis.tex").write_text("years of work")
    (user / "notes" / "a.txt").write_text("a")
    before = tree_digest(user)
    assert train_main([*FAST, "--out", str(user), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not an apt-ds run directory (it holds notes, thesis.tex)" in err[0]
    assert tree_digest(user) == before


def test_the_current_directory_is_refused(tmp_path, capsys, monkeypatch):
    (tmp_path / ".git").mkdir()
    (tmp_path / "setup.py").write_text("")
    monkeypatch.chdir(tmp_path)
    before = tree_digest(tmp_path)
    assert train_main([*FAST, "--out", ".", "--overwrite"]) == 2
    assert "not an apt-ds run directory" in capsys.readouterr().err
    assert tree_digest(tmp_path) == before


def test_a_file_is_refused_with_or_without_overwrite(tmp_path, capsys):
    target = tmp_path / "file.txt"
    target.write_text("keep me")
    for flags in ([], ["--overwrite"]):
        assert train_main([*FAST, "--out", str(target), *flags]) == 2
        assert "exists and is not a directory" in capsys.readouterr().err
    assert target.read_text() == "keep me"


def test_a_run_with_foreign_files_is_refused(previous_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(previous_run, run)
    (run / "my_analysis.ipynb").write_text("{}")
    before = tree_digest(run)
    assert train_main([*FAST, "--out", str(run), "--overwrite"]) == 2
    assert "also my_analysis.ipynb, which a run does not write" in capsys.readouterr().err
    assert tree_digest(run) == before


@pytest.mark.parametrize("added", ["plots/my_figure.svg", "tokenizer/README_mine.txt", "ranks/notes.md", "plots/mine/a.png",
                                   "monitor/NOTES.md", "monitor/apt/notes.txt", "monitor/apt/analysis.csv"])
def test_user_files_inside_a_runs_own_folders_are_refused(previous_run, tmp_path, capsys, added):
    """--overwrite checks the folders a user opens (plots/, tokenizer/, ranks/), not only the top level."""
    run = tmp_path / "run"
    shutil.copytree(previous_run, run)
    (run / added).parent.mkdir(parents=True, exist_ok=True)
    (run / added).write_text("keep")
    before = tree_digest(run)
    assert train_main([*FAST, "--out", str(run), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    shown = added if added.startswith("monitor/") else '/'.join(added.split('/')[:2])  # monitor/: checked at any depth
    assert len(err) == 1 and f"also {shown}, which a run does not write" in err[0], err
    assert tree_digest(run) == before


def test_a_run_with_its_monitor_files_is_replaced(previous_run, tmp_path):
    """RUN/monitor/<job>/ holds what DeepSpeed's monitors write there (CSV, TensorBoard events)."""
    run = tmp_path / "run"
    shutil.copytree(previous_run, run)
    (run / "monitor" / "apt").mkdir(parents=True)
    (run / "monitor" / "apt" / "apt_loss.csv").write_text("step,loss\n1,2.0\n")
    (run / "monitor" / "apt" / "events.out.tfevents.1764000000.host.1.0").write_bytes(b"")
    assert train_main([*FAST, "--out", str(run), "--overwrite"]) == 0
    assert not (run / "monitor").exists()  # the new run (no DeepSpeed monitor) replaced the old one whole


def test_a_run_with_its_own_plots_is_replaced(previous_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(previous_run, run)
    (run / "plots").mkdir()
    (run / "plots" / "curves.png").write_bytes(b"png")
    assert train_main([*FAST, "--seed", "7", "--out", str(run), "--overwrite"]) == 0
    assert not (run / "plots").exists()


def test_an_interrupted_overwrite_does_not_suggest_resuming_the_previous_run(previous_run, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(previous_run, run)
    before = tree_digest(run)

    def interrupt(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_module.APTrainer, "train", interrupt)
    assert train_main([*FAST, "--seed", "7", "--out", str(run), "--overwrite"]) == 130
    err = capsys.readouterr().err
    assert f"interrupted before the new run's first checkpoint; the previous run is back in {run}" in err
    assert "--resume" not in err
    assert tree_digest(run) == before


def test_a_previous_run_is_replaced_and_its_copy_removed_after_the_first_checkpoint(previous_run, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(previous_run, run)
    seen_before_checkpoint = []
    save = trainer_module.APTrainer.save

    def recording_save(self):
        seen_before_checkpoint.append(sorted(p.name for p in tmp_path.glob(".run.replaced-*")))
        save(self)

    monkeypatch.setattr(trainer_module.APTrainer, "save", recording_save)
    assert train_main([*FAST, "--seed", "7", "--out", str(run), "--overwrite"]) == 0
    assert seen_before_checkpoint[0] != []  # the old run was still kept when the first checkpoint began
    assert list(tmp_path.glob(".run.replaced-*")) == []  # and gone afterwards
    assert '"seed": 7' in (run / "run.json").read_text()


def test_a_failing_start_puts_the_previous_run_back(previous_run, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(previous_run, run)
    before = tree_digest(run)

    def crash(self, *args, **kwargs):
        raise RuntimeError("simulated failure before the first checkpoint")

    monkeypatch.setattr(trainer_module.APTrainer, "train", crash)
    with pytest.raises(RuntimeError, match="simulated failure"):
        train_main([*FAST, "--seed", "7", "--out", str(run), "--overwrite"])
    assert "the previous run is back" in capsys.readouterr().err
    assert tree_digest(run) == before and list(tmp_path.glob(".run.replaced-*")) == []


def test_an_empty_directory_is_used(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert train_main([*FAST, "--out", str(empty), "--overwrite"]) == 0
    assert (empty / "run.json").is_file() and (empty / "checkpoint" / "apt_state.json").is_file()


def test_checkpoint_and_probe_files_follow_the_umask(previous_run):
    """safetensors writes 0600: the checkpoint's files are made as readable as the run's others."""
    files = [p for p in (previous_run / "checkpoint").rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    modes = {p.relative_to(previous_run).as_posix(): oct(p.stat().st_mode & 0o777) for p in files}
    expected = oct((previous_run / "run.json").stat().st_mode & 0o777)
    assert set(modes.values()) == {expected}, modes


def test_the_eval_probe_follows_the_umask(tmp_path):
    from apt_ds.io.data import demo_data_path

    run = tmp_path / "run"
    assert train_main([*FAST, "--out", str(run), "--eval-data", str(demo_data_path()), "--save-eval-probe"]) == 0
    assert (run / "eval_probe.safetensors").stat().st_mode & 0o777 == (run / "run.json").stat().st_mode & 0o777


def test_make_readable_leaves_links_and_what_they_point_to(tmp_path):
    import os

    from apt_ds.io.permissions import make_readable

    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    outside.chmod(0o600)
    inside = tmp_path / "d"
    inside.mkdir()
    (inside / "f").write_text("y")
    (inside / "f").chmod(0o600)
    os.symlink(outside, inside / "link")
    make_readable(inside)
    umask = os.umask(0)
    os.umask(umask)
    assert (inside / "f").stat().st_mode & 0o777 == 0o666 & ~umask
    assert outside.stat().st_mode & 0o777 == 0o600
