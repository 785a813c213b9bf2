"""Write a copy of an HF LLaMA model without some of its decoder layers (issue 16, item 4 scout).

Uniform APT must cut every layer alike, while non-uniform APT keeps the first layers whole and
guts the last ones. Dropping whole layers first would let a uniform model (fewer layers, one
shape: still a stock LlamaConfig) spend its cut unevenly. This ranks the layers by block
influence (ShortGPT, Men et al. 2024: 1 - the mean cosine similarity of a layer's input and
output hidden states, here over every token of a task's first training rows, prompt and
completion) and writes the model without the `--drop` least influential ones, or without the
layers named by `--layers`. It prints the target density that keeps the original model's block
budget, to pass to quality.py as `--apt target_density=...`:

    python benchmarks/drop_layers.py --drop 5 --out bench_out/smollm2-drop5
    python benchmarks/quality_seeds.py --tasks sst2 --seeds 0 1 2 --methods apt_0.7_uniform --steps 144 \\
        --model bench_out/smollm2-drop5 --apt target_density=0.84 --out bench_out/sst2_uniform_drop5
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def block_influence(model, tokenizer, texts: list[str]) -> list[float]:
    """Per decoder layer: 1 - cos(input, output) of its hidden states, averaged over tokens, then rows.
    Read by hooks on the layers themselves: `output_hidden_states` hands back the last layer's output
    after the final norm (transformers 5), whose per-channel weights would turn its direction."""
    import torch

    from apt_ds.models import family_of

    layers = family_of(model).decoder_layers(model)
    influence = [0.0] * len(layers)
    pairs: dict[int, tuple] = {}

    def recorder(index: int):
        def hook(module, args, kwargs, output):
            inputs = args[0] if args else kwargs["hidden_states"]
            pairs[index] = (inputs, output[0] if isinstance(output, tuple) else output)
        return hook

    handles = [layer.register_forward_hook(recorder(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            for text in texts:
                model(**tokenizer(text, return_tensors="pt"))
                for index, (before, after) in pairs.items():
                    similarity = torch.nn.functional.cosine_similarity(before[0], after[0], dim=-1)
                    influence[index] += (1 - similarity).mean().item() / len(texts)
    finally:
        for handle in handles:
            handle.remove()
    return influence


def without_layers(model, drop: list[int]):
    """The model with the decoder layers in `drop` removed, the rest renumbered (KV-cache slots)."""
    from apt_ds.models import family_of

    family = family_of(model)
    layers = family.decoder_layers(model)
    keep = [i for i in range(model.config.num_hidden_layers) if i not in drop]
    kept = [layers[i] for i in keep]
    del layers[:]  # in place: the ModuleList is where the model's forward finds its layers
    layers.extend(kept)
    for index, layer in enumerate(layers):
        family.attention_block(layer).layer_idx = index
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    return model


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("bench_out/smollm2-135m-hf"), help="an HF LLaMA directory")
    parser.add_argument("--task", type=Path, default=Path("bench_out/tasks/sst2"), help="a prepared task (train.jsonl)")
    parser.add_argument("--rows", type=int, default=64, help="training rows the influence is measured on")
    parser.add_argument("--drop", type=int, help="drop this many layers, the least influential")
    parser.add_argument("--layers", help="drop these layers instead (comma-separated indices)")
    parser.add_argument("--density", type=float, default=0.7, help="the original model's target density")
    parser.add_argument("--out", type=Path, required=True, help="the new model directory (must not exist)")
    args = parser.parse_args(argv)
    if (args.drop is None) == (args.layers is None):
        parser.error("give one of --drop N and --layers I,J,...")
    named = None
    if args.layers is not None:
        try:
            named = [int(i) for i in args.layers.split(",")]
        except ValueError:
            parser.error(f"--layers {args.layers}: expected comma-separated layer indices, e.g. 13,14,25")
    if args.drop is not None and args.drop < 1:
        parser.error(f"--drop must be >= 1, got {args.drop}")
    if args.rows < 1 or not 0 < args.density <= 1:
        parser.error(f"--rows must be >= 1 and --density in (0, 1], got {args.rows} and {args.density}")
    staging = args.out.with_name(args.out.name + ".partial")
    if args.out.exists() or staging.exists():
        parser.error(f"--out {args.out} or {staging.name} exists; choose a new directory (or remove a failed run's "
                     f"{staging.name})")
    if not (args.model / "config.json").is_file() or not (args.task / "train.jsonl").is_file():
        parser.error(f"need {args.model}/config.json and {args.task}/train.jsonl (see benchmarks/prepare_tasks.py)")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    layers = model.config.num_hidden_layers
    with open(args.task / "train.jsonl") as f:
        rows = [json.loads(line) for line, _ in zip(f, range(args.rows)) if line.strip()]
    if not rows:
        parser.error(f"{args.task}/train.jsonl has no rows to measure on")
    influence = block_influence(model, tokenizer, [row["prompt"] + row["completion"] for row in rows])
    ranked = sorted(range(layers), key=influence.__getitem__)
    drop = ranked[: args.drop] if named is None else named
    if len(set(drop)) != len(drop) or not all(0 <= i < layers for i in drop) or len(drop) >= layers:
        parser.error(f"layers to drop must be distinct indices in [0, {layers}) and leave one: {drop}")
    kept = layers - len(drop)
    density = args.density * layers / kept  # every layer holds the same block parameters before pruning
    if density > 1:
        parser.error(f"dropping {len(drop)} of {layers} layers already cuts below density {args.density}")
    try:
        without_layers(model, drop).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # nothing half-written stays behind
        raise
    staging.rename(args.out)
    result = {"influence": [round(v, 4) for v in influence], "least_influential_first": ranked,
              "dropped": sorted(drop), "kept_layers": kept, "target_density": round(density, 4)}
    print(json.dumps(result))
    print(f"wrote {args.out}: {kept} of {layers} layers; to keep density {args.density} of the original's blocks "
          f"pass --apt target_density={density:.4f}")
    return result


if __name__ == "__main__":
    main()
