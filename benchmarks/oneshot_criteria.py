"""How much zero-shot ability a pruning decision alone keeps: one-shot structured pruning of
SmolLM2-135M by several criteria, no training, scored by lm-eval (issue 16, instruct targets).

The instruction benchmark (quality_seeds.py --tasks instruct) ends every pruning method at 0.7
far below dense LoRA on the knowledge tasks. This separates the decision from the training: each
criterion scores units on the same calibration batches of the instruction mix, the model is cut to
--densities in one shot and exported as it is (no adapters, no recovery), and the harness scores
it on the rows quality_seeds.py draws for --seed. Criteria:
- salience: APT's first-order salience (prune-then-tune's one-shot step, apt_ds.training.baselines),
  non-uniform, loss on the response tokens as training has it;
- salience_all_tokens: the same with the loss on every real token (prompt too);
- salience_uniform: the same shape in every layer (uniform mode, its shape chosen by loss);
- wanda_sp: no gradients; a unit's score is sum_j ||X_j||_2 * sum_i |W_ij| over its own o_proj /
  down_proj input columns j (structured Wanda, as in FLAP's and Wanda-sp's comparisons), hidden
  channels kept, ranked by apt_ds's pruner (kinds normalised, blocks of 32);
- wanda_sp_uniform: that score in uniform mode.
The salience criteria may also cut hidden channels (APT's default); the Wanda score has none for
them, so its rows keep all of them: a row compares a criterion with the unit kinds it can cut.
The dense model (density 1) is scored too, unless --no-dense. With --train-steps N each cut is then
LoRA-tuned for N steps as quality.py's prune-then-tune is (q/v adapters at rank 8, the instruction
records in the seed's order, LR 2e-3) before it is scored: prune-then-tune with that criterion.

    python benchmarks/prepare_instructions.py --out bench_out/tasks
    python benchmarks/oneshot_criteria.py --out bench_out/oneshot_criteria
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import add_model_arguments, command_line, ensure_hf_model, git_commit, hardware, read_json, write_json  # noqa: E402

CRITERIA = ("salience", "salience_all_tokens", "salience_uniform", "wanda_sp", "wanda_sp_uniform")
HARNESS_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "mmlu", "sst2", "boolq")
KNOWLEDGE = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "mmlu")  # not a label preference (BoolQ, SST-2)


def instruction_examples(spec: dict, tokenizer) -> list:
    """The task's training records, tokenized as the quality worker tokenizes them."""
    from apt_ds.io.data import load_records, tokenize_dataset

    train = Path(spec["task_dir"]) / "train.jsonl"
    return tokenize_dataset(load_records(train), tokenizer, spec["max_seq_len"], pack=False, source=str(train))


def calibration_batches(spec: dict, tokenizer, examples: list | None = None) -> list[dict]:
    """The first spec["calibration_batches"] micro-batches of the task's records in the order the
    quality worker's prune-then-tune draws them (`ptt_calibration`)."""
    from _quality_worker import ptt_calibration

    examples = instruction_examples(spec, tokenizer) if examples is None else examples
    return ptt_calibration(examples, spec["micro_batch_size"], spec["seed"], tokenizer.pad_token_id or 0,
                           spec["calibration_batches"])


def projection_input_sums(model, batches: list[dict], reduce) -> dict:
    """{(kind, layer index): the sum over `batches` of reduce(inputs at the real tokens)} for every
    layer's o_proj (kind "attn") and down_proj ("ffn"); inputs are (real tokens, channels)."""
    import torch

    sums, current, handles = {}, {}, []

    def keep(key):
        def hook(module, args):
            real = args[0].detach()[current["mask"]]
            sums[key] = sums.get(key, 0) + reduce(real)
        return hook

    for index, outputs in enumerate(output_projections(model)):
        for kind, linear in outputs.items():
            handles.append(linear.register_forward_pre_hook(keep((kind, index))))
    try:
        with torch.no_grad():
            for batch in batches:
                current["mask"] = batch["attention_mask"].bool()
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    return sums


def output_projections(model) -> list[dict]:
    """Per decoder layer, the Linear whose input columns are a unit's channels: attention's output
    projection (query channels, by KV group) and the FFN's down projection (neurons)."""
    from apt_ds.models import family_of

    family = family_of(model)
    return [{"attn": family.layer_module(layer, "attn_output"), "ffn": family.layer_module(layer, "ffn_down")}
            for layer in family.decoder_layers(model)]


def wanda_sp_scores(model, batches: list[dict]):
    """(KV group scores, neuron scores) per layer: sum over the unit's input columns j of
    ||X_j||_2 (over the real tokens of all batches) * sum_i |W_ij| (o_proj for a group's query
    channels, down_proj for a neuron)."""
    squares = projection_input_sums(model, batches, lambda real: real.float().pow(2).sum(0))
    groups, neurons = [], []
    for index, outputs in enumerate(output_projections(model)):
        attn = squares[("attn", index)].sqrt() * outputs["attn"].weight.detach().float().abs().sum(0)
        groups.append(attn.reshape(model.config.num_key_value_heads, -1).sum(1))  # the uncut model: config's shape
        neurons.append(squares[("ffn", index)].sqrt() * outputs["ffn"].weight.detach().float().abs().sum(0))
    return groups, neurons


def prune(model, criterion: str, density: float, batches: list[dict]):
    """Cut `model` in place; returns its new ModelShape and the KeepDecision (at the original shapes)."""
    import torch

    from apt_ds.algorithm.pruner import AdaptivePruner
    from apt_ds.config import APTConfig
    from apt_ds.training.baselines import one_shot_prune, scoring_state

    uniform = criterion.endswith("_uniform")
    if criterion.startswith("salience"):
        if criterion == "salience_all_tokens":
            batches = [{**b, "labels": b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)} for b in batches]
        result = one_shot_prune(model, batches, density, APTConfig(target_density=density, uniform=uniform))
        return result.shape, result.decision
    groups, neurons = wanda_sp_scores(model, batches)
    config = APTConfig(target_density=density, uniform=uniform, prune_hidden=False, use_kurtosis=False, distill=False,
                       grow_ranks=False, uniform_shape_trials=1)
    with scoring_state(model, config) as state:
        target = density * state.original_shape.budget_params(config.count_embeddings)
        decision = AdaptivePruner(config).decide(state.shape, groups, neurons, torch.ones(state.shape.hidden), target,
                                                 state.original_shape)
        state.shrink(decision)
    return state.shape, decision


def output_inputs(model, batches: list[dict]) -> dict:
    """The Gram matrix X^T X of the inputs of every layer's o_proj and down_proj over the real tokens
    of `batches`, and those weights as they are: what `reconstruct` needs from the uncut model."""
    weights = {(kind, index): linear.weight.detach().double().clone()
               for index, outputs in enumerate(output_projections(model)) for kind, linear in outputs.items()}
    grams = projection_input_sums(model, batches, lambda real: real.double().T @ real.double())
    return {"grams": grams, "weights": weights}


def reconstruct(model, decision, dense: dict, damping: float = 0.01) -> None:
    """Refit each layer's o_proj and down_proj to what the uncut layer put out, from the inputs it
    kept: least squares on the calibration tokens, W' = W C[:, K] (C[K, K] + d I)^-1 with C the
    uncut inputs' Gram matrix and K the kept input channels (the fast post-training pruning of Kwon
    et al. 2022, and FLAP's and SlimGPT's compensation; d = `damping` x the mean diagonal, as
    SparseGPT's, of C[K, K]'s). The rows follow the kept hidden channels; a projection that lost no
    input is left as the cut left it."""
    import torch

    groups, neurons, hidden = decision.indices()
    config = model.config  # the uncut model's: a group's query channels are that wide
    width = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width *= config.num_attention_heads // config.num_key_value_heads
    for index, outputs in enumerate(output_projections(model)):
        channels = {"attn": torch.cat([torch.arange(g * width, (g + 1) * width) for g in groups[index].tolist()]),
                    "ffn": neurons[index]}
        for kind, linear in outputs.items():
            kept, gram, weight = channels[kind], dense["grams"][(kind, index)], dense["weights"][(kind, index)][hidden]
            if len(kept) == gram.shape[0]:  # no input lost: the damped solve would only shrink the weight
                continue
            inner = gram[kept][:, kept]
            inner = inner + damping * inner.diagonal().mean() * torch.eye(len(kept), dtype=inner.dtype)
            refit = torch.linalg.solve(inner, (weight @ gram[:, kept]).T).T
            with torch.no_grad():
                linear.weight.copy_(refit.to(linear.weight.dtype))


def tune(model, spec: dict, tokenizer, examples: list | None = None):
    """LoRA-tune a cut model for spec["train_steps"] steps with quality.py's prune-then-tune
    settings; returns the merged plain model and its shape."""
    from apt_ds.config import APTConfig, TrainConfig
    from apt_ds.export.merge import compact_model
    from apt_ds.io.data import batches
    from apt_ds.models import DEFAULT_ADAPTER_TARGETS
    from apt_ds.training.trainer import APTrainer

    steps, seq = spec["train_steps"], spec["max_seq_len"]
    lora = APTConfig.for_steps(steps, adapter_rank=8, adapter_alpha=16.0, adapter_targets=DEFAULT_ADAPTER_TARGETS).as_lora()
    train = TrainConfig(steps=steps, micro_batch_size=spec["micro_batch_size"], lr=spec["lr"], warmup_steps=max(1, steps // 10),
                        max_seq_len=seq, seed=spec["seed"], log_every=1)
    examples = instruction_examples(spec, tokenizer) if examples is None else examples
    out_dir = Path(spec["run_dir"]) / "train"
    shutil.rmtree(out_dir, ignore_errors=True)  # an earlier invocation's run: this one starts afresh
    trainer = APTrainer(model, lora, train, out_dir=out_dir, progress=False)
    trainer.train(batches(examples, train.micro_batch_size, train.seed, pad_id=tokenizer.pad_token_id or 0))
    return compact_model(model, trainer.state), trainer.state.shape


def run_worker(spec_path: Path) -> None:
    import torch

    spec = read_json(spec_path)
    torch.set_num_threads(spec["threads"])
    from _quality_worker import harness_report

    from apt_ds.algorithm.units import ModelShape
    from apt_ds.export.writer import write_export
    from apt_ds.io.modeling import load_model
    from apt_ds.io.tokenizer import load_tokenizer

    run_dir = Path(spec["run_dir"])
    tokenizer = load_tokenizer(spec["hf_dir"])
    model = load_model(spec["hf_dir"])
    original = ModelShape.from_model(model)
    started = time.perf_counter()
    examples = instruction_examples(spec, tokenizer)  # once for the calibration and the tuning
    if spec["density"] < 1:
        batches = calibration_batches(spec, tokenizer, examples)
        refit_batches = calibration_batches({**spec, "calibration_batches": spec.get("refit_batches") or spec["calibration_batches"]},
                                            tokenizer, examples)
        dense = output_inputs(model, refit_batches) if spec.get("reconstruct") else None
        shape, decision = prune(model, spec["criterion"], spec["density"], batches)
        if dense is not None:
            reconstruct(model, decision, dense, spec.get("refit_damping", 0.01))
    else:
        shape = original
    prune_s = time.perf_counter() - started
    if spec.get("train_steps"):
        model, shape = tune(model, spec, tokenizer, examples)
    tokenizer.save_pretrained(str(run_dir / "tokenizer"))
    write_export(model.eval(), shape, run_dir / "export", torch.float32, tokenizer_dir=run_dir / "tokenizer")
    report = harness_report(run_dir / "export", {**spec, "harness_tasks": list(HARNESS_TASKS)})
    write_json(run_dir / "result.json", {
        "criterion": spec["criterion"] + (f"+refit({spec.get('refit_batches') or spec['calibration_batches']}, "
                                          f"{spec.get('refit_damping', 0.01):g})" if spec.get("reconstruct") else ""),
        "density": shape.block_params() / original.block_params(), "prune_s": prune_s,
        "train_steps": spec.get("train_steps", 0),
        "hidden": shape.hidden, "kv_groups": [l.num_kv_groups for l in shape.layers], "ffn": [l.ffn for l in shape.layers],
        **report})


def table(results: list[dict]) -> str:
    head = ("| criterion | density | harness mean | knowledge mean | " + " | ".join(HARNESS_TASKS)
            + " | hidden | KV groups per layer | FFN width, first / middle / last layer |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        h = r["harness"]
        knowledge = sum(h[t] for t in KNOWLEDGE) / len(KNOWLEDGE)
        ffn, groups = r["ffn"], r["kv_groups"]
        groups = "".join(map(str, groups)) if max(groups) < 10 else ",".join(map(str, groups))
        lines.append(f"| {r['criterion']} | {r['density']:.3f} | {r['accuracy']:.3f} | {knowledge:.3f} | "
                     + " | ".join(f"{h[t]:.3f}" for t in HARNESS_TASKS)
                     + f" | {r['hidden']} | {groups} | {ffn[0]} / {ffn[len(ffn) // 2]} / {ffn[-1]} |")
    return "\n".join(lines)


def _run_all(pending: list, running: list, failed: list, jobs: int) -> None:
    """Start the pending workers, `jobs` at a time, until all have ended; `running` holds the live
    ones (the caller stops them on an interrupt), `failed` gets the names of those that failed."""
    while pending or running:
        while pending and len(running) < jobs:
            run_dir, command = pending.pop(0)
            log = open(run_dir / "log.txt", "w")
            running.append((run_dir, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log))
            print(f"[start] {run_dir.name}", flush=True)
        for item in list(running):
            run_dir, process, log = item
            if process.poll() is not None:
                log.close()
                running.remove(item)
                print(f"[{'done' if process.returncode == 0 else 'FAILED'}] {run_dir.name}", flush=True)
                if process.returncode:
                    failed.append(run_dir.name)
        time.sleep(2)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--task", default="bench_out/tasks/instruct", help="made by prepare_instructions.py")
    parser.add_argument("--criteria", nargs="+", default=list(CRITERIA), choices=CRITERIA)
    parser.add_argument("--densities", nargs="+", type=float, default=[0.7])
    parser.add_argument("--seed", type=int, default=0, help="calibration order and the harness rows drawn")
    parser.add_argument("--calibration-batches", type=int, default=8, help="as quality.py's prune-then-tune")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument("--harness-limit", type=int, default=75, help="rows of each task (quality.py's default)")
    parser.add_argument("--mmlu-limit", type=int, default=2, help="questions per MMLU subject")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one torch thread each")
    parser.add_argument("--out", default="bench_out/oneshot_criteria")
    parser.add_argument("--train-steps", type=int, default=0,
                        help="LoRA-tune each cut for this many steps before scoring (0: score the cut as it is)")
    parser.add_argument("--lr", type=float, default=2e-3, help="with --train-steps (quality.py's)")
    parser.add_argument("--reconstruct", action="store_true",
                        help="refit attention's output and the FFN's down projection to the uncut layer's output after the cut (least squares on the calibration tokens)")
    parser.add_argument("--refit-batches", type=int, default=0,
                        help="with --reconstruct: micro-batches the refit's statistics take (0: --calibration-batches)")
    parser.add_argument("--refit-damping", type=float, default=0.01, help="with --reconstruct: x the mean diagonal of the kept inputs' Gram matrix")
    parser.add_argument("--no-dense", action="store_true", help="leave out the unpruned model's row (scored by an earlier run)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(Path(args.worker))
    if not all(0 < d < 1 for d in args.densities):
        parser.error(f"--densities must lie in (0, 1), got {args.densities}")
    for flag in ("jobs", "calibration_batches", "micro_batch_size", "max_seq_len", "harness_limit", "mmlu_limit"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if 0 < args.train_steps < 4 or args.train_steps < 0 or args.lr <= 0:
        parser.error(f"--train-steps must be 0 or >= 4 (the run's schedule) and --lr > 0, got {args.train_steps} and {args.lr}")
    args.criteria, args.densities = list(dict.fromkeys(args.criteria)), list(dict.fromkeys(args.densities))
    task_dir = Path(args.task)
    if not (task_dir / "train.jsonl").is_file():
        parser.error(f"{task_dir / 'train.jsonl'} not found: run benchmarks/prepare_instructions.py --out {task_dir.parent}")
    hf_dir = ensure_hf_model(args.model, args.hf_cache)
    out = Path(args.out)
    runs = ([] if args.no_dense else [("dense", 1.0)]) + [(c, d) for d in args.densities for c in args.criteria]
    started, pending = time.perf_counter(), []
    for criterion, density in runs:
        run_dir = out / f"{criterion}_{density:g}"
        run_dir.mkdir(parents=True, exist_ok=True)
        spec = {"criterion": criterion, "density": density, "seed": args.seed, "hf_dir": str(hf_dir), "task_dir": str(task_dir),
                "calibration_batches": args.calibration_batches, "micro_batch_size": args.micro_batch_size,
                "max_seq_len": args.max_seq_len, "harness_limit": args.harness_limit, "mmlu_limit": args.mmlu_limit,
                "train_steps": args.train_steps, "lr": args.lr, "threads": 1, "run_dir": str(run_dir),
                "reconstruct": args.reconstruct and density < 1, "refit_batches": args.refit_batches,
                "refit_damping": args.refit_damping}
        write_json(run_dir / "spec.json", spec)
        pending.append((run_dir, [sys.executable, __file__, "--worker", str(run_dir / "spec.json")]))
    running, failed = [], []
    try:
        _run_all(pending, running, failed, args.jobs)
    finally:  # an interrupt stops the workers too
        for _, process, _ in running:
            process.terminate()
    failed += [f"{c}_{d:g}" for c, d in runs if f"{c}_{d:g}" not in failed and not (out / f"{c}_{d:g}" / "result.json").is_file()]
    results = [read_json(out / f"{c}_{d:g}" / "result.json") for c, d in runs if f"{c}_{d:g}" not in failed]
    write_json(out / "results.json", {"command": command_line(), "commit": git_commit(), "hardware": hardware(),
                                      "wall_s": time.perf_counter() - started, "results": results})
    print(table(results))
    if failed:
        raise SystemExit(f"error: runs failed: {', '.join(failed)} (see their log.txt under {out})")


if __name__ == "__main__":
    main()
