"""GPU check: the paths that only a GPU exercises, end to end on one CUDA device, as a user runs
them (`launch/train.py` and `launch/export.py` as subprocesses).

    python benchmarks/gpu_check.py --out bench_out/gpu_check                      # one GPU
    python benchmarks/gpu_check.py --device cpu --scale small --out /tmp/gpu_check  # the same flow on CPU

Stages (a failing stage is recorded and the next one runs; each gets what is left of --budget-s):
1. `env`: versions, the GPU, and that datasets and deepspeed import.
2. `local-fp32`: one process on the device, the built-in tiny model, fp32 base weights, APT to
   0.7 with an eval probe; fp32 export; the export, loaded on the device, must reproduce the live
   run's logits (max |diff| <= 1e-3) and its 20-token greedy continuation.
3. `zero3`: the deepspeed launcher with 1 rank (NCCL on a GPU), the tiny model, fp32; exported
   and checked like stage 2.
4. `local-auto`: stage 2 with the device's default base dtype (bf16 on GPUs): the difference
   between the bf16 run and its fp32 export is reported, not asserted.
5. `zero2`: one-rank ZeRO-2 in the default dtype (trained, not exported).
6. `scale-apt-<backend>`, `scale-lora-<backend>`: a random model of `--scale`'s shape (default
   LLaMA-2-7B, written on the device in bf16), under ZeRO-3 on one device and/or in one process
   (`--scale-backends`): APT to 0.7 with 3 pruning events (or, with `--scale-schedule recipe`,
   `apt-ds train`'s own schedule for `--scale-steps`), then LoRA with the same adapters and data;
   step times, where the loop's time went by phase of the schedule, peak device memory per step.
7. `scale-export` (after the first backend's APT run, short schedule only): its streaming export in
   bf16, loaded back on the device and compared with the run's probe (reported).

Results: OUT/gpu_check.json (per stage: ok, seconds, numbers, the log's tail on failure) and
every subprocess's output in OUT/gpu_check.log. Nothing is asserted beyond each stage's own check.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from apt_ds.training.run import PROBE_FILE  # noqa: E402
from apt_ds.training.trainer import APTrainer  # noqa: E402
from benchmarks._common import read_json, write_json  # noqa: E402
from benchmarks.llama_scale import LLAMA_3B, free_port, write_model  # noqa: E402
from benchmarks.scale_on_paper import LLAMA2  # noqa: E402

EVENT_PARTS = APTrainer.EVENT_PARTS  # an event's timed parts (event_<part>_s)

LLAMA2_7B = dict(LLAMA2["7B"][0], head_dim=128, vocab_size=32000, tie_word_embeddings=False,
                 max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0)
SMALL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, vocab_size=1024, tie_word_embeddings=False,
             max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0)
SCALES = {"llama2-7b": LLAMA2_7B, "llama3.2-3b": LLAMA_3B, "small": SMALL}
SCALE_BACKENDS = {"zero3": "ds_configs/zero3.json", "local": None}  # local: one process, no DeepSpeed


class Check:
    """Runs stages against a wall-clock budget, logging every subprocess to one file."""

    def __init__(self, out: Path, work: Path, device: str, budget_s: float):
        self.out, self.work, self.device, self.deadline = out, work, device, time.monotonic() + budget_s
        for directory in (out, work):
            directory.mkdir(parents=True, exist_ok=True)
        self.log = out / "gpu_check.log"
        self.log.write_text("")
        self.results: list[dict] = []
        self.summary: dict = {}
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                    "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        if device == "cpu":
            self.env["DS_ACCELERATOR"] = "cpu"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def sh(self, cmd: list[str], timeout: float | None = None) -> None:
        """Run `cmd`, appending its output to the log; raise with the output's tail if it fails."""
        timeout = min(timeout or 1e9, self.left())
        if timeout < 5:
            raise TimeoutError("no budget left")
        with self.log.open("a") as handle:
            handle.write(f"\n$ {' '.join(cmd)}\n")
            handle.flush()
            start = handle.tell()
            try:
                code = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                                      timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        if code != 0:
            tail = self.log.read_text(errors="replace")[start:][-3000:]
            raise RuntimeError(f"{' '.join(cmd[:8])} ... exited {code}:\n{tail}")

    def stage(self, name: str, fn) -> dict:
        print(f"[{name}] {self.left():.0f} s of budget left", flush=True)
        started, result = time.monotonic(), {"stage": name}
        try:
            result.update(fn() or {})
            result.setdefault("ok", True)
        except Exception as err:  # a stage's failure is a result, not the end of the check
            result.update(ok=False, error=f"{type(err).__name__}: {err}"[-4000:])
            if not isinstance(err, (RuntimeError, TimeoutError)):
                result["traceback"] = traceback.format_exc()[-3000:]
        result["seconds"] = round(time.monotonic() - started, 1)
        print(f"[{name}] ok={result['ok']} in {result['seconds']} s", flush=True)
        self.results.append(result)
        self.write()
        return result

    def write(self) -> None:
        record = {"device": self.device, "stages": self.results, **({"summary": self.summary} if self.summary else {})}
        write_json(self.out / "gpu_check.json", record)  # through a temporary file: rewritten after every stage


def train_command(check: Check, run_dir: Path, extra: list[str], deepspeed: str | None = None) -> list[str]:
    if deepspeed is None:
        launcher = [sys.executable, "launch/train.py", "--device", check.device]
    else:
        launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1",
                    "--master_port", str(free_port()), "launch/train.py", "--deepspeed", deepspeed]
    return [*launcher, "--out", str(run_dir), "--overwrite", "--checkpoint-every", "0", "--log-every", "1", *extra]


def run_summary(run_dir: Path) -> dict:
    """The numbers a reader wants from a run's metrics.jsonl."""
    from apt_ds.io.metrics import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    steps, final = [r for r in records if not r.get("final")], records[-1]
    keep = ("density", "total_params", "train_time_s", "eval_loss", "cuda_peak_mb", "peak_rss_mb")
    return {
        **{k: final[k] for k in keep if k in final},
        "losses": [round(r["loss"], 4) for r in steps if "loss" in r],
        "step_time_s": [round(r["step_time_s"], 3) for r in steps if "step_time_s" in r],
        "event_steps": [r["step"] for r in steps if r.get("event")],
        "event_time_s": [round(r["event_time_s"], 3) for r in steps if r.get("event")],
        "mask_refresh_s": [round(r.get("mask_refresh_s", 0.0), 3) for r in steps],
        "distilled_steps": [r["step"] for r in steps if r.get("mu", 0) > 0],
        "cuda_peak_mb_by_step": [r.get("cuda_peak_mb") for r in steps],
        "phases": phase_times(run_dir, steps),
        **final_shape(run_dir),
    }


def final_shape(run_dir: Path) -> dict:
    """The shape a run ended at (hidden size, KV groups and FFN width per layer, adapter ranks):
    what its step cost depends on beyond the parameter count."""
    record = read_json(run_dir / "ranks" / "rank0.json")
    shape = record["shape"]
    return {"final_hidden": shape["hidden"], "final_kv_groups": [layer["num_kv_groups"] for layer in shape["layers"]],
            "final_ffn": [layer["ffn"] for layer in shape["layers"]], "final_adapter_ranks": sorted(set(record["ranks"].values()))}


def scale_ratios(results: list[dict]) -> dict:
    """Per backend, APT/LoRA ratios of the recipe-schedule scale runs that passed, paired by repeat: the loop
    (`train_time_s`: steps, events and refreshes) and the median step after the last event; the
    median over repeats and each repeat's value."""
    import statistics

    # recipe runs only: a short-schedule APT run also evaluates and saves a probe inside its loop
    # (and unprofiled: the profiler's overhead is in a profiled run's loop)
    runs = {r["stage"]: r for r in results if r["stage"].startswith("scale-") and r["ok"] and r.get("schedule") == "recipe"
            and "train_time_s" in r and "profiled_steps" not in r}
    summary = {}
    for name, apt in runs.items():
        if not name.startswith("scale-apt-"):
            continue
        lora = runs.get(name.replace("scale-apt-", "scale-lora-", 1))
        if lora is None:
            continue
        backend = apt["backend"]
        entry = summary.setdefault(backend, {"train_time": [], "recovery_step": []})
        entry["train_time"].append(round(apt["train_time_s"] / lora["train_time_s"], 3))
        recovery = (apt["phases"].get("recovery"), lora["phases"].get("recovery"))
        if all(recovery):
            entry["recovery_step"].append(round(recovery[0]["median_s"] / recovery[1]["median_s"], 3))
    for entry in summary.values():
        for key in list(entry):
            if entry[key]:
                entry[f"{key}_median"] = round(statistics.median(entry[key]), 3)
    return {"apt_over_lora": summary} if summary else {}


def phase_times(run_dir: Path, steps: list[dict]) -> dict:
    """Where a run's loop time went, by phase of APT's schedule (the same step ranges for a LoRA
    run, from its run.json): per phase the steps, their summed and median `step_time_s`; events
    and the decay-window refreshes, which `step_time_s` leaves out, summed apart. The pruning
    phase is split into steps with a teacher pass (mu > 0) and without."""
    import statistics

    apt = read_json(run_dir / "run.json")["apt_config"]
    start, end = apt["pruning_start_step"], apt["pruning_end_step"]

    def phase(record: dict) -> str:
        index = record["step"] - 1  # the record of optimizer step i (from 0) says step i + 1
        if index < start:
            return "warmup"
        if index >= end:
            return "recovery"
        return "pruning_teacher" if record.get("mu", 0) > 0 else "pruning"

    times: dict[str, list[float]] = {}
    for record in steps:
        if "step_time_s" in record:
            times.setdefault(phase(record), []).append(record["step_time_s"])
    summary = {name: {"steps": len(values), "sum_s": round(sum(values), 3), "median_s": round(statistics.median(values), 4)}
               for name, values in times.items()}
    summary["events_sum_s"] = round(sum(r.get("event_time_s", 0.0) for r in steps), 3)
    for part in EVENT_PARTS:  # where the events' time went (the trainer's event_<part>_s)
        summary[f"events_{part}_sum_s"] = round(sum(r.get(f"event_{part}_s", 0.0) for r in steps), 3)
    summary["mask_refresh_sum_s"] = round(sum(r.get("mask_refresh_s", 0.0) for r in steps), 3)
    return summary


def compare_with_probe(run_dir: Path, export_dir: Path, device: str, atol: float | None) -> dict:
    """The export, loaded on `device` in its saved dtype, against the run's eval probe."""
    import torch
    from safetensors.torch import load_file

    from apt_ds.io.modeling import load_pretrained

    probe = load_file(str(run_dir / PROBE_FILE))
    model = load_pretrained(export_dir).to(device).eval()
    attended = probe["attention_mask"].bool()
    prompt_len = int(probe["attention_mask"][0].sum())
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"].to(device), attention_mask=probe["attention_mask"].to(device)).logits
        ids = probe["greedy"][:, :prompt_len].to(device)
        for _ in range(probe["greedy"].shape[1] - prompt_len):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], 1)
    diff = (logits.float().cpu()[attended] - probe["logits"][attended]).abs().max().item()
    same_greedy = bool(torch.equal(ids.cpu(), probe["greedy"]))
    result = {"export_dtype": str(next(model.parameters()).dtype), "max_logit_diff": round(diff, 6),
              "greedy_matches": same_greedy,
              "greedy_tokens_matching": int((ids.cpu() == probe["greedy"]).long().cumprod(1).sum().item()) - prompt_len}
    if atol is not None:
        result["ok"] = diff <= atol and same_greedy
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def environment(device: str) -> dict:
    import importlib.metadata

    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    for package in ("transformers", "deepspeed", "datasets", "pyarrow", "safetensors", "tokenizers"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    gpu_memory_gb=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    import datasets  # noqa: F401  (fails here, not in every stage, if its pyarrow is too old)
    import deepspeed  # noqa: F401

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch sees no CUDA device")
    return info


def tiny_stage(check: Check, name: str, extra: list[str], deepspeed: str | None = None, atol: float | None = None,
               export: bool = True) -> dict:
    from apt_ds.io.records import demo_data_path

    run_dir, export_dir = check.work / name, check.work / f"{name}-export"
    check.sh(train_command(check, run_dir, ["--steps", "24", "--eval-data", str(demo_data_path()), "--eval-examples", "8",
                                            "--save-eval-probe", *extra], deepspeed), timeout=300)
    result = run_summary(run_dir)
    if export:
        check.sh([sys.executable, "launch/export.py", str(run_dir), "--out", str(export_dir), "--overwrite"], timeout=200)
        result.update(compare_with_probe(run_dir, export_dir, check.device, atol))
    return result


def scale_data(check: Check) -> Path:
    """Plain text rows packed into full --max-seq-len blocks: every step sees full sequences."""
    from apt_ds.io.records import demo_data_path

    rows = [json.loads(line) for line in demo_data_path().read_text().splitlines() if line.strip()]
    texts = [f"{r.get('instruction', '')} {r.get('input', '')} {r.get('output', '')}".strip() for r in rows]
    path = check.work / "scale_text.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(texts[i:] + texts[:i])}) + "\n" for i in range(32)))
    return path


def scale_stage(check: Check, args, method: str, backend: str, profile: bool = False, suffix: str = "") -> dict:
    model_dir, started = check.work / f"model-{args.scale}", time.monotonic()
    write_model(model_dir, SCALES[args.scale], dtype="bfloat16" if check.device != "cpu" else "float32",
                device=check.device)
    run_dir, data = check.work / f"scale-{method}-{backend}{suffix}", scale_data(check)
    extra = ["--model", str(model_dir), "--data", str(data), "--method", method,
             "--max-seq-len", str(args.scale_seq_len), "--micro-batch-size", str(args.scale_micro_batch),
             "--grad-accum-steps", "1", "--steps", str(args.scale_steps), "--target-density", "0.7", "--gradient-checkpointing"]
    if args.attention == "cudnn":  # PyTorch's first choice, which training turns off by default
        extra.append("--cudnn-attention")
    if args.scale_schedule == "short":
        extra += ["--pruning-start-step", "2", "--pruning-end-step", "8", "--num-pruning-events", "3"]
        if method == "apt":  # the probe scale-export compares with; the recipe runs evaluate nothing, so their loops compare
            extra += ["--eval-data", str(data), "--eval-examples", "4", "--save-eval-probe"]
    written = time.monotonic()
    command, profiled = train_command(check, run_dir, extra, SCALE_BACKENDS[backend]), {}
    if profile:  # the same run, some of its steps under torch.profiler (benchmarks/step_profile.py)
        first, last = args.profile_steps or (args.scale_steps - 3, args.scale_steps - 1)
        command = [sys.executable, "benchmarks/step_profile.py", "--steps-to-profile", str(first), str(last),
                   "--table", str(check.out / f"profile_{method}_{backend}.txt"), "--", *command[2:]]
        profiled = {"profiled_steps": [first, last]}
    check.sh(command, timeout=args.scale_timeout)
    return {"model": args.scale, "backend": backend, "schedule": args.scale_schedule, "seq_len": args.scale_seq_len,
            "attention": args.attention,
            "micro_batch": args.scale_micro_batch, "steps": args.scale_steps,
            **profiled, "write_model_s": round(written - started, 1),
            "run_s": round(time.monotonic() - written, 1), **run_summary(run_dir)}


def scale_export(check: Check, args) -> dict:
    run_dir = check.work / f"scale-apt-{args.scale_backends[0]}"
    export_dir = run_dir.with_name(run_dir.name + "-export")
    if not any(r["stage"] == run_dir.name and r["ok"] for r in check.results):  # not a stale run in a reused --work
        raise RuntimeError(f"stage {run_dir.name} did not run or failed in this check: nothing to export")
    started = time.monotonic()
    check.sh([sys.executable, "launch/export.py", str(run_dir), "--out", str(export_dir), "--overwrite",
              "--dtype", "bf16" if check.device != "cpu" else "fp32"], timeout=400)
    exported = sum(p.stat().st_size for p in export_dir.glob("*.safetensors"))
    return {"export_s": round(time.monotonic() - started, 1), "exported_gb": round(exported / 1e9, 2),
            **compare_with_probe(run_dir, export_dir, check.device, atol=None)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench_out" / "gpu_check", help="gpu_check.json and .log")
    parser.add_argument("--work", type=Path, help="runs, exports and the random model (default: OUT/work)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (the same flow, for trying it out)")
    parser.add_argument("--scale", choices=[*SCALES, "none"], default="llama2-7b", help="the random model of the scale stages")
    parser.add_argument("--scale-backends", nargs="+", choices=list(SCALE_BACKENDS), default=["zero3"],
                        help="how the scale runs train: under ZeRO-3 on one rank, and/or in one process")
    parser.add_argument("--scale-steps", type=int, default=16, help="at least 8 (the short schedule's events are at steps 4, 6, 8)")
    parser.add_argument("--scale-schedule", choices=["short", "recipe"], default="short",
                        help="short: prune between steps 2 and 8 in 3 events, distilling on every step, then export "
                             "APT's run; recipe: apt-ds train's own schedule for --scale-steps (warm up 10%%, prune "
                             "10-50%% with a teacher pass every 4th step, recover the last half), no eval and no export, "
                             "so the two runs' train_time_s compare")
    parser.add_argument("--scale-repeats", type=int, default=1,
                        help="run each APT/LoRA pair this many times, alternating which goes first; with the "
                             "recipe schedule gpu_check.json's summary gives the median of the APT/LoRA ratios "
                             "(profiled runs left out)")
    parser.add_argument("--scale-seq-len", type=int, default=512)
    parser.add_argument("--scale-micro-batch", type=int, default=4, help="sequences per micro-batch of the scale runs")
    parser.add_argument("--scale-timeout", type=float, default=240, help="seconds per scale training run")
    parser.add_argument("--budget-s", type=float, default=480, help="wall-clock budget of the whole check")
    parser.add_argument("--skip", nargs="*", default=[], help="stage names to leave out")
    parser.add_argument("--profile", action="store_true",
                        help="profile two late steps of each one-process scale run, the first repeat's "
                             "(OUT/profile_<method>_local.txt)")
    parser.add_argument("--profile-steps", type=int, nargs=2, metavar=("FIRST", "LAST"),
                        help="with --profile: the steps FIRST .. LAST-1 (counted from 0; e.g. 4 6 for the pruning phase)")
    parser.add_argument("--attention", choices=["no-cudnn", "cudnn"], default="no-cudnn",
                        help="attention kernels of the scale runs: no-cudnn (training's default: flash or "
                             "memory-efficient attention), cudnn (`--cudnn-attention`: PyTorch's first choice, which "
                             "plans each new attention shape)")
    args = parser.parse_args(argv)
    if args.scale_repeats < 1:
        parser.error("--scale-repeats must be at least 1")
    if args.scale_steps < 8:
        parser.error("--scale-steps must be at least 8 (pruning events at steps 4, 6 and 8)")
    if args.profile_steps and not (args.profile and 0 <= args.profile_steps[0] < args.profile_steps[1] <= args.scale_steps):
        parser.error(f"--profile-steps needs --profile and 0 <= FIRST < LAST <= --scale-steps ({args.scale_steps})")
    stage_names = {"env", "local-fp32", "zero3", "local-auto", "zero2", "scale-export"}
    stage_names |= {f"scale-{m}-{b}" for m in ("apt", "lora") for b in SCALE_BACKENDS}
    unknown = sorted(set(args.skip) - stage_names)
    if unknown:
        parser.error(f"--skip: no stage named {', '.join(unknown)}; stages: {', '.join(sorted(stage_names))}")
    check = Check(args.out, args.work or args.out / "work", args.device, args.budget_s)
    stages = [
        ("env", lambda: environment(args.device)),
        ("local-fp32", lambda: tiny_stage(check, "local-fp32", ["--base-dtype", "fp32"], atol=1e-3)),
        ("zero3", lambda: tiny_stage(check, "zero3", ["--base-dtype", "fp32"], "ds_configs/zero3.json", atol=1e-3)),
        ("local-auto", lambda: tiny_stage(check, "local-auto", [])),
        ("zero2", lambda: tiny_stage(check, "zero2", [], "ds_configs/zero2.json", export=False)),
    ]
    if args.scale != "none":
        for repeat in range(args.scale_repeats):
            # Repeats alternate the order (APT, LoRA, LoRA, APT, ...) so that a drift in the
            # machine's speed does not favour one method; their names end in -2, -3, ...
            suffix = f"-{repeat + 1}" if repeat else ""
            for index, backend in enumerate(args.scale_backends):
                profile = args.profile and backend == "local" and repeat == 0  # one profile per method: its file
                for method in ("apt", "lora") if repeat % 2 == 0 else ("lora", "apt"):
                    stages.append((f"scale-{method}-{backend}{suffix}",
                                   lambda m=method, b=backend, p=profile, x=suffix: scale_stage(check, args, m, b, p, x)))
                    if (repeat, index, method) == (0, 0, "apt") and args.scale_schedule == "short":  # recipe runs save no probe
                        stages.append(("scale-export", lambda: scale_export(check, args)))
    for name, fn in stages:
        if re.sub(r"^(scale-.*)-\d+$", r"\1", name) not in args.skip:  # --skip names a scale run's every repeat
            check.stage(name, fn)
    check.summary = scale_ratios(check.results)
    check.write()
    failed = [r["stage"] for r in check.results if not r["ok"]]
    print(json.dumps({"device": args.device, "failed": failed}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
