"""Matmul throughput at aligned and unaligned widths: why APTConfig.shape_multiple exists.

A pruned model's matrices have the widths pruning left (single units: an FFN width of 1,519, a
hidden size of 575). This times the two matmuls a frozen nn.Linear costs in training, the
forward `F.linear(x, W)` and the input gradient `dY @ W`, for matrix shapes of a SmolLM2-135M
layer at a 512-token micro-batch, at each width and at the nearest multiple of 32 below it,
alternating the two within every repeat so both see the same load. Reports GFLOP/s medians over
repeats and their ratio (aligned / unaligned throughput: the aligned matrix is slightly smaller,
so throughput, not time, is compared). One torch thread by default (as the training benchmarks run).

    python benchmarks/matmul_alignment.py --json bench_out/matmul_alignment.json
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


def aligned(shape: tuple[int, int, int], multiple: int = 32) -> tuple[int, int, int]:
    tokens, fan_in, fan_out = shape
    return tokens, fan_in - fan_in % multiple, fan_out - fan_out % multiple


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--min-run-time", type=float, default=0.3, help="seconds per timing (torch.utils.benchmark)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=Path("bench_out/matmul_alignment.json"))
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1 or args.min_run_time <= 0:
        parser.error("--repeats and --threads must be >= 1 and --min-run-time > 0")

    import torch
    import torch.nn.functional as F
    from torch.utils.benchmark import Timer

    torch.set_num_threads(args.threads)

    def gflops(shape: tuple[int, int, int], op: str) -> float:
        tokens, fan_in, fan_out = shape
        weight = torch.randn(fan_out, fan_in)  # nn.Linear's layout
        if op == "forward":
            stmt, inputs = "F.linear(x, w)", {"x": torch.randn(tokens, fan_in)}
        else:  # the input gradient of a frozen Linear: dY (tokens, out) @ W (out, in)
            stmt, inputs = "g @ w", {"g": torch.randn(tokens, fan_out)}
        timer = Timer(stmt, globals={"F": F, "w": weight, **inputs})
        seconds = timer.blocked_autorange(min_run_time=args.min_run_time).median
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
    write_json(args.json, {"command": command_line(), "git_commit": git_commit(), "hardware": hardware(),
                           "threads": args.threads, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
