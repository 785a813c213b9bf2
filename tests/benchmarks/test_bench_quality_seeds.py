"""benchmarks/quality_seeds.py's aggregation: means, spreads and the seed-aware targets, on
made-up per-seed results (the runs themselves are quality.py's, tested in test_bench_quality)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import quality_seeds

ACCURACY = {  # per seed
    "lora": [0.84, 0.82, 0.86],
    "apt_0.7": [0.82, 0.80, 0.81],
    "apt_0.7_uniform": [0.70, 0.78, 0.74],
    "ptt_0.7": [0.60, 0.80, 0.55],
    "apt_0.5": [0.70, 0.72, 0.71],
    "ptt_0.5": [0.55, 0.56, 0.54],
}


def _write(out: Path) -> None:
    for seed in range(3):
        rows = {m: {"accuracy": acc[seed], "auc": acc[seed] + 0.05, "density": 0.7 if "0.7" in m else 0.5 if "0.5" in m else 1.0,
                    "train_time_s": 100.0 if m == "lora" else 85.0, "train_cpu_s": 90.0 if m == "lora" else 80.0}
                for m, acc in ACCURACY.items()}
        (out / f"seed{seed}").mkdir(parents=True)
        (out / f"seed{seed}" / "results.json").write_text(json.dumps({"tasks": {"sst2": rows}}))


def test_means_spreads_and_targets(tmp_path, capsys):
    _write(tmp_path)
    quality_seeds.main(["--report-only", "--out", str(tmp_path)])
    found = json.loads((tmp_path / "seeds.json").read_text())["tasks"]["sst2"]
    apt = found["methods"]["apt_0.7"]
    assert apt["accuracy"]["mean"] == pytest.approx(0.81)
    assert apt["accuracy"]["std"] == pytest.approx(0.01)
    assert apt["acc_vs_lora"] == pytest.approx((0.82 / 0.84 + 0.80 / 0.82 + 0.81 / 0.86) / 3)
    assert apt["time_vs_lora"] == pytest.approx(0.85)
    targets = found["targets"]
    assert targets["apt0.7_acc_ge_95pct_lora"] is (apt["acc_vs_lora"] >= 0.95)
    assert targets["apt0.7_uniform_acc_ge_90pct_lora"] is False  # per-seed ratios 0.833, 0.951, 0.860
    # 0.81 vs 0.65 is a gap of 0.16, PTT 0.7's seeds spread by 0.13: more than the spread
    assert targets["apt0.7_beats_ptt0.7_by_more_than_spread"] is True
    assert targets["apt0.5_beats_ptt0.5_by_more_than_spread"] is True
    assert targets["apt0.7_time_le_0.9x_lora"] is True
    assert "| apt_0.7 | 0.700 | 0.810 ± 0.010 |" in capsys.readouterr().out


def test_gap_within_the_spread_is_not_a_win(tmp_path):
    ACCURACY_PTT_CLOSE = {**ACCURACY, "ptt_0.7": [0.70, 0.95, 0.70]}  # mean 0.783, std 0.144
    for seed in range(3):
        rows = {m: {"accuracy": acc[seed], "density": 0.7} for m, acc in ACCURACY_PTT_CLOSE.items()}
        (tmp_path / f"seed{seed}").mkdir(parents=True)
        (tmp_path / f"seed{seed}" / "results.json").write_text(json.dumps({"tasks": {"sst2": rows}}))
    found = quality_seeds.collect(tmp_path, [0, 1, 2])["sst2"]
    assert found["targets"]["apt0.7_beats_ptt0.7_by_more_than_spread"] is False


def test_missing_seed_and_repeated_seeds_are_one_line_errors(tmp_path, capsys):
    _write(tmp_path)
    with pytest.raises(SystemExit, match="seed7/results.json is missing"):
        quality_seeds.main(["--report-only", "--out", str(tmp_path), "--seeds", "0", "7"])
    with pytest.raises(SystemExit):
        quality_seeds.main(["--report-only", "--out", str(tmp_path), "--seeds", "0", "0"])
    assert "--seeds has repeats" in capsys.readouterr().err


def test_harness_scores_are_reported_per_task(tmp_path, capsys):
    """The instruct task's accuracy is the mean of lm-eval scores: each task's mean over seeds is reported."""
    harness = {"lora": [{"arc_easy": 0.5, "piqa": 0.7, "boolq": 0.25}, {"arc_easy": 0.6, "piqa": 0.6, "boolq": 0.25}],
               "apt_0.7": [{"arc_easy": 0.4, "piqa": 0.6, "boolq": 0.75}, {"arc_easy": 0.4, "piqa": 0.8, "boolq": 0.75}]}
    for seed in range(2):
        rows = {m: {"accuracy": sum(h[seed].values()) / 3, "density": 1.0, "harness": h[seed]} for m, h in harness.items()}
        (tmp_path / f"seed{seed}").mkdir(parents=True)
        (tmp_path / f"seed{seed}" / "results.json").write_text(json.dumps({"tasks": {"instruct": rows}}))
    quality_seeds.main(["--report-only", "--seeds", "0", "1", "--out", str(tmp_path)])
    found = json.loads((tmp_path / "seeds.json").read_text())["tasks"]["instruct"]["methods"]
    assert found["apt_0.7"]["harness"]["piqa"]["mean"] == pytest.approx(0.7)
    assert found["lora"]["harness"]["arc_easy"]["std"] == pytest.approx(0.0707, abs=1e-4)
    # the mean with BoolQ, then without it; no row stderr or answer shares in these results
    assert "| apt_0.7 | 0.400 ± 0.000 | 0.700 ± 0.141 | 0.750 ± 0.000 | 0.617 | 0.550 | – | – |" in capsys.readouterr().out


def test_row_noise_and_one_answer_tasks_are_reported(tmp_path, capsys):
    """lm-eval's per-task standard errors give each seed's row noise (sqrt of the summed squares
    over the task count); a seed answering one label on >= 95% of a task's rows (of >= 20) is
    counted; "beats" compares the gap with the spread over seeds, which holds the row sampling."""
    stderr = {"arc_easy": 0.06, "piqa": 0.08}
    runs = {"apt_0.7": ({"arc_easy": 0.50, "piqa": 0.60}, {"arc_easy": 0.6, "piqa": 0.97}),
            "ptt_0.7": ({"arc_easy": 0.45, "piqa": 0.60}, {"arc_easy": 0.6, "piqa": 0.6})}
    for seed in range(2):
        rows = {m: {"accuracy": sum(h.values()) / 2 + 0.001 * seed, "density": 0.7, "harness": h, "harness_stderr": stderr,
                    "harness_rows": {"arc_easy": 75, "piqa": 75},
                    "harness_answer_share": share if seed == 0 else {"arc_easy": 0.5, "piqa": 0.5}}
                for m, (h, share) in runs.items()}
        (tmp_path / f"seed{seed}").mkdir(parents=True)
        (tmp_path / f"seed{seed}" / "results.json").write_text(json.dumps({"tasks": {"instruct": rows}}))
    quality_seeds.main(["--report-only", "--seeds", "0", "1", "--out", str(tmp_path)])
    found = json.loads((tmp_path / "seeds.json").read_text())["tasks"]["instruct"]
    assert found["methods"]["apt_0.7"]["row_stderr"] == pytest.approx(0.05)  # sqrt(0.06² + 0.08²) / 2
    assert found["methods"]["apt_0.7"]["one_answer_tasks"] == {"piqa": 1}
    assert found["methods"]["ptt_0.7"]["one_answer_tasks"] == {}
    assert found["targets"]["apt0.7_beats_ptt0.7_by_more_than_spread"] is True  # gap 0.025 > std 0.0007
    assert "| 0.050 | piqa (1/2) |" in capsys.readouterr().out


def test_one_row_tasks_without_stderr_and_few_rows_are_not_misread(tmp_path, capsys):
    """lm-eval writes "N/A" (here None) for a one-row task's stderr: no row noise is claimed; a
    one-sided answer on 4 rows is not flagged (too often chance)."""
    for seed in range(2):
        rows = {"lora": {"accuracy": 0.5, "density": 1.0, "harness": {"mmlu": 0.5, "piqa": 0.5},
                         "harness_stderr": {"mmlu": None, "piqa": 0.25}, "harness_rows": {"mmlu": 57, "piqa": 4},
                         "harness_answer_share": {"piqa": 1.0}}}
        (tmp_path / f"seed{seed}").mkdir(parents=True)
        (tmp_path / f"seed{seed}" / "results.json").write_text(json.dumps({"tasks": {"instruct": rows}}))
    quality_seeds.main(["--report-only", "--seeds", "0", "1", "--out", str(tmp_path)])
    found = json.loads((tmp_path / "seeds.json").read_text())["tasks"]["instruct"]["methods"]["lora"]
    assert "row_stderr" not in found and found["one_answer_tasks"] == {}
    assert "| – | – |" in capsys.readouterr().out


def test_a_re_report_keeps_the_measuring_runs_time(tmp_path):
    _write(tmp_path)
    (tmp_path / "seeds.json").write_text(json.dumps({"command": "quality_seeds.py --tasks sst2", "wall_time_s": 1200.0}))
    quality_seeds.main(["--report-only", "--out", str(tmp_path)])
    found = json.loads((tmp_path / "seeds.json").read_text())
    assert found["wall_time_s"] == 1200.0 and found["command"] == "quality_seeds.py --tasks sst2"
    assert "--report-only" in found["report_command"]


def test_paired_differences_and_the_exact_sign_flip_test(tmp_path, capsys):
    """Differences are taken seed by seed; the sign-flip p counts the sign assignments whose
    |mean| reaches the observed one (ties included), and a seed one method lacks is left out."""
    _write(tmp_path)
    found = quality_seeds.collect(tmp_path, [0, 1, 2])["sst2"]["paired"]
    apt_ptt = found["apt_0.7 - ptt_0.7"]
    assert apt_ptt["differences"] == pytest.approx([0.22, 0.0, 0.26])
    assert apt_ptt["wins"] == 2
    # |mean| 0.16 is reached by the all-plus and all-minus assignments and by flipping only the zero
    assert apt_ptt["p_sign_flip"] == pytest.approx(4 / 8)
    assert found["apt_0.5 - ptt_0.5"]["p_sign_flip"] == pytest.approx(2 / 8)  # +0.15 +0.16 +0.17: only all-plus/all-minus
    # a method missing on a seed: only the shared seeds pair up
    results = json.loads((tmp_path / "seed2" / "results.json").read_text())
    del results["tasks"]["sst2"]["ptt_0.7"]
    (tmp_path / "seed2" / "results.json").write_text(json.dumps(results))
    found = quality_seeds.collect(tmp_path, [0, 1, 2])["sst2"]["paired"]
    assert found["apt_0.7 - ptt_0.7"]["differences"] == pytest.approx([0.22, 0.0])
    quality_seeds.main(["--report-only", "--out", str(tmp_path)])
    assert "- apt_0.5 - ptt_0.5: +0.160 ± 0.010 over 3 seeds (+0.150 / +0.160 / +0.170), won 3 of 3, p = 0.250" in capsys.readouterr().out


def test_a_pair_on_one_shared_seed_is_not_reported(tmp_path):
    _write(tmp_path)
    for seed in (1, 2):
        results = json.loads((tmp_path / f"seed{seed}" / "results.json").read_text())
        del results["tasks"]["sst2"]["ptt_0.5"]
        (tmp_path / f"seed{seed}" / "results.json").write_text(json.dumps(results))
    assert "apt_0.5 - ptt_0.5" not in quality_seeds.collect(tmp_path, [0, 1, 2])["sst2"]["paired"]
