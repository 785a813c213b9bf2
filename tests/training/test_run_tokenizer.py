"""apt_ds.training.run: the tokenizer is checked against --template before any model is read."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from apt_ds.config import TrainConfig
from apt_ds.io.data import DataError
from apt_ds.training import run_tokenizer as run


def test_the_built_in_models_tokenizer_renders_chats(tmp_path):
    """The tiny model's trained tokenizer gets a chat template, so conversations and --template chat run on it."""
    args = SimpleNamespace(model="tiny", resume=False)
    tokenizer = run.prepare_tokenizer(args, tmp_path / "out", ["alpha beta gamma delta"] * 20, TrainConfig(template="chat"),
                               tmp_path / "a")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                         tokenize=False)
    assert text == "<s><|user|>\nhi</s>\n<|assistant|>\nyo</s>\n"
    assert not (tmp_path / "out").exists()


def test_chat_template_without_one_is_refused_with_the_model_named(tmp_path, tokenizer):
    model = tmp_path / "model"
    tokenizer.save_pretrained(str(model))  # a local model's tokenizer without a chat template
    args = SimpleNamespace(model=str(model), resume=False)
    assert run.prepare_tokenizer(args, tmp_path / "out", [], TrainConfig(template="none"), tmp_path / "a").chat_template is None
    with pytest.raises(DataError, match=rf"^--template chat: the tokenizer of --model {re.escape(str(model))} has no chat "
                                        "template"):
        run.prepare_tokenizer(args, tmp_path / "out", [], TrainConfig(template="chat"), tmp_path / "b")
    assert not (tmp_path / "out").exists()
