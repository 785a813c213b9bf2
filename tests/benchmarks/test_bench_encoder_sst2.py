"""benchmarks/encoder_sst2.py (the MiniLM SST-2 benchmark: docs/BENCHMARKS.md, "Encoders"), on a
tiny random BERT for a few steps: every method runs in its own worker, reaches its density,
exports and is scored on the held-out rows; the report's ratios are computed as it says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "models"))
import encoder_sst2  # noqa: E402


def test_the_report_takes_the_ratio_of_mean_accuracies_and_median_paired_ratios():
    runs = [{"method": m, "seed": s, "accuracy": acc, "train_time_s": t, "peak_rss_mb": 100.0, "inference_ratio": 1.0,
             "density": 1.0} for m, s, acc, t in [("full", 0, 0.8, 2.0), ("full", 1, 0.6, 2.0), ("lora", 0, 0.7, 1.0),
                                                  ("lora", 1, 0.5, 4.0), ("apt_0.5", 0, 0.6, 1.0), ("apt_0.5", 1, 0.6, 1.0)]]
    rows = encoder_sst2.summarize(runs, ["full", "lora", "apt_0.5"], [0, 1])
    assert rows["apt_0.5"]["accuracy_vs_full"] == pytest.approx(0.6 / 0.7)  # not the median of 0.75 and 1.0
    assert rows["apt_0.5"]["train_time_vs_lora"] == pytest.approx((1.0 + 0.25) / 2)
    assert "mean vs full FT's" in encoder_sst2.table(rows)


def test_each_method_runs_reaches_its_density_and_is_scored(tmp_path, tokenizer):
    from test_encoders import tiny_encoder

    model_dir = tmp_path / "bert"
    tiny_encoder("bert", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                 num_labels=2).save_pretrained(model_dir)  # SST-2's two classes
    tokenizer.save_pretrained(str(model_dir))
    out = tmp_path / "bench"
    encoder_sst2.main(["--out", str(out), "--model", str(model_dir), "--seeds", "0", "--methods", "lora", "apt_0.6",
                       "ptt_0.6", "--steps", "6", "--micro-batch-size", "4", "--max-seq-len", "16",
                       "--calibration-batches", "2", "--inference-repeats", "1", "--threads", "1"])
    report = json.loads((out / "report.json").read_text())["methods"]
    assert set(report) == {"lora", "apt_0.6", "ptt_0.6"}
    assert report["lora"]["density"] == 1.0
    for method in ("apt_0.6", "ptt_0.6"):
        assert 0.5 <= report[method]["density"] <= 0.6 + 1e-9
    for row in report.values():
        assert 0.0 <= row["accuracy_mean"] <= 1.0 and row["inference_vs_dense"] > 0
    assert report["lora"]["train_time_vs_lora"] == 1.0
