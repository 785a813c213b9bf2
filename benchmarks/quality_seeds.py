"""Task quality over several seeds: mean and spread per method (issue 16, item 5).

Runs `benchmarks/quality.py` once per seed (seed = the data order and the adapters'
initialisation; the model, data split and every setting are the same), each into
OUT/seed<S>, then reports per task and method the mean, standard deviation and range of
accuracy and AUC over seeds, accuracy relative to dense LoRA (the mean of the per-seed
ratios), training time relative to LoRA (median of the per-seed ratios) and the issue's targets:

- non-uniform APT 0.7 keeps >= 95% of LoRA's accuracy, uniform APT 0.7 >= 90% (means);
- APT beats prune-then-tune at 0.7 and 0.5 by more than the seed spread (the difference of the
  means exceeds the larger of the two standard deviations; for harness scores, whose rows are
  drawn per seed, that spread includes the row sampling);
- APT 0.7's training time <= 0.9x LoRA's.

Besides the targets it reports the paired view (apt_0.7 - ptt_0.7, apt_0.5 - ptt_0.5, APT against
uniform APT and against LoRA): the per-seed differences, their mean and spread, the seeds won and an
exact sign-flip test, since every method of a seed shares its data order and harness rows.

    python benchmarks/quality_seeds.py --tasks sst2 --seeds 0 1 2 --out bench_out/quality_seeds
    python benchmarks/quality_seeds.py --report-only --out bench_out/quality_seeds   # re-read, no runs
    python benchmarks/quality_seeds.py --tasks instruct --out bench_out/instruct_seeds   # ~85 min; see prepare_instructions.py

Every other option goes to quality.py as it is (e.g. `--methods lora apt_0.7`); a seed whose
results exist with the same settings is reused by quality.py itself.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # apt_ds from a checkout without installing

QUALITY = Path(__file__).resolve().parent / "quality.py"
METHOD_ORDER = ["zero_shot", "lora", "apt_0.7", "apt_0.7_uniform", "ptt_0.7", "apt_0.5", "apt_0.5_uniform", "ptt_0.5",
                "apt_0.7_nodistill", "apt_0.5_nodistill"]


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def collect(out: Path, seeds: list[int]) -> dict:
    """{task: {method: {accuracy: spread, auc: spread, ...}}} from OUT/seed<S>/results.json."""
    per_seed = {}
    for seed in seeds:
        path = out / f"seed{seed}" / "results.json"
        if not path.is_file():
            raise SystemExit(f"error: {path} is missing: run without --report-only, or drop seed {seed}")
        per_seed[seed] = json.loads(path.read_text())["tasks"]
    tasks = {}
    for task in per_seed[seeds[0]]:
        rows = {}
        for method in METHOD_ORDER:
            runs = [per_seed[s][task][method] for s in seeds if method in per_seed[s].get(task, {})]
            if not runs:
                continue
            lora = [per_seed[s][task].get("lora") for s in seeds if method in per_seed[s].get(task, {})]
            row = {"seeds": len(runs), "seeds_run": [s for s in seeds if method in per_seed[s].get(task, {})],
                   "density": statistics.fmean(r["density"] for r in runs),
                   "accuracy": spread([r["accuracy"] for r in runs]), "per_seed_accuracy": [r["accuracy"] for r in runs]}
            if all(r.get("auc") is not None for r in runs):
                row["auc"] = spread([r["auc"] for r in runs])
            if all(r.get("harness") for r in runs):  # the instruct task: accuracy is the mean of these
                common = [name for name in runs[0]["harness"] if all(name in r["harness"] for r in runs)]  # seeds scored alike
                row["harness"] = {name: spread([r["harness"][name] for r in runs]) for name in common}
                row.update(harness_row_noise(runs))
            if all(ref for ref in lora):
                row["acc_vs_lora"] = statistics.fmean(r["accuracy"] / ref["accuracy"] for r, ref in zip(runs, lora))
                if all(r.get("train_time_s") for r in runs):
                    row["time_vs_lora"] = statistics.median(r["train_time_s"] / ref["train_time_s"] for r, ref in zip(runs, lora))
                    row["cpu_vs_lora"] = statistics.median(r["train_cpu_s"] / ref["train_cpu_s"] for r, ref in zip(runs, lora))
            rows[method] = row
        tasks[task] = {"methods": rows, "targets": seed_targets(rows),
                       "paired": {f"{a} - {b}": found for a, b in PAIRS if (found := paired_difference(rows, a, b))}}
    return tasks


PAIRS = [("apt_0.7", "ptt_0.7"), ("apt_0.5", "ptt_0.5"), ("apt_0.7", "apt_0.7_uniform"), ("apt_0.7", "lora")]


def paired_difference(rows: dict, a: str, b: str) -> dict | None:
    """a's accuracy minus b's, seed by seed, on the seeds both ran. A seed fixes the data order,
    the adapters' initialisation and (harness scores) the rows, so both methods of a seed share
    them and the difference leaves them out: its spread is the paired one, which the targets'
    unpaired rule (the gap of the means against the larger spread) does not use. `p_sign_flip`
    is the exact two-sided sign-flip (permutation) test of a zero mean difference: the share of
    the 2^n sign assignments whose |mean| reaches the observed one (with n seeds it is never
    under 2 / 2^n, e.g. 0.0625 with 5)."""
    if a not in rows or b not in rows:
        return None
    by_seed = {seed: acc for seed, acc in zip(rows[b]["seeds_run"], rows[b]["per_seed_accuracy"])}
    diffs = [acc - by_seed[seed] for seed, acc in zip(rows[a]["seeds_run"], rows[a]["per_seed_accuracy"]) if seed in by_seed]
    if len(diffs) < 2:
        return None
    observed = abs(statistics.fmean(diffs)) - 1e-12  # a tie with the observed mean counts as reaching it
    flips = list(itertools.product((1, -1), repeat=len(diffs)))
    reached = sum(abs(statistics.fmean(sign * d for sign, d in zip(signs, diffs))) >= observed for signs in flips)
    return {"seeds": len(diffs), "differences": diffs, **spread(diffs), "wins": sum(d > 0 for d in diffs),
            "p_sign_flip": reached / len(flips)}


def harness_row_noise(runs: list[dict]) -> dict:
    """What the rows alone make uncertain in one seed: lm-eval's standard error of the task mean
    (sqrt of the summed squared task stderrs over the task count; none where a task has no
    stderr), as the mean over seeds; and the tasks on which a seed gave (nearly) one answer only
    (apt_ds.evaluation.report's rule), as {task: seeds}."""
    from apt_ds.evaluation.report import is_one_sided

    found = {}
    if all(r.get("harness_stderr") and all(isinstance(se, (int, float)) for se in r["harness_stderr"].values()) for r in runs):
        found["row_stderr"] = statistics.fmean(
            math.sqrt(sum(se ** 2 for se in r["harness_stderr"].values())) / len(r["harness_stderr"]) for r in runs)
    one_answer = {}
    for r in runs:
        for name, share in r.get("harness_answer_share", {}).items():
            if is_one_sided(share, r.get("harness_rows", {}).get(name, 0)):
                one_answer[name] = one_answer.get(name, 0) + 1
    found["one_answer_tasks"] = one_answer
    return found


def seed_targets(rows: dict) -> dict:
    def beats(a: str, b: str):
        """The gap of the means exceeds the larger standard deviation over seeds. Harness rows are
        drawn per seed, so that spread holds the row sampling as well as the training seed."""
        if a not in rows or b not in rows:
            return None
        gap = rows[a]["accuracy"]["mean"] - rows[b]["accuracy"]["mean"]
        return gap > max(rows[a]["accuracy"]["std"], rows[b]["accuracy"]["std"])

    found = {
        "apt0.7_acc_ge_95pct_lora": rows["apt_0.7"]["acc_vs_lora"] >= 0.95 if "acc_vs_lora" in rows.get("apt_0.7", {}) else None,
        "apt0.7_uniform_acc_ge_90pct_lora": (rows["apt_0.7_uniform"]["acc_vs_lora"] >= 0.90
                                             if "acc_vs_lora" in rows.get("apt_0.7_uniform", {}) else None),
        "apt0.7_beats_ptt0.7_by_more_than_spread": beats("apt_0.7", "ptt_0.7"),
        "apt0.5_beats_ptt0.5_by_more_than_spread": beats("apt_0.5", "ptt_0.5"),
        "apt0.7_time_le_0.9x_lora": rows["apt_0.7"]["time_vs_lora"] <= 0.9 if "time_vs_lora" in rows.get("apt_0.7", {}) else None,
    }
    return {k: v for k, v in found.items() if v is not None}


def markdown(tasks: dict, seeds: list[int]) -> str:
    lines = []
    for task, found in tasks.items():
        lines += [f"#### {task}: {len(seeds)} seeds ({', '.join(map(str, seeds))})", "",
                  "| method | density | accuracy mean ± std | range | per seed | acc / LoRA | AUC mean ± std | time / LoRA |",
                  "|---|---|---|---|---|---|---|---|"]
        for method, row in found["methods"].items():
            acc, auc = row["accuracy"], row.get("auc")
            cells = [method, f"{row['density']:.3f}", f"{acc['mean']:.3f} ± {acc['std']:.3f}", f"{acc['min']:.3f}–{acc['max']:.3f}",
                     " / ".join(f"{a:.3f}" for a in row["per_seed_accuracy"]),
                     f"{row['acc_vs_lora']:.3f}" if "acc_vs_lora" in row else "–",
                     f"{auc['mean']:.3f} ± {auc['std']:.3f}" if auc else "–",
                     f"{row['time_vs_lora']:.2f}" if "time_vs_lora" in row else "–"]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "targets: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in found["targets"].items()), ""]
        lines += paired_markdown(found.get("paired", {}))
        lines += harness_markdown(task, found["methods"])
    return "\n".join(lines)


def paired_markdown(paired: dict) -> list[str]:
    if not paired:
        return []
    lines = ["paired by seed (same data order, initialisation and rows): difference of accuracy, mean ± std, seeds won, "
             "exact sign-flip p", ""]
    for name, found in paired.items():
        lines.append(f"- {name}: {found['mean']:+.3f} ± {found['std']:.3f} over {found['seeds']} seeds "
                     f"({' / '.join(f'{d:+.3f}' for d in found['differences'])}), won {found['wins']} of {found['seeds']}, "
                     f"p = {found['p_sign_flip']:.3f}")
    return lines + [""]


def harness_markdown(task: str, rows: dict) -> list[str]:
    """Per harness task, the mean ± std over seeds (the instruct task; nothing for others)."""
    scored = {method: row["harness"] for method, row in rows.items() if "harness" in row}
    if not scored:
        return []
    names = list(next(iter(scored.values())))
    # BoolQ is 62% "yes": a model that answers one label scores its prior there whatever it
    # learned, which moves a 7-task mean by several points; the mean without it is shown too
    others = [name for name in names if name != "boolq"]
    without = len(others) < len(names)
    lines = [f"#### {task}: zero-shot lm-eval score per task (mean ± std over seeds)", "",
             "| method | " + " | ".join(names) + " | mean |" + (" mean without boolq |" if without else "")
             + " row stderr | one answer on ≥95% of rows (seeds) |",
             "|---" * (len(names) + 4 + without) + "|"]
    for method, scores in scored.items():
        row = rows[method]
        cells = [f"{scores[name]['mean']:.3f} ± {scores[name]['std']:.3f}" for name in names]
        extra = f" {statistics.fmean(scores[name]['mean'] for name in others):.3f} |" if without else ""
        noise = f" {row['row_stderr']:.3f} |" if "row_stderr" in row else " – |"
        one = ", ".join(f"{name} ({n}/{row['seeds']})" for name, n in row.get("one_answer_tasks", {}).items()) or "–"
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {row['accuracy']['mean']:.3f} |" + extra + noise + f" {one} |")
    return lines + ["", "row stderr: lm-eval's standard error of one seed's task mean from its sample of rows (mean over "
                        "seeds); rows are drawn per seed, so the std over seeds includes it.", ""]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("bench_out/quality_seeds"))
    parser.add_argument("--report-only", action="store_true", help="aggregate existing OUT/seed<S> results, run nothing")
    args, passthrough = parser.parse_known_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds has repeats: {args.seeds}")
    bad = [a for a in passthrough if a in ("--seed", "--out", "--img-dir")]
    if bad:
        parser.error(f"{bad[0]} is set per seed by this script; leave it out")
    started = time.perf_counter()
    if not args.report_only:
        for seed in args.seeds:
            seed_out = args.out / f"seed{seed}"
            command = [sys.executable, str(QUALITY), "--seed", str(seed), "--out", str(seed_out),
                       "--img-dir", str(seed_out / "img"), "--skip-speed", *passthrough]
            print(f"[seeds] seed {seed}: {' '.join(command)}", flush=True)
            if subprocess.run(command, check=False).returncode != 0:
                raise SystemExit(f"error: quality.py failed for seed {seed}")
    tasks = collect(args.out, args.seeds)
    given = sys.argv[1:] if argv is None else argv
    summary = {"seeds": args.seeds, "command": " ".join([Path(__file__).name, *given]), "tasks": tasks,
               "wall_time_s": time.perf_counter() - started}
    previous = args.out / "seeds.json"
    if args.report_only and previous.is_file():  # a re-report keeps the measuring run's command and time
        old = json.loads(previous.read_text())
        summary.update(command=old.get("command", summary["command"]), wall_time_s=old.get("wall_time_s"),
                       report_command=summary["command"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "seeds.json").write_text(json.dumps(summary, indent=1))
    table = markdown(tasks, args.seeds)
    (args.out / "seeds.md").write_text(table)
    print(table)
    if summary["wall_time_s"] is not None:
        print(f"[seeds] wall time {summary['wall_time_s'] / 60:.1f} min" + (" (the measuring run)" if args.report_only else ""),
              flush=True)


if __name__ == "__main__":
    main()
