"""Ctrl-C and SIGTERM at any moment of a command: one line that says what is left to do, exit 130
(or 143), and nothing half-written; while the libraries still load, too."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import TRAIN_FAST

from apt_ds.cli.export import main as export_main

REPO = Path(__file__).resolve().parents[2]


def test_an_interrupted_export_is_one_line(trained_runs, tmp_path, monkeypatch, capsys):
    import apt_ds.export.merge as merge

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(merge, "export_run", interrupted)
    assert export_main([str(trained_runs / "nonuniform"), "--out", str(tmp_path / "e")]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did not finish" in err
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("script", ["train", "export", "evaluate", "plot"])
def test_ctrl_c_while_a_command_starts_is_one_line(script, tmp_path):
    """Ctrl-C while Python loads the libraries (the first second or two of every command) stops it
    with one line, not a traceback from inside an import."""
    code = textwrap.dedent(f"""
        import runpy, sys
        class CtrlC:  # raises where the import of the command's module would begin
            def find_spec(self, name, path=None, target=None):
                if name == "apt_ds.cli.{script}":
                    raise KeyboardInterrupt
        sys.meta_path.insert(0, CtrlC())
        sys.argv = ["launch/{script}.py", "--help"]
        runpy.run_path({str(REPO / "launch" / f"{script}.py")!r}, run_name="__main__")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 130
    assert done.stderr == "interrupted while starting; nothing was written\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["train", "export", "evaluate", "plot"])
def test_ctrl_c_inside_main_never_asks_for_the_error_classes(command, trained_runs, tmp_path, monkeypatch, capsys):
    """A Ctrl-C while main() imports torch leaves it half-imported: an `except user_errors()` (which
    imports torch's modules again) matched before `except KeyboardInterrupt` gave two tracebacks or a
    crash. The interrupt is raised where each command's heavy work starts."""
    import apt_ds.cli.errors

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    def not_now():
        raise AssertionError("user_errors() evaluated for a KeyboardInterrupt")

    run = str(trained_runs / "nonuniform")
    if command == "train":
        import apt_ds.cli.train as cli

        monkeypatch.setattr(cli, "resolve", ctrl_c)
        argv = [*TRAIN_FAST, "--out", str(tmp_path / "r")]
    elif command == "export":
        import apt_ds.cli.export as cli
        import apt_ds.export.merge as merge

        monkeypatch.setattr(merge, "export_run", ctrl_c)
        argv = [run, "--out", str(tmp_path / "e")]
    elif command == "evaluate":
        import apt_ds.cli.evaluate as cli
        import apt_ds.evaluation.report as report

        monkeypatch.setattr(report, "check_out_path", ctrl_c)
        argv = ["a-model", "--out", str(tmp_path / "r.json")]  # interrupted before the model is read (a run is refused)
    else:
        import apt_ds.cli.plot as cli

        monkeypatch.setattr(cli, "read_run", ctrl_c)
        argv = [run, "--out", str(tmp_path / "p")]
    monkeypatch.setattr(apt_ds.cli.errors, "user_errors", not_now)
    if hasattr(cli, "user_errors"):
        monkeypatch.setattr(cli, "user_errors", not_now)
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted" in err
    assert list(tmp_path.iterdir()) == []


def test_the_commands_modules_load_without_torch():
    """What a command imports before its main() runs, where its Ctrl-C handling starts: no torch
    (apt_ds's public names are imported on first use), so --help is quick and a Ctrl-C is caught."""
    code = "import sys, apt_ds.cli.train, apt_ds.cli.export, apt_ds.cli.evaluate, apt_ds.cli.plot; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.stdout.strip() == "False", done.stderr
    import apt_ds

    assert apt_ds.APTrainer.__name__ == "APTrainer" and "APTrainer" in dir(apt_ds)
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        apt_ds.Trainer


@pytest.mark.parametrize("state", ["nothing", "no checkpoint", "checkpoint"])
def test_an_interrupted_start_says_what_is_left_to_do(trained_runs, tmp_path, state):
    from apt_ds.cli.train import interrupted_note

    run = tmp_path / "run"
    if state != "nothing":
        shutil.copytree(trained_runs / "nonuniform", run)
    if state == "no checkpoint":
        shutil.rmtree(run / "checkpoint")
    expected = {"nothing": "before the run wrote anything", "no checkpoint": "with --overwrite starts again",
                "checkpoint": "--resume continues from the last checkpoint"}[state]
    assert expected in interrupted_note("interrupted", run)
