"""APTrainer on one process (LocalBackend): pruning to target, metrics, gradient accumulation,
optimizer/LR state across shape changes, and exact checkpoint resume."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import assert_resumed_as_uninterrupted, random_batch, tiny_llama
from torch.optim.optimizer import register_optimizer_step_post_hook

from apt_ds import APTConfig, APTrainer, TrainConfig
from apt_ds.algorithm.distill import TRANSFORM_ATTR
from apt_ds.algorithm.schedule import SparsityScheduler
from apt_ds.algorithm.units import ModelShape
from apt_ds.distributed.backend import LocalBackend
from apt_ds.io.metrics import read_metrics
from apt_ds.training import trainer as trainer_module
from apt_ds.training.lr_schedule import warmup_cosine

STEPS = 40
METRIC_FIELDS = ("step", "loss", "task_loss", "distill_loss", "grad_norm", "density", "block_params", "adapter_params",
                 "total_rank", "lr", "step_time_s", "peak_rss_mb")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs with one torch thread (see conftest.one_thread)."""


class _Crash(Exception):
    pass


class Batches:
    """Deterministic micro-batch stream: batch i depends only on i. Optionally 'crashes' at `crash_at`."""

    def __init__(self, crash_at: int | None = None):
        self.served = 0
        self.crash_at = crash_at

    def __iter__(self):
        return self

    def __next__(self):
        if self.crash_at is not None and self.served >= self.crash_at:
            raise _Crash(f"simulated crash before micro-batch {self.served}")
        batch = random_batch(batch=4, length=16, seed=1000 + self.served)
        self.served += 1
        return batch


def _configs():
    # one distillation block: the sampled layer is random, so resume must restore that RNG too
    apt = APTConfig.for_steps(STEPS, target_density=0.5, distill_num_blocks=1)
    train = TrainConfig(steps=STEPS, grad_accum_steps=2, checkpoint_every=10, warmup_steps=5, lr=2e-3)
    return apt, train


def _base_weight_sizes(model) -> dict[str, int]:
    """Frozen base weights (no adapters, no distillation transform)."""
    return {n: p.numel() for n, p in model.named_parameters() if "lora_" not in n and not n.startswith(TRANSFORM_ATTR)}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("full_run")
    model = tiny_llama("gqa")
    initial_sizes = _base_weight_sizes(model)
    apt, train = _configs()
    optimizer_steps, heap_releases = [], []
    handle = register_optimizer_step_post_hook(lambda opt, args, kwargs: optimizer_steps.append(1))
    release = trainer_module.release_free_heap
    trainer_module.release_free_heap = lambda: heap_releases.append(1) or release()
    try:
        trainer = APTrainer(model, apt, train, out_dir=out, progress=False)
        initial_rank = trainer.state.total_rank()
        batches = Batches()
        final = trainer.train(batches)
    finally:
        handle.remove()
        trainer_module.release_free_heap = release
    return dict(trainer=trainer, model=model, out=out, final=final, initial_sizes=initial_sizes,
                initial_rank=initial_rank, micro_batches=batches.served, optimizer_steps=len(optimizer_steps),
                heap_releases=len(heap_releases))


def test_training_reaches_target_density_with_smaller_model(full_run):
    trainer, model, final = full_run["trainer"], full_run["model"], full_run["final"]
    state = trainer.state
    assert trainer.step == STEPS and final["step"] == STEPS
    assert state.density() <= 0.5 and final["density"] <= 0.5
    assert state.density() > 0.5 - 0.1  # pruned to the target, not far past it
    assert ModelShape.from_model(model) == state.shape
    assert state.shape.block_params() <= 0.5 * state.original_shape.block_params()
    sizes = _base_weight_sizes(model)
    shrunk = [n for n in sizes if n in full_run["initial_sizes"] and sizes[n] < full_run["initial_sizes"][n]]
    assert any("proj" in n for n in shrunk) and len(shrunk) >= 8
    assert all(sizes[n] <= full_run["initial_sizes"][n] for n in sizes if n in full_run["initial_sizes"])
    assert state.total_rank() > full_run["initial_rank"]
    losses = [r["loss"] for r in trainer.history if "loss" in r]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    # the loop's wall time (benchmarks/train_time.py reads it): at least the steps' own times
    assert final["train_time_s"] >= sum(r["step_time_s"] for r in trainer.history if "step_time_s" in r) > 0
    with torch.no_grad():
        assert torch.isfinite(model(**random_batch()).loss)
    gen = model.generate(random_batch()["input_ids"][:1, :4], max_new_tokens=5, do_sample=False)
    assert gen.shape == (1, 9)


def test_events_metrics_and_distillation(full_run):
    trainer = full_run["trainer"]
    records = read_metrics(full_run["out"] / "metrics.jsonl")
    steps = [r for r in records if not r.get("final")]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for record in steps:
        missing = [f for f in METRIC_FIELDS if f not in record]
        assert not missing, f"metrics line for step {record['step']} lacks {missing}"
        assert all(math.isfinite(record[f]) for f in METRIC_FIELDS)
    assert records[-1].get("final") and records[-1]["density"] <= 0.5
    schedule = SparsityScheduler(trainer.apt_config)
    events = [r["step"] for r in steps if r.get("event")]
    assert events == schedule.event_steps
    # the steps whose masks decay toward the coming event log what their decision cost
    refreshed = [r["step"] for r in steps if "mask_refresh_s" in r]
    assert refreshed and refreshed == [r["step"] for r in steps if not r.get("event") and schedule.in_decay_window(r["step"])]
    assert all(r["mask_refresh_s"] > 0 for r in steps if "mask_refresh_s" in r)
    # an event's record says where its host time went
    for record in (r for r in steps if r.get("event")):
        parts = [record[f"event_{part}_s"] for part in trainer_module.APTrainer.EVENT_PARTS]
        assert all(value >= 0 for value in parts) and sum(parts) <= record["event_time_s"] + 1e-6
    # density falls at events only, and monotonically
    densities = [r["density"] for r in steps]
    # every event that removed units gave the freed heap back to the OS (apt_ds.training.heap)
    shrinking_events = sum(1 for before, r in zip([1.0] + densities, steps) if r.get("event") and r["density"] < before)
    assert shrinking_events > 0 and full_run["heap_releases"] == shrinking_events
    assert all(a >= b for a, b in zip(densities, densities[1:]))
    assert densities[0] == 1.0 and densities[-1] <= 0.5
    for r in steps:  # never below the schedule's target for that step by more than a unit's worth
        assert r["density"] >= schedule.density(r["step"]) - 0.1
    # distillation was active during the pruning phase and produced a real loss
    active = [r for r in steps if r["mu"] > 0]
    assert active and all(r["distill_loss"] > 0 for r in active)
    # ... on every distill_every-th step only (a record's step counts the step it completed); the
    # steps between run no teacher pass at all
    assert trainer.apt_config.distill_every > 1
    assert [r["step"] for r in active] == [s + 1 for s in range(STEPS) if schedule.distill_weight(s) > 0]
    assert all(r["distill_loss"] == 0.0 for r in steps if r["mu"] == 0)
    for r in active:
        assert r["loss"] == pytest.approx((1 - r["mu"]) * r["task_loss"] + r["mu"] * r["distill_loss"], rel=1e-5)
    ranks = [r["total_rank"] for r in steps]
    assert ranks[-1] > ranks[0] and all(a <= b for a, b in zip(ranks, ranks[1:]))


def test_gradient_accumulation_and_lr_schedule_across_rebuilds(full_run):
    trainer = full_run["trainer"]
    apt, train = _configs()
    assert full_run["micro_batches"] == STEPS * train.grad_accum_steps
    assert full_run["optimizer_steps"] == STEPS  # one optimizer step per accumulation cycle
    assert trainer.consumed_micro_batches == STEPS * train.grad_accum_steps
    factor = warmup_cosine(train.warmup_steps, train.steps)
    steps = [r for r in trainer.history if not r.get("final")]
    for record in steps:  # lr used at step s is the schedule at s-1, before and after every rebuild
        assert record["lr"] == pytest.approx(train.lr * factor(record["step"] - 1), rel=1e-9), record["step"]
    assert trainer.backend.lr == pytest.approx(train.lr * factor(STEPS), rel=1e-9)


# ---- gradient clipping (LocalBackend directly) -----------------------------------------------------

@pytest.mark.parametrize("crash_step", [10, 20], ids=["mid-pruning", "after-last-event"])
def test_resume_matches_uninterrupted_run(full_run, tmp_path, crash_step):
    apt, train = _configs()
    if crash_step == 10:  # between teacher steps of the pruning phase (events 4..20, teacher every 4th step)
        assert apt.pruning_start_step < crash_step < apt.pruning_end_step and apt.distill_every > 1
        assert (crash_step - apt.pruning_start_step) % apt.distill_every != 0
    crashed = APTrainer(tiny_llama("gqa"), apt, train, out_dir=tmp_path / "a", progress=False)
    with pytest.raises(_Crash):
        crashed.train(Batches(crash_at=crash_step * train.grad_accum_steps))
    checkpoint = tmp_path / "a" / "checkpoint"
    meta = json.loads((checkpoint / "apt_state.json").read_text())
    assert meta["step"] == crash_step and not meta["finished"]

    resumed = APTrainer(tiny_llama("gqa"), apt, train, out_dir=tmp_path / "b", progress=False)
    resumed.resume(checkpoint)
    assert resumed.step == crash_step
    resumed.train(Batches())
    reference = full_run["trainer"]

    assert resumed.step == STEPS
    new_losses = assert_resumed_as_uninterrupted(resumed, reference, crash_step, STEPS)
    if crash_step == 10:  # the resumed run kept the teacher's every-4th-step rhythm (history counts steps done)
        assert [s for s in range(11, 20) if new_losses[s]["distill_loss"] > 0] == [13, 17]


# ---- other modes -------------------------------------------------------------------------------------

def test_uniform_mode_run_keeps_a_stock_llama_shape(tmp_path):
    apt = APTConfig.for_steps(24, target_density=0.6, uniform=True, adapter_targets=("q_proj", "v_proj", "down_proj"))
    trainer = APTrainer(tiny_llama("gqa_tied"), apt, TrainConfig(steps=24, grad_accum_steps=1), progress=False)
    final = trainer.train(Batches())
    shape = trainer.state.shape
    assert final["density"] <= 0.6 and shape.uniform
    assert shape.hidden % shape.layers[0].num_q_heads == 0
    assert ModelShape.from_model(trainer.model) == shape
    assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight  # still tied
    with torch.no_grad():
        assert torch.isfinite(trainer.model(**random_batch()).loss)


def test_lora_baseline_run_changes_nothing_but_adapters():
    apt = APTConfig.for_steps(12).as_lora()
    model = tiny_llama("mha")
    sizes = _base_weight_sizes(model)
    trainer = APTrainer(model, apt, TrainConfig(steps=12, grad_accum_steps=3), progress=False)
    rank = trainer.state.total_rank()
    batches = Batches()
    final = trainer.train(batches)
    assert final["density"] == 1.0 and trainer.state.total_rank() == rank
    assert _base_weight_sizes(model) == sizes
    assert batches.served == 36 and trainer.step == 12
    assert all(r["distill_loss"] == 0.0 and r["mu"] == 0.0 for r in trainer.history if "loss" in r)
    assert any(bool((a.lora_B != 0).any()) for a in trainer.state.adapters.values())  # it did train


def test_differing_decisions_across_ranks_are_an_error():
    """A rank whose pruning decision differs must stop the run, not silently diverge."""
    import pytest


    class SplitBrainBackend(LocalBackend):
        def all_gather_object(self, obj):
            return [obj, "another rank decided differently"]

    model = tiny_llama("gqa")
    apt = APTConfig.for_steps(12, target_density=0.6)
    trainer = APTrainer(model, apt, TrainConfig(steps=12, micro_batch_size=2), backend=SplitBrainBackend(), progress=False)

    def batches():
        while True:
            yield random_batch(batch=2, length=8)

    with pytest.raises(RuntimeError, match="differ across ranks"):
        trainer.train(batches())


def test_ranks_compare_shapes_by_digest_not_by_the_kept_record():
    """After each event the ranks compare what they kept: a digest, not the record itself, which
    all_gather_object would copy from every rank to every rank (~2.3M indices at 70B)."""
    import pickle

    class RecordingBackend(LocalBackend):
        def all_gather_object(self, obj):
            gathered.append(len(pickle.dumps(obj)))
            return [obj]

    gathered: list[int] = []
    model = tiny_llama("gqa", intermediate_size=1024)  # a record of 1k+ indices per layer
    trainer = APTrainer(model, APTConfig.for_steps(12, target_density=0.6), TrainConfig(steps=12, micro_batch_size=2),
                        backend=RecordingBackend(), progress=False)
    trainer.train(random_batch(batch=2, length=8) for _ in iter(int, 1))
    assert trainer.state.density() < 0.99 and len(gathered) >= 2
    assert max(gathered) < 200


def test_shape_fingerprint_follows_kept_units_and_ranks():
    from apt_ds.algorithm.pruner import KeepDecision
    from apt_ds.algorithm.state import APTModel

    states = [APTModel(tiny_llama("gqa"), APTConfig(), seed=0) for _ in range(2)]
    assert states[0].shape_fingerprint() == states[1].shape_fingerprint()
    shape = states[0].shape
    neurons = [torch.ones(layer.ffn, dtype=torch.bool) for layer in shape.layers]
    neurons[0][3] = False
    states[0].shrink(KeepDecision([torch.ones(layer.num_kv_groups, dtype=torch.bool) for layer in shape.layers],
                                  neurons, torch.ones(shape.hidden, dtype=torch.bool), 0))
    assert states[0].shape_fingerprint() != states[1].shape_fingerprint()
    name = sorted(states[1].adapters)[0]
    before = states[1].shape_fingerprint()
    states[1].grow_rank(name, states[1].adapters[name].rank + 2)
    assert states[1].shape_fingerprint() != before


def test_rank_zero_alone_decides_whether_out_dir_holds_a_run(tmp_path):
    """A rank on another node whose file system cache still shows the checkpoint/ that rank 0 just
    moved aside (--overwrite) must not refuse alone, leaving the others waiting."""
    from apt_ds.config import ConfigError
    from apt_ds.training.out_files import check_unused_out_dir

    class Rank(LocalBackend):
        def __init__(self, rank: int, rank0_sees_a_run: bool):
            super().__init__()
            self.rank, self.rank0_sees_a_run = rank, rank0_sees_a_run

        def all_gather_object(self, obj):
            return [obj, False] if self.rank == 0 else [self.rank0_sees_a_run, obj]

    (tmp_path / "checkpoint").mkdir()
    check_unused_out_dir(tmp_path, Rank(1, rank0_sees_a_run=False))
    with pytest.raises(ConfigError, match="holds a run"):
        check_unused_out_dir(tmp_path, Rank(0, rank0_sees_a_run=True))
    with pytest.raises(ConfigError, match="holds a run"):  # rank 0 saw it: every rank stops
        check_unused_out_dir(tmp_path / "elsewhere", Rank(1, rank0_sees_a_run=True))
    unreadable = "out_dir x cannot be read: [Errno 116] Stale file handle"
    with pytest.raises(ConfigError, match="cannot be read: .*Stale file handle"):  # rank 0's error, on rank 1 too
        check_unused_out_dir(tmp_path / "elsewhere", Rank(1, rank0_sees_a_run=unreadable))


def test_an_unreadable_out_dir_is_said_on_every_rank(tmp_path, monkeypatch):
    from apt_ds.config import ConfigError
    from apt_ds.training.out_files import check_unused_out_dir

    gathered = []

    class Rank0(LocalBackend):
        def all_gather_object(self, obj):
            gathered.append(obj)
            return [obj]

    def stale(self):
        raise OSError(116, "Stale file handle")

    monkeypatch.setattr(type(tmp_path), "exists", stale)
    with pytest.raises(ConfigError, match="cannot be read"):
        check_unused_out_dir(tmp_path, Rank0())
    assert gathered and "Stale file handle" in gathered[0]  # reached the other ranks before rank 0 raised


def test_progress_bar_shows_task_loss_and_distillation_apart_on_unlogged_steps_too():
    model = tiny_llama("gqa")
    apt = APTConfig.for_steps(8, target_density=0.6, distill_every=1)
    trainer = APTrainer(model, apt, TrainConfig(steps=8, log_every=3), progress=False)
    fields = []
    from apt_ds.training import trainer as trainer_module

    progress = trainer_module.progress_fields
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer_module, "progress_fields", lambda record, density: fields.append(progress(record, density)) or fields[-1])
        trainer.train(iter(random_batch(seed=i) for i in range(100)))
    assert len(fields) == 8 and all(set(f) >= {"task_loss", "density"} for f in fields)
    distilled = [f for f in fields if "distill" in f]
    assert distilled and len(distilled) < 8  # only on distillation steps
    assert all("loss" not in f for f in fields)  # never the task/distillation mix


@pytest.mark.parametrize("cudnn_attention, before", [(False, True), (False, False), (True, False), (True, True)])
def test_training_turns_cudnn_attention_off_unless_asked_and_puts_it_back(cudnn_attention, before):
    """cuDNN's attention kernels are off while training (each pruning event gives attention new
    shapes to plan for), in forward, backward and the final evaluation, unless asked for: then
    the process's own setting stands. Afterwards the setting is as before."""
    model = tiny_llama("gqa")
    trainer = APTrainer(model, APTConfig.for_steps(6, target_density=0.6),
                        TrainConfig(steps=6, cudnn_attention=cudnn_attention), progress=False,
                        eval_batches=[random_batch(seed=99)])
    seen = []

    def record(module, args, output):  # the setting in this forward and, through its output, in its backward
        seen.append(("forward", torch.is_grad_enabled(), torch.backends.cuda.cudnn_sdp_enabled()))
        if output[0].requires_grad:
            output[0].register_hook(lambda grad: seen.append(("backward", True, torch.backends.cuda.cudnn_sdp_enabled())))

    model.model.layers[0].self_attn.register_forward_hook(record)
    process_setting = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(before)
    try:
        trainer.train(iter(random_batch(seed=i) for i in range(100)))
        assert torch.backends.cuda.cudnn_sdp_enabled() is before  # put back
    finally:
        torch.backends.cuda.enable_cudnn_sdp(process_setting)
    assert {kind for kind, _, _ in seen} == {"forward", "backward"}
    assert any(not grad for _, grad, _ in seen)  # the evaluations' forwards
    assert all(enabled is (cudnn_attention and before) for _, _, enabled in seen)


def test_a_library_trainer_leaves_another_run_alone_and_takes_any_iterable(full_run, tmp_path):
    """A new trainer (step 0) pointed at a run's directory is refused before it writes (its checkpoint
    would be replaced, its metrics.jsonl would mix two runs); a list of batches trains like an
    iterator; batches that run out are named."""
    from apt_ds.config import ConfigError

    out = full_run["out"]
    before = {p.name: p.stat().st_mtime_ns for p in (out / "checkpoint").iterdir()}
    metrics = (out / "metrics.jsonl").read_text()
    apt, train = _configs()
    with pytest.raises(ConfigError, match=r"holds a run .*continue it with trainer\.resume"):
        APTrainer(tiny_llama("gqa"), apt, train, out_dir=out, progress=False).train(Batches())
    assert {p.name: p.stat().st_mtime_ns for p in (out / "checkpoint").iterdir()} == before
    assert (out / "metrics.jsonl").read_text() == metrics

    lora = APTConfig.for_steps(4).as_lora()
    short = TrainConfig(steps=4, grad_accum_steps=1, warmup_steps=1)
    listed = [random_batch(batch=4, length=16, seed=i) for i in range(4)]
    assert APTrainer(tiny_llama("gqa"), lora, short, progress=False).train(listed)["step"] == 4
    with pytest.raises(ValueError, match=r"the batches ran out at step 4 of 4: give at least steps x grad_accum_steps"):
        APTrainer(tiny_llama("gqa"), lora, short, progress=False).train(listed[:3])
    resumed = APTrainer(tiny_llama("gqa"), apt, train, progress=False)
    resumed.resume(out / "checkpoint")  # the finished run: its micro-batches are skipped first
    with pytest.raises(ValueError, match=r"the batches ran out"):
        resumed.train(listed)


def test_a_schedule_that_ends_after_the_run_is_refused():
    """APTConfig's defaults are a 1000-step pruning phase: with 20 steps nothing would be pruned, silently."""
    from apt_ds.config import ConfigError

    with pytest.raises(ConfigError, match=r"APTConfig\.pruning_end_step \(1000\) must be <= steps \(20\)"):
        APTrainer(tiny_llama("gqa"), APTConfig(target_density=0.5), TrainConfig(steps=20), progress=False)
    APTrainer(tiny_llama("gqa"), APTConfig.for_steps(20, target_density=0.5), TrainConfig(steps=20), progress=False)
