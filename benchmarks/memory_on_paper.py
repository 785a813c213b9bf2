"""Per-rank memory of APT on LLaMA-2-7B/13B/70B and LLaMA-3-8B over 8 GPUs (ZeRO-3, bf16 base), on
paper, term by term, with the terms measured on the CPU (benchmarks/zero3_memory.py, docs/
BENCHMARKS.md "Where a rank's memory goes"), and whether the sum fits 8 x 80 GB and 8 x 24 GB.
Parameter counts come from meta-device models (exact); ZeRO-3 partitions are ceil(numel / ranks)
per tensor, as DeepSpeed pads them.

    python benchmarks/memory_on_paper.py [--ranks 8] [--seq 2048] [--json bench_out/memory_on_paper.json]

Assumptions, stated so they can be checked: adapters on q_proj/v_proj at rank 8 growing to 4x
their parameters (APTConfig defaults), fp32 masters + two Adam moments + a bf16 model copy and
bf16 gradient, all partitioned; at the step's peak the LM head is gathered plus one prefetch
bucket; up to 1e9 gathered parameters kept for reuse (the GPU default of ds_configs/zero3.json);
activations with --gradient-checkpointing: every layer's
input (seq x hidden bf16) plus one layer recomputed (~ seq x (4 hidden + 3 ffn) x 2 bytes x 2
for its backward) plus the loss's fp32 logits on `seq` positions (x3: logits, softmax, grad);
density 0.7. Export: one 5 GB shard plus one fp32 tensor and its adapter.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from apt_ds.models import family_of

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale_on_paper import LLAMA2  # noqa: E402

GB = 1e9


# LLaMA-3-8B's published config (GQA, 128k vocabulary, untied), beside LLaMA-2's
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
MODELS = {**{f"LLaMA-2-{name}": {**values, "vocab_size": 32000} for name, (values, _) in LLAMA2.items()},
          "LLaMA-3-8B": LLAMA3_8B}
KEPT_FOR_REUSE = 1_000_000_000  # ds_configs/zero3.json's "auto" stage3_max_live_parameters on a GPU
GPU_SIZES_GB = (80, 24)


def per_rank(values: dict, ranks: int, seq: int, density: float = 0.7) -> dict:
    """Each term of a rank's steady-step GPU memory (bytes), bf16 base under ZeRO-3 on `ranks`
    GPUs, as measured on the CPU (benchmarks/zero3_memory.py: the partition, what is gathered at
    the step's peak, DeepSpeed's buckets), plus the host terms of load and export."""
    values = {"vocab_size": 32000, **values}
    config = LlamaConfig(tie_word_embeddings=False, **values)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    numels = [p.numel() for p in model.parameters()]
    total = sum(numels)
    family = family_of(model)
    layer = family.decoder_layers(model)[0]
    h, f, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    largest_module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in layer.modules())
    lm_head = config.vocab_size * h
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    adapter = 4 * layers * 8 * ((h + q) + (h + kv))  # q_proj and v_proj, rank 8 grown to 4x
    terms = {
        "weights: this rank's partition (bf16)": sum(math.ceil(n / ranks) for n in numels) * 2,
        "adapters: fp32 master, Adam moments, bf16 copy and gradient, partitioned": adapter * 16 / ranks,
        # measured: the step's peak is at the LM head, the one module gathered (the tied embedding
        # at 1B/3B), plus what prefetch may gather ahead (0.9 hidden^2, the "auto" bucket)
        "gathered at the peak: the LM head, plus one prefetch bucket": (max(lm_head, largest_module) + 0.9 * h * h) * 2,
        "kept for reuse: stage3_max_live_parameters (1e9 on a GPU), bf16": min(KEPT_FOR_REUSE, total) * 2,
        "DeepSpeed's gradient bucket (reduce_bucket_size = hidden^2, bf16)": h * h * 2,
        # --gradient-checkpointing: every layer's input, one layer recomputed, fp32 logits x3
        "activations (checkpointed layers, one layer recomputed, logits)":
            layers * seq * h * 2 + seq * (4 * h + 3 * f) * 2 * 2 + seq * config.vocab_size * 4 * 3,
    }
    steady = sum(terms.values())
    blocks = total - 2 * config.vocab_size * h
    return {
        "params": total, "terms": terms, "steady": steady,
        # a shrink gathers one module at a time and partitions its replacement; pruning hidden
        # channels gathers the embedding / LM head (its columns are then kept in place)
        "event_extra": max(largest_module, lm_head) * 2,
        "pruned_partition": (density * blocks + 2 * config.vocab_size * h) * 2 / ranks,
        "fits": {size: steady < size * GB * 0.9 for size in GPU_SIZES_GB},  # 10% for the CUDA context and the allocator
        "host_load_extra": max(numels) * 4, "export_host": 5 * GB + max(numels) * 4,
    }


def table(results: dict, ranks: int = 8) -> str:
    names = list(results)
    rows = [f"| per rank ({ranks} ranks, bf16) | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for term in next(iter(results.values()))["terms"]:
        rows.append(f"| {term} | " + " | ".join(f"{r['terms'][term] / GB:.2f} GB" for r in results.values()) + " |")
    rows.append("| **steady step, sum** | " + " | ".join(f"**{r['steady'] / GB:.1f} GB**" for r in results.values()) + " |")
    rows.append("| extra at an event (one module gathered: the embedding when hidden channels go) | " + " | ".join(f"{r['event_extra'] / GB:.2f} GB" for r in results.values()) + " |")
    rows.append("| weights after pruning to 0.7 (partition) | "
                + " | ".join(f"{r['pruned_partition'] / GB:.2f} GB" for r in results.values()) + " |")
    for size in GPU_SIZES_GB:
        rows.append(f"| fits {ranks} x {size} GB (steady < 90%) | "
                    + " | ".join("yes" if r["fits"][size] else "**no**" for r in results.values()) + " |")
    rows.append(f"| host: extra per rank at load (one tensor) / the export, one process (one shard + one fp32 tensor); per {ranks}-rank node: x{ranks} at load | "
                + " | ".join(f"{r['host_load_extra'] / GB:.1f} / {r['export_host'] / GB:.1f} GB" for r in results.values()) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.ranks < 1 or args.seq < 1:
        parser.error("--ranks and --seq must be >= 1")
    results = {name: per_rank(values, args.ranks, args.seq) for name, values in MODELS.items()}
    print(table(results, args.ranks))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
