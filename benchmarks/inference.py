"""Inference cost of an APT export vs the dense original with merged LoRA (issue 4's target).

Side by side in one process, in interleaved rounds (median), at batch 1 and batch 8:
prompt-processing (prefill) and greedy decode tokens/s with the KV cache
(`apt_ds.training.evaluate.decode_speed`). Memory: parameter bytes, checkpoint size on disk, and the
process RSS of a fresh subprocess per model (RSS after imports, after loading the model, and
the peak (VmHWM) while decoding at the largest batch: the deltas are that model's own memory).

Target: exported decode time per token <= 1.25 x dense time per token x (kept fraction of
forward FLOPs per decoded token, lm_head and attention over the cache included).

    python benchmarks/quality.py                    # makes the exports used by default
    python benchmarks/inference.py --json bench_out/inference.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import command_line, hardware, reset_peak_rss, rss_mb, vm_hwm_mb, write_json  # noqa: E402

DEFAULT_DENSE = "bench_out/quality/sst2/lora/export"
DEFAULT_PRUNED = "bench_out/quality/sst2/apt_0.5/export"
TARGET_FACTOR = 1.25


def shape_of(export: Path):
    from quality import _shape_from_config

    return _shape_from_config(json.loads((export / "config.json").read_text()))


def memory_worker(export: Path, batch: int, prompt_len: int, new_tokens: int, threads: int) -> None:
    """Run in a fresh process: RSS before/after load and the peak while decoding."""
    import torch

    torch.set_num_threads(threads)
    from apt_ds.io.modeling import load_model
    from apt_ds.training.evaluate import decode_speed

    gc.collect()
    before = rss_mb()
    reset_peak_rss()
    model = load_model(export)
    gc.collect()
    after_load = rss_mb()
    load_peak = vm_hwm_mb()
    with torch.no_grad():  # safetensors weights may be mmapped lazily: touch every page once
        model(input_ids=torch.zeros(1, 1, dtype=torch.long))
    gc.collect()
    after_forward = rss_mb()
    reset_peak_rss()
    decode_speed(model, batch, prompt_len=prompt_len, new_tokens=new_tokens, repeats=1)
    print(json.dumps({"rss_before_load_mb": before, "rss_after_load_mb": after_load, "load_peak_mb": load_peak,
                      "rss_after_first_forward_mb": after_forward, "decode_peak_mb": vm_hwm_mb(),
                      "load_delta_mb": after_load - before, "resident_delta_mb": after_forward - before,
                      "decode_peak_delta_mb": vm_hwm_mb() - before}))


def measure_memory(export: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--memory-worker", str(export), "--batch-sizes", str(max(args.batch_sizes)),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"memory worker failed for {export}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dense", type=Path, default=Path(DEFAULT_DENSE), help="dense export (LoRA merged)")
    parser.add_argument("--pruned", type=Path, default=Path(DEFAULT_PRUNED), help="APT export at density 0.5")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per batch size (median)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=Path("bench_out/inference.json"))
    parser.add_argument("--memory-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_worker:
        memory_worker(args.memory_worker, args.batch_sizes[0], args.prompt_len, args.new_tokens, args.threads)
        return
    for path in (args.dense, args.pruned):
        if not (path / "config.json").is_file():
            raise SystemExit(f"error: no export at {path}; run `python benchmarks/quality.py` first (or pass --dense/--pruned)")

    import torch
    from quality import forward_flops_per_token

    from apt_ds.export.writer import weight_files
    from apt_ds.io.modeling import load_model
    from apt_ds.training.evaluate import decode_speed, directory_bytes, parameter_bytes

    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    print(f"[inference] command: {command_line()}", flush=True)
    names = {"dense": args.dense, "pruned": args.pruned}
    models = {name: load_model(path) for name, path in names.items()}
    context = args.prompt_len + args.new_tokens / 2  # mean cached length while decoding
    info = {}
    for name, path in names.items():
        shape = shape_of(path)
        info[name] = {
            "path": str(path), "total_params": shape.total_params(), "block_params": shape.block_params(),
            "parameter_bytes": parameter_bytes(models[name]),
            "checkpoint_bytes": sum(f.stat().st_size for f in weight_files(path)), "directory_bytes": directory_bytes(path),
            "flops_per_decoded_token": forward_flops_per_token(shape, int(context)),
            "prefill_flops_per_token": forward_flops_per_token(shape, args.prompt_len // 2),
            "uniform": shape.uniform, "hidden": shape.hidden,
        }
    kept_flops = info["pruned"]["flops_per_decoded_token"] / info["dense"]["flops_per_decoded_token"]
    speeds = {}
    for batch in args.batch_sizes:
        samples = {name: [] for name in models}
        for _ in range(args.rounds):
            for name, model in models.items():
                samples[name].append(decode_speed(model, batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=1))
        speeds[batch] = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in samples.items()}
        d, p = speeds[batch]["dense"], speeds[batch]["pruned"]
        allowed = TARGET_FACTOR * d["decode_ms_per_token"] * kept_flops
        speeds[batch]["target"] = {
            "dense_ms_per_token": d["decode_ms_per_token"], "pruned_ms_per_token": p["decode_ms_per_token"],
            "kept_flops_fraction": kept_flops, "allowed_ms_per_token": allowed, "met": p["decode_ms_per_token"] <= allowed,
            "pruned_over_dense_time": p["decode_ms_per_token"] / d["decode_ms_per_token"],
            "prefill_speedup": p["prefill_tokens_per_s"] / d["prefill_tokens_per_s"],
        }
        print(f"[inference] batch {batch}: dense {d['decode_ms_per_token']:.1f} ms/token, pruned {p['decode_ms_per_token']:.1f} "
              f"(allowed {allowed:.1f}: {'MET' if p['decode_ms_per_token'] <= allowed else 'MISSED'}); prefill "
              f"{d['prefill_tokens_per_s']:.0f} vs {p['prefill_tokens_per_s']:.0f} tokens/s", flush=True)
    del models
    gc.collect()
    memory = {name: measure_memory(path, args) for name, path in names.items()}
    result = {
        "command": command_line(), "hardware": hardware(), "threads": args.threads, "rounds": args.rounds,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "models": info, "speed": speeds, "memory": memory,
        "kept_flops_fraction": kept_flops, "target_factor": TARGET_FACTOR, "wall_time_s": time.perf_counter() - started,
    }
    write_json(args.json, result)
    print(markdown(result))


def markdown(r: dict) -> str:
    d, p = r["models"]["dense"], r["models"]["pruned"]
    md, mp = r["memory"]["dense"], r["memory"]["pruned"]
    lines = [
        "| | dense (LoRA merged) | APT export | ratio |", "|---|---|---|---|",
        f"| parameters (M) | {d['total_params'] / 1e6:.1f} | {p['total_params'] / 1e6:.1f} | {p['total_params'] / d['total_params']:.3f} |",
        f"| block density | 1.000 | {p['block_params'] / d['block_params']:.3f} | |",
        f"| parameter bytes (MB) | {d['parameter_bytes'] / 2**20:.0f} | {p['parameter_bytes'] / 2**20:.0f} | {p['parameter_bytes'] / d['parameter_bytes']:.3f} |",
        f"| checkpoint on disk (MB) | {d['checkpoint_bytes'] / 2**20:.0f} | {p['checkpoint_bytes'] / 2**20:.0f} | {p['checkpoint_bytes'] / d['checkpoint_bytes']:.3f} |",
        f"| RSS delta after load + 1-token forward (MB) | {md['resident_delta_mb']:.0f} | {mp['resident_delta_mb']:.0f} | {mp['resident_delta_mb'] / md['resident_delta_mb']:.3f} |",
        f"| peak RSS delta, decoding batch {max(int(b) for b in r['speed'])} (MB) | {md['decode_peak_delta_mb']:.0f} | {mp['decode_peak_delta_mb']:.0f} | {mp['decode_peak_delta_mb'] / md['decode_peak_delta_mb']:.3f} |",
        f"| forward FLOPs per decoded token (G) | {d['flops_per_decoded_token'] / 1e9:.3f} | {p['flops_per_decoded_token'] / 1e9:.3f} | {r['kept_flops_fraction']:.3f} |",
    ]
    for batch, s in r["speed"].items():
        t = s["target"]
        lines += [
            f"| batch {batch}: prefill tokens/s | {s['dense']['prefill_tokens_per_s']:.0f} | {s['pruned']['prefill_tokens_per_s']:.0f} | {t['prefill_speedup']:.2f}x |",
            f"| batch {batch}: decode tokens/s | {s['dense']['decode_tokens_per_s']:.1f} | {s['pruned']['decode_tokens_per_s']:.1f} | {s['pruned']['decode_tokens_per_s'] / s['dense']['decode_tokens_per_s']:.2f}x |",
            f"| batch {batch}: decode ms per step | {t['dense_ms_per_token']:.1f} | {t['pruned_ms_per_token']:.1f} | {t['pruned_over_dense_time']:.3f} |",
            f"| batch {batch}: target <= 1.25 x dense x kept FLOPs | | {t['allowed_ms_per_token']:.1f} ms | {'MET' if t['met'] else 'MISSED'} |",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
