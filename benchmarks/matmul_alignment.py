"""Matmul throughput at aligned and unaligned widths: why APTConfig.shape_multiple exists.

A pruned model's matrices have the widths pruning left (single units: an FFN width of 1,519, a
hidden size of 575). This times the two matmuls a frozen nn.Linear costs in training, the
forward `F.linear(x, W)` and the input gradient `dY @ W`, for matrix shapes of a SmolLM2-135M
layer at a 512-token micro-batch, at each width and at the nearest multiple of 32 below it,
alternating the two within every repeat so both see the same load. Reports GFLOP/s medians over
repeats and their ratio (aligned / unaligned throughput: the aligned matrix is slightly smaller,
so throughput, not time, is compared). One torch thread by default (as the training benchmarks run).

    python benchmarks/matmul_alignment.py --json bench_out/matmul_alignment.json

`--ffn-7b` asks another question, for a GPU: do the FFN matmuls of a pruned LLaMA-2-7B cost what
their FLOPs say? Over the final FFN widths of the fourth GPU lease's 160-step run (32 layers,
multiples of 32, 0.55 of the FFN's weights kept) it times up/gate/down at 16 x 512 tokens, forward
and input gradient, in bf16, against the same at the unpruned width 11,008, and each width against
the multiple of 128 below it (tensor-core tiles). The lease's recovery steps cost 0.850x LoRA's at
0.712x the FLOPs; a time ratio above the FLOP ratio here would place part of that gap in the matmuls.

    python benchmarks/matmul_alignment.py --ffn-7b --device cuda --repeats 3 --json OUT/matmul_ffn_7b.json   # minutes on a GPU (estimated)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import command_line, git_commit, hardware, write_json  # noqa: E402

# (tokens, in, out) of one unaligned nn.Linear and where it sits in a layer; its aligned partner
# rounds the unaligned dimensions down to multiples of 32.
SHAPES = {
    "up/gate, FFN 1519": (512, 576, 1519),
    "down, FFN 1519": (512, 1519, 576),
    "up/gate, FFN 1527, hidden 575": (512, 575, 1527),
    "q/o, hidden 575": (512, 575, 575),
    "down, FFN 1531, hidden 575": (512, 1531, 575),
}


# The final FFN widths of the fourth lease's APT 0.7 run (LLaMA-2-7B's shape, 160 steps at 16 x 512,
# bench_out/gpu_s25/1/long/gpu_check.json, stage scale-apt-local): every layer kept its 32 KV groups.
LLAMA2_7B_HIDDEN, LLAMA2_7B_FFN = 4096, 11008
PRUNED_7B_FFN = (11008, 10976, 10816, 10432, 9824, 9440, 9088, 8768, 8384, 8128, 7840, 7424, 7104, 6784, 6432, 6080,
                 5792, 5504, 5120, 4800, 4576, 4096, 3968, 3616, 3360, 2880, 2816, 2432, 2112, 1856, 1600, 1056)


def ffn_matrices(width: int) -> list[tuple[str, int, int]]:
    """(op, fan_in, fan_out) of one layer's frozen FFN matmuls in a training step at this width:
    gate and up (hidden -> width), down (width -> hidden), each forward and input gradient."""
    return [(op, fan_in, fan_out) for op in ("forward", "input_grad")
            for fan_in, fan_out in ((LLAMA2_7B_HIDDEN, width), (LLAMA2_7B_HIDDEN, width), (width, LLAMA2_7B_HIDDEN))]


def aligned(shape: tuple[int, int, int], multiple: int = 32) -> tuple[int, int, int]:
    tokens, fan_in, fan_out = shape
    return tokens, fan_in - fan_in % multiple, fan_out - fan_out % multiple


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--min-run-time", type=float, help="seconds per timing (torch.utils.benchmark; "
                        "default 0.3, with --ffn-7b 0.1)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ffn-7b", action="store_true", help="the pruned LLaMA-2-7B FFN sweep (docstring)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (--ffn-7b only)")
    parser.add_argument("--tokens", type=int, help="tokens per matmul (--ffn-7b only; default 16 x 512 on cuda; on a "
                        "CPU give it: the full sweep would take hours there)")
    parser.add_argument("--widths", type=int, nargs="+", help="per-layer FFN widths instead of the lease's (--ffn-7b only)")
    parser.add_argument("--json", type=Path, default=Path("bench_out/matmul_alignment.json"))
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1 or (args.min_run_time is not None and args.min_run_time <= 0):
        parser.error("--repeats and --threads must be >= 1 and --min-run-time > 0")
    if args.ffn_7b and args.tokens is None:
        if args.device != "cuda":
            parser.error("--ffn-7b on a CPU: pass --tokens (e.g. 64); 16 x 512 tokens over every width take hours there")
        args.tokens = 16 * 512
    if (args.tokens is not None and args.tokens < 1) or any(w < 1 or w > LLAMA2_7B_FFN for w in args.widths or ()):
        parser.error(f"--tokens must be >= 1 and --widths in [1, {LLAMA2_7B_FFN}]")

    import torch

    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        parser.error(f"--device {args.device}: expected cpu, or cuda on a machine with a CUDA GPU")
    torch.set_num_threads(args.threads)
    if args.ffn_7b:
        result = ffn_sweep(args, torch.device(args.device))
    else:
        result = {"rows": smollm2_pairs(args)}
    result.update(command=command_line(), git_commit=git_commit(), hardware=hardware(), threads=args.threads,
                  repeats=args.repeats)
    write_json(args.json, result)
    return result


def smollm2_pairs(args) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.utils.benchmark import Timer

    min_run_time = args.min_run_time or 0.3

    def gflops(shape: tuple[int, int, int], op: str) -> float:
        tokens, fan_in, fan_out = shape
        weight = torch.randn(fan_out, fan_in)  # nn.Linear's layout
        if op == "forward":
            stmt, inputs = "F.linear(x, w)", {"x": torch.randn(tokens, fan_in)}
        else:  # the input gradient of a frozen Linear: dY (tokens, out) @ W (out, in)
            stmt, inputs = "g @ w", {"g": torch.randn(tokens, fan_out)}
        timer = Timer(stmt, globals={"F": F, "w": weight, **inputs}, num_threads=args.threads)
        seconds = timer.blocked_autorange(min_run_time=min_run_time).median
        return 2 * tokens * fan_in * fan_out / seconds / 1e9

    rows = {}
    for name, shape in SHAPES.items():
        pair = {"unaligned": shape, "aligned": aligned(shape)}
        for op in ("forward", "input_grad"):
            rates = {kind: [] for kind in pair}
            for _ in range(args.repeats):
                for kind, dims in pair.items():
                    rates[kind].append(gflops(dims, op))
            medians = {kind: statistics.median(values) for kind, values in rates.items()}
            ratio = medians["aligned"] / medians["unaligned"]
            rows[f"{name} ({op})"] = {"shapes": pair, "op": op, "gflops": rates, "median_gflops": medians,
                                      "aligned_over_unaligned_throughput": ratio}
            print(f"[matmul] {name + ' ' + op:44s} {shape!s:18s} {medians['unaligned']:6.1f} GFLOP/s   "
                  f"{pair['aligned']!s:18s} {medians['aligned']:6.1f} GFLOP/s   throughput ratio {ratio:.3f}")
    return rows


def ffn_sweep(args, device) -> dict:
    """Seconds of one layer's six FFN matmuls at each width (median over repeats, every width once per
    repeat), summed over the layers: pruned widths against 32 layers at 11,008, and against each
    width rounded down to a multiple of 128."""
    import torch
    import torch.nn.functional as F
    from torch.utils.benchmark import Timer  # synchronizes CUDA around each timing

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    widths = list(args.widths or PRUNED_7B_FFN)
    by_128 = {w: w - w % 128 or w for w in widths}  # a width under 128 has no smaller multiple: itself
    distinct = sorted({LLAMA2_7B_FFN, *widths, *by_128.values()}, reverse=True)
    min_run_time = args.min_run_time or 0.1
    generator = torch.Generator(device=device).manual_seed(0)

    def layer_timer(width: int) -> Timer:
        tensors = {}
        for op, fan_in, fan_out in ffn_matrices(width):  # made where they are used: on a GPU in milliseconds
            weight = torch.randn(fan_out, fan_in, generator=generator, device=device, dtype=dtype)
            rows = torch.randn(args.tokens, fan_in if op == "forward" else fan_out, generator=generator, device=device,
                               dtype=dtype)
            tensors.setdefault(op, []).append((rows, weight))

        def run():
            for x, w in tensors["forward"]:
                F.linear(x, w)
            for g, w in tensors["input_grad"]:  # dY (tokens, out) @ W (out, in)
                g @ w
        return Timer("run()", globals={"run": run}, num_threads=args.threads)

    laps = {w: [] for w in distinct}
    for _ in range(args.repeats):
        for width in distinct:  # one timer at a time: a dense 7B layer's six pairs in bf16 are ~1.3 GB
            laps[width].append(layer_timer(width).blocked_autorange(min_run_time=min_run_time).median)
    seconds = {w: statistics.median(v) for w, v in laps.items()}
    dense = len(widths) * seconds[LLAMA2_7B_FFN]
    pruned = sum(seconds[w] for w in widths)
    rounded = sum(seconds[by_128[w]] for w in widths)
    flops = sum(widths) / (len(widths) * LLAMA2_7B_FFN)
    flops_128 = sum(by_128.values()) / (len(widths) * LLAMA2_7B_FFN)
    summary = {"flop_ratio": flops, "time_ratio": pruned / dense, "flop_ratio_128": flops_128,
               "time_ratio_128": rounded / dense,
               "throughput_pruned_over_dense": flops / (pruned / dense)}
    print(f"[matmul] {device.type}, {dtype}, {args.tokens} tokens, {len(widths)} layers: pruned FFN matmuls take "
          f"{summary['time_ratio']:.3f}x the dense ones' time at {flops:.3f}x the FLOPs (throughput "
          f"{summary['throughput_pruned_over_dense']:.3f}x); at multiples of 128: {summary['time_ratio_128']:.3f}x time at "
          f"{flops_128:.3f}x FLOPs")
    return {"device": device.type, "dtype": str(dtype), "tokens": args.tokens, "widths": widths,
            "layer_seconds": {str(w): laps[w] for w in distinct}, "median_layer_seconds": {str(w): s for w, s in seconds.items()},
            "summary": summary}


if __name__ == "__main__":
    main()
