"""benchmarks/decision_cost.py: host time of a pruning decision at LLaMA-2-7B's shape."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decision_cost


def test_times_one_decision_per_thread_count_and_writes_what_it_prints(tmp_path, capsys):
    threads = torch.get_num_threads()
    other = 2 if threads == 1 else 1  # so that putting the process's setting back is seen
    out = tmp_path / "decision_cost.json"
    result = decision_cost.main(["--threads", str(other), "--repeats", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    (run,) = result["runs"]
    assert run["threads"] == other and len(run["laps_ms"]) == 2 and run["median_ms"] > 0
    assert f"{other} thread(s):" in capsys.readouterr().out
    assert torch.get_num_threads() == threads  # the process's own setting back


@pytest.mark.parametrize("argv", [["--density", "0"], ["--repeats", "0"], ["--threads", "0"]])
def test_bad_settings_are_one_line_errors(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        decision_cost.main(argv)
    assert stop.value.code == 2 and argv[0] in capsys.readouterr().err
