"""Task quality and training/inference cost of APT vs LoRA vs prune-then-tune (SmolLM2-135M).

For each task (SST-2, BoolQ: prepared by benchmarks/prepare_tasks.py; instruct: the instruction
mix of benchmarks/prepare_instructions.py, scored zero-shot by lm-eval), with the same data
order, seed, adapters (q_proj/v_proj, rank 8), steps and learning rate (records as written by
prepare_tasks.py: compact "<input>\n<cue>\n" prompts by default):

  zero_shot         the untouched model
  lora              dense LoRA (APTConfig.as_lora(): same adapters, no pruning/growth/distillation)
  ptt_<d>           prune-then-tune: one-shot first-order Taylor pruning to density d, then LoRA
  apt_<d>           APT to density d, non-uniform
  apt_<d>_uniform   APT to density d, the same shape in every layer (stock LlamaConfig export)
  lora_nf4, apt_0.7_nf4   QLoRA and APT on an nf4 base (--base-quant nf4, docs/QUANTIZED_BASE.md);
                    exported merged into the dequantized weights they trained on

Every training run is a fresh subprocess (`--worker`), so its memory readings are its own.
The model is loaded as `apt-ds train` loads it for a pruning run (`load_model(mmap=False)`:
a mapped checkpoint would stay resident however much is pruned). Peak RSS = Linux VmHWM reset (/proc/self/clear_refs) after the model is loaded and the data
tokenized, read when training ends; "after the last pruning event" = VmHWM reset again at
the first micro-batch after the last event step (the same step number for LoRA) and read at
the end, i.e. the peak of the recovery phase at the final shapes. The run is then exported
(`apt_ds.export.merge`: adapters merged, pruned units removed), reloaded from disk and evaluated
(highest-likelihood label, exact match, on each task's whole test split by default; the instruct
task instead zero-shot by lm-eval on --harness-tasks, --harness-limit rows each, drawn at random
with --seed: every method of a seed is scored on the same rows, another seed on other rows).
Finally, in this process, every export's greedy decode speed (batch 1) is measured side by
side with the dense LoRA-merged export, in interleaved rounds (median).

    python benchmarks/quality.py                       # SST-2 and BoolQ (82 min on 2 cores, --jobs 2)
    python benchmarks/quality.py --tasks instruct --skip-speed   # the instruction protocol, one seed (~28 min)
    python benchmarks/quality.py --smoke               # pipeline check: few steps, few rows
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import add_model_arguments, command_line, ensure_hf_model, git_commit, hardware, read_json, write_json  # noqa: E402
from _quality_report import markdown, phase_split, plots, targets  # noqa: E402
from _quality_worker import run_worker  # noqa: E402

from apt_ds.config import ADAPTER_TARGETS, APTConfig, ConfigError, TrainConfig, check_schedule_fits  # noqa: E402

# Per task: sequence length (BoolQ prompts are cut from the left: the question survives),
# optimizer steps and test rows scored (each task's whole test split). BoolQ gets 6x SST-2's
# steps: with 96 steps no method learned it (Alpaca records: LoRA's AUC 0.49 at 96 tokens, 0.52
# at 192 tokens, 0.50 at LR 5e-4); with 288 steps LoRA reached AUC 0.56, 0.59 with compact
# records (docs/BENCHMARKS.md).
# "instruct" is APT's LLaMA protocol at this scale (issue 16, item 3): instruction-tune on the mix
# of benchmarks/prepare_instructions.py (Alpaca records, 128 tokens: 91% fit whole, the rest
# lose the left of their prompt) and score
# zero-shot with lm-eval (launch/evaluate.py's tasks, --harness-tasks) instead of a test split.
TASKS = {"sst2": {"max_seq_len": 64, "steps": 48, "eval_examples": None},
         "boolq": {"max_seq_len": 96, "steps": 288, "eval_examples": None},
         "instruct": {"max_seq_len": 128, "steps": 64, "eval_examples": None, "harness": True}}
HARNESS_TASKS = ["arc_easy", "arc_challenge", "hellaswag", "piqa", "mmlu", "sst2", "boolq"]
METHOD_ORDER = ["zero_shot", "lora", "apt_0.7", "ptt_0.7", "apt_0.5", "apt_0.7_uniform", "apt_0.5_uniform", "ptt_0.5"]
# ablations, run only when named in --methods: APT without self-distillation
EXTRA_METHODS = ["apt_0.7_nodistill", "apt_0.5_nodistill", "lora_nf4", "apt_0.7_nf4"]  # _nf4: --base-quant nf4


# ============================================================== parent: runs, speed, report


def forward_flops_per_token(shape, context: int) -> float:
    """Multiply-adds x 2 of one decoded token: every block matmul, attention over `context`
    cached positions, and the lm_head (embedding lookup and norms are negligible)."""
    d, total = shape.hidden, 0.0
    for layer in shape.layers:
        q = layer.num_q_heads * layer.head_dim
        kv = layer.num_kv_groups * layer.head_dim
        total += 2 * (d * q + 2 * d * kv + q * d + 3 * d * layer.ffn)
        total += 2 * 2 * q * context  # scores + weighted sum
    return total + 2 * d * shape.vocab


def measure_speed(exports: dict[str, Path], rounds: int, threads: int, prompt_len: int, new_tokens: int) -> dict:
    """Decode/prefill speed of every export at batch 1, interleaved rounds, medians."""
    import torch

    from apt_ds.io.modeling import load_model
    from apt_ds.training.evaluate import decode_speed

    torch.set_num_threads(threads)
    models = {name: load_model(path) for name, path in exports.items()}
    samples: dict[str, list[dict]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            samples[name].append(decode_speed(model, 1, prompt_len=prompt_len, new_tokens=new_tokens, repeats=1))
    out = {}
    for name, runs in samples.items():
        out[name] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        out[name]["rounds"] = rounds
    del models
    gc.collect()
    return out


Run = tuple[str, Path, Path]  # name "task/method", spec path, run directory


def start_groups(pending: list[Run]) -> list[list[Run]]:
    """Start groups in queue order: every task's LoRA and APT 0.7 as one group, pair by pair,
    then the other runs one by one, per task. A group starts only when it has a slot for
    each of its runs, so a pair's runs start together and share the machine while both run;
    the shorter one's free core then idles until its partner ends (the pair's CPU-time ratio
    is unaffected, the tail of the longer run has the machine to itself)."""
    first = ("lora", "apt_0.7")
    tasks = list(dict.fromkeys(name.split("/")[0] for name, *_ in pending))
    pairs = [[run for m in first for run in pending if run[0] == f"{task}/{m}"] for task in tasks]
    rest = [[run] for task in tasks for run in pending
            if run[0].startswith(f"{task}/") and run[0].split("/")[1] not in first]
    return [group for group in pairs if group] + rest


def run_workers(groups: list[list[Run]], jobs: int, timings: dict, wall_start: float) -> None:
    """Run the worker subprocesses, at most `jobs` at a time, starting each group's runs
    together once there are slots for all of them (a group larger than `jobs` runs one by one)."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    running: dict[str, tuple[subprocess.Popen, float, Path]] = {}
    queue = [part for group in groups for part in ([group] if len(group) <= jobs else [[run] for run in group])]
    while queue or running:
        while queue and len(running) + len(queue[0]) <= jobs:
            for name, spec_path, run_dir in queue.pop(0):
                print(f"[quality] {name}: start (elapsed {time.perf_counter() - wall_start:.0f} s, "
                      f"load {os.getloadavg()[0]:.2f})", flush=True)
                running[name] = (subprocess.Popen([sys.executable, __file__, "--worker", str(spec_path)]), time.perf_counter(), run_dir)
        time.sleep(1.0)
        for name, (proc, started, run_dir) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            timings[name] = time.perf_counter() - started
            if proc.returncode != 0:
                for other, *_ in running.values():
                    other.terminate()
                raise SystemExit(f"worker {name} failed with exit code {proc.returncode}")
            res = read_json(run_dir / "result.json")
            print(f"[quality] {name}: done in {timings[name]:.0f} s: acc {res['accuracy']:.3f}, "
                  f"density {res['density']:.3f}, train {res.get('train_time_s', 0) or 0:.0f} s, "
                  f"peak {res.get('peak_rss_mb', 0) or 0:.0f} MB", flush=True)


def data_fingerprint(task_dir: Path) -> str:
    """sha256 of a task's task.json, train and test files; exits with the fix when the task is not prepared."""
    digest = hashlib.sha256()
    harness = TASKS.get(task_dir.name, {}).get("harness")
    prepare = "prepare_instructions.py" if harness else "prepare_tasks.py"
    for name in ("task.json", "train.jsonl") + (() if harness else ("test.jsonl",)):
        path = task_dir / name
        if not path.is_file():
            raise SystemExit(f"error: {path} is missing; prepare the tasks first: "
                             f"python benchmarks/{prepare} --out {task_dir.parent}")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def check_harness(names: list[str]) -> None:
    """lm-eval, the shipped data and the task names are there, or one line saying what to install."""
    from apt_ds.evaluation.errors import EvaluationError
    from apt_ds.evaluation.tasks import check_task_names, task_manager
    from apt_ds.evaluation.tasks.shipped import data_root

    try:
        data_root()
        check_task_names(names, task_manager())
    except EvaluationError as err:
        raise SystemExit(f"error: {err}") from None


def run_all(args) -> None:
    wall_start = time.perf_counter()
    out = Path(args.out)
    data_sha256 = {task: data_fingerprint(Path(args.tasks_dir) / task) for task in args.tasks}  # before a slow conversion
    if any(TASKS[task].get("harness") for task in args.tasks):
        check_harness(args.harness_tasks)  # before minutes of training that the scoring would then throw away
    out.mkdir(parents=True, exist_ok=True)
    hf_dir = ensure_hf_model(args.model, args.hf_cache)
    print(f"[quality] command: {command_line()}", flush=True)
    hardware_start = hardware()
    print(f"[quality] hardware: {hardware_start}", flush=True)
    timings: dict[str, float] = {}
    pending, reused = [], []
    commit = git_commit()
    for task in args.tasks:
        for method in args.methods:
            run_dir = out / task / method
            spec = {
                "task": task, "method": method, "run_dir": str(run_dir), "task_dir": str(Path(args.tasks_dir) / task),
                "hf_dir": str(hf_dir), "steps": args.steps or TASKS[task]["steps"], "micro_batch_size": args.micro_batch_size, "lr": args.lr,
                "rank": args.rank, "adapter_targets": args.adapter_targets, "seed": args.seed, "threads": args.threads, "max_seq_len": args.max_seq_len or TASKS[task]["max_seq_len"],
                "eval_examples": args.eval_examples or TASKS[task]["eval_examples"], "eval_batch_size": args.eval_batch_size,
                "calibration_batches": args.calibration_batches, "check_rows": args.check_rows,
                "malloc_trim": not args.no_malloc_trim, "git_commit": commit,  # other code: run again
                "data_sha256": data_sha256[task],  # other records (e.g. prompt style): run again
            }
            if TASKS[task].get("harness"):
                spec.update(harness_tasks=args.harness_tasks, harness_limit=args.harness_limit, mmlu_limit=args.mmlu_limit)
            if args.apt:  # only when given: results of runs without overrides stay reusable
                spec["apt_overrides"] = args.apt
            spec_path = out / task / f"{method}.spec.json"
            if (run_dir / "result.json").is_file() and not args.overwrite:
                if read_json(run_dir / "result.json").get("spec") == spec:  # same settings: reuse it
                    reused.append(f"{task}/{method}")
                    print(f"[quality] {task}/{method}: have a result with these settings, skipping", flush=True)
                    continue
                print(f"[quality] {task}/{method}: the saved result used other settings; running again", flush=True)
            write_json(spec_path, spec)
            pending.append((f"{task}/{method}", spec_path, run_dir))
    run_workers(start_groups(pending), args.jobs, timings, wall_start)

    speed = {}
    previous = out / "results.json"
    if args.reuse_speed and previous.is_file():
        speed = {task: {m: row["speed"] for m, row in rows.items() if "speed" in row}
                 for task, rows in read_json(previous)["tasks"].items()}
    elif not args.skip_speed:
        for task in args.tasks:
            if TASKS[task].get("harness"):  # the same shapes as SST-2's at each density: measured there
                continue
            exports = {m: out / task / m / "export" for m in args.methods
                       if m != "zero_shot" and (out / task / m / "export" / "config.json").is_file()}
            if "lora" not in exports:
                continue
            started = time.perf_counter()
            speed[task] = measure_speed(exports, args.speed_rounds, args.threads, args.prompt_len, args.new_tokens)
            print(f"[quality] {task}: decode speed measured in {time.perf_counter() - started:.0f} s", flush=True)
    summary = aggregate(args, out, speed)
    summary["timings_s"] = timings
    summary["reused_runs"] = reused
    summary["from_scratch"] = not reused and not args.reuse_speed  # only such a run times "the whole benchmark"
    summary["wall_time_s"] = time.perf_counter() - wall_start
    if args.reuse_speed and previous.is_file():  # a re-report: keep the measuring run's timings
        old = read_json(previous)
        summary["timings_s"] = {**old.get("timings_s", {}), **timings}
        summary["measuring_run_wall_time_s"] = old.get("measuring_run_wall_time_s", old.get("wall_time_s"))
        summary["measuring_run_command"] = old.get("measuring_run_command", old.get("command"))
    else:
        summary["measuring_run_wall_time_s"] = summary["wall_time_s"]
        summary["measuring_run_command"] = command_line()
    summary["command"] = command_line()
    summary["hardware"], summary["hardware_end"] = hardware_start, hardware()  # load average before and after
    write_json(out / "results.json", summary)
    table = markdown(summary, METHOD_ORDER + EXTRA_METHODS) + phase_split(out, summary)
    (out / "results.md").write_text(table)
    print(table)
    plots(summary, out, Path(args.img_dir))
    print(f"[quality] wall time of this invocation: {summary['wall_time_s'] / 60:.1f} min "
          f"(sum over all runs incl. earlier invocations: {summary['sum_of_run_times_s'] / 60:.1f} min)", flush=True)


def aggregate(args, out: Path, speed: dict) -> dict:
    summary = {"config": {k: v for k, v in vars(args).items() if k not in ("worker",)}, "tasks": {}, "hardware": hardware()}
    run_seconds = 0.0
    for task in args.tasks:
        rows = {}
        for method in [m for m in METHOD_ORDER + EXTRA_METHODS if m in args.methods]:
            path = out / task / method / "result.json"
            if path.is_file():
                rows[method] = read_json(path)  # run_all reran every result whose settings differed
                run_seconds += sum(rows[method].get(k, 0) or 0 for k in ("load_time_s", "train_time_s", "export_time_s", "eval_time_s"))
        lora = rows.get("lora")
        for method, row in rows.items():
            if method in speed.get(task, {}):
                row["speed"] = speed[task][method]
            export = out / task / method / "export"
            if (export / "config.json").is_file():
                cfg = json.loads((export / "config.json").read_text())
                row["flops_per_token"] = forward_flops_per_token(_shape_from_config(cfg), args.prompt_len + args.new_tokens // 2)
            if lora:
                row["acc_vs_lora"] = row["accuracy"] / lora["accuracy"] if lora["accuracy"] else None
                for key, ref in (("train_time_s", "train_time_s"), ("train_cpu_s", "train_cpu_s"), ("peak_rss_mb", "peak_rss_mb"),
                                 ("peak_rss_after_last_event_mb", "peak_rss_after_last_event_mb"),
                                 ("rss_after_last_event_mb", "rss_after_last_event_mb"), ("export_bytes", "export_bytes"),
                                 ("flops_per_token", "flops_per_token")):
                    if row.get(key) and lora.get(ref):
                        row[f"{key}_vs_lora"] = row[key] / lora[ref]
                if row.get("speed") and lora.get("speed"):
                    row["decode_speed_vs_dense"] = row["speed"]["decode_tokens_per_s"] / lora["speed"]["decode_tokens_per_s"]
                    row["prefill_speed_vs_dense"] = row["speed"]["prefill_tokens_per_s"] / lora["speed"]["prefill_tokens_per_s"]
        summary["tasks"][task] = rows
        summary.setdefault("targets", {})[task] = targets(rows)
    summary["sum_of_run_times_s"] = run_seconds
    return summary


def _shape_from_config(cfg: dict):
    from apt_ds.algorithm.units import LayerShape, ModelShape

    if cfg.get("apt_layer_shapes"):
        layers = tuple(LayerShape(**s) for s in cfg["apt_layer_shapes"])
    else:
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        layers = tuple(LayerShape(kv, heads // kv, head_dim, cfg["intermediate_size"]) for _ in range(cfg["num_hidden_layers"]))
    return ModelShape(cfg["hidden_size"], layers, cfg["vocab_size"], bool(cfg.get("tie_word_embeddings")))


def apt_overrides(pairs: list[str], run_steps: list[int]) -> dict:
    """{'kurtosis_weight': 0.0, ...} from ['kurtosis_weight=0', ...], checked against the APTConfig
    of a run of each length in `run_steps` (a schedule override such as pruning_end_step=43 is only
    valid against a run's own schedule, whose other steps scale with its length)."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(APTConfig)}
    found = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in known:
            raise ValueError(f"--apt {pair}: expected FIELD=VALUE with FIELD an APTConfig field ({', '.join(sorted(known))})")
        try:
            found[name] = json.loads(text)
        except json.JSONDecodeError:
            found[name] = text
    for steps in run_steps:
        try:
            check_schedule_fits(APTConfig.for_steps(steps, **found), TrainConfig(steps=steps))
        except (ConfigError, TypeError) as err:  # the config's own one-line validation message
            raise ValueError(f"--apt (a {steps}-step run): {err}") from None
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    add_model_arguments(parser)
    parser.add_argument("--tasks-dir", default="bench_out/tasks")
    parser.add_argument("--out", default=None, help="default bench_out/quality (bench_out/quality_smoke with --smoke)")
    parser.add_argument("--img-dir", default=None,
                        help="where the plots go (default OUT/img; the tracked docs/img plots are the full run's: "
                             "pass --img-dir docs/img only for that run)")
    parser.add_argument("--tasks", nargs="+", default=["sst2", "boolq"], choices=sorted(TASKS))
    parser.add_argument("--methods", nargs="+", default=METHOD_ORDER, choices=METHOD_ORDER + EXTRA_METHODS)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps of every run (default: per task, see TASKS)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="tokens per example of every run (default: per task, see TASKS)")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--rank", type=int, default=8, help="initial adapter rank (LoRA's rank)")
    parser.add_argument("--adapter-targets", nargs="+", default=list(APTConfig().adapter_targets), choices=ADAPTER_TARGETS,
                        help="projections that get adapters, in every trained method (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (1: stable timings on a shared machine)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="training runs at once (default 2: one per core at --threads 1; 1 for an otherwise idle machine)")
    parser.add_argument("--eval-examples", type=int, default=None, help="test rows scored (default: per task, see TASKS)")
    parser.add_argument("--eval-batch-size", type=int, default=16)
    parser.add_argument("--check-rows", type=int, default=16, help="rows on which the fast scorer is checked against label_accuracy")
    parser.add_argument("--harness-tasks", nargs="+", default=HARNESS_TASKS, choices=HARNESS_TASKS,
                        help="lm-eval tasks that score the instruct task (zero-shot); its accuracy is their mean")
    parser.add_argument("--harness-limit", type=int, default=75,
                        help="instruct: rows of each harness task, drawn at random with --seed (the same rows for every "
                             "method of a seed)")
    parser.add_argument("--mmlu-limit", type=int, default=2, help="instruct: MMLU questions per subject (57 subjects), "
                        "drawn like --harness-limit's")
    parser.add_argument("--calibration-batches", type=int, default=8)
    parser.add_argument("--speed-rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--no-malloc-trim", action="store_true",
                        help="do not call glibc malloc_trim(0) before training (after pruning events apt_ds itself trims)")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--reuse-speed", action="store_true", help="take decode speeds from an existing OUT/results.json (re-report only)")
    parser.add_argument("--overwrite", action="store_true", help="rerun methods that already have a result.json")
    parser.add_argument("--smoke", action="store_true", help="8 steps, 16 eval rows, 2 calibration batches, 1 speed round")
    parser.add_argument("--apt", nargs="+", default=[], metavar="FIELD=VALUE",
                        help="APTConfig fields for every APT and prune-then-tune run, e.g. kurtosis_weight=0 "
                             "score_normalization=none (values read as JSON, else as text); they win over what a "
                             "method's name sets, e.g. target_density=0.84 for a model with layers already dropped "
                             "(benchmarks/drop_layers.py)")
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args.worker)
        return
    if args.jobs < 1 or args.threads < 1:
        parser.error(f"--jobs and --threads must be >= 1 (got --jobs {args.jobs}, --threads {args.threads})")
    if min(args.harness_limit, args.mmlu_limit) < 1:
        parser.error(f"--harness-limit and --mmlu-limit must be >= 1 (got {args.harness_limit}, {args.mmlu_limit})")
    if args.smoke:
        args.steps, args.eval_examples, args.calibration_batches, args.speed_rounds, args.check_rows = 8, 16, 2, 1, 8
        args.harness_limit, args.mmlu_limit = 4, 1
    try:
        args.apt = apt_overrides(args.apt, [args.steps] if args.steps else sorted({TASKS[t]["steps"] for t in args.tasks}))
    except ValueError as err:
        parser.error(str(err))
    args.out = args.out or ("bench_out/quality_smoke" if args.smoke else "bench_out/quality")
    args.img_dir = args.img_dir or str(Path(args.out) / "img")  # a narrower run must not replace the docs' plots
    run_all(args)


if __name__ == "__main__":
    main()
