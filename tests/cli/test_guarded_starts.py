"""One training process per run directory, exports that a run would delete, and targets that
no pruning can reach: each refused in one line before anything is written."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import RUN_FLAGS, TRAIN_FAST, tree_digest

from apt_ds.algorithm.blocks import PruningError
from apt_ds.algorithm.pruner import AdaptivePruner
from apt_ds.algorithm.reachable import check_target_reachable
from apt_ds.algorithm.units import ModelShape
from apt_ds.cli.export import done_message
from apt_ds.cli.export import main as export_main
from apt_ds.cli.train import main as train_main
from apt_ds.config import APTConfig
from apt_ds.io import run_lock
from apt_ds.io.modeling import build_tiny_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def held(tmp_path):
    """Another process holding `run`'s training lock, as a live `launch/train.py` on it does."""
    holders = []

    def hold(run: Path) -> subprocess.Popen:
        code = textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from apt_ds.io import run_lock
            run_lock.acquire(Path({str(run)!r}))
            print("held", flush=True)
            time.sleep(120)
        """)
        holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
        assert holder.stdout.readline().strip() == "held"
        holders.append(holder)
        return holder

    yield hold
    for holder in holders:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("mode", ["--resume", "--overwrite"])
def test_a_second_start_on_a_run_in_training_is_refused(trained_runs, tmp_path, held, capsys, mode):
    run = tmp_path / "run"
    shutil.copytree(trained_runs / "nonuniform", run)
    holder = held(run)
    before = tree_digest(tmp_path)
    code = train_main([*TRAIN_FAST, "--target-density", "0.6", "--steps", "12", "--out", str(run), mode])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "is being trained by another process" in err and f"PID {holder.pid}" in err
    assert tree_digest(tmp_path) == before  # nothing moved aside, nothing written, the live run's lock kept


def test_a_dead_holder_leaves_no_lock(tmp_path, held):
    """flock dies with its process (SIGKILL included): the file it leaves locks nothing."""
    run = tmp_path / "run"
    holder = held(run)
    assert "PID" in run_lock.training_now(run)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert run_lock.lock_path(run).exists() and run_lock.training_now(run) is None
    run_lock.acquire(run)
    try:
        assert "this process" in run_lock.training_now(run)
    finally:
        run_lock.release(run)
    assert not run_lock.lock_path(run).exists()


def test_training_holds_the_lock_and_lets_it_go(in_tmp, monkeypatch):
    seen = []
    real = run_lock.acquire

    def spy(out):
        real(out)
        seen.append(run_lock.training_now(out))

    monkeypatch.setattr(run_lock, "acquire", spy)
    assert train_main([*TRAIN_FAST, "--out", "runs/new/r"]) == 0  # its parent did not exist at the start
    assert seen and all("this process" in who for who in seen)
    assert run_lock.training_now(in_tmp / "runs/new/r") is None
    assert sorted(p.name for p in (in_tmp / "runs" / "new").iterdir()) == ["r"]  # no lock file left beside it


def test_export_of_a_run_in_training_says_so():
    report = {"final": {"total_params": 10}, "finished": False, "step": 53, "steps": 80}
    assert "still training (PID 7 on h)" in done_message(report, "x", training="PID 7 on h")
    assert "stopped at step 53 of 80" in done_message(report, "x")


def test_export_inside_a_folder_the_run_replaces_is_refused(trained_runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_runs / "nonuniform", run)
    before = tree_digest(run)
    for inside in ("checkpoint/my_export", "plots", "tokenizer/x"):
        assert export_main([str(run), "--out", str(run / inside)]) == 2
        assert "which the run replaces whole" in capsys.readouterr().err
    assert tree_digest(run) == before
    assert export_main([str(run), "--out", str(run / "exports" / "e")]) == 0  # elsewhere in the run: allowed


def test_export_into_another_runs_checkpoint_is_refused(trained_runs, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(trained_runs / "nonuniform", other)
    before = tree_digest(other)
    for inside in ("checkpoint/my_export", "ranks/e"):  # its next --resume would replace them, the export with them
        assert export_main([str(trained_runs / "nonuniform"), "--out", str(other / inside)]) == 2
        assert f"is inside {other.resolve() / inside.split('/')[0]}, which the run replaces whole" in capsys.readouterr().err
    assert tree_digest(other) == before


def test_an_unreachable_target_is_refused_before_anything_is_written(in_tmp, capsys):
    code = train_main([*TRAIN_FAST, "--target-density", "0.01", "--out", "r"])
    err = capsys.readouterr().err
    assert code == 2 and err.splitlines()[-1].startswith("error: --target-density 0.01 is below")  # after a truncation note
    assert not (in_tmp / "r").exists()


@pytest.mark.parametrize("uniform", [False, True])
def test_the_named_minimum_is_the_smallest_density_that_fits(uniform):
    shape = ModelShape.from_model(build_tiny_model(vocab_size=97, seed=0))
    config = APTConfig(uniform=uniform)
    pruner, budget = AdaptivePruner(config), shape.budget_params(config.count_embeddings)
    check_target_reachable(pruner, shape, 0.7, budget)  # the default fits
    with pytest.raises(PruningError, match=r"at least (0\.\d+)") as info:
        check_target_reachable(pruner, shape, 0.001, budget)
    minimum = float(info.value.args[0].split("at least ")[1].split(" ")[0])
    check_target_reachable(pruner, shape, minimum, budget)  # what the error names does fit
    with pytest.raises(PruningError):
        check_target_reachable(pruner, shape, minimum - 1e-3, budget)


def test_no_check_without_pruning():
    shape = ModelShape.from_model(build_tiny_model(vocab_size=97, seed=0))
    check_target_reachable(AdaptivePruner(APTConfig(prune=False)), shape, 0.001, shape.budget_params(False))


def test_resume_refuses_data_that_gives_other_examples(in_tmp, capsys):
    """The same --data path with other rows, or the same rows packed differently: a resume would
    continue at a position in another example stream."""
    assert train_main([*RUN_FLAGS, "--out", "r"]) == 0
    state = in_tmp / "r" / "checkpoint" / "apt_state.json"
    finished = state.read_text()
    state.write_text(json.dumps({**json.loads(finished), "finished": False}))  # as if stopped at its last checkpoint
    rows = (in_tmp / "data.jsonl").read_text()
    (in_tmp / "data.jsonl").write_text(rows.replace("lazy dog number 7.", "lazy cat number 7."))
    before = tree_digest(in_tmp / "r")
    capsys.readouterr()
    assert train_main([*RUN_FLAGS, "--out", "r", "--resume"]) == 2
    assert "no longer gives the examples the run was trained on" in capsys.readouterr().err
    (in_tmp / "data.jsonl").write_text(rows)
    assert train_main([*RUN_FLAGS, "--out", "r", "--resume", "--no-pack"]) == 2
    assert "--no-pack" in capsys.readouterr().err
    assert tree_digest(in_tmp / "r") == before
    assert train_main([*RUN_FLAGS, "--out", "r", "--resume"]) == 0  # the data as it was: it resumes
    assert json.loads(state.read_text())["finished"]
    (in_tmp / "data.jsonl").write_text(rows.replace("lazy dog number 7.", "lazy cat number 7."))
    capsys.readouterr()
    assert train_main([*RUN_FLAGS, "--out", "r", "--resume"]) == 0  # a finished run trains no more, whatever the data
    assert "already finished" in capsys.readouterr().out


def test_a_warm_up_longer_than_the_run_is_refused(in_tmp, capsys):
    assert train_main([*RUN_FLAGS, "--warmup-steps", "8", "--out", "r"]) == 2
    assert "--warmup-steps (8) must be < steps (8)" in capsys.readouterr().err
    assert not (in_tmp / "r").exists()


def test_lora_says_which_typed_apt_settings_it_does_not_use(monkeypatch, capsys):
    """A recipe's APT values stay quiet (its LoRA baseline is --config R --method lora)."""
    from apt_ds.cli.arguments import RunArguments
    from apt_ds.cli.train import note_what_lora_ignores

    note_what_lora_ignores(RunArguments(method="lora"), {"target_density": 0.5, "distill": False, "lr": 1e-3})
    assert capsys.readouterr().err.strip() == "note: --method lora does not prune, grow ranks or distill: --target-density 0.5 not used"
    note_what_lora_ignores(RunArguments(method="apt"), {"target_density": 0.5})
    assert capsys.readouterr().err == ""


def test_the_lock_is_the_real_directorys(trained_runs, tmp_path, held, capsys):
    """A symbolic link or `..` in --out names the same run, and so the same lock."""
    run = tmp_path / "run"
    shutil.copytree(trained_runs / "nonuniform", run)
    (tmp_path / "link").symlink_to(run)
    (tmp_path / "x").mkdir()
    held(run)
    for spelled in (tmp_path / "link", tmp_path / "x" / ".." / "run"):
        assert train_main([*TRAIN_FAST, "--target-density", "0.6", "--out", str(spelled), "--resume"]) == 2
        assert "is being trained by another process" in capsys.readouterr().err
        assert run_lock.training_now(spelled)


def test_ranks_of_mpirun_and_srun_do_not_lock(monkeypatch):
    """Only global rank 0 holds the run: under mpirun or srun with --deepspeed RANK is set later, from
    their variables; without --deepspeed each of their tasks is a one-process run of its own."""
    from apt_ds.cli.errors import launcher_rank

    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert launcher_rank(deepspeed=True) == "0"
    for name in ("OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMI_RANK"):
        monkeypatch.setenv(name, "1")
        assert launcher_rank(deepspeed=True) == "1" and launcher_rank() == "0"
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("RANK", "0")  # set by the deepspeed launcher or torchrun: it wins
    assert launcher_rank(deepspeed=True) == "0"


def test_a_probes_brief_shared_lock_is_waited_out(tmp_path):
    """Export asks with a shared lock held for microseconds: a start at that instant is not refused."""
    import threading

    run = tmp_path / "run"
    run_lock.acquire(run)
    path = run_lock.lock_path(run)
    run_lock.release(run)
    path.touch()
    probe = os.open(path, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH)
    threading.Timer(0.08, os.close, [probe]).start()  # let go while acquire retries
    try:
        run_lock.acquire(run)
        assert "this process" in run_lock.training_now(run)
    finally:
        run_lock.release(run)


def test_a_directory_locked_run_refuses_a_start_that_can_make_the_file(tmp_path):
    """A start that could not make the lock file locked the directory; one that can make it must still see that."""
    run = tmp_path / "run"
    run.mkdir()
    handle = os.open(run, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(handle, fcntl.LOCK_EX)  # as the other start's fallback holds it
    try:
        assert run_lock.training_now(run) == "the run directory is locked; its PID is not recorded"
        with pytest.raises(run_lock.RunLockedError, match="the run directory is locked"):
            run_lock.acquire(run)
        assert run_lock.training_now(run)  # the file it made does not hide the directory's lock
    finally:
        os.close(handle)
    run_lock.acquire(run)
    run_lock.release(run)


def test_a_lock_file_that_cannot_be_removed_is_left_locking_nothing(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run_lock.acquire(run)

    def refuse(self, missing_ok=False):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "unlink", refuse)
    run_lock.release(run)  # no exception: the run's own error or result stays what the user sees
    monkeypatch.undo()
    assert run_lock.lock_path(run).exists() and run_lock.training_now(run) is None


def test_a_pid_no_process_can_have_is_not_alive():
    assert not run_lock.pid_alive(99999999999) and not run_lock.pid_alive(0) and not run_lock.pid_alive(-1)
    assert run_lock.pid_alive(os.getpid()) and run_lock.pid_alive(1)


def test_a_left_lock_file_never_names_its_dead_owner(tmp_path, monkeypatch):
    """A holder that could open the lock file only read-only (another user's, left by a killed run)
    cannot write its own line: a refusal must not name the earlier owner, which has ended."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    run = tmp_path / "run"
    path = run_lock.lock_path(run)
    dead_line = f"PID {ended.stdout.strip()} on {host}, since 2026-01-01 00:00:00"
    for line, shown in ((dead_line, "its PID is not recorded"),
                        (f"PID {os.getpid()} on {host}, since 2026-01-01 00:00:00", f"PID {os.getpid()} on {host}"),
                        ("PID 12 on another-node, since 2026-01-01 00:00:00", "PID 12 on another-node")):  # cannot be asked
        path.write_text(line)
        assert run_lock._owner(path).startswith(shown)
    real_open = os.open

    def read_only(name, flags, *args):  # the file is another user's: it opens for reading only
        if Path(name) == path and flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(13, "Permission denied")
        return real_open(name, flags, *args)

    path.write_text(dead_line)
    monkeypatch.setattr(os, "open", read_only)
    run_lock.acquire(run)
    monkeypatch.undo()
    try:
        assert path.read_text() == dead_line  # it could not write its own line
        second = "from apt_ds.io import run_lock\ntry:\n    run_lock.acquire({!r})\nexcept run_lock.RunLockedError as e:\n    print(e)"
        refused = subprocess.run([sys.executable, "-c", second.format(str(run))], capture_output=True, text=True, cwd=REPO)
        assert "is being trained by another process (its PID is not recorded)" in refused.stdout, refused.stderr
    finally:
        run_lock.release(run)


def test_without_a_file_beside_out_the_run_directory_is_locked(tmp_path, monkeypatch):
    """A writable run directory in a read-only parent (a container volume): the directory itself is locked."""
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setattr(run_lock, "lock_path", lambda out, kind="train": tmp_path / "read-only" / f".run.{kind}.lock")  # cannot be made
    run_lock.acquire(run)
    try:
        other = os.open(run, os.O_RDONLY | os.O_DIRECTORY)
        with pytest.raises(BlockingIOError):  # another open of the directory, as a second process's
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(other)
    finally:
        run_lock.release(run)
    assert run_lock.training_now(run) is None


def test_a_file_system_without_locks_trains_unlocked_and_says_so(in_tmp, monkeypatch, capsys):
    def no_locks(handle, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    import types

    monkeypatch.setattr(run_lock, "fcntl", types.SimpleNamespace(**{**vars(fcntl), "flock": no_locks}))  # run_lock's only
    assert train_main([*RUN_FLAGS, "--out", "r"]) == 0
    assert capsys.readouterr().err.count("cannot lock") == 1  # said once, not again by prepare_out_dir
    assert sorted(p.name for p in in_tmp.iterdir()) == ["data.jsonl", "r"]  # no lock file left


def test_out_root_is_one_line(capsys):
    assert train_main([*TRAIN_FAST, "--out", "/"]) == 2
    assert capsys.readouterr().err.startswith("error: --out / ")


def test_prepare_out_dir_locks_before_it_moves_anything(trained_runs, tmp_path, held):
    """A start whose --out had no parent at its beginning locks in prepare_out_dir: a concurrent
    start that got there first keeps its run where it is."""
    from apt_ds.io.run_dir import prepare_out_dir

    run = tmp_path / "new" / "run"
    shutil.copytree(trained_runs / "nonuniform", run)
    held(run)
    before = tree_digest(tmp_path)
    with pytest.raises(run_lock.RunLockedError):
        prepare_out_dir(run, resume=False, overwrite=True, is_main=True)
    assert tree_digest(tmp_path) == before and sorted(p.name for p in run.parent.iterdir()) == [".run.train.lock", "run"]
