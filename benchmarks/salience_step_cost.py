"""Host cost of one salience step end (`SalienceCollector.end_step`: all-reduce, unit scores with
the outlier term, EMA) at real model shapes, with random sums: median wall time and the number
of operations dispatched (host dispatcher time; those that compute are roughly a GPU's kernel launches).

    python benchmarks/salience_step_cost.py --repeats 20

Run it at two commits to compare implementations (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from _common import dispatched_operations, positive_int  # noqa: E402

from apt_ds.algorithm.salience import SalienceCollector  # noqa: E402
from apt_ds.algorithm.units import LayerShape, ModelShape  # noqa: E402

SHAPES = {  # (layers, KV groups, group size, head dim, FFN, hidden)
    "smollm2-135m": (30, 3, 3, 64, 1536, 576),
    "llama2-7b": (32, 32, 1, 128, 11008, 4096),
}


def _fill(collector: SalienceCollector, generator: torch.Generator) -> None:
    for site in collector.attn_sites + collector.ffn_sites + collector.hidden_sites:
        for name in ("act_abs", "grad_abs", "act_sum"):
            tensor = getattr(site, name)
            if tensor is not None:
                tensor.copy_(torch.rand(tensor.shape, generator=generator))
    collector.tokens.fill_(2048)


def measure(name: str, repeats: int, device: str) -> dict:
    layers, groups, group_size, head_dim, ffn, hidden = SHAPES[name]
    shape = ModelShape(hidden=hidden, layers=tuple(LayerShape(groups, group_size, head_dim, ffn) for _ in range(layers)),
                       vocab=32000, tied_embeddings=False)
    collector = SalienceCollector(shape, beta=0.85, use_kurtosis=True, device=device)
    generator = torch.Generator().manual_seed(0)
    for site in collector.attn_sites + collector.ffn_sites:
        site.power_sums = torch.rand(4, site.act_abs.numel(), dtype=torch.float64, generator=generator).to(device)
    times = []
    for _ in range(repeats + 2):  # two warm-ups; the EMA exists from the first
        _fill(collector, generator)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        collector.end_step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    _fill(collector, generator)
    operations = dispatched_operations(collector.end_step)
    return {"shape": name, "median_ms": round(1000 * statistics.median(times[2:]), 2), "operations": operations}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=positive_int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in SHAPES:
        print(measure(name, args.repeats, args.device), flush=True)


if __name__ == "__main__":
    main()
