"""LLaMA scale on this machine: a LLaMA-3.2-3B-shaped model fine-tuned with APT on 2 ranks under
ZeRO-3 (partitioned loading, partition-preserving shrinks), then exported, with each rank's
resident anonymous memory (RssAnon) sampled every 0.2 s and split into phases.

    python benchmarks/llama_scale.py --model-dir /tmp/llama3b --out bench_out/llama_scale
    python benchmarks/llama_scale.py --shape qwen2.5-3b --model-dir /tmp/qwen25_3b --out bench_out/qwen25_scale
    python benchmarks/llama_scale.py --base-quant nf4 --model-dir /tmp/apt_llama3b --out bench_out/llama_scale_nf4

1. writes (once; reused when present) a random fp32 model of LLaMA-3.2-3B's shape: hidden 3072,
   28 layers, 24 heads / 8 KV groups, FFN 8192, vocabulary 128,256, tied embeddings (3.21B
   parameters, 12.0 GiB), tensor by tensor into 2 GB safetensors shards (never more than one
   shard in memory), plus a sentencepiece tokenizer trained on the shipped demo data;
2. `deepspeed --num_gpus 2 launch/train.py --deepspeed OUT/zero3_release.json` (ds_configs/zero3.json
   with stage3_max_live_parameters and stage3_max_reuse_distance 0: gathered weights are
   released after use) with APT to
   density 0.7: micro-batch 1, 64 tokens, 12 steps, pruning events at steps 4 and 6, no eval;
3. `launch/export.py` (streaming) in bf16.
Phases come from the run's metrics.jsonl wall-clock times: load (launch until the first step
starts), steady steps (steps without an event), each event, export. The ideal per rank is
model bytes / ranks + one decoder layer + the (tied) embedding gathered for the LM head.
Nothing is asserted: the numbers go to OUT/llama_scale.json and docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LLAMA_3B = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=True,
                max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0)
# Qwen2.5-3B's published config (q/k/v biases): the largest Qwen that fits 2 fp32 ranks in 24 GB here
QWEN25_3B = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                 num_key_value_heads=2, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0)
# Qwen3-1.7B's (q/k norms)
QWEN3_17B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0)
SHAPES = {"llama-3.2-3b": ("llama", LLAMA_3B), "qwen2.5-3b": ("qwen2", QWEN25_3B), "qwen3-1.7b": ("qwen3", QWEN3_17B)}
SHARD_BYTES = 2 * 10**9


# ---- 1. the model, written tensor by tensor ------------------------------------------------------
def tensor_shapes(config: dict, model_type: str = "llama") -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's shape, from the family's description (biases, q/k norms included)."""
    from apt_ds.algorithm.units import LayerShape
    from apt_ds.models import family_for

    family, h = family_for(model_type), config["hidden_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    layer = LayerShape(num_kv_groups=kv, group_size=heads // kv, head_dim=config["head_dim"], ffn=config["intermediate_size"])
    sizes = layer.axis_sizes(h)
    shapes = {family.embedding: (config["vocab_size"], h)}
    for l in range(config["num_hidden_layers"]):
        shapes.update({f"{family.layer_prefix(l)}.{t.name}": tuple(sizes[axis] for axis in t.dims) for t in family.layer_tensors})
    shapes[family.final_norm] = (h,)
    if not config["tie_word_embeddings"]:
        shapes[family.output_embedding] = (config["vocab_size"], h)
    return shapes


def write_model(directory: Path, config: dict, dtype: str = "float32", device: str = "cpu", model_type: str = "llama") -> None:
    """Random weights (N(0, 0.02), biases too; norms 1 + N(0, 0.1)) of a `model_type` model in
    `dtype` (a torch dtype's name), one shard in memory at a time, drawn on `device` (a GPU draws
    a 7B model in seconds)."""
    import torch
    from safetensors.torch import save_file

    from apt_ds.io.data import demo_data_path
    from apt_ds.io.tokenizer import train_sentencepiece_tokenizer
    from apt_ds.models import family_for

    if (directory / "config.json").is_file():
        saved_config = json.loads((directory / "config.json").read_text())
        if saved_config.get("model_type") != model_type:
            raise SystemExit(f"error: {directory} holds a {saved_config.get('model_type')} model, not {model_type}: "
                             f"pass another directory")
        saved = saved_config.get("dtype") or "float32"
        if saved != dtype:
            raise SystemExit(f"error: {directory} holds a {saved} model, not {dtype}: pass another directory")
        print(f"reusing the model in {directory}")
        return
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device).manual_seed(0)
    torch_dtype, element_bytes = getattr(torch, dtype), getattr(torch, dtype).itemsize
    shapes = tensor_shapes(config, model_type)
    groups, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * element_bytes
        if current and size + nbytes > SHARD_BYTES:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    groups.append(current)
    weight_map = {}
    for index, names in enumerate(groups, 1):
        filename = f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for name in names:
            scale, shift = (0.1, 1.0) if name.endswith("norm.weight") else (0.02, 0.0)
            drawn = torch.randn(shapes[name], generator=generator, device=device)
            shard[name] = (shift + scale * drawn).to(torch_dtype).cpu()
            weight_map[name] = filename
        save_file(shard, str(directory / filename), metadata={"format": "pt"})
        print(f"wrote {filename} ({len(names)} tensors)", flush=True)
        del shard
    total = sum(math.prod(s) * element_bytes for s in shapes.values())
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    family = family_for(model_type)
    family.classes()[0](**config, architectures=[family.causal_lm_class], dtype=dtype).save_pretrained(str(directory))
    texts = [json.loads(line)["output"] for line in demo_data_path().read_text().splitlines()]
    train_sentencepiece_tokenizer(texts, directory / "_tokenizer", vocab_size=512).save_pretrained(str(directory))


# ---- 2./3. runs with per-rank memory sampling ----------------------------------------------------
def rss_anon_mb(pid: int) -> float | None:
    from _common import proc_status_mb

    fields = proc_status_mb("RssAnon", pid=pid)
    return fields.get("RssAnon") if fields else None


def run_sampled(cmd: list[str], env: dict, log: Path, rank_processes: bool) -> list[dict]:
    """Run `cmd`, sampling RssAnon of its rank processes (children running launch/train.py) or of
    the process itself every 0.2 s: [{"t": unix time, "pid": pid, "mb": MiB}, ...]."""
    import psutil

    samples: list[dict] = []
    with log.open("w") as handle:
        process = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        parent = psutil.Process(process.pid)
        while process.poll() is None:
            now = time.time()
            try:
                pids = [c.pid for c in parent.children(recursive=True) if _is_rank(c.cmdline())] \
                    if rank_processes else [process.pid]
            except psutil.Error:
                pids = []
            for pid in pids:
                mb = rss_anon_mb(pid)
                if mb is not None:
                    samples.append({"t": now, "pid": pid, "mb": mb})
            time.sleep(0.2)
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:6])}... failed (exit {process.returncode}); see {log}")
    return samples


def _is_rank(cmdline: list[str]) -> bool:
    """A training rank (launch/train.py), not DeepSpeed's per-node launcher that starts them."""
    joined = " ".join(cmdline)
    return "launch/train.py" in joined and "deepspeed.launcher" not in joined


def peak_by_rank(samples: list[dict], start: float, end: float) -> list[float]:
    """Each rank's peak MiB in [start, end] (ranks ordered by pid: the launcher starts rank 0 first)."""
    pids = sorted({s["pid"] for s in samples})
    return [round(max((s["mb"] for s in samples if s["pid"] == pid and start <= s["t"] <= end), default=0.0), 1)
            for pid in pids]


def _step_start(m: dict) -> float:
    """When the step of record `m` began: its record is written after the step and what follows
    it (an event, or a decay-window step's decision and mask refresh)."""
    return m["time"] - m["step_time_s"] - m.get("event_time_s", 0.0) - m.get("mask_refresh_s", 0.0)


def phases(samples: list[dict], metrics: list[dict], started: float) -> dict:
    steps = [m for m in metrics if not m.get("final")]
    out = {"load": peak_by_rank(samples, started, _step_start(steps[0]))}
    steady = [m for m in steps if not m.get("event")]
    out["steady_steps"] = [max(v) for v in zip(*[peak_by_rank(samples, _step_start(m), m["time"]) for m in steady])]
    for m in steps:
        if m.get("event"):
            out[f"event_step_{m['step']}"] = peak_by_rank(samples, m["time"] - m["event_time_s"], m["time"])
    out["per_step"] = {m["step"]: peak_by_rank(samples, _step_start(m), m["time"]) for m in steps}
    out["whole_run"] = peak_by_rank(samples, started, time.time())
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/apt_llama3b"),
                        help="where the random 3B model (12 GiB of fp32 safetensors) is written once and reused")
    parser.add_argument("--out", type=Path, default=ROOT / "bench_out" / "llama_scale")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--base-quant", choices=["none", "nf4", "fp4"], default="none",
                        help="train.py's --base-quant: the frozen projections' codes partitioned under ZeRO-3")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-3b",
                        help="whose published config the random model has (its family's tensors: Qwen2's biases, ...)")
    args = parser.parse_args()
    if args.steps < 4:  # before the 12 GB model is written: train.py's own minimum
        parser.error(f"--steps must be >= 4 to warm up, prune and recover, got {args.steps}")
    args.out.mkdir(parents=True, exist_ok=True)
    model_type, config = SHAPES[args.shape]
    write_model(args.model_dir, config, model_type=model_type)

    from apt_ds.io.weights import SafetensorsWeights

    weights = SafetensorsWeights(args.model_dir)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)  # apt_ds sets cores / local ranks itself
    # The shipped zero3.json keeps up to 1e9 gathered parameters resident for reuse
    # (stage3_max_live_parameters / max_reuse_distance, the values of the Hugging Face examples):
    # 4 GB of fp32 per rank here, which the first run of this benchmark did not survive (OOM at
    # 11.9 GB per rank). Memory-bound runs release gathered weights after use instead.
    ds_config = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    ds_config["zero_optimization"].update(stage3_max_live_parameters=0, stage3_max_reuse_distance=0)
    ds_path = args.out / "zero3_release.json"
    ds_path.write_text(json.dumps(ds_config, indent=1))
    run_dir = args.out / "run"
    train = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
             str(ROOT / "launch" / "train.py"), "--deepspeed", str(ds_path),
             "--model", str(args.model_dir), "--micro-batch-size", "1", "--max-seq-len", "64", "--steps", str(args.steps),
             "--target-density", "0.7", "--pruning-start-step", "2", "--pruning-end-step", "6",
             "--num-pruning-events", "2", "--checkpoint-every", "0", "--base-quant", args.base_quant,
             "--out", str(run_dir), "--overwrite"]
    started = time.time()
    samples = run_sampled(train, env, args.out / "train.log", rank_processes=True)
    train_s = time.time() - started
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    export_dir = args.out / "export"
    export = [sys.executable, str(ROOT / "launch" / "export.py"), str(run_dir), "--out", str(export_dir),
              "--dtype", "bf16", "--overwrite", "--max-shard-size", "2GB"]
    export_started = time.time()
    export_samples = run_sampled(export, env, args.out / "export.log", rank_processes=False)
    final = metrics[-1]
    embedding = config["vocab_size"] * config["hidden_size"] * (1 if config["tie_word_embeddings"] else 2)
    layer_params = (weights.numel() - embedding) / config["num_hidden_layers"]
    result = {
        "command": " ".join([sys.executable, *sys.argv]), "shape": args.shape, "base_quant": args.base_quant, "model_type": model_type, "host": platform.node(), "cpus": os.cpu_count(),
        "model_bytes": weights.nbytes(), "model_params": weights.numel(),
        "ideal_per_rank_mb": round((weights.nbytes() / 2 + 4 * (layer_params + config["vocab_size"] * config["hidden_size"])) / 2**20),
        "rss_anon_peak_mb_by_rank": phases(samples, metrics, started),
        "export_peak_mb": round(max(s["mb"] for s in export_samples), 1), "export_s": round(time.time() - export_started, 1),
        "train_s": round(train_s, 1), "final_density": final["density"], "steps": args.steps,
        "step_time_s": [round(m["step_time_s"], 1) for m in metrics if not m.get("final")],
        "events": [m["step"] for m in metrics if m.get("event")],
        "exported_bytes": sum(p.stat().st_size for p in export_dir.glob("*.safetensors")),
    }
    (args.out / "llama_scale.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
