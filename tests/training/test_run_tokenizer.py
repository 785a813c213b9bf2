"""apt_ds.training.run: the tokenizer is checked against --template before any model is read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from apt_ds.config import TrainConfig
from apt_ds.io.data import DataError
from apt_ds.training import run


def test_chat_template_without_one_is_refused_with_the_model_named(tmp_path):
    args = SimpleNamespace(model="tiny", resume=False)
    texts = ["alpha beta gamma delta"] * 20
    tokenizer = run._tokenizer(args, tmp_path / "out", texts, TrainConfig(template="none"), tmp_path / "a")
    assert tokenizer.chat_template is None
    with pytest.raises(DataError, match=r"^--template chat: the tokenizer of --model tiny has no chat template"):
        run._tokenizer(args, tmp_path / "out", texts, TrainConfig(template="chat"), tmp_path / "b")
    assert not (tmp_path / "out").exists()
