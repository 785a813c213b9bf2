"""launch/train.py --resume end to end: what a resumed run must keep, and the one line that names
what changed."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import RUN_FLAGS as BASE
from conftest import TRAIN_FAST as FAST
from conftest import interrupted_after_step, interrupted_at

from apt_ds.cli.train import main as train_main
from apt_ds.io import checkpoint_save as checkpoint_module
from apt_ds.io.metrics import read_metrics
from apt_ds.io.run_dir import check_replaceable


def _disk_full(tensors, path):  # stands in for safetensors' save_file on a full disk
    raise OSError(28, "No space left on device")


def test_resume_of_a_lora_run_without_method_lora_says_so(tmp_path, capsys):
    run = tmp_path / "lora"
    assert train_main([*FAST, "--method", "lora", "--out", str(run)]) == 0
    assert train_main([*FAST, "--resume", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert "(it was trained with --method lora: pass --method lora)" in err and "--prune" not in err


def test_resume_of_an_apt_run_with_method_lora_says_so(trained_runs, capsys):
    """--method lora overrides the pruning flags, so the method is named, with the run's density: not
    the default, --method apt alone would not restore it."""
    assert train_main([*FAST, "--method", "lora", "--resume", "--out", str(trained_runs / "nonuniform")]) == 2
    assert capsys.readouterr().err.rstrip().endswith("(it was trained with --method apt: pass --method apt --target-density 0.6)")


def test_the_method_is_read_from_the_run_not_guessed(tmp_path, capsys):
    """An APT run without pruning or rank growth looks like LoRA by its settings; the run records
    its method, so a resume that adds them back is told to pass the two flags, not --method lora
    (which would also turn distillation off and could never match)."""
    run = tmp_path / "plain"
    assert train_main([*FAST, "--prune", "false", "--grow-ranks", "false", "--out", str(run)]) == 0
    assert train_main([*FAST, "--resume", "--out", str(run)]) == 2
    assert capsys.readouterr().err.rstrip().endswith("(pass --grow-ranks false --prune false)")
    # back to APT, --method apt alone would not restore what was not the default
    assert train_main([*FAST, "--method", "lora", "--resume", "--out", str(run)]) == 2
    advice = "(it was trained with --method apt: pass --method apt --grow-ranks false --prune false)"
    assert capsys.readouterr().err.rstrip().endswith(advice)
    assert train_main([*FAST, "--method", "apt", "--grow-ranks", "false", "--prune", "false", "--resume", "--out", str(run)]) == 0


def test_a_changed_steps_names_neither_the_schedule_nor_the_warmup_it_derives(trained_runs, capsys):
    """--steps 100 instead of 8 also moves the default warm-up (5% of the steps) and the pruning
    schedule: the one flag to fix is --steps."""
    argv = [*FAST[:-2], "--steps", "100", "--target-density", "0.6", "--resume", "--out", str(trained_runs / "nonuniform")]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: --resume must use the run's training settings; changed: steps: 8 -> 100 (pass --steps 8)"


def test_resume_of_a_finished_run_changes_nothing(trained_runs, capsys):
    metrics = (trained_runs / "nonuniform" / "metrics.jsonl").read_bytes()
    assert train_main([*FAST, "--target-density", "0.6", "--resume", "--out", str(trained_runs / "nonuniform")]) == 0
    assert "already finished" in capsys.readouterr().out
    assert (trained_runs / "nonuniform" / "metrics.jsonl").read_bytes() == metrics
    # a changed APT setting is refused, finished or not, not ignored
    assert train_main([*FAST, "--target-density", "0.5", "--resume", "--out", str(trained_runs / "nonuniform")]) == 2
    err = capsys.readouterr().err
    assert "used a different APT config; changed: target_density: 0.6 -> 0.5 (pass --target-density 0.6)" in err
    assert "already finished" not in err
    assert "--method lora" not in err
    assert (trained_runs / "nonuniform" / "metrics.jsonl").read_bytes() == metrics


def test_resume_with_changed_training_settings_is_refused(trained_runs, capsys):
    assert train_main([*FAST, "--target-density", "0.6", "--seed", "5", "--resume", "--out", str(trained_runs / "nonuniform")]) == 2
    assert "seed: 0 -> 5" in capsys.readouterr().err


def test_resume_of_a_run_from_before_gradient_clipping(trained_runs, tmp_path, capsys):
    """A checkpoint without max_grad_norm was trained unclipped on one process: resuming asks
    for --max-grad-norm 0 instead of silently clipping the rest of the run."""
    old = tmp_path / "old"
    shutil.copytree(trained_runs / "nonuniform", old)
    state = old / "checkpoint" / "apt_state.json"
    meta = json.loads(state.read_text())
    del meta["train_config"]["max_grad_norm"]
    state.write_text(json.dumps(meta))
    assert train_main([*FAST, "--target-density", "0.6", "--resume", "--out", str(old)]) == 2
    assert "max_grad_norm: 0.0 -> 1.0 (pass --max-grad-norm 0.0)" in capsys.readouterr().err
    assert train_main([*FAST, "--target-density", "0.6", "--max-grad-norm", "0", "--resume", "--out", str(old)]) == 0
    assert "already finished" in capsys.readouterr().out


def test_resume_writes_an_unreadable_run_json_again(trained_runs, tmp_path, capsys):
    """run.json marks the directory as a run (what --overwrite may replace) and plot reads it; a torn
    one used to stay torn through every resume. A kill while it is written leaves run.json.tmp,
    which the run's directory may hold (--overwrite still takes it)."""
    torn = tmp_path / "torn"
    shutil.copytree(trained_runs / "nonuniform", torn)
    whole = json.loads((torn / "run.json").read_text())
    (torn / "run.json").write_text('{"model": ')
    assert train_main([*FAST, "--target-density", "0.6", "--resume", "--out", str(torn)]) == 0
    again = json.loads((torn / "run.json").read_text())
    assert again["apt_config"] == whole["apt_config"] and again["train_config"] == whole["train_config"]
    assert not [p.name for p in torn.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp")]  # none left
    (torn / "run.json.tmp").write_text('{"mod')  # what a kill mid-write leaves
    check_replaceable(torn)


def test_clipping_of_deepspeed_runs_from_before_max_grad_norm(tmp_path):
    from apt_ds.training.resume import clipping_before_max_grad_norm as _clipping_before_max_grad_norm

    own = tmp_path / "ds.json"
    own.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 0.3}))
    default = tmp_path / "default.json"
    default.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert _clipping_before_max_grad_norm({"deepspeed": str(own)}) == 0.3
    assert _clipping_before_max_grad_norm({"deepspeed": str(default)}) == 1.0  # DeepSpeed's default
    assert _clipping_before_max_grad_norm({"deepspeed": str(tmp_path / "gone.json")}) == 1.0
    assert _clipping_before_max_grad_norm({"deepspeed": None}) == 0.0


def test_resume_with_another_split_of_the_global_batch(tmp_path, capsys):
    """Crash after the step-4 checkpoint, resume with micro 1 x accumulation 2 instead of micro 2:
    same global batch, so the same data and the same decisions as the uninterrupted run. A
    different global batch is refused."""
    common = [*FAST, "--target-density", "0.6", "--checkpoint-every", "4"]
    assert train_main([*common, "--out", str(tmp_path / "whole")]) == 0
    with interrupted_after_step(5):
        assert train_main([*common, "--out", str(tmp_path / "split")]) == 130  # Ctrl-C: one line, no traceback
    assert "interrupted; --resume continues" in capsys.readouterr().err
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


def test_resume_rewrites_a_damaged_export_copy(tmp_path, monkeypatch, capsys):
    """A resume reads engine/, not checkpoint/trainable.safetensors (what export reads): a truncated
    copy used to stay until the next checkpoint, so export failed on a run that trained on. The
    resume rewrites it from the restored weights, to the tensor what the checkpoint held."""
    from safetensors.torch import load_file

    from apt_ds.training.trainer import APTrainer

    common = [*FAST, "--target-density", "0.6", "--checkpoint-every", "4"]
    run = tmp_path / "run"
    monkeypatch.setattr(APTrainer, "_train_step", interrupted_at(5))
    assert train_main([*common, "--out", str(run)]) == 130
    copy = run / "checkpoint" / "trainable.safetensors"
    saved = {k: v.clone() for k, v in load_file(str(copy)).items()}  # load_file maps the file we then tear
    copy.write_bytes(copy.read_bytes()[:-64])  # torn by a full disk or a copy that stopped
    monkeypatch.setattr(APTrainer, "_train_step", interrupted_at(6))  # before the next checkpoint rewrites it
    real_save = checkpoint_module.save_file

    monkeypatch.setattr(checkpoint_module, "save_file", _disk_full)  # a rewrite that fails lets training go on
    capsys.readouterr()
    assert train_main([*common, "--resume", "--out", str(run)]) == 130
    assert "could not rewrite it ([Errno 28] No space left on device); the next checkpoint will" in capsys.readouterr().err
    assert not list((run / "checkpoint").glob("*.tmp"))
    monkeypatch.setattr(checkpoint_module, "save_file", real_save)
    assert train_main([*common, "--resume", "--out", str(run)]) == 130
    assert "trainable.safetensors was unreadable (the export's copy of the weights" in capsys.readouterr().err
    again = load_file(str(copy))
    assert again.keys() == saved.keys() and all(torch.equal(again[k], saved[k]) for k in saved)
    assert not list((run / "checkpoint").glob("*.tmp"))


def test_resume_of_a_finished_run_rewrites_a_damaged_export_copy(trained_runs, tmp_path, capsys):
    """A finished run is not trained again, but export reads its copy of the weights: --resume
    restores them from engine/ and rewrites a torn copy, then says the run is finished."""
    from safetensors.torch import load_file

    run = tmp_path / "finished"
    shutil.copytree(trained_runs / "nonuniform", run)
    copy = run / "checkpoint" / "trainable.safetensors"
    saved = {k: v.clone() for k, v in load_file(str(copy)).items()}  # load_file maps the file we then tear
    copy.write_bytes(copy.read_bytes()[: len(copy.read_bytes()) // 2])
    metrics, state = (run / "metrics.jsonl").read_bytes(), (run / "checkpoint" / "apt_state.json").read_bytes()

    # no later checkpoint will write the copy of a finished run: a failed rewrite is an error
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint_module, "save_file", _disk_full)
        assert train_main([*FAST, "--target-density", "0.6", "--resume", "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and err.endswith("could not be rewritten from " + str(run / "checkpoint" / "engine") +
                        " ([Errno 28] No space left on device); free space, then run --resume again")
    assert train_main([*FAST, "--target-density", "0.6", "--resume", "--out", str(run)]) == 0
    captured = capsys.readouterr()
    assert "rewritten from the restored weights" in captured.err and "already finished" in captured.out
    again = load_file(str(copy))
    assert again.keys() == saved.keys() and all(torch.equal(again[k], saved[k]) for k in saved)
    assert (run / "metrics.jsonl").read_bytes() == metrics  # nothing trained
    assert (run / "checkpoint" / "apt_state.json").read_bytes() == state and not list((run / "checkpoint").glob("*.tmp"))


def test_resume_from_a_different_model_is_refused(trained_runs, tmp_path, capsys, monkeypatch):
    """...before the weights are read: the fingerprint of a safetensors directory comes from its files."""
    from conftest import tiny_llama

    import apt_ds.training.run as run

    other = tmp_path / "other-model"
    tiny_llama("gqa", vocab=512).save_pretrained(str(other))
    for item in (trained_runs / "nonuniform" / "tokenizer").iterdir():
        shutil.copy2(item, other / item.name)
    state = (trained_runs / "nonuniform" / "checkpoint" / "apt_state.json").read_bytes()
    loads = []
    monkeypatch.setattr(run, "load_model", lambda *args, **kwargs: loads.append(args))
    assert train_main([*FAST, "--target-density", "0.6", "--model", str(other), "--resume", "--out", str(trained_runs / "nonuniform")]) == 2
    err = capsys.readouterr().err
    assert "--resume: --model" in err and "is not the model this run was trained from" in err
    assert loads == []
    assert (trained_runs / "nonuniform" / "checkpoint" / "apt_state.json").read_bytes() == state


def test_resume_without_checkpoint_is_refused(tmp_path, capsys):
    assert train_main([*FAST, "--resume", "--out", str(tmp_path / "fresh")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_torn_metrics_line_and_changed_data_on_resume(tmp_path, capsys):
    from apt_ds.training.resume import truncate_metrics

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


def test_resume_accepts_the_same_data_spelled_another_way(in_tmp, tmp_path, capsys, monkeypatch):
    assert train_main([*BASE, "--out", "run"]) == 0
    argv = [a if a != "data.jsonl" else "./data.jsonl" for a in BASE]
    assert train_main([*argv, "--out", "run", "--resume"]) == 0
    argv = [a if a != "data.jsonl" else str(tmp_path / "data.jsonl") for a in BASE]
    assert train_main([*argv, "--out", "run", "--resume"]) == 0
    elsewhere = tmp_path / "elsewhere"  # the same file from another directory: the resolved path was recorded
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    argv = [a if a != "data.jsonl" else "../data.jsonl" for a in BASE]
    assert train_main([*argv, "--out", "../run", "--resume"]) == 0
    monkeypatch.chdir(tmp_path)
    (tmp_path / "other.jsonl").write_text((tmp_path / "data.jsonl").read_text())
    argv = [a if a != "data.jsonl" else "other.jsonl" for a in BASE]
    assert train_main([*argv, "--out", "run", "--resume"]) == 2
    assert "the run was trained on --data data.jsonl, not other.jsonl" in capsys.readouterr().err


def test_resume_under_the_other_backend_is_one_line_before_the_model_loads(in_tmp, tmp_path):
    from apt_ds.config import TrainConfig
    from apt_ds.training.resume import check_resumable_settings

    assert train_main([*BASE, "--out", "run"]) == 0
    meta = json.loads((tmp_path / "run" / "checkpoint" / "apt_state.json").read_text())
    train = TrainConfig.from_dict(meta["train_config"])
    with pytest.raises(checkpoint_module.CheckpointError, match="trained in one process, without DeepSpeed; resume it without --deepspeed"):
        check_resumable_settings(meta, train, meta["run_info"]["data"], 1, deepspeed="ds_configs/zero2.json")
    meta["run_info"]["deepspeed"] = "ds_configs/zero3.json"
    with pytest.raises(checkpoint_module.CheckpointError, match=r"under DeepSpeed \(ds_configs/zero3.json\); resume it with"):
        check_resumable_settings(meta, train, meta["run_info"]["data"], 1, deepspeed=None)
