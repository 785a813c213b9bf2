"""Task quality and training/inference cost of APT vs LoRA vs prune-then-tune (SmolLM2-135M).

For each task (SST-2, BoolQ; prepared by benchmarks/prepare_tasks.py), with the same data
order, seed, adapters (q_proj/v_proj, rank 8), steps and learning rate:

  zero_shot         the untouched model
  lora              dense LoRA (APTConfig.as_lora(): same adapters, no pruning/growth/distillation)
  ptt_<d>           prune-then-tune: one-shot first-order Taylor pruning to density d, then LoRA
  apt_<d>           APT to density d, non-uniform
  apt_<d>_uniform   APT to density d, the same shape in every layer (stock LlamaConfig export)

Every training run is a fresh subprocess (`--worker`), so its memory readings are its own.
The model is loaded as `apt-ds train` loads it for a pruning run (`load_model(mmap=False)`:
a mapped checkpoint would stay resident however much is pruned). Peak RSS = Linux VmHWM reset (/proc/self/clear_refs) after the model is loaded and the data
tokenized, read when training ends; "after the last pruning event" = VmHWM reset again at
the first micro-batch after the last event step (the same step number for LoRA) and read at
the end, i.e. the peak of the recovery phase at the final shapes. The run is then exported
(`apt_ds.export`: adapters merged, pruned units removed), reloaded from disk and evaluated
(highest-likelihood label, exact match, on each task's whole test split by default).
Finally, in this process, every export's greedy decode speed (batch 1) is measured side by
side with the dense LoRA-merged export, in interleaved rounds (median).

    python benchmarks/quality.py                       # full run (74 min on 2 cores, --jobs 2)
    python benchmarks/quality.py --smoke               # pipeline check: few steps, few rows
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import (  # noqa: E402
    DEFAULT_GGUF, check_fast_scorer, command_line, ensure_hf_model, fast_label_report, git_commit, hardware, read_json, reset_peak_rss, rss_mb,
    vm_hwm_mb, write_json,
)
from _quality_report import markdown, plots, targets  # noqa: E402

from apt_ds.config import ADAPTER_TARGETS, APTConfig  # noqa: E402

# Per task: sequence length (BoolQ prompts are cut from the left: the question survives),
# optimizer steps and test rows scored (each task's whole test split). BoolQ gets 6x SST-2's
# steps: with 96 steps no method learned it (LoRA's AUC 0.49 at 96 tokens, 0.52 at 192 tokens,
# 0.50 at LR 5e-4); with 288 steps LoRA reached AUC 0.56 (docs/BENCHMARKS.md).
TASKS = {"sst2": {"max_seq_len": 64, "steps": 48, "eval_examples": None},
         "boolq": {"max_seq_len": 96, "steps": 288, "eval_examples": None}}
METHOD_ORDER = ["zero_shot", "lora", "apt_0.7", "ptt_0.7", "apt_0.5", "apt_0.7_uniform", "apt_0.5_uniform", "ptt_0.5"]
# ablations, run only when named in --methods: APT without self-distillation
EXTRA_METHODS = ["apt_0.7_nodistill", "apt_0.5_nodistill"]


def method_spec(name: str) -> dict:
    if name in ("zero_shot", "lora"):
        return {"kind": name, "density": 1.0, "uniform": False}
    kind, density, *rest = name.split("_")
    # prune-then-tune's LoRA phase never distils
    return {"kind": kind, "density": float(density), "uniform": "uniform" in rest,
            "distill": kind == "apt" and "nodistill" not in rest}


# ============================================================== worker (one method, one task)


def _rows(path: Path, n: int | None) -> list[dict]:
    """The first n rows (all when n is None)."""
    from apt_ds.data import load_records

    records = load_records(path)
    return [dict(records[i]) for i in range(len(records) if n is None else min(n, len(records)))]


def run_worker(spec_path: Path) -> None:
    import torch

    spec = read_json(spec_path)
    torch.set_num_threads(spec["threads"])
    from apt_ds.config import TrainConfig
    from apt_ds.data import batches, load_records, tokenize_dataset
    from apt_ds.evaluate import parameter_bytes
    from apt_ds.export import compact_model, export_run, weight_files, write_export
    from apt_ds.heap import release_free_heap
    from apt_ds.modeling import load_model
    from apt_ds.tokenizer import load_tokenizer
    from apt_ds.trainer import APTrainer
    from apt_ds.units import ModelShape

    run_dir, task_dir = Path(spec["run_dir"]), Path(spec["task_dir"])
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    task = read_json(task_dir / "task.json")
    labels, seq = task["labels"], spec["max_seq_len"]
    method = method_spec(spec["method"])
    result = {"task": spec["task"], "method": spec["method"], **method, "max_seq_len": seq, "seed": spec["seed"], "spec": spec,
              "git_commit": spec["git_commit"], "hardware": hardware()}
    tokenizer = load_tokenizer(spec["hf_dir"])
    test_rows = _rows(task_dir / "test.jsonl", spec["eval_examples"])
    result["eval_rows"] = len(test_rows)
    started = time.perf_counter()
    model = load_model(spec["hf_dir"], mmap=False)  # as `apt-ds train` loads for pruning: freed weights leave RSS
    result["load_time_s"] = time.perf_counter() - started
    original = ModelShape.from_model(model)

    if method["kind"] == "zero_shot":
        started = time.perf_counter()
        result.update(fast_label_report(model, tokenizer, test_rows, labels, seq, spec["eval_batch_size"]))
        result["eval_time_s"] = time.perf_counter() - started
        # cross-check the one-forward scorer against apt_ds.evaluate.label_accuracy's own scores
        result["scorer_check"] = check_fast_scorer(model, tokenizer, test_rows[: spec["check_rows"]], labels, seq)
        result.update(density=1.0, block_params=original.block_params(), total_params=original.total_params(),
                      parameter_bytes=parameter_bytes(model))
        write_json(run_dir / "result.json", result)
        return

    steps = spec["steps"]
    apt = APTConfig.for_steps(steps, target_density=method["density"], uniform=method["uniform"],
                              distill=method.get("distill", True),
                              adapter_rank=spec["rank"], adapter_alpha=2.0 * spec["rank"],
                              adapter_targets=tuple(spec["adapter_targets"]))
    train = TrainConfig(steps=steps, micro_batch_size=spec["micro_batch_size"], lr=spec["lr"],
                        warmup_steps=max(1, steps // 10), max_seq_len=seq, seed=spec["seed"], log_every=1)
    records = load_records(task_dir / "train.jsonl")
    examples = tokenize_dataset(records, tokenizer, seq, pack=False, source=str(task_dir / "train.jsonl"))
    pad_id = tokenizer.pad_token_id or 0
    last_event_step = apt.pruning_end_step
    holder: dict = {}
    trim = spec.get("malloc_trim", True)  # before training only: after pruning events apt_ds trims itself
    memory = {"reset_ok": None, "post_event_reset_step": None}

    def stream():
        inner = batches(examples, train.micro_batch_size, train.seed, pad_id=pad_id)
        for batch in inner:
            trainer = holder.get("trainer")
            if trainer is not None and memory["post_event_reset_step"] is None and trainer.step >= last_event_step:
                gc.collect()
                memory["peak_before_last_event_mb"] = vm_hwm_mb()
                memory["rss_after_last_event_mb"] = rss_mb()
                reset_peak_rss()
                memory["post_event_reset_step"] = trainer.step
            yield batch

    tokenizer.save_pretrained(str(run_dir / "tokenizer"))
    run_info = {"model": str(Path(spec["hf_dir"]).resolve()), "tokenizer": "tokenizer", "method": spec["method"],
                "data": str(task_dir / "train.jsonl")}
    if trim:
        release_free_heap()  # collects too
    else:
        gc.collect()
    result["rss_before_train_mb"] = rss_mb()
    memory["reset_ok"] = reset_peak_rss()
    cpu_started = time.process_time()  # user + sys CPU of this process: robust to other tenants' load
    started = time.perf_counter()
    if method["kind"] == "ptt":
        from apt_ds.baselines import one_shot_prune

        calib_stream = batches(examples, train.micro_batch_size, train.seed + 1000, pad_id=pad_id)
        calibration = [next(calib_stream) for _ in range(spec["calibration_batches"])]
        pruned = one_shot_prune(model, calibration, method["density"], apt)
        result["calibration_time_s"] = time.perf_counter() - started
        result["calibration_cpu_s"] = time.process_time() - cpu_started
        result["calibration_batches"] = len(calibration)
        train_started = time.perf_counter()
        trainer = APTrainer(model, apt.as_lora(), train, out_dir=run_dir, progress=False,
                            run_info={**run_info, "one_shot_density": pruned.density})
    else:
        trainer = APTrainer(model, apt if method["kind"] == "apt" else apt.as_lora(), train, out_dir=run_dir,
                            progress=False, run_info=run_info)
        train_started = started
    holder["trainer"] = trainer
    trainer.train(stream())
    result["train_only_time_s"] = time.perf_counter() - train_started
    result["train_time_s"] = time.perf_counter() - started  # incl. calibration for prune-then-tune
    result["train_cpu_s"] = time.process_time() - cpu_started
    result["peak_rss_mb"] = max(vm_hwm_mb(), memory.get("peak_before_last_event_mb", 0.0))
    result["peak_rss_after_last_event_mb"] = vm_hwm_mb() if memory["post_event_reset_step"] is not None else None
    result["rss_after_last_event_mb"] = memory.get("rss_after_last_event_mb")
    result["malloc_trim_before_training"] = trim
    result["memory_method"] = {"peak_reset_supported": memory["reset_ok"], "post_event_reset_step": memory["post_event_reset_step"],
                               "last_event_step": last_event_step}
    result["apt_config"], result["train_config"] = trainer.apt_config.to_dict(), train.to_dict()
    history = [r for r in trainer.history if "loss" in r]
    result["final_loss"] = history[-1]["loss"]
    result["mean_loss_last10"] = statistics.mean(r["loss"] for r in history[-10:])
    result["step_time_median_s"] = statistics.median(r["step_time_s"] for r in history)
    result["total_rank"] = trainer.state.total_rank()

    export_dir = run_dir / "export"
    started = time.perf_counter()
    if method["kind"] == "ptt":
        shape = trainer.state.shape
        compact = compact_model(model, trainer.state)
        write_export(compact, shape, export_dir, torch.float32, tokenizer_dir=run_dir / "tokenizer")
    else:
        del trainer, holder["trainer"], model
        gc.collect()
        export_run(run_dir, export_dir, dtype="fp32", overwrite=True)
    result["export_time_s"] = time.perf_counter() - started
    report = read_json(export_dir / "apt_export.json")
    model = load_model(export_dir)  # what a user gets; uniform/dense exports load via stock transformers
    shape = ModelShape.from_model(model)
    result.update(
        density=shape.block_params() / original.block_params(), block_params=shape.block_params(),
        total_params=shape.total_params(), uniform_shape=shape.uniform, hidden=shape.hidden,
        exported_params=report["exported_params"], parameter_bytes=parameter_bytes(model),
        export_bytes=sum(f.stat().st_size for f in weight_files(export_dir)),
        stock_loadable=not (json.loads((export_dir / "config.json").read_text()).get("apt_layer_shapes")),
    )
    started = time.perf_counter()
    result.update(fast_label_report(model, tokenizer, test_rows, labels, seq, spec["eval_batch_size"]))
    result["eval_time_s"] = time.perf_counter() - started
    # the one-forward scorer calls model.model and lm_head directly: check it on this (pruned) export too
    result["scorer_check"] = check_fast_scorer(model, tokenizer, test_rows[: spec["check_rows"]], labels, seq)
    write_json(run_dir / "result.json", result)


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

    from apt_ds.evaluate import decode_speed
    from apt_ds.modeling import load_model

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


def paired_first(pending: list[tuple[str, Path, Path]]) -> list[tuple[str, Path, Path]]:
    """Queue order: every task's LoRA and APT 0.7 first, pair by pair, then the rest per task.
    With two jobs the first pair starts together; a later pair's runs start as the previous
    runs end, so they overlap but need not start together (the measured run's SST-2 LoRA
    started 177 s before its APT)."""
    first = ("lora", "apt_0.7")
    tasks = list(dict.fromkeys(name.split("/")[0] for name, *_ in pending))

    def key(item):
        task, method = item[0].split("/")
        return (0 if method in first else 1, tasks.index(task))

    return sorted(pending, key=key)  # stable: table order within each group


def run_workers(pending: list[tuple[str, Path, Path]], jobs: int, timings: dict, wall_start: float) -> None:
    """Run the worker subprocesses, `jobs` at a time, in list order."""
    running: dict[str, tuple[subprocess.Popen, float, Path]] = {}
    queue = list(pending)
    while queue or running:
        while queue and len(running) < jobs:
            name, spec_path, run_dir = queue.pop(0)
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


def run_all(args) -> None:
    wall_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hf_dir = ensure_hf_model(args.model, args.hf_cache)
    print(f"[quality] command: {command_line()}", flush=True)
    print(f"[quality] hardware: {hardware()}", flush=True)
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
            }
            spec_path = out / task / f"{method}.spec.json"
            if (run_dir / "result.json").is_file() and not args.overwrite:
                if read_json(run_dir / "result.json").get("spec") == spec:  # same settings: reuse it
                    reused.append(f"{task}/{method}")
                    print(f"[quality] {task}/{method}: have a result with these settings, skipping", flush=True)
                    continue
                print(f"[quality] {task}/{method}: the saved result used other settings; running again", flush=True)
            write_json(spec_path, spec)
            pending.append((f"{task}/{method}", spec_path, run_dir))
    run_workers(paired_first(pending), args.jobs, timings, wall_start)

    speed = {}
    previous = out / "results.json"
    if args.reuse_speed and previous.is_file():
        speed = {task: {m: row["speed"] for m, row in rows.items() if "speed" in row}
                 for task, rows in read_json(previous)["tasks"].items()}
    elif not args.skip_speed:
        for task in args.tasks:
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
    summary["hardware_end"] = hardware()
    write_json(out / "results.json", summary)
    table = markdown(summary, METHOD_ORDER + EXTRA_METHODS)
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
    from apt_ds.units import LayerShape, ModelShape

    if cfg.get("apt_layer_shapes"):
        layers = tuple(LayerShape(**s) for s in cfg["apt_layer_shapes"])
    else:
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        layers = tuple(LayerShape(kv, heads // kv, head_dim, cfg["intermediate_size"]) for _ in range(cfg["num_hidden_layers"]))
    return ModelShape(cfg["hidden_size"], layers, cfg["vocab_size"], bool(cfg.get("tie_word_embeddings")))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=DEFAULT_GGUF, help="a .gguf file or an HF LLaMA directory")
    parser.add_argument("--hf-cache", default="bench_out/smollm2-135m-hf", help="where a .gguf is converted once")
    parser.add_argument("--tasks-dir", default="bench_out/tasks")
    parser.add_argument("--out", default=None, help="default bench_out/quality (bench_out/quality_smoke with --smoke)")
    parser.add_argument("--img-dir", default=None, help="default docs/img (OUT/img with --smoke)")
    parser.add_argument("--tasks", nargs="+", default=["sst2", "boolq"], choices=sorted(TASKS))
    parser.add_argument("--methods", nargs="+", default=METHOD_ORDER, choices=METHOD_ORDER + EXTRA_METHODS)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps of every run (default: per task, see TASKS)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="tokens per example of every run (default: per task, see TASKS)")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--rank", type=int, default=8, help="initial adapter rank (LoRA's rank)")
    parser.add_argument("--adapter-targets", nargs="+", default=list(APTConfig().adapter_targets), choices=ADAPTER_TARGETS,
                        help="projections that get adapters, in every trained method (default: q_proj v_proj)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (1: stable timings on a shared machine)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="training runs at once (default 2: one per core at --threads 1; 1 for an otherwise idle machine)")
    parser.add_argument("--eval-examples", type=int, default=None, help="test rows scored (default: per task, see TASKS)")
    parser.add_argument("--eval-batch-size", type=int, default=16)
    parser.add_argument("--check-rows", type=int, default=16, help="rows on which the fast scorer is checked against label_accuracy")
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
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args.worker)
        return
    if args.jobs < 1 or args.threads < 1:
        parser.error(f"--jobs and --threads must be >= 1 (got --jobs {args.jobs}, --threads {args.threads})")
    if args.smoke:
        args.steps, args.eval_examples, args.calibration_batches, args.speed_rounds, args.check_rows = 8, 16, 2, 1, 8
    args.out = args.out or ("bench_out/quality_smoke" if args.smoke else "bench_out/quality")
    args.img_dir = args.img_dir or (str(Path(args.out) / "img") if args.smoke else "docs/img")
    run_all(args)


if __name__ == "__main__":
    main()
