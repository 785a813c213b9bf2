"""Unit accounting and pruning decisions at LLaMA-2 scale, without any weights.

Builds the models on the meta device (no memory), checks the exact parameter counts against
the published sizes, then times one pruning decision (non-uniform and uniform) on LLaMA-2-70B
shapes (or `--decision-model 7B` / `13B`) with synthetic salience (median of repeats) and reports
the process's peak RSS growth.

    python benchmarks/scale_on_paper.py --repeats 3 --json bench_out/scale_on_paper.json
    python benchmarks/scale_on_paper.py --decision-model 7B --shape-multiple 1
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from apt_ds.algorithm.pruner import AdaptivePruner  # noqa: E402
from apt_ds.algorithm.units import ModelShape  # noqa: E402
from apt_ds.config import APTConfig  # noqa: E402

LLAMA2 = {  # published parameter counts (Touvron et al. 2023; HF model cards)
    "7B": (dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32), 6_738_415_616),
    "13B": (dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40), 13_015_864_320),
    "70B": (dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8), 68_976_648_192),
}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--decision-model", choices=list(LLAMA2), default="70B", help="the shapes the decisions are timed on")
    parser.add_argument("--shape-multiple", type=int, default=None,
                        help="APTConfig.shape_multiple of the decisions (default: its default; 1 = single units)")
    args = parser.parse_args()
    if args.repeats < 1 or (args.shape_multiple is not None and args.shape_multiple < 1):
        parser.error("--repeats and --shape-multiple must be >= 1")
    result = {"counts": {}}
    for name, (values, published) in LLAMA2.items():
        config = LlamaConfig(vocab_size=32000, tie_word_embeddings=False, **values)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        meta_count = sum(p.numel() for p in model.parameters())
        shape = ModelShape.from_config(config)
        result["counts"][name] = {"published": published, "units_py": shape.total_params(), "meta_model": meta_count,
                                  "match": published == shape.total_params() == meta_count}
    shape = ModelShape.from_config(LlamaConfig(vocab_size=32000, **LLAMA2[args.decision_model][0]))
    tag = args.decision_model.lower()
    generator = torch.Generator().manual_seed(0)
    groups = [torch.rand(l.num_kv_groups, generator=generator, dtype=torch.float64) for l in shape.layers]
    neurons = [torch.rand(l.ffn, generator=generator, dtype=torch.float64) for l in shape.layers]
    hidden = torch.rand(shape.hidden, generator=generator, dtype=torch.float64)
    units = sum(g.numel() for g in groups) + sum(n.numel() for n in neurons) + hidden.numel()
    before = peak_rss_mb()
    for uniform in (False, True):
        blocks = {} if args.shape_multiple is None else {"shape_multiple": args.shape_multiple}
        pruner = AdaptivePruner(APTConfig(target_density=0.5, pruning_start_step=0, pruning_end_step=10, num_pruning_events=1,
                                          uniform=uniform, **blocks))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            decision = pruner.decide(shape, groups, neurons, hidden, 0.5 * shape.block_params())
            times.append(time.perf_counter() - start)
        key = "uniform" if uniform else "non_uniform"
        result[f"decision_{tag}_{key}_s"] = statistics.median(times)
        result[f"decision_{tag}_{key}_density"] = decision.params / shape.block_params()
    result[f"units_{tag}"] = units
    result["peak_rss_growth_mb"] = peak_rss_mb() - before
    result["bytes_per_unit"] = result["peak_rss_growth_mb"] * 2**20 / units
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
