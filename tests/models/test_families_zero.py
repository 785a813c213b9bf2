"""Each new family under ZeRO-3 on 2 real ranks (CPU accelerator) from the partitioned build
(Qwen3's run uniform), and Qwen2 (biases sliced with their heads) under ZeRO-2 too: under ZeRO-3
the family's own class is built partitioned (Qwen2's config has no attention_bias, which a
LlamaForCausalLM build read), both ranks take the same decisions, the run reaches its density,
and its export gives the live model's logits. Killed after a pruned checkpoint, the run resumes
(its pruned shapes, biases and per-head norms rebuilt under ZeRO-3) and finishes with the
uninterrupted run's decisions and losses. With -m slow: Mistral and Qwen3 under ZeRO-2, and Qwen3
per-layer under ZeRO-3."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import check_against_probe, tiny_family

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from test_distributed import (  # noqa: E402
    COMMON,
    EVAL,
    REPO,
    TRAIN,
    _wait_for_checkpoint,
    check_identical_and_pruned,
    ds_config,
    env,
    free_port,
    launch,
    metrics,
    rank_records,
)

from apt_ds.cli.export import main as export_main  # noqa: E402
from apt_ds.models import FAMILIES  # noqa: E402

# LLaMA's runs: tests/distributed/test_distributed.py. Qwen3 uniform: the family a GGUF needs it for.
# ZeRO-2 builds no partitioned model, so one family (Qwen2's biases) runs it by default; the others
# under ZeRO-2, Qwen3 non-uniform and Mistral (LLaMA's tensors: test_distributed.py runs those under
# ZeRO-3) under ZeRO-3, run with -m slow.
RUNS = [*((name, 3, ["--uniform"] if name == "qwen3" else []) for name in FAMILIES if name not in ("llama", "mistral")),
        pytest.param("mistral", 3, [], marks=pytest.mark.slow), ("qwen2", 2, []),
        *(pytest.param(name, 2, [], marks=pytest.mark.slow) for name in FAMILIES if name not in ("llama", "qwen2")),
        pytest.param("qwen3", 3, [], marks=pytest.mark.slow)]


def _run_id(run) -> str:
    name, stage, flags = run.values if hasattr(run, "values") else run
    return f"{name}-zero{stage}{'-uniform' if flags else ''}"


@pytest.mark.parametrize(("model_type", "stage", "flags"), RUNS, ids=[_run_id(run) for run in RUNS])
def test_a_two_rank_zero_run_prunes_exports_and_resumes(tmp_path, tokenizer, model_type, stage, flags):
    base = tmp_path / model_type
    tiny_family(model_type, vocab=len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(str(base))
    out = tmp_path / "run"
    # events at steps 5 and 8: the step-6 checkpoint is a pruned one
    args = ["--deepspeed", ds_config(tmp_path, stage), *COMMON, "--micro-batch-size", "2", "--checkpoint-every", "6",
            "--model", str(base), *flags]
    result = launch(2, [*args, *EVAL, "--save-eval-probe", "--out", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check_identical_and_pruned(out, 2)
    assert export_main([str(out), "--out", str(tmp_path / "hf")]) == 0
    check_against_probe(out, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [FAMILIES[model_type].causal_lm_class]
    assert not flags or "apt_layer_shapes" not in config  # uniform: a stock config
    _killed_then_resumed_as_uninterrupted(tmp_path / "killed", args, reference=out)


def _killed_then_resumed_as_uninterrupted(out: Path, args: list[str], reference: Path) -> None:
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()), TRAIN,
           *args, "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env(), cwd=REPO, start_new_session=True)
    try:
        _wait_for_checkpoint(proc, out, 6)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=120)
    saved = json.loads((out / "checkpoint" / "apt_state.json").read_text())
    assert 6 <= saved["step"] < 12 and saved["shape"] != saved["original_shape"]
    result = launch(2, [*args, "--out", str(out), "--resume"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    resumed, expected = check_identical_and_pruned(out, 2, since_step=saved["step"]), rank_records(reference)[0]
    assert resumed["shape_fingerprint"] == expected["shape_fingerprint"] and resumed["ranks"] == expected["ranks"]
    reference_losses = {m["step"]: m["loss"] for m in metrics(reference) if not m.get("final")}
    resumed_losses = {m["step"]: m["loss"] for m in metrics(out) if not m.get("final") and m["step"] > saved["step"]}
    assert resumed_losses and all(abs(resumed_losses[s] - reference_losses[s]) < 1e-4 for s in resumed_losses)
