"""Which merge of a quantized-base run matches the trained model better on a real model
(docs/QUANTIZED_BASE.md, `launch/export.py --merge-into`): the adapters merged into the
dequantized weights the run trained on (the default) or into the original full-precision ones.

For each run that `benchmarks/quality.py --methods ... _nf4` left (its run directory holds the
checkpoint and run.json of a --base-quant run), both exports are written, scored on the task's
held-out rows with the same one-forward label scorer as quality.py, and compared with the
dequantized export's logits (which equal the live model's: tests/training/test_quantized_base.py)
on the first rows' prompts.

    python benchmarks/merge_choice.py bench_out/qlora_seeds_v3/seed*/sst2/*_nf4 --json bench_out/merge_choice.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import cpu_model_name, fast_label_report, git_commit, read_json  # noqa: E402
from _quality_worker import _rows  # noqa: E402

from apt_ds.export.merge import export_run  # noqa: E402
from apt_ds.io.data import prompt_and_answer  # noqa: E402
from apt_ds.io.modeling import load_model  # noqa: E402
from apt_ds.io.tokenizer import load_tokenizer  # noqa: E402

MERGES = ("dequantized", "original")


def score_run(run_dir: Path, gap_rows: int) -> dict:
    spec = read_json(run_dir.parent / f"{run_dir.name}.spec.json")
    task = read_json(Path(spec["task_dir"]) / "task.json")
    rows = _rows(Path(spec["task_dir"]) / "test.jsonl", spec["eval_examples"])
    tokenizer = load_tokenizer(spec["hf_dir"])
    prompts = tokenizer([prompt_and_answer(row)[0] for row in rows[:gap_rows]],
                        return_tensors="pt", padding=True, truncation=True, max_length=spec["max_seq_len"])
    result, logits = {"run": str(run_dir), "method": spec["method"], "seed": spec["seed"]}, {}
    with tempfile.TemporaryDirectory(prefix="merge-choice-") as tmp:
        for merge in MERGES:
            out = Path(tmp) / merge
            export_run(run_dir, out, dtype="fp32", merge_into=merge)
            model = load_model(out)
            report = fast_label_report(model, tokenizer, rows, task["labels"], spec["max_seq_len"], spec["eval_batch_size"])
            with torch.no_grad():
                logits[merge] = model(**prompts).logits[prompts["attention_mask"].bool()]
            result[merge] = {k: report[k] for k in ("accuracy", "auc", "best_threshold_accuracy", "gold_nll") if k in report}
            del model
    gap = (logits["original"] - logits["dequantized"]).abs()
    result["original_vs_live_logit_gap"] = {"max": float(gap.max()), "mean": float(gap.mean())}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories of quality.py's _nf4 methods")
    parser.add_argument("--gap-rows", type=int, default=16, help="held-out prompts the logit gap is measured on")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    results = []
    for run in args.runs:
        result = score_run(run, args.gap_rows)
        results.append(result)
        print(f"{result['method']:>12} seed {result['seed']}: " + "  ".join(
            f"{merge} acc {result[merge]['accuracy']:.3f} auc {result[merge]['auc']:.3f}" for merge in MERGES)
            + f"  original vs live logits: max {result['original_vs_live_logit_gap']['max']:.2f} "
              f"mean {result['original_vs_live_logit_gap']['mean']:.3f}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"results": results, "cpu": cpu_model_name(), "commit": git_commit()},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
