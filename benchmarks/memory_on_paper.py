"""Per-rank memory of APT on LLaMA-2-7B/13B/70B over 8 GPUs (ZeRO-3, bf16 base), on paper, with
the accounting the code uses, before and after partitioned loading / partition-preserving
shrinks / streaming export. Parameter counts come from meta-device models (exact); ZeRO-3
partitions are ceil(numel / ranks) per tensor, as DeepSpeed pads them.

    python benchmarks/memory_on_paper.py [--ranks 8] [--seq 2048] [--json bench_out/memory_on_paper.json]

Assumptions, stated so they can be checked: adapters on q_proj/v_proj at rank 8 growing to 4x
their parameters (APTConfig defaults), fp32 masters + two Adam moments + a bf16 model copy and
bf16 gradient, all partitioned; DeepSpeed prefetches one module while the current one is
gathered (2 x the largest module); activations with --gradient-checkpointing: every layer's
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


def per_rank(values: dict, ranks: int, seq: int, density: float = 0.7) -> dict:
    config = LlamaConfig(vocab_size=32000, tie_word_embeddings=False, **values)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    numels = [p.numel() for p in model.parameters()]
    total = sum(numels)
    partition_bf16 = sum(math.ceil(n / ranks) for n in numels) * 2
    family = family_of(model)
    layer = family.decoder_layers(model)[0]
    largest_module = max(max(sum(p.numel() for p in m.parameters(recurse=False)) for m in layer.modules()),
                         family.embedding_module(model).weight.numel()) * 2
    h, f, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    adapter = 4 * layers * 8 * ((h + q) + (h + kv))  # q_proj and v_proj, rank 8 grown to 4x
    adapter_state = adapter * (4 + 4 + 4 + 2 + 2) / ranks
    activations = layers * seq * h * 2 + seq * (4 * h + 3 * f) * 2 * 2 + seq * config.vocab_size * 4 * 3
    blocks = total - 2 * config.vocab_size * h
    shrunk_bf16 = (density * blocks + 2 * config.vocab_size * h) * 2
    largest_tensor = max(numels) * 4
    new_gpu = partition_bf16 + adapter_state + 2 * largest_module + activations
    return {
        "params": total,
        "new": {"gpu_steady": new_gpu, "gpu_event_extra": largest_module, "host_load_extra": largest_tensor,
                "export_host": 5 * GB + largest_tensor},
        "old": {"host_load_per_rank": total * 4, "host_load_per_node": total * 4 * ranks,
                "gpu_before_partitioning": total * 2, "gpu_after_first_event": shrunk_bf16 + new_gpu - partition_bf16,
                "export_host": total * 4},
    }


def table(results: dict, ranks: int = 8) -> str:
    rows = [f"| per rank ({ranks} ranks, bf16) | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    lines = [
        ("new: GPU, steady step (weights + adapter state + 2 modules + activations)", lambda r: r["new"]["gpu_steady"]),
        ("new: GPU, extra at an event (one module)", lambda r: r["new"]["gpu_event_extra"]),
        ("new: host, extra at load (one tensor's rows)", lambda r: r["new"]["host_load_extra"]),
        ("new: host, export (one shard + one fp32 tensor)", lambda r: r["new"]["export_host"]),
        ("old: host at load, per rank (full fp32 model)", lambda r: r["old"]["host_load_per_rank"]),
        (f"old: host at load, per {ranks}-rank node", lambda r: r["old"]["host_load_per_node"]),
        ("old: GPU before DeepSpeed partitions (module.to(device), bf16)", lambda r: r["old"]["gpu_before_partitioning"]),
        ("old: GPU after the first shrink (whole shrunk model, density 0.7)", lambda r: r["old"]["gpu_after_first_event"]),
        ("old: host, export (whole fp32 model)", lambda r: r["old"]["export_host"]),
    ]
    for label, value in lines:
        rows.append(f"| {label} | " + " | ".join(f"{value(r) / GB:.1f} GB" for r in results.values()) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.ranks < 1 or args.seq < 1:
        parser.error("--ranks and --seq must be >= 1")
    results = {name: per_rank(values, args.ranks, args.seq) for name, (values, _) in LLAMA2.items()}
    print(table(results, args.ranks))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
