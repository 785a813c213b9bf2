"""Tiny random LLaMA models and a small trained tokenizer for tests (no hub access needed)."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

TINY_CONFIGS = {
    "mha": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "gqa_tied": dict(
        hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}


def tiny_llama(kind: str = "gqa", seed: int = 0, vocab: int = 97, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    values = dict(vocab_size=vocab, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
    values.update(TINY_CONFIGS[kind])
    values.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**values))
    # Random init has near-zero norms' effect; perturb norm weights so hidden pruning is visible.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


# Per family, what its tiny model adds to TINY_CONFIGS["gqa"]: Qwen3's head_dim spelled out (its
# default is 128), Mistral's window shorter than the test sequences so that it matters.
FAMILY_OVERRIDES = {"llama": {}, "mistral": {"sliding_window": 8}, "qwen2": {}, "qwen3": {"head_dim": 16}}


def tiny_family(model_type: str, seed: int = 0, vocab: int = 97, tied: bool = False, **overrides):
    """A tiny random model of a family (GQA), its biases and every norm weight (per-head ones too)
    set to non-trivial random values: zero biases or unit norms would hide a dropped tensor."""
    from apt_ds.models import family_for

    config_class, model_class = family_for(model_type).classes()
    torch.manual_seed(seed)
    values = dict(vocab_size=vocab, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=tied)
    values.update(TINY_CONFIGS["gqa"])
    values.update(FAMILY_OVERRIDES[model_type])
    values.update(overrides)  # the caller's word last (a Mistral without a window)
    return randomise_biases_and_norms(model_class(config_class(**values)))


def randomise_biases_and_norms(model):
    """Every bias around 0 and every norm parameter (RMSNorm, LayerNorm) perturbed, in place:
    transformers' zeros and ones would hide a dropped tensor; returns the model in eval mode."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
            elif "norm" in name.lower():
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def masked_then_shrunk(model, shape, batch: dict, kept, min_effect: float):
    """Logits of `model` (with UnitMasks installed) under the binary masks of `kept`, which must
    move them by more than `min_effect`, and after shrink_model to `kept`, which must equal
    them to 1e-5; returns the new shape and the shrink's trainable edits."""
    from apt_ds.algorithm.masks import UnitMasks
    from apt_ds.algorithm.shrink import shrink_model

    masks = UnitMasks(shape)
    masks.install(model)
    with torch.no_grad():
        unmasked = model(**batch).logits
        set_binary_masks(masks, shape, *kept)
        masked = model(**batch).logits
    assert (masked - unmasked).abs().max() > min_effect
    new_shape, change = shrink_model(model, shape, *kept)
    masks.reset(new_shape)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, masked, rtol=0, atol=1e-5)
    return new_shape, change


@pytest.fixture(params=list(TINY_CONFIGS))
def any_tiny(request):
    return request.param


def random_batch(vocab: int = 97, batch: int = 4, length: int = 12, seed: int = 1) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny model's kind of tokenizer (test_data.py and test_tokenizer.py), trained on the demo set."""
    from apt_ds.io.data import demo_data_path, format_prompt
    from apt_ds.io.tokenizer import train_sentencepiece_tokenizer

    rows = [json.loads(line) for line in demo_data_path().read_text().splitlines()]
    texts = [format_prompt(r["instruction"], r["input"]) + r["output"] for r in rows]
    texts += ["the quick brown fox jumps over the lazy dog", "Question: is it? Answer: yes"]
    return train_sentencepiece_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=512)


def random_kept(shape, seed: int, prune_hidden: bool = True):
    """Kept (sorted) indices: every layer loses something, and at least one group/neuron survives."""
    gen = torch.Generator().manual_seed(seed)
    groups, neurons = [], []
    for l, layer in enumerate(shape.layers):
        n_groups = max(1, layer.num_kv_groups - 1 - (l % 2))
        groups.append(torch.randperm(layer.num_kv_groups, generator=gen)[:n_groups].sort().values)
        n_neurons = layer.ffn // 2 + 5 * l
        neurons.append(torch.randperm(layer.ffn, generator=gen)[:n_neurons].sort().values)
    n_hidden = shape.hidden - 7 if prune_hidden else shape.hidden  # 7: not a multiple of any head count
    hidden = torch.randperm(shape.hidden, generator=gen)[:n_hidden].sort().values
    return groups, neurons, hidden


def set_binary_masks(masks, shape, groups, neurons, hidden) -> None:
    for l, layer in enumerate(shape.layers):
        masks.kv_group[l] = torch.zeros(layer.num_kv_groups).index_fill_(0, groups[l], 1.0)
        masks.ffn_neuron[l] = torch.zeros(layer.ffn).index_fill_(0, neurons[l], 1.0)
    masks.hidden = torch.zeros(shape.hidden).index_fill_(0, hidden, 1.0)
    masks.refresh()


# launch/train.py's flags for a run of a few seconds on the built-in tiny model
TRAIN_FAST = ["--steps", "8", "--max-seq-len", "32", "--micro-batch-size", "2", "--warmup-steps", "1"]


def interrupted_at(step: int):
    """APTrainer._train_step, but Ctrl-C as the trainer reaches `step`: a run stopped there, which
    --resume continues from its last checkpoint (monkeypatch it in; setattr the real one back)."""
    from apt_ds.training.trainer import APTrainer

    real_step = getattr(APTrainer._train_step, "real_step", APTrainer._train_step)  # not another of these

    def train_step(self, batches):
        if self.step == step:
            raise KeyboardInterrupt
        return real_step(self, batches)
    train_step.real_step = real_step
    return train_step


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory):
    """Two finished APT runs to 0.6 of the tiny model, non-uniform and uniform, trained once for the
    train, resume and export CLI tests. Shared: a test that changes a run works on a copy."""
    from apt_ds.cli.train import main as train_main

    root = tmp_path_factory.mktemp("runs")
    assert train_main([*TRAIN_FAST, "--target-density", "0.6", "--out", str(root / "nonuniform")]) == 0
    assert train_main([*TRAIN_FAST, "--target-density", "0.6", "--uniform", "--out", str(root / "uniform")]) == 0
    return root


# a text data set of the CLI's plain format, and flags for runs on it that checkpoint at step 4
CLI_TEXT_ROWS = [{"text": f"row {i}: the quick brown fox jumps over the lazy dog number {i}."} for i in range(120)]
RUN_FLAGS = ["--steps", "8", "--max-seq-len", "32", "--micro-batch-size", "2", "--checkpoint-every", "4", "--data", "data.jsonl"]


@contextlib.contextmanager
def interrupted_after_step(step: int):
    """Ctrl-C in the training loop once `step` steps are done: a run for --resume to continue."""
    from apt_ds.training.trainer import APTrainer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(APTrainer, "_train_step", interrupted_at(step))
        yield


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Work in tmp_path, with CLI_TEXT_ROWS there as data.jsonl (RUN_FLAGS's --data)."""
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in CLI_TEXT_ROWS))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: threads only add synchronisation cost (and noise on a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def greedy(model, ids: torch.Tensor, new_tokens: int = 20) -> torch.Tensor:
    """The probe's loop: argmax of a full forward, no cache, no EOS stop."""
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def check_against_probe(run_dir: Path, export_dir: Path, atol: float = 1e-4) -> None:
    """Exported logits = the live run's logits (`atol` where attended; a bf16 run's merge rounds to
    bf16) and 20 greedy tokens."""
    from safetensors.torch import load_file

    from apt_ds.io.modeling import load_pretrained

    probe = load_file(str(run_dir / "eval_probe.safetensors"))
    model = load_pretrained(export_dir)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    attended = probe["attention_mask"].bool()
    assert attended.sum() > 0
    torch.testing.assert_close(logits[attended], probe["logits"][attended], atol=atol, rtol=0)
    prompt_len = int(probe["attention_mask"][0].sum())
    assert probe["greedy"].shape[1] == prompt_len + 20
    assert torch.equal(greedy(model, probe["greedy"][:, :prompt_len]), probe["greedy"])
    with torch.no_grad():  # the full next-token distributions along the trajectory, not only their argmax
        along = model(input_ids=probe["greedy"]).logits[0, prompt_len - 1 : -1]
    torch.testing.assert_close(along, probe["greedy_logits"], atol=atol, rtol=0)
    # HF generate (KV cache) agrees for as long as it runs (it may stop early at EOS)
    generated = model.generate(probe["greedy"][:, :prompt_len], max_new_tokens=20, do_sample=False)
    assert torch.equal(generated, probe["greedy"][:, : generated.shape[1]])


@pytest.fixture(scope="session", autouse=True)
def _remove_leaked_deepspeed_shared_memory():
    """DeepSpeed's CPU all-reduce keeps a 69 MB /dev/shm buffer per launched rank and never
    unlinks it (killed ranks cannot): the test launches would leave ~1.5 GB per suite run in
    RAM-backed /dev/shm. Remove the buffers this session created."""
    shm = Path("/dev/shm")
    pattern = "deepspeed_allreduce_buffer_*"
    before = set(shm.glob(pattern)) if shm.is_dir() else set()
    yield
    if shm.is_dir():
        for leaked in set(shm.glob(pattern)) - before:
            leaked.unlink(missing_ok=True)


def tree_digest(root: Path) -> str:
    """Names, sizes and contents of everything under `root` (what must not change)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def assert_resumed_as_uninterrupted(resumed, reference, crash_step: int, steps: int) -> dict:
    """Two APTrainers, one resumed from a checkpoint at `crash_step`: the same shapes, kept units,
    ranks and masks, the same losses and learning rate at every step after it, the same trained
    parameters. Returns the resumed run's records by step."""
    assert resumed.state.shape == reference.state.shape
    assert resumed.state.kept_record() == reference.state.kept_record()
    assert resumed.state.ranks() == reference.state.ranks()
    for a, b in zip(resumed.state.masks.state_dict().values(), reference.state.masks.state_dict().values()):
        assert torch.equal(a, b)
    expected = {r["step"]: r for r in reference.history if "loss" in r}
    got = {r["step"]: r for r in resumed.history if "loss" in r}
    assert sorted(got) == list(range(crash_step + 1, steps + 1))
    for step, record in got.items():
        for key in ("loss", "task_loss", "distill_loss"):
            assert record[key] == pytest.approx(expected[step][key], abs=1e-5, rel=1e-5), (step, key)
        assert record["lr"] == pytest.approx(expected[step]["lr"], rel=1e-12)
    trained = dict(reference.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param, trained[name], rtol=1e-4, atol=1e-5)
    return got


class Crash(Exception):
    """The simulated crash of `micro_batches`."""


def micro_batches(crash_at: int | None = None):
    """Micro-batch i depends only on i; the stream 'crashes' (Crash) before micro-batch `crash_at`."""
    served = 0
    while crash_at is None or served < crash_at:
        yield random_batch(batch=4, length=16, seed=1000 + served)
        served += 1
    raise Crash(f"simulated crash before micro-batch {served}")
