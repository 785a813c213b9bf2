"""Host time of one pruning decision at a real model's shape (`AdaptivePruner.decide`).

A decision ranks every KV group, FFN neuron block and hidden block of the model on the host in
float64. It runs at every step of a decay window and at every event, and on a GPU the device
waits for it: nothing of the next step is queued until it returns. This times it on random
scores at LLaMA-2-7B's shape (32 layers of 32 KV groups and 11,008 neurons, 4,096 hidden
channels), non-uniform, at the budget of a first event (0.9 of the blocks' parameters).

    python benchmarks/decision_cost.py --threads 1 2 --repeats 15 --json bench_out/decision_cost.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import cpu_model_name, git_commit, positive_int, write_json  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from apt_ds.algorithm.pruner import AdaptivePruner  # noqa: E402
from apt_ds.algorithm.units import ModelShape  # noqa: E402
from apt_ds.config import APTConfig  # noqa: E402

LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000)


def time_decisions(threads: int, repeats: int, density: float) -> dict:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _time_decisions(threads, repeats, density)
    finally:
        torch.set_num_threads(before)


def _time_decisions(threads: int, repeats: int, density: float) -> dict:
    shape = ModelShape.from_config(LlamaConfig(**LLAMA2_7B))
    g = torch.Generator().manual_seed(0)
    groups = [torch.rand(layer.num_kv_groups, generator=g) for layer in shape.layers]
    neurons = [torch.rand(layer.ffn, generator=g) for layer in shape.layers]
    hidden = torch.rand(shape.hidden, generator=g)
    pruner = AdaptivePruner(APTConfig.for_steps(160, target_density=0.7))
    target = density * shape.budget_params(False)
    laps = []
    for _ in range(repeats + 1):  # the first one warms up
        started = time.perf_counter()
        pruner.decide(shape, groups, neurons, hidden, target, shape)
        laps.append(time.perf_counter() - started)
    return {"threads": threads, "median_ms": round(1000 * statistics.median(laps[1:]), 2),
            "laps_ms": [round(1000 * lap, 2) for lap in laps[1:]]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2], help="torch threads, one run each")
    parser.add_argument("--repeats", type=positive_int, default=15)
    parser.add_argument("--density", type=float, default=0.9, help="the decision's budget, a fraction of the blocks' parameters")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if not 0 < args.density <= 1:
        parser.error(f"--density must be in (0, 1], got {args.density}")
    result = {"shape": "llama2-7b", "hardware": cpu_model_name(), "commit": git_commit(), "density": args.density,
              "runs": [time_decisions(threads, args.repeats, args.density) for threads in args.threads]}
    for run in result["runs"]:
        print(f"{run['threads']} thread(s): {run['median_ms']} ms per decision (median of {args.repeats})")
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
