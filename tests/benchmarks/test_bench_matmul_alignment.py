"""benchmarks/matmul_alignment.py: the SmolLM2 pairs and the pruned LLaMA-2-7B FFN sweep, on tiny settings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import matmul_alignment


def test_ffn_sweep_compares_pruned_widths_with_the_dense_width_and_multiples_of_128(tmp_path, capsys):
    out = tmp_path / "ffn.json"
    result = matmul_alignment.main(["--ffn-7b", "--tokens", "4", "--widths", "11008", "1056", "--repeats", "2",
                                    "--min-run-time", "0.01", "--json", str(out)])
    assert json.loads(out.read_text())["summary"] == result["summary"]
    summary = result["summary"]
    assert summary["flop_ratio"] == pytest.approx((11008 + 1056) / (2 * 11008))
    assert summary["flop_ratio_128"] == pytest.approx((11008 + 1024) / (2 * 11008))  # 1056 rounds down to 1024
    # every width timed (1024 for the rounding), each once per repeat
    assert sorted(int(w) for w in result["layer_seconds"]) == [1024, 1056, 11008]
    assert all(len(laps) == 2 and min(laps) > 0 for laps in result["layer_seconds"].values())
    seconds = result["median_layer_seconds"]
    assert summary["time_ratio"] == pytest.approx((seconds["11008"] + seconds["1056"]) / (2 * seconds["11008"]))
    assert "pruned FFN matmuls take" in capsys.readouterr().out
    assert matmul_alignment.PRUNED_7B_FFN[0] == 11008 and len(matmul_alignment.PRUNED_7B_FFN) == 32


def test_each_layer_times_the_six_frozen_ffn_matmuls_of_a_step():
    matrices = matmul_alignment.ffn_matrices(1056)
    assert sorted(matrices) == sorted([(op, fan_in, fan_out) for op in ("forward", "input_grad")
                                       for fan_in, fan_out in ((4096, 1056), (4096, 1056), (1056, 4096))])


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0", "--tokens", "4"], "--repeats"),
    (["--tokens", "0"], "--tokens must"),
    (["--widths", "20000", "--tokens", "4"], "--widths in"),
    (["--device", "tpu", "--tokens", "4"], "--device tpu"),
    (["--device", "cpu"], "pass --tokens"),  # 16 x 512 tokens over every width on a CPU would take hours
])
def test_bad_settings_are_one_line_errors(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        matmul_alignment.main([*argv, "--ffn-7b", "--json", str(tmp_path / "x.json")])
    assert stop.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "x.json").exists()
