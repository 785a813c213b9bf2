"""Which units an export keeps, as a record of ORIGINAL unit indices
({"groups": [[...] per layer], "neurons": [[...] per layer], "hidden": [...]}, the form of a
run's checkpoint/apt_state.json) or as binary masks over the original model."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from apt_ds.algorithm.masks import is_binary
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
    if any(m.dim() != 1 for m in masks.values()):
        raise CheckpointError(f"--kept {path}: every mask must be a 1-D tensor (one entry per unit)")
    if not all(is_binary(m) for m in masks.values()):
        raise CheckpointError(f"--kept {path}: masks must be binary (0/1) to be exported; finish the decay first")

    def kept(name: str) -> list[int]:
        return masks[name].nonzero().flatten().tolist()

    record = {"groups": [kept(f"kv_group.{i}") for i in range(layers)],
              "neurons": [kept(f"ffn_neuron.{i}") for i in range(layers)], "hidden": kept("hidden")}
    widths = {"groups": [len(masks[f"kv_group.{i}"]) for i in range(layers)],
              "neurons": [len(masks[f"ffn_neuron.{i}"]) for i in range(layers)], "hidden": len(masks["hidden"])}
    return record, widths


def check_mask_widths(path: str, widths: dict, expected: dict) -> None:
    """Masks must cover the ORIGINAL model unit for unit. A run's checkpoint/masks.safetensors covers
    the run's pruned model instead: its kept positions 0..n-1 are not the original units 0..n-1,
    and exporting them would silently keep the wrong ones. `expected`: the model's widths in the
    same form (`model_widths`)."""
    layers = len(expected["groups"])
    if len(widths["groups"]) != layers:
        raise CheckpointError(f"--kept {path} has masks for {len(widths['groups'])} layers; the model has {layers}")
    found = [(kind, i, width, expected[kind][i]) for kind in ("groups", "neurons") for i, width in enumerate(widths[kind])
             if width != expected[kind][i]]
    if widths["hidden"] != expected["hidden"]:
        found.append(("hidden", None, widths["hidden"], expected["hidden"]))
    if found:
        kind, layer, width, wanted = found[0]
        where = "" if layer is None else f" in layer {layer}"
        unit = {"groups": "KV groups", "neurons": "FFN neurons", "hidden": "hidden channels"}[kind]
        raise CheckpointError(f"--kept {path} masks {width} {unit}{where}, where the model has {wanted}: masks must cover "
                              f"the original model (a run's checkpoint/masks.safetensors covers its pruned model; give "
                              f"the run's checkpoint/apt_state.json instead)")


def model_widths(model) -> dict:
    """Each layer's KV groups and FFN neurons and the hidden size of a loaded model (per layer: an
    apt-ds export given as the base may have layers of different widths)."""
    from apt_ds.algorithm.units import ModelShape

    shape = ModelShape.from_model(model)
    return {"groups": [layer.num_kv_groups for layer in shape.layers], "neurons": [layer.ffn for layer in shape.layers],
            "hidden": shape.hidden}


def config_widths(config: dict) -> dict | None:
    """`model_widths` from a plain model's config.json, before the weights are loaded; None when the
    config alone does not say (an apt-ds export's per-layer shapes, a missing field)."""
    if config.get("apt_layer_shapes") or not all(key in config for key in ("num_hidden_layers", "intermediate_size",
                                                                          "hidden_size", "num_attention_heads")):
        return None
    layers = config["num_hidden_layers"]
    return {"groups": [config.get("num_key_value_heads") or config["num_attention_heads"]] * layers,
            "neurons": [config["intermediate_size"]] * layers, "hidden": config["hidden_size"]}


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
