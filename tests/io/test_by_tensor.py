"""A pruning run's base read one tensor at a time (apt_ds.io.by_tensor): the same model as
transformers' from_pretrained, every tensor in a storage of its own (so a tensor replaced by its
sliced copy leaves memory), and a checkpoint that does not fit the config refused in one line."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import tiny_family
from safetensors.torch import load_file, save_file

from apt_ds.io.by_tensor import load_by_tensor
from apt_ds.io.modeling import ModelLoadError, load_model
from apt_ds.models import FAMILIES

FAMILY_TIES = [(name, tied) for name in FAMILIES for tied in (False, True)]


@pytest.mark.parametrize("model_type, tied", FAMILY_TIES)
def test_a_base_read_tensor_by_tensor_is_the_model_from_pretrained_gives(tmp_path, model_type, tied):
    from transformers import AutoModelForCausalLM

    tiny_family(model_type, tied=tied).to(torch.bfloat16).save_pretrained(tmp_path)  # bf16 on disk, fp32 here
    ours = load_model(tmp_path, dtype=torch.float32, mmap=False)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert type(ours) is type(theirs) and not ours.training
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for name, tensor in theirs.state_dict().items():
        assert ours.state_dict()[name].dtype == tensor.dtype and torch.equal(ours.state_dict()[name], tensor), name
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    assert ours.config.to_diff_dict() == theirs.config.to_diff_dict()
    assert ours.generation_config.to_diff_dict() == theirs.generation_config.to_diff_dict()
    ids = torch.randint(0, ours.config.vocab_size, (2, 9))
    assert torch.equal(ours(ids).logits, theirs(ids).logits)


def test_every_tensor_has_a_storage_of_its_own(tmp_path):
    """What lets memory drop as units are pruned: no parameter is a view into a buffer shared
    with others (a whole file read at once, or one mapping of it)."""
    tiny_family("llama").save_pretrained(tmp_path)
    model = load_by_tensor(tmp_path)
    for name, param in model.named_parameters():
        assert param.untyped_storage().nbytes() == param.numel() * param.element_size(), name


def _rewrite(directory, change) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "has no weights for ['model.layers.1.mlp.up_proj.weight']"),
    (lambda t: t.update({"model.norm.weight": torch.ones(3)}), "weight model.norm.weight has shape [3]"),
])
def test_a_checkpoint_that_does_not_fit_its_config_is_refused(tmp_path, change, message):
    tiny_family("llama").save_pretrained(tmp_path)
    _rewrite(tmp_path, change)
    with pytest.raises(ModelLoadError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_model(tmp_path, mmap=False)


def test_a_tensor_the_model_has_no_place_for_is_named(tmp_path, caplog):
    tiny_family("llama").save_pretrained(tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with caplog.at_level(logging.WARNING, logger="apt_ds.io.by_tensor"):
        load_model(tmp_path, mmap=False)
    assert "1 tensors the model has no place for are not loaded: ['model.extra.weight']" in caplog.text


def test_an_encoder_base_without_its_head_gets_a_seeded_one(tmp_path):
    """A BertModel checkpoint (no `bert.` prefix, no classifier) under a sequence classifier: the
    encoder's tensors are its own, the classifier is made from the seed alone."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                        max_position_embeddings=24)
    BertModel(config).save_pretrained(tmp_path)
    one, again, other = (load_model(tmp_path, num_labels=3, seed=seed) for seed in (1, 1, 2))
    assert isinstance(one, BertForSequenceClassification) and one.classifier.out_features == 3
    reference = BertModel.from_pretrained(str(tmp_path))
    for name, tensor in reference.state_dict().items():
        assert torch.equal(one.bert.state_dict()[name], tensor), name
    assert torch.equal(one.classifier.weight, again.classifier.weight)
    assert not torch.equal(one.classifier.weight, other.classifier.weight)
    assert one.classifier.weight.std() > 0 and one.bert.embeddings.position_ids.tolist()[0] == list(range(24))


def test_old_layernorm_names_and_a_missing_pooler_load(tmp_path, caplog):
    """bert-base-uncased's files name LayerNorms' parameters gamma and beta; a masked-LM
    checkpoint has no pooler: both load, the pooler made from the seed with a warning."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48)
    BertModel(config, add_pooling_layer=False).save_pretrained(tmp_path)
    _rewrite(tmp_path, lambda t: t.update({k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
        "LayerNorm.bias", "LayerNorm.beta"): t.pop(k) for k in [k for k in t if "LayerNorm" in k]}))
    assert any(k.endswith("LayerNorm.gamma") for k in load_file(str(tmp_path / "model.safetensors")))
    with caplog.at_level(logging.WARNING, logger="apt_ds.io.by_tensor"):
        model = load_model(tmp_path, num_labels=2, seed=0)
    reference = BertModel.from_pretrained(str(tmp_path), add_pooling_layer=False)
    assert torch.equal(model.bert.embeddings.LayerNorm.weight, reference.embeddings.LayerNorm.weight)
    assert "the checkpoint has no bert.pooler.dense: it is made from the seed and stays frozen" in caplog.text
