"""Benchmark scripts refuse nonsense counts in one argparse line, before any work (llama_scale
would otherwise write a 12 GiB model first), and report the rank count they were given."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv, message", [
    (["memory_on_paper.py", "--ranks", "0"], "--ranks and --seq must be >= 1"),
    (["step_overhead.py", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    (["zero_bench.py", "--only", "foo"], "--only: unknown ['foo']"),
    (["llama_scale.py", "--steps", "0", "--model-dir", "{tmp}/model"], "--steps must be >= 4"),
    (["make_demo_data.py", "--count", "-1", "--out", "{tmp}/demo.jsonl"], "--count must be >= 1"),
])
def test_bad_counts_are_one_argparse_line_and_nothing_is_written(tmp_path, argv, message):
    argv = [a.format(tmp=tmp_path) for a in argv]
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / argv[0]), *argv[1:]], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr.strip().splitlines()[-1], result.stderr[-500:]
    assert list(tmp_path.iterdir()) == []


def test_memory_on_paper_labels_the_rank_count_it_was_given():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory_on_paper

    results = {name: memory_on_paper.per_rank(values, 4, 2048) for name, values in memory_on_paper.MODELS.items()}
    text = memory_on_paper.table(results, 4)
    assert "per rank (4 ranks, bf16)" in text and "per 4-rank node" in text and "fits 4 x 24 GB" in text
    assert "8" not in text.split("|")[1]
    for result in results.values():  # the steady step is the sum of its terms, each positive
        assert result["steady"] == sum(result["terms"].values()) and min(result["terms"].values()) > 0
