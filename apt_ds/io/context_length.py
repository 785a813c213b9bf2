"""How many positions a model knows, and --max-seq-len checked against it.

A sequence longer than `max_position_embeddings` runs (rotary embeddings have no table to
overflow) but its later positions were never trained: a model fine-tuned on such blocks learns
from noise. Rope scaling is the exception, where the config says so: linear, dynamic NTK, YaRN
and LongRoPE stretch the trained length by `factor` (from `original_max_position_embeddings`
where given, as transformers reads it); Llama 3's `llama3` scaling is already counted in its
`max_position_embeddings` (131072 for Llama 3.1), so it adds nothing.
"""

from __future__ import annotations

from apt_ds.config import ConfigError
from apt_ds.models import ENCODERS, FAMILIES

STRETCHING_ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope")


def known_positions(config: dict) -> tuple[int, str] | None:
    """(the longest sequence the config supports, how it got there), or None where it says nothing."""
    trained = config.get("max_position_embeddings")
    if not isinstance(trained, int) or trained < 1:
        return None
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    if kind in STRETCHING_ROPE_TYPES and isinstance(factor, (int, float)) and factor > 1:
        original = scaling.get("original_max_position_embeddings") or config.get("original_max_position_embeddings") or trained
        stretched = int(original * factor)
        if stretched > trained:
            return stretched, f"its rope_scaling ({kind}, factor {factor:g} of {original}) extends max_position_embeddings {trained} to {stretched}"
    family = FAMILIES.get(config.get("model_type")) or ENCODERS.get(config.get("model_type"))
    if family is not None and family.positions_after_padding and isinstance(config.get("pad_token_id"), int):
        usable = trained - config["pad_token_id"] - 1
        return usable, (f"max_position_embeddings is {trained}, and {family.names}'s positions start after pad_token_id "
                        f"{config['pad_token_id']}")
    return trained, f"max_position_embeddings is {trained}"


def check_max_seq_len(config: dict, max_seq_len: int, model: str) -> str | None:
    """Refuse a --max-seq-len past what the model knows; a note where only rope scaling allows it."""
    known = known_positions(config)
    if known is None:
        return None
    limit, why = known
    if max_seq_len > limit:
        raise ConfigError(f"--max-seq-len {max_seq_len} is longer than --model {model} knows ({why}): positions past "
                          f"{limit} were never trained; give --max-seq-len {limit} or less")
    trained = config["max_position_embeddings"]
    if max_seq_len > trained:
        return f"note: --max-seq-len {max_seq_len} is past max_position_embeddings {trained}: allowed because {why}"
    return None
