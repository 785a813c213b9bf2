"""benchmarks/quality.py end to end on the tiny model: parallel workers, every method kind,
the aggregated table and targets. The real benchmark needs SmolLM2 and an hour; this keeps
the script from rotting when apt_ds changes under it (an import moved, a result key renamed)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from apt_ds.io.modeling import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
# single tokens in the tiny tokenizer (yes/no are not): the one-forward scorer, the real
# benchmark's path, is then used and checked against label_accuracy on every model
LABELS = ("a", "the")


def _write_task(task_dir: Path, rows: int, seed: int) -> None:
    rng = random.Random(seed)
    words = "the quick brown fox jumps over the lazy dog is it".split()
    task_dir.mkdir(parents=True)
    (task_dir / "task.json").write_text(json.dumps({"name": "sst2", "labels": list(LABELS), "prompt_style": "compact"}))
    for split, n in (("train", rows), ("test", rows // 2)):
        lines = []
        for _ in range(n):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
            # prepare_tasks.py's default (compact) record format
            lines.append(json.dumps({"prompt": f"{text}\nAnswer (a or the):\n", "completion": rng.choice(LABELS)}))
        (task_dir / f"{split}.jsonl").write_text("\n".join(lines) + "\n")


def test_quality_benchmark_runs_every_method_on_the_tiny_model(tmp_path, tokenizer):
    model_dir = tmp_path / "tiny"
    build_tiny_model(vocab_size=len(tokenizer), seed=0).save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    _write_task(tmp_path / "tasks" / "sst2", rows=40, seed=0)
    out = tmp_path / "out"
    methods = ["zero_shot", "lora", "apt_0.7", "ptt_0.7", "apt_0.5_uniform"]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--model", str(model_dir), "--tasks-dir", str(tmp_path / "tasks"),
           "--tasks", "sst2", "--methods", *methods, "--steps", "8", "--max-seq-len", "32", "--eval-examples", "12",
           "--calibration-batches", "2", "--check-rows", "4", "--speed-rounds", "1", "--new-tokens", "4", "--prompt-len", "8",
           "--adapter-targets", "q_proj", "v_proj", "o_proj", "--jobs", "2", "--out", str(out), "--img-dir", str(out / "img")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]

    starts = [line.split(":")[0].split()[-1] for line in proc.stdout.splitlines() if line.endswith(")") and ": start (" in line]
    assert starts[:2] == ["sst2/lora", "sst2/apt_0.7"]  # the target pair starts together
    summary = json.loads((out / "results.json").read_text())
    rows = summary["tasks"]["sst2"]
    assert sorted(rows) == sorted(methods)
    for method, row in rows.items():
        assert 0.0 <= row["accuracy"] <= 1.0, method
    assert rows["lora"]["density"] == pytest.approx(1.0)
    for method in ("lora", "apt_0.7", "ptt_0.7"):  # --adapter-targets reaches every trained method
        assert rows[method]["apt_config"]["adapter_targets"] == ["q_proj", "v_proj", "o_proj"], method
    for method, target in (("apt_0.7", 0.7), ("ptt_0.7", 0.7), ("apt_0.5_uniform", 0.5)):
        assert rows[method]["density"] < 0.95, method  # something was pruned and exported
        assert abs(rows[method]["density"] - target) < 0.15, (method, rows[method]["density"])
        assert rows[method]["export_bytes_vs_lora"] < 1.0
        assert rows[method]["speed"]["decode_tokens_per_s"] > 0
    assert rows["apt_0.5_uniform"]["stock_loadable"] is True
    for method in ("lora", "apt_0.7"):  # the recovery-phase window was measured from the last event on
        memory = rows[method]["memory_method"]
        assert memory["peak_reset_supported"] is True
        assert memory["post_event_reset_step"] == memory["last_event_step"]
        assert rows[method]["peak_rss_after_last_event_mb"] > 0
    for method, row in rows.items():  # the fast scorer agreed with label_accuracy on every model, pruned too
        assert row["eval_rows"] == 12
        assert row["scorer_check"]["rows"] == 4 and row["scorer_check"]["max_abs_logprob_diff"] < 1e-3, method
        if "auc" in row:  # the argmax is one of the cuts best_threshold_accuracy tries
            assert row["best_threshold_accuracy"] >= row["accuracy"], method
        assert row["prompt_style"] == "compact", method
    assert set(summary["targets"]["sst2"]) >= {"apt0.7_acc_ge_90pct_lora", "apt0.7_acc_gt_ptt0.7", "apt0.7_peak_le_1.1x_lora"}
    report = (out / "results.md").read_text()
    assert "| apt_0.7 |" in report
    assert "step time per phase of APT 0.7's schedule" in report and "| recovery: final shape, no teacher (" in report
    assert set(summary["timings_s"]) == {f"sst2/{m}" for m in methods}

    # same settings again: every result is reused, nothing retrains
    again = subprocess.run(cmd + ["--skip-speed"], capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("have a result with these settings, skipping") == len(methods)

    # a result whose recorded settings differ (e.g. a run interrupted before it was redone) is
    # neither reused nor shown next to the others
    stale = out / "sst2" / "ptt_0.7" / "result.json"
    row = json.loads(stale.read_text())
    row["spec"]["steps"] = 99
    stale.write_text(json.dumps(row))
    # (run again with --apt target_density=0.5: the override reaches prune-then-tune's one-shot cut)
    table_only = subprocess.run(cmd + ["--skip-speed", "--methods", "lora", "ptt_0.7", "--steps", "8", "--jobs", "1",
                                       "--apt", "target_density=0.5"], capture_output=True, text=True, cwd=ROOT)
    assert table_only.returncode == 0, table_only.stderr[-3000:]
    assert "sst2/ptt_0.7: the saved result used other settings; running again" in table_only.stdout
    redone = json.loads(stale.read_text())
    assert redone["spec"]["steps"] == 8 and redone["spec"]["apt_overrides"] == {"target_density": 0.5}
    assert redone["target_density"] == 0.5 and abs(redone["density"] - 0.5) < 0.15, redone["density"]
    lora_row = json.loads((out / "sst2" / "lora" / "result.json").read_text())
    assert lora_row["density"] == pytest.approx(1.0) and "target_density" not in lora_row  # LoRA stays dense


def test_every_tasks_target_pair_is_queued_first_and_together():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from quality import start_groups
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    names = [f"{t}/{m}" for t in ("boolq", "sst2") for m in ("zero_shot", "lora", "apt_0.7", "ptt_0.7", "apt_0.5")]
    groups = [[name for name, *_ in group] for group in start_groups([(name, Path("."), Path(".")) for name in names])]
    assert groups[:2] == [["boolq/lora", "boolq/apt_0.7"], ["sst2/lora", "sst2/apt_0.7"]]
    assert groups[2:] == [[n] for n in ("boolq/zero_shot", "boolq/ptt_0.7", "boolq/apt_0.5", "sst2/zero_shot", "sst2/ptt_0.7", "sst2/apt_0.5")]


def test_a_pair_waits_for_two_free_slots_and_starts_together(monkeypatch, tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import quality
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    events, clock, live = [], iter(range(10**6)), {"now": 0, "max": 0}

    class FakeWorker:  # finishes after a number of polls set by its method name
        def __init__(self, cmd):
            self.name = json.loads(Path(cmd[-1]).read_text())["name"]
            self.polls = {"zero_shot": 1, "lora": 2, "apt_0.7": 5}[self.name.split("/")[1]]  # LoRA ends first
            self.returncode = 0
            events.append(("start", self.name))
            live["now"] += 1
            live["max"] = max(live["max"], live["now"])

        def poll(self):
            self.polls -= 1
            if self.polls > 0:
                return None
            if self.polls == 0:
                events.append(("end", self.name))
                live["now"] -= 1
            return 0

    sleeps = iter(range(10**4))

    def sleep(seconds):  # a scheduler that stops making progress fails here instead of spinning
        next(sleeps)

    monkeypatch.setattr(quality.subprocess, "Popen", FakeWorker)
    monkeypatch.setattr(quality.time, "sleep", sleep)
    monkeypatch.setattr(quality.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(quality, "read_json", lambda path: {"accuracy": 0.5, "density": 1.0})
    runs = []
    for name in ("a/zero_shot", "a/lora", "a/apt_0.7", "b/zero_shot", "b/lora", "b/apt_0.7"):
        spec = tmp_path / f"{name.replace('/', '_')}.json"
        spec.write_text(json.dumps({"name": name}))
        runs.append((name, spec, tmp_path))
    groups = quality.start_groups(runs)
    quality.run_workers(groups, 2, {}, 0.0)
    assert live["max"] == 2
    starts = [i for i, (kind, _) in enumerate(events) if kind == "start"]
    pair_b = [events.index(("start", "b/lora")), events.index(("start", "b/apt_0.7"))]
    assert pair_b[1] == pair_b[0] + 1  # both started in one go
    assert pair_b[0] > max(events.index(("end", "a/lora")), events.index(("end", "a/apt_0.7")))  # waited for both slots
    assert len(starts) == 6
    events.clear()
    live["max"] = 0
    quality.run_workers(groups, 1, {}, 0.0)  # one job: the pair runs one after the other
    assert events.index(("start", "a/apt_0.7")) > events.index(("end", "a/lora"))
    assert live["max"] == 1


def test_targets_flag_a_model_that_answers_one_label():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _quality_report import targets
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    lora = {"accuracy": 0.63, "train_time_s": 10.0, "peak_rss_mb": 100.0, "predicted_share": {"no": 0.03, "yes": 0.97}}
    always_yes = {**lora, "accuracy": 0.62, "predicted_share": {"no": 0.0, "yes": 1.0}}
    assert targets({"lora": lora, "apt_0.7": always_yes})["apt0.7_acc_ge_90pct_lora"]  # the prior alone passes it
    assert targets({"lora": lora, "apt_0.7": always_yes})["apt0.7_answers_both_labels"] is False
    assert targets({"lora": lora, "apt_0.7": lora})["apt0.7_answers_both_labels"] is True


def test_best_threshold_accuracy_is_the_ceiling_of_any_cut_and_respects_ties():
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _common import best_threshold_accuracy
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    generator = torch.Generator().manual_seed(0)
    score = torch.randint(0, 5, (40,), generator=generator).double()  # many ties
    positive = torch.rand(40, generator=generator) < 0.6
    brute = max(float(((score > t) == positive).double().mean()) for t in [-1.0, *score.unique().tolist()])
    assert best_threshold_accuracy(score, positive) == pytest.approx(brute)
    # fully tied scores: only "all positive" or "all negative", whatever the rows' order (untied cuts would give 1.0)
    assert best_threshold_accuracy(torch.tensor([0.5, 0.5, 0.5]), torch.tensor([True, True, False])) == pytest.approx(2 / 3)
    assert best_threshold_accuracy(torch.tensor([]), torch.tensor([], dtype=torch.bool)) is None


def test_apt_overrides_are_typed_and_checked():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import quality
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert quality.apt_overrides(["kurtosis_weight=0", "score_normalization=none", "uniform=true"], [48]) == {
        "kurtosis_weight": 0, "score_normalization": "none", "uniform": True}
    for bad, message in ((["kurtosis_weigth=0"], "APTConfig field"), (["kurtosis_weight"], "FIELD=VALUE"),
                         (["kurtosis_weight=-1"], "kurtosis_weight"), (["score_normalization=layer"], "score_normalization")):
        with pytest.raises(ValueError, match=message):
            quality.apt_overrides(bad, [48])
    # A schedule override is checked against each run's own schedule (start at 10% of its steps),
    # not against APTConfig()'s defaults (start 100), which rejected every end before step 101.
    assert quality.apt_overrides(["pruning_end_step=43"], [144]) == {"pruning_end_step": 43}
    assert quality.apt_overrides(["pruning_end_step=10"], [48]) == {"pruning_end_step": 10}  # pruning from step 5
    with pytest.raises(ValueError, match=r"--apt \(a 144-step run\): .*pruning_end_step"):  # pruning from step 14
        quality.apt_overrides(["pruning_end_step=10"], [48, 144])


def test_apt_overrides_win_over_what_the_method_name_sets():
    """`--apt target_density=...` or `uniform=...` used to reach APTConfig twice (by the name and by
    the override) and stopped the worker with a TypeError; the override now wins."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _quality_worker as worker
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    spec = {"steps": 40, "rank": 4, "adapter_targets": ["q_proj", "v_proj"]}
    method = worker.method_spec("apt_0.7_uniform")
    plain = worker.apt_config(method, spec)
    assert (plain.target_density, plain.uniform, plain.adapter_rank, plain.adapter_alpha) == (0.7, True, 4, 8.0)
    changed = worker.apt_config(method, {**spec, "apt_overrides": {"target_density": 0.84, "uniform": False,
                                                                   "kurtosis_weight": 0}})
    assert (changed.target_density, changed.uniform, changed.kurtosis_weight) == (0.84, False, 0)
    assert changed.pruning_end_step == plain.pruning_end_step  # the schedule still follows spec["steps"]


def test_instruct_task_is_scored_zero_shot_by_the_harness(tmp_path, tokenizer):
    pytest.importorskip("lm_eval")
    """The instruct task (prepare_instructions.py's Alpaca mix) has no test split: every run,
    zero-shot included, is scored by lm-eval on the shipped tasks, and its accuracy is their mean."""
    model_dir = tmp_path / "tiny"
    build_tiny_model(vocab_size=len(tokenizer), seed=0).save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    task_dir = tmp_path / "tasks" / "instruct"
    task_dir.mkdir(parents=True)
    (task_dir / "task.json").write_text(json.dumps({"name": "instruct", "prompt_style": "alpaca"}))
    rng = random.Random(0)
    words = "the quick brown fox jumps over the lazy dog is it".split()
    records = [{"instruction": "Answer the question.", "input": " ".join(rng.choices(words, k=6)), "output": rng.choice(words)}
               for _ in range(40)]
    (task_dir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    methods = ["zero_shot", "apt_0.7"]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--model", str(model_dir), "--tasks-dir", str(tmp_path / "tasks"),
           "--tasks", "instruct", "--methods", *methods, "--steps", "8", "--max-seq-len", "48", "--calibration-batches", "2",
           "--harness-tasks", "arc_easy", "piqa", "mmlu", "--harness-limit", "3", "--mmlu-limit", "1", "--skip-speed", "--jobs", "2",
           "--out", str(out), "--img-dir", str(out / "img")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())["tasks"]["instruct"]
    assert sorted(rows) == sorted(methods)
    for method, row in rows.items():
        assert set(row["harness"]) == {"arc_easy", "piqa", "mmlu"}, method
        assert row["harness_rows"] == {"arc_easy": 3, "piqa": 3, "mmlu": 57}, method  # one question per subject
        assert row["harness_metric"] == {"arc_easy": "acc", "piqa": "acc", "mmlu": "acc"}
        assert row["accuracy"] == pytest.approx(sum(row["harness"].values()) / 3)
        assert row["harness_every_metric"]["piqa"]["acc"] == row["harness"]["piqa"]
        assert set(row["harness_every_metric"]["arc_easy"]) == {"acc", "acc_norm"}
        assert set(row["harness_answer_share"]) == {"arc_easy", "piqa"}  # mmlu is a group: its subjects have theirs
        assert all(0.25 <= share <= 1.0 for share in row["harness_answer_share"].values())
    assert rows["apt_0.7"]["density"] < 0.95  # the pruned export was the one scored
    # every method was scored on the rows drawn with the run's seed (0), not the top of each file
    from apt_ds.evaluation.harness import draw_rows
    from apt_ds.evaluation.tasks import task_manager

    manager = task_manager()
    expected = {**draw_rows(manager, ["arc_easy", "piqa"], 3, seed=0), **draw_rows(manager, ["mmlu"], 1, seed=0)}
    assert expected["arc_easy"] != [0, 1, 2] and len(expected) == 2 + 57
    for method, row in rows.items():
        assert row["harness_rows_drawn"] == {"sample_seed": 0, "indices": expected}, method

    missing = subprocess.run(cmd[:2] + ["--tasks-dir", str(tmp_path / "none"), "--tasks", "instruct", "--out", str(out)],
                             capture_output=True, text=True, cwd=ROOT)
    assert missing.returncode != 0
    assert "prepare_instructions.py" in missing.stderr.strip().splitlines()[-1]
