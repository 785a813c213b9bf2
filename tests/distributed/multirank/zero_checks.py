"""Multi-rank checks of apt_ds.distributed.zero.DeepSpeedBackend, run by tests/distributed/test_zero.py.

    deepspeed --num_gpus 2 tests/distributed/multirank/zero_checks.py --config ds_configs/zero2.json --out res.json
    python tests/distributed/multirank/zero_checks.py --config ds_configs/zero2.json --out res.json --only baseline

Every rank runs the same scenarios on a tiny random GQA LLaMA with adapters on q/v; rank 0
writes one JSON of measurements (losses, Adam values, RSS, timings) that the test asserts on.
Scenarios are mirrored on `LocalBackend` over the full global batch (the reference the
DeepSpeed seam must match). The global batch per step is fixed, so any world size / micro
batch / gradient accumulation split must give the same trajectory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import weakref
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from memory_probes import fixed_mmap_threshold, live_tensor_mb  # noqa: E402

from apt_ds.algorithm.adapters import add_adapters, find_adapters  # noqa: E402
from apt_ds.distributed.backend import LocalBackend  # noqa: E402
from apt_ds.distributed.zero import DeepSpeedBackend  # noqa: E402
from apt_ds.training.heap import release_free_heap  # noqa: E402

GLOBAL_BATCH, SEQ, VOCAB = 4, 16, 128
LR, WD = 1e-2, 0.01
CLIP_NORM = 0.02  # below the scenario's gradient norms, so every step is clipped
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.1 * step)  # a schedule whose position matters


def make_model(seed: int = 0, hidden: int = 64, rank: int = 4, targets=("q_proj", "v_proj")):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    model = LlamaForCausalLM(cfg)
    add_adapters(model, list(targets), rank=rank, alpha=2 * rank, seed=seed)
    with torch.no_grad():  # B = 0 makes lora_A's first gradients zero; start from a non-trivial point
        gen = torch.Generator().manual_seed(seed + 1)
        for adapter in find_adapters(model).values():
            adapter.lora_B.normal_(0, 0.02, generator=gen)
    model.train()
    return model


def global_batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)


class Runner:
    """Drives a backend over the fixed global batches, splitting them by rank and micro-batch."""

    def __init__(self, backend, model, gas: int):
        self.backend, self.model, self.gas = backend, model, gas
        self.world, self.rank = backend.world_size, backend.rank
        self.step_times = []

    def micro_batches(self, step: int):
        rows = global_batch(step).chunk(self.world)[self.rank]
        return rows.chunk(self.gas)

    def train_step(self, step: int, before_step=None) -> float:
        t0 = time.perf_counter()
        total = torch.zeros((), dtype=torch.float64)
        for ids in self.micro_batches(step):
            out = self.backend.forward(input_ids=ids, labels=ids)
            loss = out.loss
            self.backend.backward(loss)
            total += loss.detach().double()
        if before_step is not None:
            before_step()
        self.backend.step()
        self.step_times.append(time.perf_counter() - t0)
        total = self.backend.all_reduce_sum(total) / (self.world * self.gas)
        return float(total)

    def eval_loss(self, step: int) -> float:
        total = torch.zeros((), dtype=torch.float64)
        for ids in self.micro_batches(step):
            total += self.backend.forward_no_grad(input_ids=ids, labels=ids).loss.double()
        return float(self.backend.all_reduce_sum(total) / (self.world * self.gas))


def make_backend(kind: str, ds_config: dict, model, gas: int, micro: int | None, max_grad_norm: float = 0.0):
    backend = LocalBackend() if kind == "local" else DeepSpeedBackend(ds_config, micro_batch_size=micro)
    if kind == "local":
        backend.rank, backend.world_size = 0, 1
    backend.attach(model, LR, lr_lambda, WD, gas, max_grad_norm=max_grad_norm)
    return backend


def _torch_optimizer(backend) -> torch.optim.Optimizer:
    """The torch AdamW that steps (DeepSpeed's inner one over flat fp32 partitions); it changes at a rebuild."""
    return backend.adam_optimizer


def close(backend) -> None:
    if isinstance(backend, DeepSpeedBackend):
        backend.close()


# ---- shape changes (work on both backends) ----------------------------------------------------
def grow_change(backend, model, new_rank):
    def change():
        gen = torch.Generator().manual_seed(7)
        out = {}
        for name, adapter in find_adapters(model).items():
            with backend.gathered([adapter.lora_A, adapter.lora_B]):
                for key, edits in adapter.grow_rank(new_rank, gen).items():
                    out[f"{name}.{key}"] = edits
        return out
    return change


def _replace(linear: nn.Linear, weight: torch.Tensor) -> None:
    linear.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
    linear.out_features, linear.in_features = weight.shape


def shrink_change(backend, model):
    """Layer 0: keep every other FFN neuron. Layer 1: drop KV group 1 (q heads 2,3; kv head 1)."""
    def change():
        mlp = model.model.layers[0].mlp
        keep = torch.arange(0, mlp.gate_proj.out_features, 2)
        with backend.gathered([mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]):
            _replace(mlp.gate_proj, mlp.gate_proj.weight.detach().index_select(0, keep))
            _replace(mlp.up_proj, mlp.up_proj.weight.detach().index_select(0, keep))
            _replace(mlp.down_proj, mlp.down_proj.weight.detach().index_select(1, keep))
        attn = model.model.layers[1].self_attn
        head_dim = attn.head_dim
        q_keep = torch.arange(0, 2 * head_dim)
        kv_keep = torch.arange(0, head_dim)
        q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        change = {}
        with backend.gathered([q.weight, q.lora_A, q.lora_B, k.weight, v.weight, v.lora_A, v.lora_B, o.weight]):
            _replace(q, q.weight.detach().index_select(0, q_keep))
            _replace(k, k.weight.detach().index_select(0, kv_keep))
            _replace(v, v.weight.detach().index_select(0, kv_keep))
            _replace(o, o.weight.detach().index_select(1, q_keep))
            for prefix, adapter, idx in (("model.layers.1.self_attn.q_proj", q, q_keep),
                                         ("model.layers.1.self_attn.v_proj", v, kv_keep)):
                for key, edits in adapter.keep_adapter_entries(out_index=idx, in_index=None).items():
                    change[f"{prefix}.{key}"] = edits
        return change
    return change


def adam_probe(backend, name: str) -> dict:
    """A few Adam values of `name` (old entries) via the backend's own access path."""
    param = dict(backend.module.named_parameters())[name]
    if isinstance(backend, LocalBackend):
        state = backend.optimizer.state[param]
        avg, sq, step = state["exp_avg"], state["exp_avg_sq"], float(state["step"])
    else:
        from deepspeed.utils import safe_get_full_optimizer_state

        avg = safe_get_full_optimizer_state(param, "exp_avg")
        sq = safe_get_full_optimizer_state(param, "exp_avg_sq")
        basic = backend.adam_optimizer
        step = float(next(iter(basic.state.values()))["step"])
    return {"exp_avg": avg.flatten()[:6].tolist(), "exp_avg_sq": sq.flatten()[:6].tolist(), "step": step,
            "shape": list(avg.shape), "exp_avg_tail": avg[:, -1].abs().sum().item() if avg.dim() == 2 else None}


# ---- scenarios ------------------------------------------------------------------------------
def scenario(kind, ds_config, gas, micro, steps=6, event=None, event_at=3, probe=None, max_grad_norm=0.0):
    """Train `steps` steps; after step `event_at` apply `event` ("rebuild", "grow", "shrink")."""
    model = make_model()
    backend = make_backend(kind, ds_config, model, gas, micro, max_grad_norm)
    runner = Runner(backend, model, gas)
    rec = {"losses": [], "grad_norms": [], "stepped_norms": []}
    for step in range(steps):
        if event and step == event_at:
            if probe:
                rec["probe_before"] = adam_probe(backend, probe)
            t0 = time.perf_counter()
            if event == "rebuild":
                backend.apply_shape_change(lambda: {})
            elif event == "grow":
                backend.apply_shape_change(grow_change(backend, model, 8))
            elif event == "shrink":
                backend.apply_shape_change(shrink_change(backend, model))
            rec["rebuild_s"] = time.perf_counter() - t0
            rec["eval_after_event"] = runner.eval_loss(step)
            rec["lr_after_event"] = backend.lr
            if probe:
                rec["probe_after"] = adam_probe(backend, probe)
        stepped = []  # sums of squares of the gradients the torch optimizer steps with (after clipping)
        handle = _torch_optimizer(backend).register_step_pre_hook(lambda opt, args, kwargs: stepped.append(sum(
            float(p.grad.double().pow(2).sum()) for g in opt.param_groups for p in g["params"] if p.grad is not None)))
        rec["losses"].append(runner.train_step(step))
        handle.remove()
        rec["grad_norms"].append(backend.grad_norm)
        # partitions are disjoint across ranks (ZeRO), so the global norm is the root of the summed squares
        rec["stepped_norms"].append(float(backend.all_reduce_sum(torch.tensor(sum(stepped), dtype=torch.float64))) ** 0.5)
    rec["lr"] = backend.lr
    rec["optimizer_steps"] = backend.optimizer_steps
    rec["step_s"] = sorted(runner.step_times)[len(runner.step_times) // 2]
    return rec, backend, model, runner


def run_grads(kind, ds_config, gas, micro):
    model = make_model()
    backend = make_backend(kind, ds_config, model, gas, micro)
    runner = Runner(backend, model, gas)
    runner.train_step(0)
    grads, unchanged = {}, {}
    probe = "model.layers.0.self_attn.q_proj.lora_A"

    def grab():
        for name, param in backend.module.named_parameters():
            if param.requires_grad:
                grads[name] = backend.full_grad(name, param).double().flatten()[:8].tolist()

    if kind != "local" and gas > 1:  # parameters must not move on non-boundary micro-batches
        before = backend.full_param(probe, dict(model.named_parameters())[probe]).clone()
        ids = runner.micro_batches(1)[0]
        backend.backward(backend.forward(input_ids=ids, labels=ids).loss)
        after = backend.full_param(probe, dict(model.named_parameters())[probe])
        unchanged["non_boundary_param_delta"] = float((after - before).abs().max())
        unchanged["steps_mid_cycle"] = backend.engine.global_steps
        for ids in runner.micro_batches(1)[1:]:
            backend.backward(backend.forward(input_ids=ids, labels=ids).loss)
        grab()
        backend.step()
    else:
        runner.train_step(1, before_step=grab)
    values = {}  # full values after two steps: trainable (masters) and frozen (gathered)
    for name, param in model.named_parameters():
        if param.requires_grad or name.endswith("layers.1.mlp.down_proj.weight"):
            full = backend.full_param(name, param) if kind != "local" else param.detach()
            values[name] = [list(full.shape), full.double().flatten()[-8:].tolist()]
    close(backend)
    return {"grads": grads, "values": values, **unchanged}


def shrunk_model():
    """A fresh model shrunk like `shrink_change` before any backend is attached (frozen base
    identical to the shrunk training run's)."""
    model = make_model()
    local = LocalBackend()
    local.rank, local.world_size = 0, 1
    shrink_change(local, model)()
    return model


def resume(ds_config, ckpt: Path, gas: int, micro) -> dict:
    """Fresh shrunk model, attach, load `ckpt` (saved after step 3), train steps 3 and 4."""
    model = shrunk_model()
    backend = make_backend("ds", ds_config, model, gas, micro)
    backend.load(ckpt)
    steps_loaded, lr_loaded = backend.optimizer_steps, backend.lr
    runner = Runner(backend, model, gas)
    resumed = [runner.train_step(s) for s in (3, 4)]
    close(backend)
    return {"resumed": resumed, "steps_loaded": steps_loaded, "lr_loaded": lr_loaded,
            "zero_stage": backend.zero_stage, "world_size": backend.world_size}


def run_save_load(ds_config, tmp: Path, gas: int, micro):
    """Shrink, train, save; continue 2 steps; rebuild a fresh shrunk model, load, replay 2 steps."""
    model = make_model()
    backend = make_backend("ds", ds_config, model, gas, micro)
    runner = Runner(backend, model, gas)
    for step in range(2):
        runner.train_step(step)
    backend.apply_shape_change(shrink_change(backend, model))
    runner.train_step(2)
    backend.save(tmp)
    cont = [runner.train_step(s) for s in (3, 4)]
    lr_cont = backend.lr
    close(backend)
    del backend, runner, model
    gc.collect()
    out = resume(ds_config, tmp, gas, micro)
    return {**out, "continued": cont, "lr_continued": lr_cont, "ckpt": str(tmp),
            "ckpt_files": sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*"))}


def run_resume_elsewhere(specs: list[str], ds_config: dict, gas: int, micro) -> dict:
    """Load checkpoints saved by another launch (other world size / ZeRO stage): each spec is
    KEY=CKPT_DIR@CONFIG_JSON. Also loads into a model of the wrong shape (error message)."""
    out = {}
    for spec in specs:
        key, rest = spec.split("=", 1)
        ckpt, config_path = rest.split("@", 1)
        out[key] = resume(fixed_config(config_path), Path(ckpt), gas, micro)
    if specs:  # the unshrunk model has other lora_B / weight shapes than the checkpoint
        ckpt = Path(specs[0].split("=", 1)[1].split("@", 1)[0])
        backend = make_backend("ds", ds_config, make_model(), gas, micro)
        try:
            backend.load(ckpt)
            out["mismatch_error"] = None
        except ValueError as err:
            out["mismatch_error"] = str(err)
        close(backend)
    return out


def run_launcher_probe(ds_config) -> dict:
    """Init the backend (process group from the launcher's env) and all-reduce rank + 1."""
    backend = DeepSpeedBackend(ds_config)
    total = backend.all_reduce_sum(torch.tensor([float(backend.rank + 1)]))
    views = backend.all_gather_object({key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    return {"sum": float(total), "world_size": backend.world_size, "rank_env": views}


def run_leak(ds_config, gas, micro, rebuilds: int, hidden: int = 64, rank: int = 4):
    """Rebuild `rebuilds` times (one step between); RSS, engine collection, hook counts."""
    import psutil

    proc = psutil.Process()
    fixed_mmap_threshold()
    model = make_model(hidden=hidden, rank=rank, targets=ALL_TARGETS if rank > 4 else ("q_proj", "v_proj"))
    trainable_mb = sum(p.numel() for p in model.parameters() if p.requires_grad) * 4 / 2**20
    backend = make_backend("ds", ds_config, model, gas, micro)
    runner = Runner(backend, model, gas)
    runner.train_step(0)
    rss, dead, hooks, times, tensors = [], [], [], [], []
    for i in range(rebuilds):
        old = weakref.ref(backend.engine)
        old_opt = weakref.ref(backend.engine.optimizer)
        offload = getattr(backend.engine.optimizer, "parameter_offload", None)  # ZeRO-3's hook owner
        old_offload = weakref.ref(offload) if offload is not None else (lambda: None)
        del offload
        t0 = time.perf_counter()
        backend.apply_shape_change(lambda: {})
        times.append(time.perf_counter() - t0)
        runner.train_step(1 + i)
        gc.collect()
        dead.append(old() is None and old_opt() is None and old_offload() is None)
        hooks.append(sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()))
        release_free_heap()  # RSS then reflects live memory, not allocator caching
        rss.append(proc.memory_info().rss / 2**20)
        if i in (0, rebuilds - 1):  # a gc scan is slow: first and last only
            tensors.append(live_tensor_mb())
    close(backend)
    return {"trainable_fp32_mb": trainable_mb, "rss_mb": rss, "old_engine_collected": dead, "hook_counts": hooks, "live_tensor_mb": tensors, "rebuild_s": times,
            "step_s": sorted(runner.step_times)[len(runner.step_times) // 2]}


def fixed_config(path) -> dict:
    """A shipped config in fp32 (so ranks and references agree closely), every param partitioned."""
    ds_config = json.loads(Path(path).read_text())
    ds_config.setdefault("bf16", {})["enabled"] = False
    ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition every tiny param
    return ds_config


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="all",
                        help="comma list: baseline,rebuild,grow,shrink,gas,grads,save,leak,bf16 (all), resume, probe")
    parser.add_argument("--micro", type=int, default=None)
    parser.add_argument("--rebuilds", type=int, default=6)
    parser.add_argument("--leak-hidden", type=int, default=512, help="512 with --leak-rank 64: ~1M trainable params")
    parser.add_argument("--leak-rank", type=int, default=64)
    parser.add_argument("--resume", action="append", default=[], help="KEY=CKPT_DIR@CONFIG_JSON (section resume)")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    ds_config = fixed_config(args.config)
    only = set(args.only.split(",")) if args.only != "all" else None
    out: dict = {}
    probe = "model.layers.1.self_attn.q_proj.lora_B"

    def both(key, gas=1, **kw):
        rec, backend, *_ = scenario("ds", ds_config, gas, args.micro, **kw)
        close(backend)
        ref, *_ = scenario("local", ds_config, gas, None, **kw)
        out[key], out[key + "_local"] = rec, ref

    def gas():
        rec, backend, *_ = scenario("ds", ds_config, 2, None, event="grow")
        close(backend)
        out["gas2_grow"] = rec

    def grads():
        out["grads"] = run_grads("ds", ds_config, 1, None)
        out["grads_gas2"] = run_grads("ds", ds_config, 2, None)
        out["grads_local"] = run_grads("local", ds_config, 1, None)

    def bf16():
        bf16_config = json.loads(json.dumps(ds_config))
        bf16_config["bf16"]["enabled"] = True
        rec, backend, *_ = scenario("ds", bf16_config, 1, None, event="grow", probe=probe)
        out["bf16_grow_dtype"] = str(dict(backend.module.named_parameters())[probe].dtype)
        close(backend)
        out["bf16_grow"] = rec
        rec, backend, *_ = scenario("ds", bf16_config, 1, None)
        close(backend)
        out["bf16_baseline"] = rec

    sections = {
        "baseline": lambda: both("baseline"),
        "rebuild": lambda: both("rebuild", event="rebuild"),
        "grow": lambda: both("grow", event="grow", probe=probe),
        "shrink": lambda: both("shrink", event="shrink", probe=probe),
        "clip": lambda: both("clip", gas=2, event="shrink", max_grad_norm=CLIP_NORM),
        "gas": gas,
        "grads": grads,
        "save": lambda: out.update(save_load=run_save_load(ds_config, Path(args.out).parent / "ckpt", 1, None)),
        "leak": lambda: out.update(leak=run_leak(ds_config, 1, None, args.rebuilds, args.leak_hidden, args.leak_rank)),
        "bf16": bf16,
    }
    extra = {  # only when asked for by name
        "resume": lambda: out.update(resume=run_resume_elsewhere(args.resume, ds_config, 1, args.micro)),
        "probe": lambda: out.update(probe=run_launcher_probe(ds_config)),
    }
    out["section_s"] = {}
    for name, run in [*sections.items(), *extra.items()]:
        if (only is None and name in sections) or (only is not None and name in only):
            t0 = time.perf_counter()
            run()
            out["section_s"][name] = round(time.perf_counter() - t0, 2)
    out["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
    out["clip_norm"] = CLIP_NORM
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(out, indent=1))
    if torch.distributed.is_initialized():  # a clean teardown: see DeepSpeedBackend.shutdown
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
