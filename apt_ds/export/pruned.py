"""Export a plain model (no run: adapters already merged, or none) pruned to given units.

`launch/export.py --model BASE --kept KEPT`: the binary masks of a run stated as the original
unit indices they keep, applied to a model of any supported family. Needs neither DeepSpeed nor
a run directory.
"""

from __future__ import annotations

from pathlib import Path

from apt_ds.algorithm.units import ModelShape, UnsupportedModelError
from apt_ds.export.kept import read_kept_record
from apt_ds.export.out_dir import check_export_out
from apt_ds.export.writer import DEFAULT_SHARD_SIZE, DTYPES, check_options, summary, write_export
from apt_ds.io.checkpoint import CheckpointError
from apt_ds.models import family_of


def export_pruned(model, kept: dict, out: Path, dtype: str = "fp32", tokenizer_dir: Path | None = None,
                  overwrite: bool = False, max_shard_size: str | int = DEFAULT_SHARD_SIZE, format: str = "hf",
                  base: str | Path | None = None) -> dict:
    """Export `model` pruned to `kept` ORIGINAL unit indices ({"groups": [[...] per layer],
    "neurons": [[...] per layer], "hidden": [...]}, as in a run's checkpoint/apt_state.json).
    `format="gguf"`: one llama.cpp file.

    `base`: the safetensors directory `model` was loaded from. Every tensor in its files must be
    written or left out on purpose; transformers drops a tensor its class does not know when it
    loads, so checking the loaded model against itself would miss exactly that tensor."""
    out = Path(out)
    check_options(dtype, max_shard_size, format)
    check_export_out(out, overwrite, protected=[p for p in (tokenizer_dir, base) if p is not None])
    from apt_ds.algorithm.shrink import shrink_model
    from apt_ds.algorithm.units import check_supported_model
    from apt_ds.io.fingerprint import check_base_head
    from apt_ds.io.weights import SafetensorsWeights

    check_supported_model(model)
    if family_of(model).kind == "encoder":  # its classifier is a run's, never in a base checkpoint
        raise UnsupportedModelError(f"{type(model).__name__}: --model with --kept exports a causal LM; a sequence "
                                    f"classifier's head is trained by a run: export the run (launch/export.py RUN)")
    if family_of(model).kind == "seq2seq":  # its bias routing and output scale are a run's export's
        raise UnsupportedModelError(f"{type(model).__name__}: --model with --kept exports a causal LM; export a T5 "
                                    f"run itself (launch/export.py RUN)")
    base_names = None
    if base is not None and Path(base).is_dir():
        check_base_head(base)  # a head transformers loaded otherwise than config.json says
        base_names = SafetensorsWeights(Path(base)).names()
    named = str(base) if base is not None else "the model"
    original = ModelShape.from_model(model)
    groups, neurons, hidden = read_kept_record(kept)
    limits = [(g, l.num_kv_groups) for g, l in zip(groups, original.layers)] + [(n, l.ffn) for n, l in zip(neurons, original.layers)]
    if len(groups) != len(original.layers) or len(neurons) != len(original.layers) or any(
        ix.dim() != 1 or len(ix) == 0 or int(ix.max()) >= size or int(ix.min()) < 0 for ix, size in limits + [(hidden, original.hidden)]
    ):
        raise CheckpointError("kept-units record does not fit this model (layer count or unit indices out of range)")
    shape, _ = shrink_model(model, original, groups, neurons, hidden)
    if format == "gguf":
        from apt_ds.export.gguf import ModelTensors, write_gguf_export

        return write_gguf_export(out, shape, ModelTensors(model, base_names, named), model.config, dtype, tokenizer_dir,
                                 {"original": summary(original)})
    return write_export(model.eval(), shape, out, DTYPES[dtype], tokenizer_dir=tokenizer_dir,
                        extra_report={"original": summary(original)}, max_shard_size=max_shard_size,
                        base_names=base_names, base=named)
