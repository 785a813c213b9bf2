"""Device, precision and memory decisions (apt_ds.distributed.placement, DeepSpeed precision), gradient
checkpointing, and the host round trips a training step makes."""

from __future__ import annotations

import traceback

import pytest
import torch
from conftest import random_batch, tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode

from apt_ds import APTConfig, APTrainer, TrainConfig
from apt_ds.cli.train import main as train_main
from apt_ds.config import ConfigError
from apt_ds.distributed.ds_config import DeepSpeedConfigError, resolve_precision
from apt_ds.distributed.placement import cpu_threads_per_rank, resolve_base_dtype, resolve_device


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs with one torch thread (see conftest.one_thread)."""


# ---- decisions ---------------------------------------------------------------------------------
def test_base_dtype_defaults_and_refusals():
    assert resolve_base_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_base_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_base_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ConfigError, match="fp16 is not supported on CPU"):
        resolve_base_dtype("fp16", torch.device("cpu"))
    with pytest.raises(ConfigError, match="must be one of"):
        resolve_base_dtype("fp8", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_device_refused_without_cuda():
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="no CUDA device"):
        resolve_device("cuda")


def test_threads_per_rank_follow_local_ranks():
    assert cpu_threads_per_rank({"LOCAL_WORLD_SIZE": "2"}, cores=16) == 8
    assert cpu_threads_per_rank({"LOCAL_SIZE": "3"}, cores=2) == 1  # never 0
    assert cpu_threads_per_rank({}, cores=4) == 4
    assert cpu_threads_per_rank({"OMP_NUM_THREADS": "3", "LOCAL_SIZE": "2"}, cores=16) is None  # the user decided


def test_host_threads_are_shared_by_the_ranks_of_a_node_on_gpus_too(monkeypatch):
    """8 GPU ranks on a node ran their pruning decisions' host sorts on every core each; ranks the
    launcher gave cores of their own (Slurm's --cpus-per-task) are left as they are."""
    from apt_ds.distributed import placement

    affinity = set(range(64))
    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda pid: affinity)
    monkeypatch.setattr(placement.os, "cpu_count", lambda: 64)
    calls = []
    monkeypatch.setattr(placement.torch, "set_num_threads", calls.append)
    assert placement.configure_host_threads(torch.device("cuda", 3), {"LOCAL_SIZE": "8"}) == 8
    assert placement.configure_host_threads(torch.device("cuda", 0), {}) is None  # one process: torch's default
    assert placement.configure_host_threads(torch.device("cpu"), {}) == 64
    assert placement.configure_host_threads(torch.device("cuda", 0), {"LOCAL_SIZE": "8", "OMP_NUM_THREADS": "4"}) is None
    affinity = set(range(12))  # srun --ntasks-per-node 8 --cpus-per-task 12
    assert placement.configure_host_threads(torch.device("cuda", 1), {"SLURM_NTASKS_PER_NODE": "8"}) is None
    assert calls == [8, 64]


def test_training_sets_the_host_threads_for_its_device(monkeypatch):
    from types import SimpleNamespace

    from apt_ds.training import run

    seen = []
    monkeypatch.setattr(run, "configure_host_threads", seen.append)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    backend, _ = run.make_backend(SimpleNamespace(deepspeed=None, global_batch_size=None), TrainConfig(device="cpu"))
    assert seen == [backend.device] == [torch.device("cpu")]


def test_deepspeed_precision_auto_is_fp32_on_cpu_and_bf16_on_gpus():
    auto = {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}}
    assert resolve_precision(auto, on_cpu=True) == "fp32"
    assert resolve_precision(auto, on_cpu=False) == "bf16"
    assert resolve_precision(auto, on_cpu=False, bf16_supported=False) == "fp32"
    assert resolve_precision(auto, "bf16", on_cpu=True) == "bf16"  # asked for
    assert resolve_precision({"zero_optimization": {"stage": 2}}, "bf16", on_cpu=False) == "bf16"  # section added
    assert resolve_precision(auto, "fp32", on_cpu=False) == "fp32"
    with pytest.raises(DeepSpeedConfigError, match="contradicts --base-dtype fp32"):
        resolve_precision({"bf16": {"enabled": True}}, "fp32", on_cpu=False)


# ---- the CLI's answers to bad input ----------------------------------------------------------------
def test_unknown_base_dtype_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--base-dtype", "fp8", "--out", "never"])
    assert exit_info.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err


def test_fp16_on_cpu_is_refused_in_one_line(tmp_path, capsys):
    assert train_main(["--base-dtype", "fp16", "--device", "cpu", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --base-dtype fp16 is not supported on CPU (no fp16 kernels); use fp32 (default) or bf16"]
    assert not (tmp_path / "run").exists()


def test_a_model_bigger_than_memory_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    model_dir = tmp_path / "model"
    tiny_llama("gqa", vocab=512).save_pretrained(model_dir)
    from apt_ds.io.tokenizer import train_sentencepiece_tokenizer

    train_sentencepiece_tokenizer(["a small text to train on"] * 50, tmp_path / "tok", vocab_size=300).save_pretrained(str(model_dir))
    monkeypatch.setattr("apt_ds.distributed.placement.available_bytes", lambda device, environ=None: 1000)
    loaded = []
    monkeypatch.setattr("apt_ds.training.run.load_model", lambda *a, **k: loaded.append(1))
    capsys.readouterr()
    assert train_main(["--model", str(model_dir), "--device", "cpu", "--max-seq-len", "128", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(0.1M parameters in float32) needs 497.2 KiB per rank for its weights alone, " \
        "but only 1000 B is available on cpu" in err[0], err
    assert "--base-dtype bf16" in err[0] and not loaded and not (tmp_path / "run").exists()


# ---- precision in training ---------------------------------------------------------------------
def test_bf16_base_trains_fp32_adapters():
    model = tiny_llama("gqa").to(torch.bfloat16)
    apt = APTConfig.for_steps(8, target_density=0.6)
    trainer = APTrainer(model, apt, TrainConfig(steps=8, lr=1e-2), progress=False)
    final = trainer.train(iter(random_batch(seed=i) for i in range(100)))
    assert final["density"] < 0.7
    frozen = {p.dtype for n, p in model.named_parameters() if not p.requires_grad and "apt_distill" not in n}
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and trained == {torch.float32}
    assert all(torch.isfinite(torch.tensor(h["task_loss"])) for h in trainer.history if "task_loss" in h)


# ---- gradient checkpointing ----------------------------------------------------------------------
def _run(checkpointing: bool, steps: int = 10):
    model = tiny_llama("gqa")
    forwards = []
    model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda *args: forwards.append(1))
    apt = APTConfig.for_steps(steps, target_density=0.6, distill_every=1)
    train = TrainConfig(steps=steps, grad_accum_steps=2, lr=1e-2, gradient_checkpointing=checkpointing)
    trainer = APTrainer(model, apt, train, progress=False)
    trainer.train(iter(random_batch(batch=2, seed=i) for i in range(1000)))
    return trainer, len(forwards)


def test_gradient_checkpointing_keeps_salience_losses_and_decisions():
    plain, plain_forwards = _run(False)
    checkpointed, checkpointed_forwards = _run(True)
    assert any(getattr(m, "gradient_checkpointing", False) for m in checkpointed.model.modules())
    assert checkpointed_forwards > plain_forwards  # layers really were recomputed in backward
    assert any(h.get("event") for h in plain.history) and any(h["distill_loss"] > 0 for h in plain.history if "distill_loss" in h)
    for a, b in zip(plain.history, checkpointed.history):
        if "task_loss" in a:
            assert b["task_loss"] == pytest.approx(a["task_loss"], rel=1e-5)
            assert b["distill_loss"] == pytest.approx(a["distill_loss"], rel=1e-4, abs=1e-7)
    assert checkpointed.state.kept_record() == plain.state.kept_record()
    assert checkpointed.state.ranks() == plain.state.ranks()
    s, c = plain.state.salience, checkpointed.state.salience
    torch.testing.assert_close(c.hidden_scores, s.hidden_scores, rtol=1e-4, atol=0)
    for a, b in zip(s.group_scores + s.neuron_scores, c.group_scores + c.neuron_scores):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=0)


# ---- host round trips ----------------------------------------------------------------------------
class _HostReads(TorchDispatchMode):
    """Counts tensor -> Python reads (`item`, `float(t)`, `nonzero`): each is a device sync on a
    GPU. Adam's own step counters are host tensors and are not counted."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
            if not any("torch/optim/" in frame for frame in traceback.format_stack(limit=30)):
                self.count += 1
        return func(*args, **(kwargs or {}))


def _host_reads_of_a_step(layers: int, targets: tuple) -> int:
    model = tiny_llama("gqa", num_hidden_layers=layers)
    apt = APTConfig.for_steps(20, target_density=0.5, adapter_targets=targets)
    trainer = APTrainer(model, apt, TrainConfig(steps=20, grad_accum_steps=2), progress=False)
    stream = iter(random_batch(batch=2, seed=i) for i in range(1000))
    while not trainer.schedule.collects_salience(trainer.step):
        trainer._train_step(stream)
        trainer._after_step()
    reads = _HostReads()
    with reads:
        trainer._train_step(stream)  # salience, adapter importance, clipping, metrics
    return reads.count


def test_host_reads_per_step_do_not_grow_with_layers_or_adapters():
    small = _host_reads_of_a_step(2, ("q_proj", "v_proj"))
    large = _host_reads_of_a_step(4, ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"))
    assert small == large  # per micro-batch and per step only: none per layer, site or adapter
    assert small <= 20

