"""DeepSpeed (ZeRO) costs of apt_ds, measured side by side in one run (medians of repeats).

(a) peak / steady RSS per rank, ZeRO-3, 1 rank vs 2 ranks, on the same model, with the model
    built the way apt_ds builds it (full fp32 model on every rank, partitioned by
    `deepspeed.initialize`); with the shipped config (stage3_max_live_parameters and
    max_reuse_distance 1e9: gathered weights stay resident) and with "release" (both 0:
    weights are freed after use); and, as an analysis, built under `deepspeed.zero.Init`
    (each rank only ever holds its partition). Launches are interleaved across repeats.
(b) one engine rebuild (`apply_shape_change` with a function-preserving rank growth: every
    adapter +2 rank) vs one training step, ZeRO-2 and ZeRO-3, 2 ranks; interleaved
    rebuild / first step after it / steady step.
(c) APT step (APTModel: salience hooks incl. kurtosis, masks, tuner.accumulate through
    full_param/full_grad) vs plain LoRA step at density 1.0, ZeRO-3 (or --apt-config zero2,
    --apt-fp32), 2 ranks; both engines live in the same processes, stepped alternately; the
    APT step is also timed by part. Under a noisy load use the paired per-step ratio.

    python benchmarks/zero_bench.py --repeats 3 --steps 20 --json bench_out/zero_bench.json

Every worker runs with OMP_NUM_THREADS=1 and DS_ACCELERATOR=cpu; 2 ranks use DeepSpeed's
launcher (`--num_gpus 2`), 1 rank is a plain `python` process (the backend makes a 1-rank
group). Model: `build_tiny_model(32000, hidden 512, FFN 1408, 8 layers, 8 q / 4 kv heads)`,
56.4M parameters (215 MiB fp32); adapters on q_proj/v_proj rank 8 (APTConfig defaults);
shipped ds_configs (bf16 "auto": bf16 on this CPU); micro-batch 2 x 128 tokens per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VOCAB = 32000
MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4)
MICRO, SEQ = 2, 128


# ---- worker (one per rank) -------------------------------------------------------------------
def _mem() -> dict:
    import psutil

    from apt_ds.io.metrics import process_peak_rss_mb

    return {"rss_mb": psutil.Process().memory_info().rss / 2**20,
            "peak_rss_mb": process_peak_rss_mb()}  # getrusage's alone misses what interval readings reset


def _batch(rank: int, step: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids}


def _backend(config: str, fp32: bool = False):
    from apt_ds.distributed.zero import DeepSpeedBackend

    backend = DeepSpeedBackend(ROOT / "ds_configs" / config, micro_batch_size=MICRO)
    if fp32:
        backend.user_config["bf16"] = {"enabled": False}
    return backend


def _lora_model(zero_init_config: dict | None = None):
    import contextlib

    from apt_ds.algorithm.adapters import add_adapters
    from apt_ds.config import APTConfig
    from apt_ds.io.modeling import build_tiny_model

    apt = APTConfig()
    if zero_init_config is None:
        context = contextlib.nullcontext()
    else:
        import deepspeed

        context = deepspeed.zero.Init(config_dict_or_path=zero_init_config)
    with context:
        model = build_tiny_model(VOCAB, **MODEL)
    add_adapters(model, apt.adapter_targets, apt.adapter_rank, apt.adapter_alpha)
    return model.train()


def _warm_imports() -> None:
    """Lazy imports (torch._dynamo, transformers' LLaMA) done up front, in every variant: under
    zero.Init (which patches Tensor.__new__) importing torch._dynamo fails, and the baseline
    RSS must not depend on the variant."""
    import torch._dynamo  # noqa: F401

    from apt_ds.io.modeling import build_tiny_model

    build_tiny_model(64, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1)


def _step(backend, rank: int, step: int) -> float:
    start = time.perf_counter()
    backend.backward(backend.forward(**_batch(rank, step)).loss)
    backend.step()
    return time.perf_counter() - start


def worker_memory(spec: dict) -> dict:
    """(a): RSS at each phase; the model built plainly or under deepspeed.zero.Init."""
    import torch

    from apt_ds.distributed.ds_config import resolve_config

    torch.set_num_threads(1)
    backend = _backend("zero3.json")
    zero = backend.user_config["zero_optimization"]
    if spec["release"]:  # free gathered weights right after use instead of keeping up to 1e9 live
        zero.update(stage3_max_live_parameters=0, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
    else:  # the measured "shipped" row: 1e9 kept (zero3.json's "auto" is 0 on the CPU accelerator since issue 47)
        zero.update(stage3_max_live_parameters=10**9, stage3_max_reuse_distance=10**9)
    _warm_imports()
    phases = {"imported": _mem()}
    zero_init = None
    if spec["zero_init"]:
        from deepspeed.accelerator import get_accelerator

        zero_init = resolve_config(backend.user_config, grad_accum_steps=1, world_size=backend.world_size,
                                   micro_batch_size=MICRO, bf16_supported=get_accelerator().is_bf16_supported(),
                                   hidden_size=MODEL["hidden_size"])
    model = _lora_model(zero_init)
    phases["model_built"] = _mem()
    backend.attach(model, 1e-4, lambda s: 1.0, 0.0, 1, max_grad_norm=1.0)
    phases["engine_ready"] = _mem()
    times = [_step(backend, backend.rank, s) for s in range(spec["steps"])]
    phases["after_steps"] = _mem()
    held = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() if hasattr(p, "ds_tensor")
               else p.numel() * p.element_size() for p in model.parameters())
    return {"phases": phases, "param_bytes_held_mb": held / 2**20, "step_s": statistics.median(times[1:]),
            "dtype": str(backend.param_dtype), "params_m": sum(getattr(p, "ds_numel", p.numel())
                                                             for p in model.parameters()) / 1e6}


def worker_rebuild(spec: dict) -> dict:
    """(b): interleaved rebuild (rank growth, function preserving) / first step / steady step."""
    import torch

    from apt_ds.algorithm.adapters import find_adapters

    torch.set_num_threads(1)
    backend = _backend(spec["config"])
    model = _lora_model()
    backend.attach(model, 1e-4, lambda s: 1.0, 0.0, 1, max_grad_norm=1.0)
    step = 0
    for _ in range(2):  # warm-up (ZeRO-3 records its fetch trace in the second step)
        _step(backend, backend.rank, step)
        step += 1
    rebuild_s, first_s, steady_s = [], [], []
    gen = torch.Generator().manual_seed(0)
    for _ in range(spec["repeats"]):
        adapters = find_adapters(model)

        def grow():
            change = {}
            for name in sorted(adapters):
                adapter = adapters[name]
                with backend.gathered([adapter.lora_A, adapter.lora_B]):
                    for key, edits in adapter.grow_rank(adapter.rank + 2, gen).items():
                        change[f"{name}.{key}"] = edits
            return change

        backend.barrier()
        start = time.perf_counter()
        backend.apply_shape_change(grow)
        rebuild_s.append(time.perf_counter() - start)
        first_s.append(_step(backend, backend.rank, step))
        steady_s += [_step(backend, backend.rank, step + 1), _step(backend, backend.rank, step + 2)]
        step += 3
    return {"rebuild_s": rebuild_s, "first_step_after_s": first_s, "steady_step_s": steady_s,
            "final_rank": next(iter(find_adapters(model).values())).rank, "trainable_m":
            sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad) / 1e6}


def worker_apt_vs_lora(spec: dict) -> dict:
    """(c): two engines in the same processes (same model, same seed), stepped alternately."""
    import torch

    from apt_ds.algorithm.state import APTModel
    from apt_ds.algorithm.tuner import AdaptiveTuner
    from apt_ds.config import APTConfig
    from apt_ds.io.modeling import build_tiny_model

    torch.set_num_threads(1)
    lora_backend = _backend(spec["config"], spec["fp32"])
    lora_model = _lora_model()
    lora_backend.attach(lora_model, 1e-4, lambda s: 1.0, 0.0, 1, max_grad_norm=1.0)

    apt_backend = _backend(spec["config"], spec["fp32"])
    config = APTConfig()
    apt_model = build_tiny_model(VOCAB, **MODEL).train()
    state = APTModel(apt_model, config, reduce_sum=apt_backend.all_reduce_sum, world_size=apt_backend.world_size)
    state.salience.enabled = True
    tuner = AdaptiveTuner(config)
    apt_backend.attach(apt_model, 1e-4, lambda s: 1.0, 0.0, 1, max_grad_norm=1.0)
    rank = apt_backend.rank

    parts: dict[str, list[float]] = {"forward_backward": [], "salience_end_step": [], "tuner_accumulate": [],
                                     "optimizer_step": []}

    def apt_step(step: int) -> float:
        marks = [time.perf_counter()]
        apt_backend.backward(apt_backend.forward(**_batch(rank, step)).loss)
        marks.append(time.perf_counter())
        state.salience.end_step()  # one all-reduce of all salience sums
        marks.append(time.perf_counter())
        tuner.accumulate(state.adapters, apt_backend.full_param, apt_backend.full_grad)  # 2 collectives / adapter
        marks.append(time.perf_counter())
        apt_backend.step()
        marks.append(time.perf_counter())
        for key, a, b in zip(parts, marks, marks[1:]):
            parts[key].append(b - a)
        return marks[-1] - marks[0]

    for step in range(2):  # warm-up both
        _step(lora_backend, rank, step)
        apt_step(step)
    lora_s, apt_s = [], []
    for step in range(2, 2 + spec["repeats"]):
        if step % 2:  # alternate which goes first
            lora_s.append(_step(lora_backend, rank, step))
            apt_s.append(apt_step(step))
        else:
            apt_s.append(apt_step(step))
            lora_s.append(_step(lora_backend, rank, step))
    parts = {key: values[2:] for key, values in parts.items()}  # drop the warm-up steps
    return {"lora_step_s": lora_s, "apt_step_s": apt_s, "apt_parts_s": parts, "density": state.density(),
            "has_salience": state.salience.has_scores}


WORKERS = {"memory": worker_memory, "rebuild": worker_rebuild, "apt_vs_lora": worker_apt_vs_lora}


def run_worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    result = WORKERS[spec["mode"]](spec)
    rank = int(os.environ.get("RANK", "0"))
    result["rank"], result["world_size"] = rank, int(os.environ.get("WORLD_SIZE", "1"))
    Path(spec["out"]).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))


# ---- orchestration ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(out_dir: Path, name: str, ranks: int, spec: dict) -> list[dict]:
    spec = {**spec, "out": str(out_dir / f"{name}.json")}
    spec_path = out_dir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    script = [str(Path(__file__).resolve()), "--worker", str(spec_path)]
    if ranks == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
               str(_free_port()), *script]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    started = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    files = [Path(spec["out"]).with_suffix(f".rank{r}.json") for r in range(ranks)]
    if result.returncode != 0 or not all(f.exists() for f in files):
        raise RuntimeError(f"{name} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    print(f"[zero_bench] {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return [json.loads(f.read_text()) for f in files]


def hardware() -> dict:
    import deepspeed
    import torch
    import transformers

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    mem = next((line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), "?")
    return {"cpu": fields.get("Model name", platform.processor()).strip(), "cpus": fields.get("CPU(s)", "?").strip(),
            "mem_gib": round(int(mem) / 2**20, 1), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


STAGES = {"memory", "rebuild", "apt_vs_lora"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # set by DeepSpeed's launcher
    parser.add_argument("--repeats", type=int, default=3, help="launches per memory configuration (a)")
    parser.add_argument("--steps", type=int, default=10, help="repeats inside the timing workers (b), (c)")
    parser.add_argument("--only", default="memory,rebuild,apt_vs_lora")
    parser.add_argument("--apt-config", default="zero3", choices=["zero2", "zero3"], help="ZeRO stage for (c)")
    parser.add_argument("--apt-fp32", action="store_true", help="(c) in fp32 instead of the config's bf16 \"auto\"")
    parser.add_argument("--out-dir", default="bench_out/zero_bench")
    parser.add_argument("--json", default=None, help="write the summary here")
    args = parser.parse_args()
    if args.worker:
        run_worker(args.worker)
        return
    only = set(args.only.split(","))
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be >= 1")
    if only - STAGES:
        parser.error(f"--only: unknown {sorted(only - STAGES)}; choose from {','.join(sorted(STAGES))}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    med = statistics.median
    summary: dict = {"command": "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:]), "hardware": hardware(),
                     "load_before": os.getloadavg(), "model": MODEL, "vocab": VOCAB, "micro_batch": MICRO, "seq": SEQ}

    if "memory" in only:  # (a)
        configs = [  # name, ranks, zero.Init, release gathered weights after use
            ("1rank", 1, False, False), ("2ranks", 2, False, False),
            ("1rank_release", 1, False, True), ("2ranks_release", 2, False, True),
            ("1rank_zero_init_release", 1, True, True), ("2ranks_zero_init_release", 2, True, True),
        ]
        runs: dict = {name: [] for name, *_ in configs}
        for rep in range(args.repeats):  # interleaved: every configuration once per repeat
            for name, ranks, zero_init, release in configs:
                runs[name].append(launch(out_dir, f"mem_{name}_{rep}", ranks, {
                    "mode": "memory", "zero_init": zero_init, "release": release, "steps": 3}))
        memory = {}
        for name, reps in runs.items():
            per_rank = [r for rep in reps for r in rep]
            row = {phase: {key: med(r["phases"][phase][key] for r in per_rank) for key in ("rss_mb", "peak_rss_mb")}
                   for phase in per_rank[0]["phases"]}
            row["param_bytes_held_mb"] = med(r["param_bytes_held_mb"] for r in per_rank)
            row["dtype"], row["params_m"] = per_rank[0]["dtype"], per_rank[0]["params_m"]
            row["peak_rss_runs"] = [round(r["phases"]["after_steps"]["peak_rss_mb"], 1) for r in per_rank]
            memory[name] = row
        summary["memory"] = memory

    if "rebuild" in only:  # (b)
        rebuild = {}
        for config in ("zero2", "zero3"):
            ranks = launch(out_dir, f"rebuild_{config}", 2, {"mode": "rebuild", "config": f"{config}.json",
                                                              "repeats": args.steps})
            r0 = ranks[0]  # rank 0's clock (ranks are synchronised by the collectives anyway)
            rebuild[config] = {"rebuild_s": med(r0["rebuild_s"]), "first_step_after_s": med(r0["first_step_after_s"]),
                               "steady_step_s": med(r0["steady_step_s"]),
                               "rebuild_over_step": med(r0["rebuild_s"]) / med(r0["steady_step_s"]),
                               "repeats": len(r0["rebuild_s"]), "final_rank": r0["final_rank"],
                               "trainable_m_at_end": r0["trainable_m"]}
        summary["rebuild"] = rebuild

    if "apt_vs_lora" in only:  # (c)
        ranks = launch(out_dir, f"apt_vs_lora_{args.apt_config}{'_fp32' * args.apt_fp32}", 2, {
            "mode": "apt_vs_lora", "config": f"{args.apt_config}.json", "fp32": args.apt_fp32,
            "repeats": max(args.steps, 3)})
        r0 = ranks[0]
        summary["apt_vs_lora"] = {"config": args.apt_config, "fp32": args.apt_fp32, "lora_step_s": med(r0["lora_step_s"]), "apt_step_s": med(r0["apt_step_s"]),
                                  "ratio": med(r0["apt_step_s"]) / med(r0["lora_step_s"]),
                                  "paired_ratio": med(a / b for a, b in zip(r0["apt_step_s"], r0["lora_step_s"])),
                                  "apt_parts_s": {k: med(v) for k, v in r0["apt_parts_s"].items()},
                                  "repeats": len(r0["apt_step_s"]), "density": r0["density"]}

    summary["load_after"] = os.getloadavg()
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
