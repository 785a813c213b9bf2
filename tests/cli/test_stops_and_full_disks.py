"""A run stopped or starved of disk loses nothing: a full disk while a checkpoint is written keeps
the previous one, a stop (Ctrl-C, SIGTERM, a kill) during an --overwrite start puts the previous
run back or keeps the new one once it has a checkpoint, and the recovery of a killed start never
deletes what is not its own. docs/RELIABILITY.md lists what each leaves on disk."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import RUN_FLAGS as BASE
from conftest import tree_digest
from safetensors import SafetensorError

from apt_ds.cli.export import main as export_main
from apt_ds.cli.train import main as train_main
from apt_ds.io import checkpoint_save as checkpoint_module

REPO = Path(__file__).resolve().parents[2]


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(in_tmp, tmp_path, capsys, monkeypatch):
    """ENOSPC while the step-8 checkpoint is written: one line with the space it needs, the step-4
    checkpoint untouched and resumable, no half-written checkpoint left."""
    argv = [*BASE, "--steps", "12", "--out", "run"]
    save, calls = checkpoint_module.save_file, []

    def fill_the_disk_at_the_second_checkpoint(tensors, path, *args, **kwargs):
        calls.append(path)
        if (Path("run") / "checkpoint" / "apt_state.json").is_file():  # as safetensors 0.8 reports ENOSPC
            raise SafetensorError(f"Error while serializing: I/O error: No space left on device (os error {errno.ENOSPC})")
        return save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "save_file", fill_the_disk_at_the_second_checkpoint)
    capsys.readouterr()
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "disk full while writing the step-8 checkpoint" in errors[0], err
    assert "needs about" in errors[0] and "MB are free" in errors[0] and "the previous checkpoint (step 4) is kept" in errors[0]
    assert "Traceback" not in err
    assert json.loads((tmp_path / "run" / "checkpoint" / "apt_state.json").read_text())["step"] == 4
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("checkpoint")) == ["checkpoint"]
    monkeypatch.setattr(checkpoint_module, "save_file", save)  # space freed: the run resumes and finishes
    assert train_main([*argv, "--resume"]) == 0
    assert json.loads((tmp_path / "run" / "checkpoint" / "apt_state.json").read_text())["step"] == 12


def test_a_killed_overwrite_start_gets_the_previous_run_back(in_tmp, tmp_path, capsys, monkeypatch):
    """SIGKILL after --overwrite set the previous run aside but before the new run's first
    checkpoint: the next invocation puts the previous run back (it would be lost otherwise)."""
    assert train_main([*BASE, "--out", "run"]) == 0
    before = tree_digest(tmp_path / "run")
    dead_pid = 2**22 + 17  # above the kernel's default pid_max: no such process
    (tmp_path / "run").rename(tmp_path / f".run.replaced-{dead_pid}")
    (tmp_path / "run").mkdir()  # what the killed run had written: run.json, no checkpoint
    shutil.copy(tmp_path / f".run.replaced-{dead_pid}" / "run.json", tmp_path / "run" / "run.json")
    capsys.readouterr()
    assert train_main([*BASE, "--steps", "12", "--out", "run", "--resume"]) == 2  # settings differ: refused...
    err = capsys.readouterr().err
    assert "it is back in run" in err  # ...but only after the previous run came back
    assert tree_digest(tmp_path / "run") == before and not list(tmp_path.glob(".run.replaced-*"))


@pytest.mark.parametrize("command", ["export", "plot"])
def test_export_and_plot_say_where_a_killed_overwrite_left_the_previous_run(in_tmp, tmp_path, capsys, command):
    """They move nothing (the start may still be alive on another host, where a lock does not
    reach), but say where the previous run is and that train puts it back."""
    from apt_ds.cli.plot import main as plot_main

    assert train_main([*BASE, "--out", "run"]) == 0
    dead_pid = 2**22 + 17
    (tmp_path / "run").rename(tmp_path / f".run.replaced-{dead_pid}")
    (tmp_path / "run").mkdir()
    shutil.copy(tmp_path / f".run.replaced-{dead_pid}" / "run.json", tmp_path / "run" / "run.json")
    before = tree_digest(tmp_path)
    capsys.readouterr()
    export_main(["run", "--out", "compact"]) if command == "export" else plot_main(["run", "--out", "figures"])
    err = capsys.readouterr().err
    assert f"it is in {Path('.run.replaced-' + str(dead_pid))}" in err and "--resume` puts it back" in err
    assert tree_digest(tmp_path) == before


def test_a_stop_between_the_first_checkpoint_and_its_hook_keeps_the_new_run(in_tmp, tmp_path, capsys, monkeypatch):
    """The new run has its checkpoint: a Ctrl-C/SIGTERM before the previous copy is deleted keeps
    the new run and deletes the old copy, instead of putting the old run back over it."""
    from apt_ds.training import run as run_module

    assert train_main([*BASE, "--out", "run"]) == 0

    def stopped(aside):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "discard", stopped)
    assert train_main([*BASE, "--seed", "3", "--out", "run", "--overwrite"]) == 130
    assert '"seed": 3' in (tmp_path / "run" / "run.json").read_text()
    assert (tmp_path / "run" / "checkpoint" / "apt_state.json").is_file()
    assert not list(tmp_path.glob(".run.replaced-*")) and not list(tmp_path.glob(".run.discarding-*"))


def test_a_deletion_stopped_halfway_is_never_put_back(in_tmp, tmp_path):
    from apt_ds.io.run_dir import recover_interrupted_overwrite

    assert train_main([*BASE, "--out", "run"]) == 0
    remnant = tmp_path / f".run.discarding-{2**22 + 17}-ab"
    shutil.copytree(tmp_path / "run", remnant)
    shutil.rmtree(remnant / "checkpoint")  # half deleted
    before = tree_digest(tmp_path / "run")
    assert recover_interrupted_overwrite(tmp_path / "run") is None
    assert not remnant.exists() and tree_digest(tmp_path / "run") == before


def test_sigterm_is_handled_as_ctrl_c(in_tmp, tmp_path, capsys, monkeypatch):
    """The deepspeed launcher, Slurm and docker stop with SIGTERM: an --overwrite start puts the
    previous run back and says so, as for Ctrl-C (exit status 143)."""
    import signal

    from apt_ds.training import trainer as trainer_module

    assert train_main([*BASE, "--out", "run"]) == 0
    before = tree_digest(tmp_path / "run")

    def terminated(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(trainer_module.APTrainer, "train", terminated)
    previous = signal.getsignal(signal.SIGTERM)
    assert train_main([*BASE, "--seed", "3", "--out", "run", "--overwrite"]) == 143
    assert "terminated before the new run's first checkpoint; the previous run is back in run" in capsys.readouterr().err
    assert tree_digest(tmp_path / "run") == before
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler is the run's only


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@contextmanager
def _small_tmpfs(disk: Path, room: int):
    """A tmpfs of about `room` bytes at `disk`, unmounted afterwards; the test is skipped where
    this machine gives no mount rights (the faked ENOSPC tests still run)."""
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room // 4096 * 4096}", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()}); the faked ENOSPC test above still runs")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)  # lazy: a failed run may hold a file open


def test_a_really_full_disk_keeps_the_previous_checkpoint(in_tmp, tmp_path, capsys, monkeypatch):
    """The same on a real file system that fills up: a tmpfs with room for one checkpoint, not
    two (the new one is written before the old one goes). Needs mount rights (root)."""
    assert train_main([*BASE, "--out", "sized"]) == 0
    room = _du(tmp_path / "sized") + _du(tmp_path / "sized" / "checkpoint") // 2
    with _small_tmpfs(tmp_path / "disk", room) as disk:
        capsys.readouterr()
        assert train_main([*BASE, "--out", "disk/run"]) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "disk full while writing the step-8 checkpoint" in errors[0], err
        assert "the previous checkpoint (step 4) is kept" in errors[0] and "Traceback" not in err
        assert json.loads((disk / "run" / "checkpoint" / "apt_state.json").read_text())["step"] == 4
        assert not (disk / "run" / "checkpoint.tmp").exists()
        subprocess.run(["mount", "-o", f"remount,size={4 * room // 4096 * 4096}", str(disk)], check=True)
        assert train_main([*BASE, "--out", "disk/run", "--resume"]) == 0  # space freed: it finishes
        assert json.loads((disk / "run" / "checkpoint" / "apt_state.json").read_text())["step"] == 8


def test_recovery_never_deletes_what_took_the_runs_place(in_tmp, tmp_path, capsys, monkeypatch):
    """A killed --overwrite left the previous run aside; the user then put their own files at
    --out. The next invocation keeps both and says where the previous run is."""
    assert train_main([*BASE, "--out", "run"]) == 0
    dead_pid = 2**22 + 17
    (tmp_path / "run").rename(tmp_path / f".run.replaced-{dead_pid}")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("precious")
    before = tree_digest(tmp_path)
    capsys.readouterr()
    assert train_main([*BASE, "--out", "run", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"still in .run.replaced-{dead_pid}" in err and "holds no checkpoint" in err
    assert tree_digest(tmp_path) == before


def test_glob_characters_in_out_touch_no_other_runs_copy(in_tmp, tmp_path, capsys, monkeypatch):
    assert train_main([*BASE, "--out", "e1"]) == 0
    dead_pid = 2**22 + 17
    (tmp_path / "e1").rename(tmp_path / f".e1.replaced-{dead_pid}")  # e1's own set-aside copy
    before = tree_digest(tmp_path)
    assert train_main([*BASE, "--out", "e[1]", "--steps", "4", "--target-density", "1.5"]) == 2  # refused after recovery ran
    assert tree_digest(tmp_path) == before


def test_set_aside_copies_are_owned_by_a_lock_not_a_pid(in_tmp, capsys):
    """A container restart gives the new process the dead one's PID: the copy a killed
    --overwrite start left under that PID is still recovered (nobody holds its lock), and a copy
    whose lock is held is left alone."""
    from apt_ds.io import run_dir

    assert train_main([*BASE, "--out", "run"]) == 0
    before = tree_digest(in_tmp / "run")
    held = run_dir.move_aside(in_tmp / "run")  # this process holds its lock, as a running start does
    assert run_dir.recover_interrupted_overwrite(in_tmp / "run") is None and held.is_dir()
    orphan = held.with_name(f".run.replaced-{os.getpid()}-0badc0de")  # our own PID, as after a restart
    held.rename(orphan)
    run_dir._lock_path(orphan).touch()  # its lock file, held by nobody
    note = run_dir.recover_interrupted_overwrite(in_tmp / "run")
    assert note and "it is back in" in note
    assert tree_digest(in_tmp / "run") == before
    run_dir._release(held)
    assert sorted(p.name for p in in_tmp.iterdir() if p.name.startswith(".run")) == []


def test_a_user_error_after_overwrite_set_the_run_aside_is_still_one_line(in_tmp, capsys, monkeypatch):
    from apt_ds.config import ConfigError
    from apt_ds.training import trainer as trainer_module

    assert train_main([*BASE, "--out", "run"]) == 0
    before = tree_digest(in_tmp / "run")

    def refuse(self, *args, **kwargs):
        raise ConfigError("simulated user error during the start")

    monkeypatch.setattr(trainer_module.APTrainer, "train", refuse)
    capsys.readouterr()
    assert train_main([*BASE, "--out", "run", "--overwrite", "--seed", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "simulated user error" in err[0] and "the previous run is back in run" in err[0], err
    assert tree_digest(in_tmp / "run") == before


@pytest.mark.parametrize("streaming", [True, False], ids=["streamed", "in-memory"])
def test_disk_full_during_an_export_is_one_line_and_leaves_nothing(in_tmp, tmp_path, capsys, monkeypatch, tokenizer,
                                                                    streaming):
    """ENOSPC while the weights are written: one line with the space needed and free, no
    `.NAME.tmp-*` left, a previous export untouched; the same command succeeds once there is room."""
    import safetensors.torch
    from conftest import tiny_llama

    from apt_ds.export import merge, writer

    tiny_llama("gqa", vocab=len(tokenizer)).save_pretrained(tmp_path / "base")  # a safetensors base: streamed
    tokenizer.save_pretrained(str(tmp_path / "base"))
    assert train_main([*BASE, "--model", "base", "--out", "run"]) == 0
    if not streaming:
        real_export_run = merge.export_run
        monkeypatch.setattr(merge, "export_run", lambda *a, **k: real_export_run(*a, **{**k, "streaming": False}))
    assert export_main(["run", "--out", "export"]) == 0
    before = tree_digest(tmp_path)

    def full_disk(*args, **kwargs):
        raise SafetensorError(f"Error while serializing: I/O error: No space left on device (os error {errno.ENOSPC})")

    save = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)  # the streamed export's
    monkeypatch.setattr(writer, "save_file", full_disk)  # the in-memory export's
    for out, flags, kept in (("new", [], "nothing was written"), ("export", ["--overwrite"], "the previous export in --out is unchanged")):
        capsys.readouterr()
        assert export_main(["run", "--out", out, *flags]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("Loading weights")]
        assert len(err) == 1 and err[0].startswith(f"error: disk full while writing the export to {out}: it needs about"), err
        assert "MB are free" in err[0] and kept in err[0], err
        assert tree_digest(tmp_path) == before
    monkeypatch.setattr(safetensors.torch, "save_file", save)
    monkeypatch.setattr(writer, "save_file", save)
    assert export_main(["run", "--out", "new"]) == 0


@pytest.mark.parametrize("format", ["hf", "gguf"])
def test_a_really_full_disk_during_an_export(in_tmp, tmp_path, capsys, format):
    """On a tmpfs too small for the export (half its size): one line, nothing left on it; both
    formats (the GGUF writer's short write is numpy's, without an errno). Needs mount rights (root)."""
    assert train_main([*BASE, "--out", "run"]) == 0
    assert export_main(["run", "--out", "sized", "--format", format]) == 0
    room = max(_du(tmp_path / "sized") // 2, 4096)
    with _small_tmpfs(tmp_path / "disk", room) as disk:
        capsys.readouterr()
        assert export_main(["run", "--out", "disk/export", "--format", format]) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "disk full while writing the export to disk/export: it needs about" in errors[0], err
        assert "Traceback" not in err and not any(disk.iterdir())


def test_two_exports_into_one_new_out_one_is_refused(in_tmp, tmp_path):
    """Started at the same moment into the same new --out: one writes it, the other stops in one
    line (the export lock while the first writes, or --overwrite's refusal once it is done); the
    export left there loads."""
    assert train_main([*BASE, "--out", "run"]) == 0
    command = [sys.executable, str(REPO / "launch" / "export.py"), "run", "--out", "together"]
    exports = [subprocess.Popen(command, cwd=tmp_path, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
               for _ in range(2)]
    results = [(export.wait(timeout=300), export.stderr.read()) for export in exports]
    assert sorted(code for code, _ in results) == [0, 2], results
    refused = next(err for code, err in results if code == 2).strip().splitlines()
    assert len(refused) == 1 and ("is being written by another export" in refused[0]
                                  or "holds a previous export; pass --overwrite" in refused[0]), refused
    from apt_ds.io.modeling import load_pretrained

    load_pretrained(tmp_path / "together")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".together")) == []
