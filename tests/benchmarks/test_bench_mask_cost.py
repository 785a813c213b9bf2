"""benchmarks/mask_cost.py: what decaying masks add to a checkpointed forward and backward."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import mask_cost


def test_decaying_masks_cost_a_few_operations_per_layer(tmp_path):
    out = tmp_path / "mask_cost.json"
    result = mask_cost.main(["--repeats", "1", "--batch", "1", "--seq", "16", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    computing = result["computing_per_step"]
    layers = mask_cost.MODEL["num_hidden_layers"]
    # a multiplication per masked site and the norms' division, in forward, recompute and backward
    assert 0 < computing["masks_decaying"] - computing["masks_idle"] <= 20 * layers + 4
    assert result["masks_idle_s"] > 0 and result["masks_decaying_s"] > 0


def test_bad_settings_are_one_line_errors(capsys):
    with pytest.raises(SystemExit) as stop:
        mask_cost.main(["--seq", "1"])
    assert stop.value.code == 2
    assert "--seq" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mask_cost.main(["--device", "no-such-device"])
    assert "--device no-such-device" in capsys.readouterr().err
