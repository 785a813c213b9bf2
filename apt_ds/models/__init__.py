"""Architecture descriptions: what apt-ds knows of each model family, as data in one place.

A family's description names the checkpoint tensors an export leaves out on purpose (and why);
everything else a base checkpoint holds must reach the export, written or sliced, or the export
fails (apt_ds.export.accounting). Issue 44 grows these descriptions into the whole architecture
(prunable units, biases, per-head norms, transformers classes, llama.cpp's tensor map) for
Qwen2, Qwen3 and Mistral; until their exports are right, only `llama` is accepted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class UnsupportedModelError(ValueError):
    """The model is not one apt-ds can prune; the message says why in one line."""


@dataclass(frozen=True)
class LeftOut:
    """Base checkpoint tensors an export does not write: `pattern` (a full-match regex over the
    HF name) and why dropping them changes nothing."""

    pattern: str
    why: str

    def __post_init__(self):
        re.compile(self.pattern)  # a typo in a description fails at import, not at export

    def matches(self, name: str) -> bool:
        return re.fullmatch(self.pattern, name) is not None


@dataclass(frozen=True)
class Family:
    """One model family (a transformers `model_type`)."""

    model_type: str
    names: str  # the models it covers, for messages and docs
    left_out: tuple[LeftOut, ...] = ()
    output_embedding: str = "lm_head.weight"  # not written when the config ties it to the input embedding

    def left_out_on_purpose(self, name: str, tied_embeddings: bool) -> bool:
        if tied_embeddings and name == self.output_embedding:
            return True
        return any(rule.matches(name) for rule in self.left_out)


def _registry() -> dict[str, Family]:
    from apt_ds.models.llama import LLAMA

    return {family.model_type: family for family in (LLAMA,)}


FAMILIES = _registry()


def family_for(model_type, where: str = "") -> Family:
    """The description of `model_type`; any other is refused in one line naming those supported."""
    family = FAMILIES.get(model_type)
    if family is None:
        supported = ", ".join(f"{f.model_type} ({f.names})" for f in FAMILIES.values())
        prefix = f"{where}: " if where else ""
        raise UnsupportedModelError(f"{prefix}model_type {model_type!r} is not supported; apt-ds prunes {supported}")
    return family
