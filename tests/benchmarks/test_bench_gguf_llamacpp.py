"""benchmarks/gguf_llamacpp.py: the label choice on llama.cpp's top-n log-prob lists (no model needed)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from gguf_llamacpp import choose_label, label_logprobs, ratio


def _top(*pairs):
    return [{"id": i, "token": str(i), "logprob": lp} for i, lp in pairs]


def test_both_labels_listed_takes_the_larger():
    top = _top((5, -0.1), (30, -2.0), (20, -3.5))
    assert label_logprobs(top, [20, 30]) == [-3.5, -2.0]
    assert choose_label(label_logprobs(top, [20, 30]), -3.5) == 1
    assert choose_label(label_logprobs(top, [30, 20]), -3.5) == 0


def test_missing_label_counts_below_the_smallest_returned():
    top = _top((5, -0.1), (20, -9.0))
    scores = label_logprobs(top, [20, 30])
    assert scores == [-9.0, None]
    assert choose_label(scores, -9.0) == 0  # the listed one wins, however unlikely
    assert choose_label([None, -9.0], -9.0) == 1


def test_ties_go_to_the_first_label_as_torch_argmax():
    assert choose_label([-1.0, -1.0], -1.0) == 0
    assert choose_label([None, None], -5.0) == 0


def test_ratio_without_reference():
    assert ratio(2.0, 4.0) == 0.5
    assert ratio(None, 4.0) is None and ratio(1.0, 0) is None
