"""The APT model state: adapters, masks, salience, kept units, and how they change together.

`APTModel` owns everything that is attached to the network (adapters, masks,
salience hooks, the distillation transform) plus the bookkeeping that lets a shrunk
architecture be rebuilt from the original checkpoint: which ORIGINAL unit indices survive.
"""

from __future__ import annotations

import hashlib
import json

import torch

from apt_ds.algorithm.adapters import add_adapters, find_adapters
from apt_ds.algorithm.distill import TRANSFORM_ATTR, attach_transform, student_adapters
from apt_ds.algorithm.edits import ShapeChange
from apt_ds.algorithm.masks import UnitMasks
from apt_ds.algorithm.position_bias import HeadBias, record_head_bias, uses_head_bias
from apt_ds.algorithm.pruner import KeepDecision
from apt_ds.algorithm.salience import SalienceCollector
from apt_ds.algorithm.shrink import LOCAL_ACCESS, ParamAccess, replace_module_params, shrink_model, slice_linear
from apt_ds.algorithm.units import ModelShape, check_supported_model
from apt_ds.config import APTConfig
from apt_ds.models import family_of


class APTModel:
    def __init__(self, model, config: APTConfig, seed: int = 0, reduce_sum=None, world_size: int = 1,
                 device: torch.device | str | None = None):
        """`device`: where adapters, masks and salience live (default: the model's; give it for
        a ZeRO-3 partitioned model)."""
        check_supported_model(model)
        if getattr(model, "apt_head_bias", None) is not None:  # its kept heads would index the export's, not the table's
            raise ValueError("this T5 was loaded from an export with heads pruned per layer: apt-ds does not train from "
                             "one yet; train from the model it was pruned from")
        self.model, self.config = model, config
        self.device = torch.device(device) if device is not None else model.get_input_embeddings().weight.device
        self.original_shape = ModelShape.from_model(model)
        self.shape = self.original_shape
        self.kept_groups = [torch.arange(l.num_kv_groups) for l in self.shape.layers]
        self.kept_neurons = [torch.arange(l.ffn) for l in self.shape.layers]
        self.kept_hidden = torch.arange(self.shape.hidden)
        add_adapters(model, config.adapter_targets, config.adapter_rank, config.adapter_alpha, seed=seed, device=self.device)
        for path in family_of(model).modules_to_save:  # a new task head: trained in full, as PEFT's modules_to_save
            model.get_submodule(path).requires_grad_(True)
        if config.distill and config.prune:
            attach_transform(model, self.shape.hidden, config.transform_rank, config.adapter_alpha, seed, self.device)
        self.masks = UnitMasks(self.shape, self.device)
        self.masks.install(model)
        self.salience = SalienceCollector(self.shape, config.salience_beta, config.use_kurtosis, reduce_sum, world_size,
                                          device=self.device, kurtosis_weight=config.kurtosis_weight)
        self.salience.install(model)
        self.salience.enabled = False
        # T5: each attention reads its own heads' columns of its stack's position bias (shared otherwise)
        self.head_bias = HeadBias(model, lambda: self.kept_groups) if uses_head_bias(model) else None

    @property
    def adapters(self):
        return student_adapters(self.model)

    def block_params(self) -> int:
        return self.shape.block_params()

    def density(self) -> float:
        return self.shape.block_params() / self.original_shape.block_params()

    def adapter_params(self) -> int:
        return sum(a.adapter_params() for a in find_adapters(self.model).values())

    def total_rank(self) -> int:
        return sum(a.rank for a in self.adapters.values())

    def ranks(self) -> dict[str, int]:
        return {name: a.rank for name, a in sorted(self.adapters.items())}

    # ---- shape changes -------------------------------------------------------------------
    def shrink(self, decision: KeepDecision, access: ParamAccess = LOCAL_ACCESS) -> ShapeChange:
        """Physically remove what `decision` drops; keep every record consistent."""
        groups, neurons, hidden = decision.indices()
        new_shape, change = shrink_model(self.model, self.shape, groups, neurons, hidden, access)
        transform = getattr(self.model, TRANSFORM_ATTR, None)
        if transform is not None and len(hidden) != self.shape.hidden:
            change.update(replace_module_params(access, transform,
                                                lambda: slice_linear(transform, hidden, hidden, TRANSFORM_ATTR)))
        self.kept_groups = [k[i] for k, i in zip(self.kept_groups, groups)]
        self.kept_neurons = [k[i] for k, i in zip(self.kept_neurons, neurons)]
        self.kept_hidden = self.kept_hidden[hidden]
        self.salience.keep(new_shape, groups, neurons, hidden)
        if self.head_bias is not None:  # what a per-layer export's load_pretrained routes again
            record_head_bias(self.model.config, self.kept_groups, self.original_shape.heads)
        self.masks.reset(new_shape)
        self.shape = new_shape
        return change

    def restore_architecture(self, kept: dict, ranks: dict[str, int], access: ParamAccess = LOCAL_ACCESS) -> None:
        """Resume: shrink the original model to saved ORIGINAL indices and grow saved ranks."""
        groups = [torch.tensor(g, dtype=torch.long) for g in kept["groups"]]
        neurons = [torch.tensor(n, dtype=torch.long) for n in kept["neurons"]]
        hidden = torch.tensor(kept["hidden"], dtype=torch.long)
        flags = KeepDecision(
            [torch.zeros(l.num_kv_groups, dtype=torch.bool).index_fill_(0, g, True) for l, g in zip(self.shape.layers, groups)],
            [torch.zeros(l.ffn, dtype=torch.bool).index_fill_(0, n, True) for l, n in zip(self.shape.layers, neurons)],
            torch.zeros(self.shape.hidden, dtype=torch.bool).index_fill_(0, hidden, True),
            0,
        )
        self.shrink(flags, access)
        adapters = self.adapters
        unknown = sorted(set(ranks) - set(adapters))
        if unknown:
            raise ValueError(f"checkpoint has adapters {unknown[:3]} that this model/config does not have")
        for name in sorted(ranks):  # same order on every rank: gathering is collective
            self.grow_rank(name, ranks[name], access)

    def grow_rank(self, name: str, rank: int, access: ParamAccess = LOCAL_ACCESS,
                  generator: torch.Generator | None = None) -> ShapeChange:
        """Grow one adapter's rank (read, grow, re-partition); returns the edits of A and B."""
        adapter = self.adapters[name]
        edits = replace_module_params(access, adapter, lambda: adapter.grow_rank(rank, generator),
                                      read=[adapter.lora_A, adapter.lora_B])  # not the frozen weight
        return {f"{name}.{param}": param_edits for param, param_edits in edits.items()}

    def shape_fingerprint(self) -> str:
        """A digest of the kept units and adapter ranks, equal on two ranks iff those are: what the
        ranks compare after each event, and what each rank's record keeps (the record itself is
        ~2.3M indices at 70B, which all_gather_object would copy from every rank to every rank)."""
        return shape_digest([*self.kept_groups, *self.kept_neurons, self.kept_hidden], self.ranks())

    def kept_record(self) -> dict:
        return {
            "groups": [k.tolist() for k in self.kept_groups],
            "neurons": [k.tolist() for k in self.kept_neurons],
            "hidden": self.kept_hidden.tolist(),
        }


def shape_digest(kept: list, ranks: dict[str, int]) -> str:
    """`APTModel.shape_fingerprint` of kept index tensors (groups per layer, neurons per layer,
    then hidden) and adapter ranks; also of a saved record's lists (torch.as_tensor of each)."""
    digest = hashlib.sha256()
    for indices in kept:
        indices = torch.as_tensor(indices, dtype=torch.int64)
        digest.update(len(indices).to_bytes(8, "little"))
        digest.update(indices.to("cpu").numpy().tobytes())
    digest.update(json.dumps(ranks).encode())
    return digest.hexdigest()
