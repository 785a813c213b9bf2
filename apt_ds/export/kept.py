"""Which units an export keeps, as a record of ORIGINAL unit indices
({"groups": [[...] per layer], "neurons": [[...] per layer], "hidden": [...]}, the form of a
run's checkpoint/apt_state.json) or as binary masks over the original model."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from apt_ds.config import ConfigError
from apt_ds.io.checkpoint import CheckpointError


def kept_from_masks(path: str) -> tuple[dict, dict]:
    """Binary unit masks over the ORIGINAL model (`hidden`, `kv_group.<layer>`, `ffn_neuron.<layer>`,
    as `UnitMasks.state_dict()` names them) -> (the kept-units record, each mask's length), the
    lengths for `check_mask_widths` once the model's config is known."""
    try:
        masks = load_file(path)
    except Exception as err:
        raise ConfigError(f"cannot read --kept {path}: {str(err).splitlines()[0]}") from None
    layers = sum(1 for key in masks if key.startswith("kv_group."))
    names = ["hidden"] + [f"{kind}.{i}" for i in range(layers) for kind in ("kv_group", "ffn_neuron")]
    if not layers or any(name not in masks for name in names):
        raise CheckpointError(f"--kept {path}: expected masks hidden, kv_group.<i>, ffn_neuron.<i> for every layer")
    if any(not bool(((m == 0) | (m == 1)).all()) for m in masks.values()):
        raise CheckpointError(f"--kept {path}: masks must be binary (0/1) to be exported; finish the decay first")

    def kept(name: str) -> list[int]:
        return masks[name].nonzero().flatten().tolist()

    record = {"groups": [kept(f"kv_group.{i}") for i in range(layers)],
              "neurons": [kept(f"ffn_neuron.{i}") for i in range(layers)], "hidden": kept("hidden")}
    widths = {"groups": [len(masks[f"kv_group.{i}"]) for i in range(layers)],
              "neurons": [len(masks[f"ffn_neuron.{i}"]) for i in range(layers)], "hidden": len(masks["hidden"])}
    return record, widths


def check_mask_widths(path: str, widths: dict, config: dict) -> None:
    """Masks must cover the ORIGINAL model unit for unit. A run's checkpoint/masks.safetensors covers
    the run's pruned model instead: its kept positions 0..n-1 are not the original units 0..n-1,
    and exporting them would silently keep the wrong ones. `config`: the model's config.json as a dict."""
    expected = {"groups": config.get("num_key_value_heads") or config["num_attention_heads"],
                "neurons": config["intermediate_size"], "hidden": config["hidden_size"]}
    layers = config["num_hidden_layers"]
    if len(widths["groups"]) != layers:
        raise CheckpointError(f"--kept {path} has masks for {len(widths['groups'])} layers; the model has {layers}")
    found = [(kind, i, width) for kind in ("groups", "neurons") for i, width in enumerate(widths[kind])
             if width != expected[kind]] + ([("hidden", None, widths["hidden"])] if widths["hidden"] != expected["hidden"] else [])
    if found:
        kind, layer, width = found[0]
        where = "" if layer is None else f" of layer {layer}"
        unit = {"groups": "KV groups", "neurons": "FFN neurons", "hidden": "hidden channels"}[kind]
        raise CheckpointError(f"--kept {path} masks {width} {unit}{where}, the model has {expected[kind]}: masks must cover "
                              f"the original model (a run's checkpoint/masks.safetensors covers its pruned model; give "
                              f"the run's checkpoint/apt_state.json instead)")


def read_kept_record(kept) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """(groups per layer, neurons per layer, hidden) index tensors of a kept-units record, checked
    for form and duplicates (a unit listed twice would be copied twice)."""
    if not isinstance(kept, dict):
        raise CheckpointError("kept-units record is malformed: expected a JSON object with groups/neurons/hidden lists")
    try:
        lists = [*kept["groups"], *kept["neurons"], kept["hidden"]]
        if not all(isinstance(ix, list) and all(type(i) is int for i in ix) for ix in lists):
            raise TypeError("indices must be lists of integers")
        groups = [torch.tensor(g, dtype=torch.long) for g in kept["groups"]]
        neurons = [torch.tensor(n, dtype=torch.long) for n in kept["neurons"]]
        hidden = torch.tensor(kept["hidden"], dtype=torch.long)
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"kept-units record is malformed ({err}); expected groups/neurons/hidden lists") from None
    if any(ix.dim() != 1 or len(torch.unique(ix)) != len(ix) for ix in [*groups, *neurons, hidden]):
        raise CheckpointError("kept-units record lists a unit twice (or is not flat lists); every kept index must be unique")
    return groups, neurons, hidden
