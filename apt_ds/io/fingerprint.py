"""Which base model a run was trained from: a fingerprint of its config and weights, computed
from a model in memory or from its safetensors files one chunk at a time, and compared across
apt-ds versions (`same_model`)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch


def model_fingerprint(model) -> dict:
    """Identifies the base model of a run: its config, and a checksum over every weight tensor
    (|w| summed over a strided sample of ~4k entries per tensor, so any retrained layer changes
    it) and the embedding's |w| sum. Memory stays at one 16 MB chunk, but every byte is read once
    (the embedding sum needs them all; from files a 70B model is 140 GB of reads, which the ranks
    of a job share: `file_fingerprint_part`)."""
    with torch.no_grad():
        readers = ((name, _tensor_reader(param.detach())) for name, param in sorted(model.named_parameters()))
        return _fingerprint(model.config, readers, _tensor_reader(model.get_input_embeddings().weight.detach()))


def file_fingerprint(directory: str | Path) -> dict:
    """`model_fingerprint(load_model(directory))`, read from the safetensors files one tensor at
    a time (a partitioned ZeRO-3 model has no full tensors to read, and the fingerprint must
    not depend on the dtype the weights are trained in)."""
    return combine_fingerprint_parts([file_fingerprint_part(directory, 0, 1)])


def file_fingerprint_part(directory: str | Path, part: int, parts: int) -> dict:
    """Part `part` of `parts` of `file_fingerprint`: each part reads its own tensors and embedding
    chunks (about 1/parts of the bytes, assigned from the headers alone, so every rank of a job
    agrees on who reads what without a word), and `combine_fingerprint_parts` of all of them is
    `file_fingerprint`, to the last bit (each tensor's sample is summed by one part; the embedding's
    chunk sums are added in chunk order). Part 0 also checks the LM head."""
    from transformers import AutoConfig

    from apt_ds.io.weights import SafetensorsWeights
    from apt_ds.models import family_for

    config = AutoConfig.from_pretrained(str(directory))
    weights = SafetensorsWeights(directory)
    family = family_for(config.model_type)
    if part == 0 and family.output_embedding is not None:  # an encoder has no LM head
        check_output_head(directory, config, weights, family)
    names = [n for n in weights.names() if not (family.ties(config) and n == family.output_embedding)]
    embedding_name = weights.stored(family.embedding)  # a BertModel checkpoint: without `bert.`

    def reader(name):
        return math.prod(weights.shape(name)), lambda start, length: weights.flat_range(name, start, length)

    embedding_numel = reader(embedding_name)[0]
    work = [("tensor", name, reader(name)[0]) for name in names]
    work += [("chunk", start, min(FINGERPRINT_CHUNK, embedding_numel - start))
             for start in range(0, embedding_numel, FINGERPRINT_CHUNK)]
    mine = [item for item, owner in zip(work, _balanced_owners([size for _, _, size in work], parts)) if owner == part]
    embedding = reader(embedding_name)[1]
    return {"config_sha": _config_sha(config),
            "sums": {name: _sample_sum(reader(name)) for kind, name, _ in mine if kind == "tensor"},
            "embedding_chunks": {start: float(embedding(start, FINGERPRINT_CHUNK).double().abs().sum())
                                 for kind, start, _ in mine if kind == "chunk"}}


def combine_fingerprint_parts(parts: list[dict]) -> dict:
    """The fingerprint from every part of `file_fingerprint_part` (in any order)."""
    sums = {name: value for part in parts for name, value in part["sums"].items()}
    chunks = {start: value for part in parts for start, value in part["embedding_chunks"].items()}
    return _fingerprint_of(parts[0]["config_sha"], sums, [chunks[start] for start in sorted(chunks)])


def _balanced_owners(sizes: list[int], parts: int) -> list[int]:
    """The part that reads each item: the largest first, each to the part with the fewest elements
    so far (ties to the lowest part), so no part reads much more than 1/parts of the model."""
    loads, owners = [0] * parts, [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owners[index] = min(range(parts), key=lambda p: (loads[p], p))
        loads[owners[index]] += sizes[index]
    return owners


def check_base_head(directory: str | Path) -> None:
    """`check_output_head` of a safetensors directory on its own (an export with --kept)."""
    from transformers import AutoConfig

    from apt_ds.io.weights import SafetensorsWeights
    from apt_ds.models import family_for

    config = AutoConfig.from_pretrained(str(directory))
    check_output_head(directory, config, SafetensorsWeights(directory), family_for(config.model_type))


def check_output_head(directory, config, weights, family) -> None:
    """The LM head the config says and the files hold agree. transformers loads a tied config whose
    files hold another head as an untied model (a warning), and an untied config without a head
    with a random one; training, the ZeRO-3 build and the exports would each read the model
    otherwise, so a run or export from such a base is refused here, before any weight is read."""
    from apt_ds.io.modeling import ModelLoadError

    head, embedding = family.output_embedding, family.embedding
    tied = family.ties(config)  # T5's config keeps config.json's word as scale_decoder_outputs
    if not tied and head not in weights:
        raise ModelLoadError(f"{directory}: config.json does not tie the LM head to the embedding (tie_word_embeddings "
                             f"false) but its weights hold no {head}: set tie_word_embeddings true, or add the head")
    if tied and head in weights:
        numel = math.prod(weights.shape(embedding))
        same = weights.shape(head) == weights.shape(embedding) and all(
            torch.equal(weights.flat_range(head, start, FINGERPRINT_CHUNK).to(chunk.dtype), chunk)
            for start, chunk in _chunks((numel, lambda start, length: weights.flat_range(embedding, start, length))))
        if not same:
            raise ModelLoadError(f"{directory}: config.json ties the LM head to the embedding (tie_word_embeddings true) "
                                 f"but its weights hold a different {head}: set tie_word_embeddings false to use that "
                                 f"head, or remove it from the files")


# Elements read at a time (16 MiB of fp32): the fingerprint never holds a whole tensor, let alone
# float64 copies of one (the 3B model's 128k x 3072 embedding would take 2 x 3 GB that way).
FINGERPRINT_CHUNK = 1 << 22


def _tensor_reader(tensor: torch.Tensor):
    flat = tensor.reshape(-1)
    return flat.numel(), lambda start, length: flat[start : start + length]


def _chunks(reader):
    numel, read = reader
    for start in range(0, numel, FINGERPRINT_CHUNK):
        yield start, read(start, FINGERPRINT_CHUNK)


def _fingerprint(config, named_readers, embedding_reader) -> dict:
    """Config digest, |w| summed over a strided sample of ~4k entries of every tensor, and the
    embedding's |w| sum; every tensor read in chunks."""
    sums = {name: _sample_sum(reader) for name, reader in named_readers}
    chunk_sums = [float(chunk.double().abs().sum()) for _, chunk in _chunks(embedding_reader)]
    return _fingerprint_of(_config_sha(config), sums, chunk_sums)


def _config_sha(config) -> str:
    values = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version", "dtype", "torch_dtype")}
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _sample_sum(reader) -> str:
    """|w| summed over the same entries, in the same order, as flat[::step] of the whole tensor."""
    step = max(1, reader[0] // 4096)
    sample = torch.cat([chunk[(-start) % step :: step] for start, chunk in _chunks(reader)])
    return f"{float(sample.double().abs().sum()):.6e}"


def _fingerprint_of(config_sha: str, sums: dict[str, str], embedding_chunk_sums: list[float]) -> dict:
    """`sums`: each tensor's sample sum by name; the embedding's chunk sums in chunk order, added
    in that order (a float64 sum's last digits depend on it)."""
    weights = hashlib.sha256("|".join(f"{name}:{sums[name]}" for name in sorted(sums)).encode()).hexdigest()[:16]
    return {"config_sha": config_sha, "embedding_sum": round(sum(embedding_chunk_sums), 3), "weights_sha": weights}


def same_model(recorded: dict, fingerprint: dict) -> bool:
    """Compare on the fields the recorded fingerprint has (runs from before `weights_sha`). The
    embedding sum to 1e-9 relative: a float64 sum's last digits depend on summation order."""
    for key, value in recorded.items():
        current = fingerprint.get(key)
        if key == "embedding_sum" and isinstance(value, (int, float)) and isinstance(current, (int, float)):
            if abs(current - value) > 1e-9 * max(1.0, abs(value)) + 1e-3:
                return False
        elif current != value:
            return False
    return True
