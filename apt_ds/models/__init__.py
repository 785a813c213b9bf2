"""Architecture descriptions: what apt-ds knows of each model family, as data in one place.

A family's description (`family.Family`, one file a family) lists the tensors of a decoder
layer with the unit axis of each dimension; from that table come a layer's exact parameter
count, the pruner's budget terms, the export's slicing and the tensors it must write. It also
names the config values the family refuses, its transformers classes, and the base tensors an
export leaves out on purpose (any other base tensor must reach the export, or the export fails:
apt_ds.export.accounting). Adding a family is one file here, a tiny random model in the tests
and its published sizes.
"""

from __future__ import annotations

from apt_ds.models.family import Family, LayerTensor, LeftOut, OuterTensor, UnitCosts, UnsupportedModelError

__all__ = ["ADAPTER_TARGETS", "DEFAULT_ADAPTER_TARGETS", "ENCODERS", "FAMILIES", "SEQ2SEQ", "Family", "LayerTensor", "LeftOut",
           "OuterTensor", "UnitCosts", "UnsupportedModelError", "family_for", "family_of"]


def _registry() -> dict[str, Family]:
    """Every Family defined in a module of this package (one a family), LLaMA's first."""
    import importlib
    import pkgutil

    families = {}
    for module in sorted(info.name for info in pkgutil.iter_modules(__path__)):
        for value in vars(importlib.import_module(f"{__name__}.{module}")).values():
            if isinstance(value, Family):
                families.setdefault(value.model_type, value)
    return {"llama": families.pop("llama"), **families}


_ALL = _registry()
# The decoders (causal LMs: `tiny-<family>` built-in models, GGUF exports, lm-eval)
FAMILIES = {name: family for name, family in _ALL.items() if family.kind == "decoder"}
# The encoders (BERT, RoBERTa sequence classifiers): trained on classification data (one process,
# ZeRO-2 or ZeRO-3) and exported as HF sequence classifiers
ENCODERS = {name: family for name, family in _ALL.items() if family.kind == "encoder"}
# The encoder-decoders (T5): trained on input/target rows, exported as HF seq2seq models
SEQ2SEQ = {name: family for name, family in _ALL.items() if family.kind == "seq2seq"}
# The projections an adapter can wrap, by module name as PEFT's `target_modules` takes them
ADAPTER_TARGETS = tuple(dict.fromkeys(name for family in FAMILIES.values() for name in family.projections))
# The paper's (and LoRA's) default: adapters on the query and value projections
DEFAULT_ADAPTER_TARGETS = tuple(FAMILIES["llama"].module_path(role).rsplit(".", 1)[-1] for role in ("attn_q", "attn_v"))


def family_for(model_type, where: str = "") -> Family:
    """The description of `model_type`; any other is refused in one line naming those supported."""
    family = FAMILIES.get(model_type) or ENCODERS.get(model_type) or SEQ2SEQ.get(model_type)
    if family is None:
        supported = ", ".join(f"{f.model_type} ({f.names})" for f in [*FAMILIES.values(), *ENCODERS.values(), *SEQ2SEQ.values()])
        prefix = f"{where}: " if where else ""
        raise UnsupportedModelError(f"{prefix}model_type {model_type!r} is not supported; apt-ds prunes {supported}")
    return family


def family_of(model) -> Family:
    """The description of a transformers model's family (from its config's model_type)."""
    return family_for(getattr(model.config, "model_type", None))
