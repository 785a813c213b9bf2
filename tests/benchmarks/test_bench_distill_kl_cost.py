"""benchmarks/distill_kl_cost.py: the chunked KL's peak memory against the plain formula's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import distill_kl_cost


def test_chunked_kl_peaks_lower_than_the_plain_formula(tmp_path):
    out = tmp_path / "kl.json"
    assert distill_kl_cost.main(["--rows", "2048", "--vocabulary", "32000", "--repeats", "1", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    results = {r["method"]: r for r in record["results"]}
    assert set(results) == {"plain", "chunked"} and results["plain"]["inputs_mb"] == 250.0
    # plain: four fp32 (rows x vocabulary) tensors kept for backward and more in flight (~1.25 GB);
    # chunked: the bf16 gradient and a few 64 MiB chunks
    assert results["chunked"]["peak_growth_mb"] < 0.6 * results["plain"]["peak_growth_mb"]
