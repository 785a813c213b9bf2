"""GGUF exports of benchmarks/quality.py's SST-2 runs, run in llama.cpp (issue 15).

For every method's run (lora, apt_0.7, apt_0.5, apt_0.7_uniform, apt_0.5_uniform: whichever
RUNS holds), F16 and Q8_0 GGUF files are written through the user-facing CLI, one subprocess per
file: `python launch/export.py RUN --out OUT/gguf/METHOD_DTYPE --format gguf --dtype fp16|q8_0
--overwrite` (a quality.py run directory is a regular apt-ds run, so the run form works). Then,
one model at a time, each file is loaded into llama.cpp's server in this process (xllamacpp,
127.0.0.1, a free port, one slot, n_ctx 256, N threads for prompt and decode, default 2) and:

- speed at batch 1: a fixed 64-token prompt of token ids (random ids, seed 0), 32 generated
  tokens (temperature 0, ignore_eos, no prompt cache); prompt and decode tokens/s are
  llama.cpp's own `timings` (prompt_per_second, predicted_per_second). Each round starts the
  server afresh for every file in turn, sends one untimed warm-up request and one timed one;
  medians over --rounds rounds (interleaved across all files).
- SST-2 accuracy: for every test row, the prompt token ids exactly as the transformers scorer
  (benchmarks/_common.fast_label_scores) builds them, one request with n_predict 1 and
  n_probs --top-n; its top_logprobs are llama.cpp's log-softmax over the whole vocabulary before
  sampling. The answer is the label token with the highest log-prob; if a label token is not in
  the top-n the row is asked again with n_probs = vocabulary size, so every label log-prob used
  is exact. The transformers reference is fast_label_scores itself on the run's fp32 HF export
  (the numbers quality.py reports), compared row by row.

Ratios are against the dense LoRA export of the same dtype. File sizes in MiB (2^20 bytes).

    # the runs: benchmarks/quality.py --tasks sst2 --methods lora apt_0.7 apt_0.5 apt_0.7_uniform \\
    #     apt_0.5_uniform --out bench_out/quality_gguf --skip-speed     (or any quality.py OUT/sst2)
    python benchmarks/gguf_llamacpp.py --runs bench_out/quality_seeds/seed0/sst2 --out bench_out/gguf_bench2 \\
        --json bench_out/gguf_bench2/results.json      # what docs/BENCHMARKS.md reports (8.8 min)
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import command_line, fast_label_scores, git_commit, hardware, label_token_ids, read_json, write_json

ROOT = Path(__file__).resolve().parent.parent
METHODS = ["lora", "apt_0.7", "apt_0.5", "apt_0.7_uniform", "apt_0.5_uniform"]
DTYPES = ["fp16", "q8_0"]


# ------------------------------------------------------------------ pure logic (tested)


def label_logprobs(top_logprobs: list[dict], label_ids: list[int]) -> list[float | None]:
    """Each label token's log-prob in llama.cpp's top-n list, None where it is not listed."""
    found = {entry["id"]: entry["logprob"] for entry in top_logprobs}
    return [found.get(i) for i in label_ids]


def choose_label(logprobs: list[float | None], floor: float) -> int:
    """Index of the most likely label; a label missing from the top-n list counts as below
    `floor` (the smallest log-prob returned). Ties go to the first label, as torch's argmax."""
    values = [floor - 1.0 if lp is None else lp for lp in logprobs]
    return max(range(len(values)), key=lambda i: (values[i], -i))


def ratio(value, reference):
    return value / reference if value is not None and reference else None


# ------------------------------------------------------------------ llama.cpp


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


LOG = {"verbosity": -1}  # llama.cpp's own log: off unless --llama-log


def start_server(path: Path, threads: int, n_ctx: int = 256):
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(path)
    params.n_ctx = n_ctx
    params.n_parallel = 1  # one slot: batch 1
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
    params.warmup = False
    params.verbosity = LOG["verbosity"]
    params.port = _free_port()
    return xllamacpp.Server(params)


def complete(server, ids: list[int], **extra) -> dict:
    reply = server.handle_completions({"prompt": ids, "temperature": 0, "cache_prompt": False, **extra})
    if "choices" not in reply:
        raise RuntimeError(f"llama.cpp refused the request: {str(reply)[:500]}")
    return reply


def speed_once(path: Path, threads: int, prompt: list[int], new_tokens: int) -> dict:
    server = start_server(path, threads)
    try:
        complete(server, prompt, n_predict=new_tokens, ignore_eos=True)  # warm-up, not counted
        timings = complete(server, prompt, n_predict=new_tokens, ignore_eos=True)["timings"]
    finally:
        del server
        gc.collect()
    if timings["prompt_n"] != len(prompt) or timings["predicted_n"] != new_tokens:
        raise RuntimeError(f"{path.name}: llama.cpp processed {timings['prompt_n']} prompt / "
                           f"{timings['predicted_n']} new tokens, expected {len(prompt)} / {new_tokens}")
    return {"prompt_tokens_per_s": timings["prompt_per_second"], "decode_tokens_per_s": timings["predicted_per_second"]}


def llama_cpp_label_scores(path: Path, threads: int, prompts: list[list[int]], label_ids: list[int], top_n: int,
                           vocab: int) -> tuple[list[list[float | None]], list[int], int]:
    """Per row: the label tokens' log-probs, the chosen label, and how many rows needed the full vocabulary."""
    server = start_server(path, threads)
    scores, chosen, retried = [], [], 0
    try:
        for ids in prompts:
            top = complete(server, ids, n_predict=1, n_probs=top_n)["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
            lps = label_logprobs(top, label_ids)
            if None in lps and top_n < vocab:
                retried += 1
                top = complete(server, ids, n_predict=1, n_probs=vocab)["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
                lps = label_logprobs(top, label_ids)
            scores.append(lps)
            chosen.append(choose_label(lps, min(entry["logprob"] for entry in top)))
    finally:
        del server
        gc.collect()
    return scores, chosen, retried


# ------------------------------------------------------------------ transformers reference


def transformers_reference(run_dir: Path, spec: dict, threads: int, check_rows: int) -> dict:
    """The scorer's prompts, label ids and fp32 label log-probs on the run's HF export."""
    import torch

    from apt_ds.io.data import encode_prompt_response, load_records, prompt_and_answer
    from apt_ds.io.modeling import load_model
    from apt_ds.io.tokenizer import load_tokenizer

    torch.set_num_threads(threads)
    labels = read_json(Path(spec["task_dir"]) / "task.json")["labels"]
    tokenizer = load_tokenizer(spec["hf_dir"])
    records = load_records(Path(spec["task_dir"]) / "test.jsonl")
    n = len(records) if spec["eval_examples"] is None else min(spec["eval_examples"], len(records))
    rows = [dict(records[i]) for i in range(n)]
    seq = spec["max_seq_len"]
    # as fast_label_scores builds them: BOS + prompt (+ left truncation) without the label and EOS
    suffix = 1 + (tokenizer.eos_token_id is not None)
    prompts = [encode_prompt_response(tokenizer, prompt_and_answer(row)[0], labels[0], seq)["input_ids"][:-suffix]
               for row in rows]
    model = load_model(run_dir / "export")
    scores = fast_label_scores(model, tokenizer, rows, labels, seq)
    with torch.no_grad():  # check that these prompts are the scorer's: one unpadded forward per row
        single = torch.stack([torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
                              for ids in prompts[:check_rows]])[:, label_token_ids(tokenizer, labels)]
    gold = [labels.index(prompt_and_answer(row)[1]) for row in rows]
    del model
    gc.collect()
    return {"labels": labels, "label_ids": label_token_ids(tokenizer, labels), "prompts": prompts, "gold": gold,
            "scores": scores.tolist(), "predicted": scores.argmax(1).tolist(), "vocab": len(tokenizer),
            "prompt_check_max_abs_diff": float((single - scores[:check_rows]).abs().max()), "prompt_check_rows": len(single)}


# ------------------------------------------------------------------ export


def export_gguf(run_dir: Path, out_dir: Path, dtype: str, reuse: bool) -> Path:
    """`python launch/export.py RUN --out DIR --format gguf --dtype DTYPE --overwrite`; the .gguf path."""
    target = out_dir / f"{out_dir.name}.gguf"
    report = out_dir / "apt_export.json"
    if reuse and target.is_file() and report.is_file() and read_json(report).get("dtype") == dtype:
        return target
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / "launch" / "export.py"), str(run_dir), "--out", str(out_dir), "--format", "gguf",
           "--dtype", dtype, "--overwrite"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return target


def stored_types(path: Path) -> dict:
    """Parameters per GGML storage type in the file, zero padding included (an o_proj whose rows fill no
    32-block is F16 in a q8_0 file)."""
    import gguf

    counts: dict[str, int] = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + int(tensor.n_elements)
    return counts


# ------------------------------------------------------------------ report


def markdown(rows: list[dict]) -> str:
    head = ["method", "density", "hidden", "arch", "dtype", "params stored Q8_0 / F16", "file MB", "size / dense", "prompt tok/s", "prompt / dense",
            "decode tok/s", "decode / dense", "SST-2 acc llama.cpp", "SST-2 acc transformers (fp32)", "row agreement",
            "max |Δ label log-prob|"]

    def f(value, digits):
        return "–" if value is None else f"{value:.{digits}f}"

    def types(counts):
        total = sum(counts.values())
        return f"{counts.get('Q8_0', 0) / total:.2f} / {counts.get('F16', 0) / total:.2f}"

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["method"], f(r["density"], 3), str(r["hidden"]), r["arch"], r["dtype"], types(r["stored_types"]), f(r["file_mb"], 1), f(r["size_vs_dense"], 3),
            f(r["prompt_tokens_per_s"], 0), f(r["prompt_vs_dense"], 2), f(r["decode_tokens_per_s"], 1),
            f(r["decode_vs_dense"], 2), f(r["accuracy_llama_cpp"], 3), f(r["accuracy_transformers"], 3),
            f"{r['agreement']:.3f} ({r['disagreements']} rows differ)", f"{r['max_abs_label_logprob_diff']:.3g}"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="bench_out/quality_gguf/sst2", help="quality.py's task folder (one run per method)")
    parser.add_argument("--out", default="bench_out/gguf_bench", help="GGUF files go to OUT/gguf/METHOD_DTYPE/")
    parser.add_argument("--json", default=None, help="results file (default OUT/results.json)")
    parser.add_argument("--methods", nargs="+", default=METHODS, help="run folders under --runs; the first is the dense reference")
    parser.add_argument("--dtypes", nargs="+", default=DTYPES, choices=["fp32", "fp16", "bf16", "q8_0"])
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (prompt and decode) and torch threads")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved speed rounds (median)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--top-n", type=int, default=50, help="n_probs of the scoring requests (full vocabulary when a label is missing)")
    parser.add_argument("--check-rows", type=int, default=64, help="rows whose prompt ids are checked by an unpadded transformers forward")
    parser.add_argument("--llama-log", action="store_true", help="keep llama.cpp's log (stderr)")
    parser.add_argument("--reuse-exports", action="store_true", help="keep GGUF files already in OUT with the same dtype")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.threads < 1:
        parser.error("--rounds and --threads must be >= 1")
    LOG["verbosity"] = 3 if args.llama_log else -1
    started = time.perf_counter()
    runs, out = Path(args.runs), Path(args.out)
    json_path = Path(args.json) if args.json else out / "results.json"
    missing = [m for m in args.methods if not (runs / m / "result.json").is_file()]
    if missing:
        raise SystemExit(f"error: no finished run for {missing} under {runs}; run benchmarks/quality.py first")
    hw_start = hardware()
    print(f"[gguf] command: {command_line()}\n[gguf] hardware: {hw_start}", flush=True)

    results = {m: read_json(runs / m / "result.json") for m in args.methods}
    files: dict[tuple[str, str], Path] = {}
    export_s = {}
    for method in args.methods:
        for dtype in args.dtypes:
            t0 = time.perf_counter()
            files[method, dtype] = export_gguf(runs / method, out / "gguf" / f"{method}_{dtype}", dtype, args.reuse_exports)
            export_s[f"{method}/{dtype}"] = time.perf_counter() - t0
            print(f"[gguf] {method} {dtype}: {files[method, dtype]} ({export_s[f'{method}/{dtype}']:.0f} s)", flush=True)

    reference = {}
    for method in args.methods:
        reference[method] = transformers_reference(runs / method, results[method]["spec"], args.threads, args.check_rows)
        acc = sum(p == g for p, g in zip(reference[method]["predicted"], reference[method]["gold"])) / len(reference[method]["gold"])
        reference[method]["accuracy"] = acc
        print(f"[gguf] {method} transformers: acc {acc:.3f} (quality.py: {results[method]['accuracy']:.3f}), "
              f"prompt check {reference[method]['prompt_check_max_abs_diff']:.2g}", flush=True)

    vocab = reference[args.methods[0]]["vocab"]
    prompt = [random.Random(0).randrange(100, vocab) for _ in range(args.prompt_len)]
    samples: dict[tuple[str, str], list[dict]] = {key: [] for key in files}
    for r in range(args.rounds):
        for key, path in files.items():
            samples[key].append(speed_once(path, args.threads, prompt, args.new_tokens))
        print(f"[gguf] speed round {r + 1}/{args.rounds} done (load {os.getloadavg()[0]:.2f})", flush=True)

    rows = []
    for (method, dtype), path in files.items():
        ref = reference[method]
        t0 = time.perf_counter()
        scores, chosen, retried = llama_cpp_label_scores(path, args.threads, ref["prompts"], ref["label_ids"], args.top_n, vocab)
        gaps = [abs(a - b) for row, hf in zip(scores, ref["scores"]) for a, b in zip(row, hf) if a is not None]
        report = read_json(path.parent / "apt_export.json")
        speed = {k: statistics.median(s[k] for s in samples[method, dtype]) for k in samples[method, dtype][0]}
        disagree = [i for i, (a, b) in enumerate(zip(chosen, ref["predicted"])) if a != b]
        rows.append({
            "method": method, "dtype": dtype, "file": str(path), "density": results[method]["density"],
            "arch": report["gguf_architecture"], "hidden": report["final"].get("hidden"), "stored_types": stored_types(path),
            "file_bytes": path.stat().st_size, "file_mb": path.stat().st_size / 2**20,
            **speed, "speed_samples": samples[method, dtype],
            "accuracy_llama_cpp": sum(c == g for c, g in zip(chosen, ref["gold"])) / len(chosen),
            "accuracy_transformers": ref["accuracy"], "accuracy_quality_py": results[method]["accuracy"],
            "agreement": 1 - len(disagree) / len(chosen), "disagreements": len(disagree), "disagreeing_rows": disagree,
            "max_abs_label_logprob_diff": max(gaps), "median_abs_label_logprob_diff": statistics.median(gaps),
            "rows": len(chosen), "rows_rescored_full_vocab": retried, "predicted_llama_cpp": chosen,
            "label_logprobs_llama_cpp": scores, "scoring_s": time.perf_counter() - t0})
        print(f"[gguf] {method} {dtype}: acc {rows[-1]['accuracy_llama_cpp']:.3f} vs {ref['accuracy']:.3f}, "
              f"{len(disagree)} rows differ, max gap {max(gaps):.3g} ({rows[-1]['scoring_s']:.0f} s)", flush=True)
    dense = {r["dtype"]: r for r in rows if r["method"] == args.methods[0]}
    for r in rows:
        d = dense[r["dtype"]]
        r["size_vs_dense"] = ratio(r["file_bytes"], d["file_bytes"])
        r["prompt_vs_dense"] = ratio(r["prompt_tokens_per_s"], d["prompt_tokens_per_s"])
        r["decode_vs_dense"] = ratio(r["decode_tokens_per_s"], d["decode_tokens_per_s"])
    import importlib.metadata

    import xllamacpp

    summary = {"command": command_line(), "git_commit": git_commit(), "config": vars(args), "hardware": hw_start,
               "hardware_end": hardware(), "xllamacpp": importlib.metadata.version("xllamacpp"),
               "llama_cpp_build_info": dict(xllamacpp.BUILD_INFO), "speed_prompt_ids": prompt, "export_s": export_s,
               "reference": {m: {k: v for k, v in ref.items() if k in ("accuracy", "prompt_check_max_abs_diff", "labels",
                                                                        "label_ids", "predicted", "scores", "gold")}
                             for m, ref in reference.items()},
               "rows": rows, "wall_time_s": time.perf_counter() - started}
    write_json(json_path, summary)
    table = markdown(rows)
    (out / "results.md").write_text(table)
    print(table)
    print(f"[gguf] wall time {summary['wall_time_s'] / 60:.1f} min, load {hw_start['loadavg_1_5_15']} -> "
          f"{summary['hardware_end']['loadavg_1_5_15']}", flush=True)


if __name__ == "__main__":
    main()
