"""Training-step cost of APT on one process, measured side by side (medians of repeats).

1. APT at density 1.0 (salience hooks, masks, adapter importance all active) vs the same
   LoRA step without any of them;
2. APT step after physically shrinking to density 0.5 vs before, next to the ratio of block
   FLOPs kept.

Also the operations each step dispatches, all of them (each costs the host dispatcher time,
which decides a host-bound GPU step) and those that compute (views, aliases and detaches left
out: roughly the kernels a GPU launches). The batch carries an attention mask, as the CLI's
batches do, so salience takes its padding-aware path.

    python benchmarks/step_overhead.py --repeats 15 --json bench_out/step_overhead.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import dispatched_operations, positive_int  # noqa: E402

from apt_ds.algorithm.adapters import add_adapters  # noqa: E402
from apt_ds.algorithm.pruner import AdaptivePruner  # noqa: E402
from apt_ds.algorithm.state import APTModel  # noqa: E402
from apt_ds.algorithm.tuner import AdaptiveTuner  # noqa: E402
from apt_ds.config import APTConfig  # noqa: E402
from apt_ds.distributed.backend import LocalBackend  # noqa: E402
from apt_ds.io.modeling import build_tiny_model  # noqa: E402

MODEL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)


def make_batch(vocab: int, batch: int, length: int) -> dict:
    ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def lora_step(model, optimizer, batch) -> None:
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def apt_step(state: APTModel, tuner: AdaptiveTuner, backend: LocalBackend, batch) -> None:
    backend.backward(backend.forward(**batch).loss)
    state.salience.end_step()
    tuner.accumulate(state.adapters, backend.full_param, backend.full_grad)
    backend.step()


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=positive_int, default=15)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadier on a shared machine)")
    parser.add_argument("--json", default=None, help="write results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    vocab = 2048
    batch = make_batch(vocab, args.batch, args.seq)
    config = APTConfig(target_density=0.5, pruning_start_step=0, pruning_end_step=10, num_pruning_events=1)

    lora = build_tiny_model(vocab, **MODEL)
    add_adapters(lora, config.adapter_targets, config.adapter_rank, config.adapter_alpha)
    lora_opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-4)

    def apt_setup():
        model = build_tiny_model(vocab, **MODEL)
        state = APTModel(model, config)
        state.salience.enabled = True
        backend = LocalBackend()
        backend.attach(model, 1e-4, lambda s: 1.0, 0.0, 1, max_grad_norm=1.0)
        return state, AdaptiveTuner(config), backend

    dense, shrunk = apt_setup(), apt_setup()
    for _ in range(3):  # warm-up; also gives the shrunk copy salience to decide with
        lora_step(lora, lora_opt, batch)
        apt_step(*dense, batch)
        apt_step(*shrunk, batch)
    state, _, backend = shrunk
    before = state.shape
    s = state.salience
    decision = AdaptivePruner(config).decide(before, s.group_scores, s.neuron_scores, s.hidden_scores,
                                             0.5 * before.block_params())
    backend.apply_shape_change(lambda: state.shrink(decision, backend.param_access()))
    apt_step(*shrunk, batch)

    # Interleaved, so drifts in machine load hit all three alike.
    lora_times, apt_times, shrunk_times = [], [], []
    for _ in range(args.repeats):
        lora_times += timed(lambda: lora_step(lora, lora_opt, batch), 1)
        apt_times += timed(lambda: apt_step(*dense, batch), 1)
        shrunk_times += timed(lambda: apt_step(*shrunk, batch), 1)

    def flops(shape) -> int:  # forward matmul FLOPs per token: blocks + lm_head
        return 2 * (shape.block_params() + shape.vocab * shape.hidden)

    med = statistics.median
    result = {
        "hardware": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "model": MODEL, "batch": args.batch, "seq": args.seq, "repeats": args.repeats,
        "lora_step_s": med(lora_times), "apt_step_density1_s": med(apt_times),
        "apt_overhead_ratio": med(apt_times) / med(lora_times),
        "apt_step_after_shrink_s": med(shrunk_times),
        "shrink_step_ratio": med(shrunk_times) / med(apt_times),
        "density_after_shrink": state.density(),
        "forward_flops_ratio": flops(state.shape) / flops(before),
        **{f"{key}_per_step": {"lora": dispatched_operations(lambda: lora_step(lora, lora_opt, batch), views),
                               "apt_density1": dispatched_operations(lambda: apt_step(*dense, batch), views),
                               "apt_after_shrink": dispatched_operations(lambda: apt_step(*shrunk, batch), views)}
           for key, views in (("dispatched", True), ("computing", False))},
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
