"""Memory and time of the distillation KL on one micro-batch's logits: the plain formula (both
log-softmaxes in fp32, autograd through all of it; the distiller before apt_ds.algorithm.kl)
against `kl_divergence_from_logits` (fp32 work in row chunks, the closed-form gradient computed in the
same pass and kept alone for backward).

    python benchmarks/distill_kl_cost.py                      # 8,192 tokens x 32,000 (LLaMA-2-7B at 16 x 512), CPU
    python benchmarks/distill_kl_cost.py --device cuda        # the same on a GPU: peak allocated memory

Each method runs in a fresh process: bf16 student logits (requiring grad) and teacher logits,
then forward + backward of the KL. Memory: on a CPU the growth of the peak RSS (VmHWM, reset
after the inputs exist) over the inputs; on a GPU the growth of `max_memory_allocated`. Time:
median of --repeats forward + backward passes after one warm-up. Prints and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks._common import write_json  # noqa: E402

METHODS = ("plain", "chunked")
TEMPERATURE = 2 / 3  # APTConfig's distill_temperature


def measure(method: str, rows: int, vocabulary: int, device: str, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    from apt_ds.algorithm.kl import kl_divergence_from_logits, kl_divergence_sum
    from benchmarks._common import reset_peak_rss, rss_mb, vm_hwm_mb

    def plain(student, teacher):
        log_probs = [F.log_softmax(x.float() / TEMPERATURE, -1) for x in (student, teacher)]
        return kl_divergence_sum(*log_probs)

    kl = plain if method == "plain" else lambda student, teacher: kl_divergence_from_logits(student, teacher, TEMPERATURE)
    generator = torch.Generator(device=device).manual_seed(0)
    student = torch.randn(rows, vocabulary, generator=generator, device=device, dtype=torch.bfloat16).requires_grad_()
    teacher = torch.randn(rows, vocabulary, generator=generator, device=device, dtype=torch.bfloat16)

    def step():
        kl(student, teacher).backward()
        student.grad = None
        if device != "cpu":
            torch.cuda.synchronize()

    if device == "cpu":
        reset_peak_rss()
        before = rss_mb()
        step()
        peak_growth = vm_hwm_mb() - before
    else:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
        step()
        peak_growth = torch.cuda.max_memory_allocated() / 2**20 - before
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    inputs_mb = 2 * student.numel() * student.element_size() / 2**20
    return {"method": method, "peak_growth_mb": round(peak_growth, 1), "inputs_mb": round(inputs_mb, 1),
            "forward_backward_s": round(statistics.median(times), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192, help="distilled token positions")
    parser.add_argument("--vocabulary", type=int, default=32000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=ROOT / "bench_out" / "distill_kl_cost.json")
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.rows, args.vocabulary, args.repeats) < 1:
        parser.error("--rows, --vocabulary and --repeats must be >= 1")
    if args.worker:
        print(json.dumps(measure(args.worker, args.rows, args.vocabulary, args.device, args.repeats)))
        return 0
    results = []
    for method in METHODS:  # a fresh process each: the peak is its own
        command = [sys.executable, __file__, "--worker", method, "--rows", str(args.rows), "--vocabulary",
                   str(args.vocabulary), "--device", args.device, "--repeats", str(args.repeats)]
        output = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT).stdout
        results.append(json.loads(output.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    record = {"rows": args.rows, "vocabulary": args.vocabulary, "device": args.device, "results": results}
    write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
