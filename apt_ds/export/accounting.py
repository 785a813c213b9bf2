"""Every base tensor accounted for: an export writes each tensor of the base checkpoint (sliced
to the kept units, adapters merged) or leaves it out on purpose, as the family's description
says; anything else fails the export before a byte is written.

Without this an export only checked that what it wrote existed in the base, never the converse:
a base tensor the writer does not know (Qwen2's q/k/v biases, Qwen3's q_norm/k_norm) was dropped
without a word, and the exported model silently differed from the one trained.
"""

from __future__ import annotations

from collections.abc import Iterable

from apt_ds.io.checkpoint import CheckpointError
from apt_ds.models import Family


class UnaccountedTensorError(CheckpointError):
    """A base tensor the export would drop, or a written tensor the base does not hold."""


def check_every_base_tensor_written(base_names: Iterable[str], written_names: Iterable[str], family: Family,
                                    tied_embeddings: bool, base: str) -> None:
    """`base_names`: the base checkpoint's tensors (HF names); `written_names`: the export's."""
    base_set, written = set(base_names), set(written_names)
    dropped = sorted(n for n in base_set - written if not family.left_out_on_purpose(n, tied_embeddings))
    if dropped:
        more = f" and {len(dropped) - 1} more" if len(dropped) > 1 else ""
        raise UnaccountedTensorError(
            f"export refused: the base model {base} holds {dropped[0]}{more}, which the {family.model_type} export "
            f"would not write, so the exported model would differ from the one trained; nothing was written "
            f"(apt-ds's {family.model_type} description does not say how to export it: please report this)")
    extra = sorted(written - base_set)
    if extra:
        raise UnaccountedTensorError(f"export refused: it would write {extra[0]} ({len(extra)} such), which the base model "
                                     f"{base} does not hold; is it the model this run was trained from?")


def base_names_as_the_model_names_them(weights, model_names: Iterable[str], family: Family) -> list[str]:
    """The base checkpoint's tensors under the names of the model the run built from it (a
    `BertModel` checkpoint's `embeddings.` is `bert.embeddings.`, `LayerNorm.gamma` is
    `LayerNorm.weight`: SafetensorsWeights.stored), with a task head the run made where the base
    had none (its tensors are the run's, so an export writes them)."""
    as_model = {weights.stored(name): name for name in model_names}
    names = [as_model.get(name, name) for name in weights.names()]
    made = [name for name in sorted(family.head_names) if weights.stored(name) not in weights]
    return names + made


def check_gguf_reads_every_tensor(exported_names: Iterable[str], read_names: Iterable[str],
                                  left_out: Iterable[str], family: Family, architecture: str) -> None:
    """The GGUF writer's plan reads every tensor the HF export holds, but those it leaves out for
    the llama.cpp architecture (`left_out`: e.g. a `deci` layer without heads has no attention)."""
    unread = sorted(set(exported_names) - set(read_names) - set(left_out))
    if unread:
        more = f" and {len(unread) - 1} more" if len(unread) > 1 else ""
        raise UnaccountedTensorError(
            f"export refused: the GGUF ({architecture}) would not hold {unread[0]}{more} of this {family.model_type} "
            f"model, so llama.cpp would run another model; nothing was written. Export with --format hf")
