"""benchmarks/gpu_check.py and benchmarks/step_profile.py, run through their CPU flow (the GPU
numbers they produced: docs/BENCHMARKS.md, "On a GPU")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from apt_ds.io.metrics import memory_mb

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_check


def test_cpu_flow_trains_exports_and_profiles(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    code = gpu_check.main(["--device", "cpu", "--scale", "small", "--scale-seq-len", "32", "--scale-steps", "8", "--scale-micro-batch", "2",
                           "--scale-backends", "local", "--profile", "--out", str(out), "--work", str(work),
                           "--skip", "local-auto", "zero3", "zero2",
                           "--budget-s", "3600"])  # the default (480 s) fits a GPU lease, not a loaded 2-core machine
    stages = {s["stage"]: s for s in json.loads((out / "gpu_check.json").read_text())["stages"]}
    assert code == 0 and list(stages) == ["env", "local-fp32", "scale-apt-local", "scale-export", "scale-lora-local"]
    assert all(s["ok"] for s in stages.values())
    tiny = stages["local-fp32"]
    assert tiny["max_logit_diff"] <= 1e-3 and tiny["greedy_matches"] and tiny["greedy_tokens_matching"] == 20
    apt, lora = stages["scale-apt-local"], stages["scale-lora-local"]
    assert apt["event_steps"] == [4, 6, 8] and abs(apt["density"] - 0.7) < 0.05 and lora["density"] == 1.0
    assert apt["total_params"] < lora["total_params"] and len(apt["step_time_s"]) == 8
    assert (apt["micro_batch"], apt["profiled_steps"]) == (2, [5, 7])
    assert stages["scale-export"]["greedy_matches"]
    for method in ("apt", "lora"):  # the profiled run's last steps: wall times and the operator table
        table = (out / f"profile_{method}_local.txt").read_text()
        assert "profiled steps [5, 7), each with what follows it" in table and "aten::mm" in table
        assert "== operators by self CPU time" in table
        assert "optimizer steps inside the profile: 2\n" in table  # both steps, not only the first
    assert "$ " in (out / "gpu_check.log").read_text()  # every subprocess's command and output


def test_a_failing_stage_is_recorded_and_the_next_one_runs(tmp_path):
    check = gpu_check.Check(tmp_path / "out", tmp_path / "work", "cpu", budget_s=60)

    def broken():
        raise ValueError("planted")

    check.stage("broken", broken)
    check.stage("fine", lambda: {"value": 1})
    stages = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["stages"]
    assert [(s["stage"], s["ok"]) for s in stages] == [("broken", False), ("fine", True)]
    assert "planted" in stages[0]["error"] and "traceback" in stages[0] and stages[1]["value"] == 1


def test_a_failing_command_reports_its_output(tmp_path):
    check = gpu_check.Check(tmp_path / "out", tmp_path / "work", "cpu", budget_s=60)
    result = check.stage("fails", lambda: check.sh([sys.executable, "-c", "print('said this'); raise SystemExit(3)"]))
    assert not result["ok"] and "exited 3" in result["error"] and "said this" in result["error"]


def test_memory_record_has_cuda_fields_only_once_cuda_is_in_use(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    record = memory_mb()
    assert record["rss_mb"] > 0 and "cuda_mb" not in record and "cuda_peak_mb" not in record
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 5 * 2**20)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    assert "cuda_interval_peak_mb" not in memory_mb() and memory_mb()["cuda_peak_mb"] >= 5.0
    record = memory_mb(interval=True)
    assert (record["cuda_mb"], record["cuda_interval_peak_mb"]) == (3.0, 5.0) and record["cuda_peak_mb"] >= 5.0


def test_unknown_stage_names_and_profile_windows_outside_the_run_are_refused(tmp_path, capsys):
    for argv, message in ((["--skip", "zero4"], "no stage named zero4"),
                          (["--profile", "--profile-steps", "4", "30"], "--profile-steps needs --profile and"),
                          (["--profile-steps", "4", "6"], "--profile-steps needs --profile and")):
        with pytest.raises(SystemExit):
            gpu_check.main(["--device", "cpu", "--out", str(tmp_path), *argv])
        assert message in capsys.readouterr().err


@pytest.mark.slow  # ~35 s of four short runs; the CPU flow above runs the script end to end by default
def test_recipe_schedule_repeats_alternate_and_summarise_ratios(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    code = gpu_check.main(["--device", "cpu", "--scale", "small", "--scale-seq-len", "32", "--scale-steps", "12", "--scale-micro-batch", "2",
                           "--scale-backends", "local", "--scale-schedule", "recipe", "--scale-repeats", "2", "--out", str(out),
                           "--work", str(work), "--skip", "local-fp32", "local-auto", "zero3", "zero2"])
    record = json.loads((out / "gpu_check.json").read_text())
    stages = {s["stage"]: s for s in record["stages"]}
    # the second repeat runs LoRA first; a recipe run saves no probe, so nothing is exported
    assert code == 0 and list(stages) == ["env", "scale-apt-local", "scale-lora-local", "scale-lora-local-2", "scale-apt-local-2"]
    apt = stages["scale-apt-local"]
    run = json.loads((work / "scale-apt-local" / "run.json").read_text())["apt_config"]
    assert (run["pruning_start_step"], run["pruning_end_step"]) == (1, 6)  # apt-ds train's own schedule for 12 steps
    phases = apt["phases"]
    assert sum(phases[p]["steps"] for p in ("warmup", "pruning", "pruning_teacher", "recovery") if p in phases) == 12
    assert phases["recovery"]["steps"] == 6 and phases["events_sum_s"] > 0 and len(apt["event_time_s"]) == len(apt["event_steps"])
    assert len(apt["final_ffn"]) == len(apt["final_kv_groups"]) == 4 and apt["final_hidden"] <= 512  # the small model's shape
    assert stages["scale-lora-local"]["final_ffn"] == [1408] * 4
    parts = [phases[f"events_{part}_sum_s"] for part in gpu_check.EVENT_PARTS]
    # each sum is rounded to 1 ms: five of them may exceed the rounded total by up to 3 ms
    assert all(value >= 0 for value in parts) and 0 < sum(parts) <= phases["events_sum_s"] + 3e-3
    assert set(stages["scale-lora-local"]["phases"]) - {f"events_{part}_sum_s" for part in gpu_check.EVENT_PARTS} == {"warmup", "pruning", "recovery", "events_sum_s", "mask_refresh_sum_s"}
    ratios = record["summary"]["apt_over_lora"]["local"]
    assert len(ratios["train_time"]) == 2 and ratios["train_time_median"] > 0 and len(ratios["recovery_step"]) == 2


def test_skip_names_every_repeat_of_a_scale_run(tmp_path):
    out = tmp_path / "out"
    code = gpu_check.main(["--device", "cpu", "--scale", "small", "--scale-seq-len", "32", "--scale-steps", "8", "--scale-micro-batch", "2",
                           "--scale-backends", "local", "--scale-schedule", "recipe", "--scale-repeats", "2", "--out", str(out),
                           "--work", str(tmp_path / "work"), "--skip", "env", "local-fp32", "local-auto", "zero3", "zero2", "scale-apt-local"])
    record = json.loads((out / "gpu_check.json").read_text())
    assert code == 0 and [s["stage"] for s in record["stages"]] == ["scale-lora-local", "scale-lora-local-2"]
    assert "summary" not in record  # no APT run to pair with


def test_sync_sites_counts_sync_warnings_by_the_innermost_apt_ds_line(recwarn):
    """step_profile's sync count (GPU only, so the torch side is faked here): warnings of the sync
    debug mode are counted by the innermost apt_ds frame, every occurrence, and only while on;
    other warnings pass through, and the mode and the warning machinery are restored afterwards."""
    import traceback
    import warnings

    import step_profile

    frame = traceback.FrameSummary
    inner = step_profile.PACKAGE_DIR + "training/trainer.py"
    stack = [frame("/x/launch.py", 3, "main"), frame(inner, 42, "_log"), frame("/torch/_tensor.py", 9, "item")]
    assert step_profile.sync_site(stack) == "apt_ds/training/trainer.py:42 (_log)"
    assert step_profile.sync_site(stack[:1]) == "/x/launch.py:3 (main)"  # no apt_ds frame: the innermost
    sibling = step_profile.PACKAGE_DIR.rstrip("/") + "_old/x.py"  # apt_ds_old/ is not apt_ds/
    assert step_profile.sync_site([frame(sibling, 1, "f")]) == f"{sibling}:1 (f)"

    modes = []
    sites = step_profile.SyncSites(lambda: 0, modes.append)
    shown = warnings.showwarning
    message = step_profile.SyncSites.MESSAGE
    warnings.warn(message)  # before counting: not counted
    sites.on()
    for _ in range(3):
        warnings.warn(message)  # the same line three times: three waits
    warnings.warn("something else")  # passes through to the previous handler
    sites.on()  # already on: nothing changes
    warnings.warn(message)
    sites.off()
    sites.off()  # already off: nothing changes
    warnings.warn(message)  # after: not counted
    assert modes == ["warn", 0] and warnings.showwarning is shown
    assert sum(sites.counts.values()) == 4 and len(sites.counts) == 2
    assert all("test_bench_gpu_check.py" in site for site in sites.counts)  # no apt_ds frame here: this file
    assert sites.report().startswith("host waits for the device (synchronising operations) inside the profiled "
                                     "steps, counted while CUDA was in use: 4\n")
    assert [str(w.message) for w in recwarn] == [message, "something else", message]


def test_profiled_steps_count_their_own_host_waits_only(tmp_path, monkeypatch):
    """profiled_train switches the count on for each profiled step and what follows it, and off
    for the logging, progress bar and checkpoints between steps; the table reports it."""
    import warnings

    import step_profile

    from apt_ds.training.trainer import APTrainer

    message = step_profile.SyncSites.MESSAGE
    train_step, log = APTrainer._train_step, APTrainer._log

    def step_that_waits(self, batches):
        warnings.warn(message)
        return train_step(self, batches)

    def log_that_waits(self, record):
        warnings.warn(message)
        return log(self, record)

    monkeypatch.setattr(APTrainer, "_train_step", step_that_waits)
    monkeypatch.setattr(APTrainer, "_log", log_that_waits)
    modes = []
    sites = step_profile.SyncSites(lambda: 0, modes.append)
    table = tmp_path / "profile.txt"
    argv = ["--device", "cpu", "--steps", "8", "--max-seq-len", "32", "--micro-batch-size", "2", "--out", str(tmp_path / "run")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the waits of the steps outside the window
        assert step_profile.profiled_train(argv, 5, 7, table, syncs=sites) == 0
    assert modes == ["warn", 0, "warn", 0]  # on and off once per profiled step
    assert sum(sites.counts.values()) == 2  # the two steps' own waits, not the logging after them
    assert "counted while CUDA was in use: 2\n" in table.read_text()


@pytest.mark.parametrize("attention", ["no-cudnn", "cudnn"])
def test_attention_choice_reaches_the_training_command(tmp_path, monkeypatch, attention):
    args = gpu_check.argparse.Namespace(scale="small", scale_seq_len=32, scale_micro_batch=2, scale_steps=8,
                                        scale_schedule="recipe", scale_timeout=60, profile_steps=None,
                                        attention=attention)
    check = gpu_check.Check(tmp_path / "out", tmp_path / "work", "cpu", budget_s=60)
    commands = []

    def capture(command, timeout=None):
        commands.append(command)
        raise RuntimeError("captured")

    monkeypatch.setattr(check, "sh", capture)
    result = check.stage("scale-apt-local", lambda: gpu_check.scale_stage(check, args, "apt", "local"))
    assert not result["ok"] and "captured" in result["error"]
    (command,) = commands
    assert command[1] == "launch/train.py" and "--method" in command
    assert ("--cudnn-attention" in command) == (attention == "cudnn")
