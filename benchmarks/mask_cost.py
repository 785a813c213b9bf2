"""What decaying unit masks add to a training step's forward and backward (one process).

In the window before each pruning event the leaving units' masks decay from 1 to 0, and every
forward multiplies them in (`apt_ds.algorithm.masks`): KV groups at o_proj's input, FFN neurons
at down_proj's input, hidden channels at every write to the residual stream, and each RMSNorm
averages x^2 over the kept hidden channels only. This script times a forward and backward of the
same model and batch with every mask at 1 (the hooks return at once) and with a block of each
kind half decayed in every layer, interleaved, and counts the operations each dispatches, all of
them and those that compute (roughly the kernels a GPU launches: a host-bound GPU step pays
for each). Each timed step first sets its masks and refreshes them, as every decay-window step
of training does (so what the hooks make once per mask update is counted in every step).

    python benchmarks/mask_cost.py --repeats 15 --json bench_out/mask_cost.json
    # on a GPU: two layers at LLaMA-2-7B's widths, bf16, 16 x 512 tokens (the recipe's micro-batch)
    python benchmarks/mask_cost.py --device cuda --dtype bfloat16 --width llama2-7b --batch 16 --seq 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import cpu_model_name, dispatched_operations, git_commit  # noqa: E402
from step_overhead import MODEL  # noqa: E402  (the step-cost benchmark's small model)

from apt_ds.algorithm.state import APTModel  # noqa: E402
from apt_ds.config import APTConfig  # noqa: E402
from apt_ds.io.modeling import build_tiny_model  # noqa: E402
from apt_ds.training.forward import enable_activation_checkpointing  # noqa: E402

WIDTHS = {"small": (MODEL, 2048),  # (layer shape, vocabulary)
          "llama2-7b": (dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=2, num_attention_heads=32,
                             num_key_value_heads=32), 32000)}


def decay_a_block_of_each(state: APTModel, value: float) -> None:
    """Set the last KV group, the last 32 FFN neurons and the last 32 hidden channels of every
    layer to `value`, as a decay window leaves them halfway."""
    masks = state.masks
    for group_mask, neuron_mask in zip(masks.kv_group, masks.ffn_neuron):
        group_mask[-1:] = value
        neuron_mask[-32:] = value
    masks.hidden[-32:] = value
    masks.refresh()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the model's dtype (bf16 matmuls are slow on CPUs without native bf16)")
    parser.add_argument("--width", choices=sorted(WIDTHS), default="small",
                        help="small: the model above; llama2-7b: two layers at LLaMA-2-7B's widths (about 0.7B parameters)")
    parser.add_argument("--device", default="cpu", help="where the model runs, e.g. cuda")
    parser.add_argument("--no-gradient-checkpointing", action="store_true",
                        help="keep every activation (the CLI checkpoints layers by default)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadier on a shared machine)")
    parser.add_argument("--json", default=None, help="write results here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.batch < 1 or args.seq < 2:
        parser.error("--repeats and --batch must be >= 1 and --seq >= 2")
    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:
        parser.error(f"--device {args.device}: {str(err).splitlines()[0]}")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return measure(args, device)
    finally:
        torch.set_num_threads(threads)  # as it was for a caller in the same process (the tests)


def measure(args, device: torch.device) -> dict:
    torch.manual_seed(0)
    layer_shape, vocab = WIDTHS[args.width]
    model = build_tiny_model(vocab, **layer_shape).to(device=device, dtype=getattr(torch, args.dtype))
    model.train()
    if not args.no_gradient_checkpointing:
        enable_activation_checkpointing(model)
    state = APTModel(model, APTConfig(target_density=0.5, pruning_start_step=0, pruning_end_step=10, num_pruning_events=1))
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def step() -> None:
        model(**batch).loss.backward()
        for param in model.parameters():
            param.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()  # the step's time, not its launch

    def with_masks(value: float):
        def run() -> None:
            decay_a_block_of_each(state, value)
            step()
        return run

    idle, decaying = with_masks(1.0), with_masks(0.5)
    for _ in range(2):  # warm-up
        idle()
        decaying()
    idle_times, decaying_times = [], []
    for _ in range(args.repeats):  # interleaved, so drifts in load hit both alike
        for run, times in ((idle, idle_times), (decaying, decaying_times)):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    med = statistics.median
    result = {
        "hardware": (torch.cuda.get_device_name(device) if device.type == "cuda" else
                     f"{cpu_model_name()}, {torch.get_num_threads()} threads") + f", torch {torch.__version__}",
        "commit": git_commit(), "model": layer_shape, "vocab": vocab, "device": str(device), "dtype": args.dtype,
        "batch": args.batch, "seq": args.seq,
        "gradient_checkpointing": not args.no_gradient_checkpointing, "repeats": args.repeats,
        "masks_idle_s": med(idle_times), "masks_decaying_s": med(decaying_times),
        "decaying_over_idle": med(decaying_times) / med(idle_times),
        **{f"{key}_per_step": {"masks_idle": dispatched_operations(idle, views),
                               "masks_decaying": dispatched_operations(decaying, views)}
           for key, views in (("dispatched", True), ("computing", False))},
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
