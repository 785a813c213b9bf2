"""Getting models in and out: local HF dirs, GGUF files, the built-in tiny model, and apt_ds
exports whose layers have their own shapes.

A non-uniform export is still its family's stock causal LM (`LlamaForCausalLM`,
`Qwen2ForCausalLM`, ...): only its Linear modules are sized per layer (recorded in config.json
as `apt_layer_shapes`). These families' attention reads the head count from its weights
(reshape with -1), so nothing else changes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from apt_ds.algorithm.position_bias import route_recorded_head_bias
from apt_ds.algorithm.units import BIAS_HEADS, LayerShape, UnsupportedModelError
from apt_ds.io.errors import ModelLoadError, weights_misfit
from apt_ds.models import FAMILIES, family_for

logger = logging.getLogger(__name__)

TINY_MODEL = "tiny"  # --model value for the built-in demo model
# Built-in random models (no download): --model value -> (family, overrides of TINY_CONFIG). One a
# family, so that every family's whole path (train, prune, export, GGUF) runs on any CPU in seconds.
TINY_MODELS = {
    TINY_MODEL: ("llama", {}),
    "tiny-mha": ("llama", {"num_key_value_heads": 4}),
    **{f"tiny-{name}": (name, family.tiny_config) for name, family in FAMILIES.items() if name != "llama"},
}
TINY_CONFIG = dict(
    hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
)


def tiny_config(variant: str) -> dict:
    """The built-in model's config values (as its config.json would hold them)."""
    model_type, overrides = TINY_MODELS[variant]
    return {**TINY_CONFIG, **overrides, "model_type": model_type}


def build_tiny_model(vocab_size: int, seed: int = 0, variant: str = TINY_MODEL, **overrides):
    """A built-in demo model: a small random model of a family (TINY_MODELS), in its own class."""
    model_type, variant_overrides = TINY_MODELS[variant]
    config_class, model_class = family_for(model_type).classes()
    torch.manual_seed(seed)
    model = model_class(config_class(**{**TINY_CONFIG, **variant_overrides, **overrides, "vocab_size": vocab_size}))
    # transformers initialises biases to 0 and per-head norms to 1, under which an export that
    # dropped them would still match: random values make a dropped tensor show in the logits.
    generator = torch.Generator().manual_seed(seed)
    randomised = [t for t in family_for(model_type).layer_tensors if t.kind == "bias" or t.dims == ("head",)]
    with torch.no_grad():
        for layer in family_for(model_type).decoder_layers(model):
            for tensor in randomised:
                param = layer.get_parameter(tensor.name)
                noise = torch.randn(param.shape, generator=generator)
                if tensor.kind == "bias":
                    param.copy_(0.5 * noise)
                else:  # a norm's weight: around 1
                    param.add_(0.1 * noise)
    return model


def check_model_path(path: str | Path, flag: str = "model path") -> dict:
    """The cheap checks before anything heavy: the path exists and is a .gguf file of a family
    transformers reads, or a model (or apt_ds export) directory. Returns the directory's config.json ({} for a GGUF file)."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{flag} {path} does not exist (give a local HF directory, a .gguf file, a Hub name "
                             f"org/name in the local Hugging Face cache, or one of {', '.join(TINY_MODELS)})")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{flag} {path} is not a .gguf file; give a directory with config.json or a .gguf")
        check_gguf_architecture(path, flag)
        return {}
    if not (path / "config.json").is_file():
        from apt_ds.io.run_record import is_run_dir

        run = path if is_run_dir(path) else path.parent if (path / "apt_state.json").is_file() and is_run_dir(path.parent) \
            else None  # a run, or its checkpoint/
        if run is not None:
            what = "an apt-ds run" if run == path else "an apt-ds run's checkpoint"
            raise ModelLoadError(f"{flag} {path} is {what}, not a model: export it first (launch/export.py {run} --out DIR) "
                                 f"and give DIR")
        gguf = sorted(path.glob("*.gguf"))
        if len(gguf) == 1:  # an apt-ds GGUF export's directory (or a folder holding one GGUF)
            check_gguf_architecture(gguf[0], flag)  # one that cannot be loaded says so, not "give the file"
            raise ModelLoadError(f"{flag} {path} holds a GGUF file and no config.json: give the file, {gguf[0]}")
        raise ModelLoadError(f"{flag} {path} has no config.json: not a Hugging Face model directory")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{flag} {path}: unreadable config.json ({err})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{flag} {path}: config.json is not a JSON object")
    if not config.get("apt_layer_shapes"):
        family_for(config.get("model_type"), where=str(path))
    if not any(path.glob("*.safetensors")):
        pickled = " (only pickled *.bin weights, which are not loaded: convert them to safetensors)" if any(path.glob("*.bin")) else ""
        raise ModelLoadError(f"{flag} {path} holds no *.safetensors weights{pickled}")
    return config


def single_gguf(path: str | Path) -> Path | None:
    """The .gguf file of a directory that holds one and no config.json (an apt-ds GGUF export's
    directory), else None."""
    path = Path(path)
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    return found[0] if len(found) == 1 else None


def model_file(model: str) -> str:
    """What a --model value names: a directory holding one .gguf and no config.json (an apt-ds GGUF
    export's) is that file; anything else (a directory, a file, a built-in tiny model) itself."""
    return model if model in TINY_MODELS else str(single_gguf(model) or model)


def gguf_architecture(path: Path) -> str | None:
    """general.architecture of a GGUF file, read from its header (llama.cpp's writers put it
    first); None when the header does not start with it. Not gguf-py's GGUFReader: it maps and
    indexes every tensor of a many-GB file, and gguf is an optional extra."""
    import struct

    try:
        with open(path, "rb") as handle:
            head = handle.read(4 + 4 + 8 + 8 + 8)
            if len(head) < 32 or head[:4] != b"GGUF":
                return None
            if struct.unpack("<Q", head[24:32])[0] != len(b"general.architecture"):  # also: a damaged length, never read
                return None
            key = handle.read(len(b"general.architecture"))
            value_type = struct.unpack("<I", handle.read(4))[0]
            if key != b"general.architecture" or value_type != 8:  # 8: a string
                return None
            return handle.read(min(struct.unpack("<Q", handle.read(8))[0], 64)).decode("utf-8", "replace")
    except (OSError, struct.error):
        return None


def check_gguf_architecture(path: Path, flag: str = "model path") -> None:
    """transformers reads the GGUF architectures of the families it maps right (LLaMA's, which
    Mistral's files use too, and Qwen2's); apt-ds's non-uniform export is 'deci' (per-layer head
    counts and widths), which only llama.cpp runs."""
    architecture = gguf_architecture(path)
    readable = {f.gguf_uniform: f for f in FAMILIES.values() if f.gguf_uniform and not f.gguf_input_why}
    if architecture is None or architecture in readable:
        return
    family = next((f for f in FAMILIES.values() if f.gguf_uniform == architecture), None)
    if architecture == "deci":
        hint = (" (apt-ds's non-uniform GGUF export, which llama.cpp runs): give the HF export of the same model "
                "(launch/export.py without --format gguf) instead")
    elif family is not None:
        hint = f", which transformers does not load right ({family.gguf_input_why}): give the model's HF directory"
    else:
        hint = f" (GGUF bases read here: {', '.join(sorted(readable))}; other models: give the HF directory)"
    raise UnsupportedModelError(f"{flag} {path} is a GGUF of architecture {architecture!r}{hint}")


def _check_gguf_tensors(path: Path) -> None:
    """A tensor transformers' GGUF reader would drop without a word: Llama-3.x's RoPE factors."""
    try:
        from gguf import GGUFReader

        names = {tensor.name for tensor in GGUFReader(str(path)).tensors}
    except Exception:  # unreadable here: transformers' own load says what is wrong with it
        return
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError(f"{path} holds llama3 RoPE factors (rope_freqs.weight), which transformers' GGUF reader "
                                    f"drops (the model would compute with plain RoPE): give the model's HF directory")


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, mmap: bool = True, num_labels: int | None = None,
               seed: int = 0):
    """A causal LM from a local HF directory, a .gguf file, or an apt_ds export; an encoder's
    sequence classifier with `num_labels` classes (its head new where the checkpoint has none,
    from `seed`), always read tensor by tensor so that every method starts from the same head.

    mmap=False reads a HF directory's weights into process memory, one tensor at a time
    (apt_ds.io.by_tensor), instead of mapping the file. Pruning needs that: the mapped pages stay
    resident after the weights were sliced into smaller copies, so memory would not drop as
    units are removed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    config = check_model_path(path)
    if path.is_file():
        _check_gguf_tensors(path)
        try:
            return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        except Exception as err:  # transformers raises many types for bad GGUF
            raise ModelLoadError(f"cannot load GGUF {path}: {str(err).splitlines()[0]}") from None
    if config.get("apt_layer_shapes"):
        return load_pretrained(path, dtype=dtype)
    try:
        AutoConfig.from_pretrained(str(path))
        if not mmap or family_for(config.get("model_type")).kind != "decoder":  # an encoder's or T5's: its own class
            from apt_ds.io.by_tensor import load_by_tensor

            return load_by_tensor(path, dtype, num_labels=num_labels, seed=seed)
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except Exception as err:
        raise ModelLoadError(f"cannot load model from {path}: {str(err).splitlines()[0]}") from None


def resize_layers(model, layer_shapes: list[LayerShape]) -> None:
    """Give every layer its own (empty) Linear sizes and head geometry before weights are loaded:
    each projection of the family's description, with a bias where the description lists one."""
    family = family_for(model.config.model_type)
    hidden = model.config.hidden_size
    for unit, shape in zip(family.unit_layers(model), layer_shapes):
        kind, layer, sizes = unit.kind, unit.module, shape.axis_sizes(hidden)
        for tensor in kind.linears:  # norms and biases come with their module
            owner_path, name = tensor.module.rsplit(".", 1)
            owner = layer.get_submodule(owner_path)
            old = getattr(owner, name)
            n_out, n_in = (sizes[axis] for axis in tensor.dims)
            setattr(owner, name, nn.Linear(n_in, n_out, bias=kind.has_tensor(f"{tensor.module}.bias"),
                                           dtype=old.weight.dtype, device=old.weight.device))
        kind.set_head_geometry(layer, shape.head_dim, shape.group_size, shape.num_q_heads)
        if kind.has_ffn:
            kind.ffn_block(layer).intermediate_size = shape.ffn
    bias_heads = getattr(model.config, BIAS_HEADS, None)  # a pruned T5's bias tables keep every original head
    for tensor in (t for t in family.outer_tensors if bias_heads and "heads" in t.dims):
        owner, name = tensor.module.rsplit(".", 1)
        old = model.get_submodule(tensor.module)
        setattr(model.get_submodule(owner), name, nn.Embedding(old.num_embeddings, bias_heads, dtype=old.weight.dtype,
                                                              device=old.weight.device))


def load_pretrained(directory: str | Path, dtype: torch.dtype | str | None = None):
    """Load an apt_ds export (uniform or not) as its family's own model (LlamaForCausalLM,
    Qwen2ForCausalLM, ..., BertForSequenceClassification) with per-layer shapes; `dtype`: a torch.dtype or its name (fp32,
    bf16, fp16, float32, ...)."""
    from safetensors.torch import load_file

    directory, dtype = Path(directory), _torch_dtype(dtype)
    raw = dict(check_model_path(directory, flag="load_pretrained:"))  # a run, a file, no weights: said in one line
    try:
        shapes = [LayerShape(**s) for s in raw.pop("apt_layer_shapes", None) or []]
    except TypeError as err:
        raise ModelLoadError(f"{directory}: config.json's apt_layer_shapes is malformed ({err})") from None
    if directory.is_file():
        raise ModelLoadError(f"load_pretrained: {directory} is a GGUF file; read it with apt_ds.io.modeling.load_model")
    family = family_for(raw.get("model_type"), where=str(directory))
    config_class, model_class = family.classes()
    try:
        config = config_class(**{k: v for k, v in raw.items() if k not in ("architectures", "transformers_version")})
    except Exception as err:  # transformers validates head counts etc. with several exception types
        raise ModelLoadError(f"{directory}: config.json is not a valid {family.model_type} config "
                             f"({str(err).splitlines()[0]})") from None
    with torch.device("meta"):
        model = model_class(config)
    if shapes:
        if len(shapes) != len(family.unit_kinds(config)):
            raise ModelLoadError(f"{directory}: apt_layer_shapes has {len(shapes)} layers, config says "
                                 f"{len(family.unit_kinds(config))}")
        resize_layers(model, shapes)
        model.config.apt_layer_shapes = [s.to_dict() for s in shapes]
    from safetensors import SafetensorError

    state = {}
    for shard in sorted(directory.glob("*.safetensors")):
        try:
            state.update(load_file(str(shard)))
        except (SafetensorError, OSError) as err:  # a truncated or foreign file
            raise ModelLoadError(f"cannot read {shard}: {str(err).splitlines()[0]}") from None
    if not state:
        raise ModelLoadError(f"{directory}: no *.safetensors weights found")
    tied = family.ties(config)
    if tied:
        state.pop(family.output_embedding, None)
    family.tie_embedding(model)  # a class that ties what the config does not (T5 v1.1): its own head first
    try:  # tied views (the LM head, T5's stacks' embed_tokens) are not in the files
        model.load_state_dict(state, strict=not tied and not family.embedding_aliases, assign=True)
    except RuntimeError as err:  # a tensor of the wrong shape or name: the weights are not this config's
        heads = [t.name for t in family.outer_tensors if t.part == "head"]
        raise ModelLoadError(f"{directory}: {weights_misfit(err, model.state_dict(), state, heads)}") from None
    family.tie_embedding(model)
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ModelLoadError(f"{directory}: weights missing for {missing[:3]}")
    # Buffers (rotary inv_freq, an encoder's position ids) were created on meta: rebuild them on CPU.
    from apt_ds.io.by_tensor import rebuild_position_ids

    family.rebuild_rotary(model)
    rebuild_position_ids(model, torch.device("cpu"))
    route_recorded_head_bias(model)  # a pruned T5's heads read their own bias columns
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def _torch_dtype(dtype):
    names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = names.get(dtype.lower()) if isinstance(dtype, str) else None
    if found is None:
        raise ModelLoadError(f"dtype {dtype!r} is not a floating-point torch.dtype nor one of {', '.join(names)}")
    return found

