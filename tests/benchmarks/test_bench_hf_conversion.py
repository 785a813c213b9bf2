"""benchmarks/_common.py converts the shipped GGUF into an HF directory once. Two benchmarks
started side by side on a fresh machine both convert; they shared one ".tmp" directory, so one
deleted the other's half-written files and that benchmark died in safetensors. Each now writes
a directory of its own and takes a sibling's finished conversion when it loses the rename."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from apt_ds.io.modeling import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def common(monkeypatch, tokenizer):
    """benchmarks/_common.py with a tiny model standing in for the dequantized GGUF."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _common
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    import apt_ds.io.modeling
    import apt_ds.io.tokenizer

    monkeypatch.setattr(apt_ds.io.modeling, "load_model", lambda path: build_tiny_model(vocab_size=len(tokenizer), seed=0))
    monkeypatch.setattr(apt_ds.io.tokenizer, "load_tokenizer", lambda path: tokenizer)
    return _common


def test_conversion_is_written_whole_and_leaves_no_partial_directory(tmp_path, common):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"stand-in")
    cache = tmp_path / "cache" / "hf"
    cache.parent.mkdir()
    killed = cache.parent / "hf.4194999.x1.partial"  # above any pid_max: a conversion that was killed
    running = cache.parent / f"hf.{os.getpid()}.x2.partial"  # a live process's: left alone
    for leftover in (killed, running):
        leftover.mkdir()
    assert common.ensure_hf_model(gguf, cache) == cache
    assert (cache / "config.json").is_file() and (cache / "tokenizer_config.json").is_file()
    assert json.loads((cache / "converted_from.json").read_text()) == {"source": str(gguf)}
    assert sorted(p.name for p in cache.parent.iterdir()) == ["hf", running.name]
    assert cache.stat().st_mode & 0o777 == 0o755  # not mkdtemp's private 0700
    assert common.ensure_hf_model(gguf, cache) == cache  # the second call reuses it


def _sibling_converts_first(common, monkeypatch, tokenizer, sibling_model: Path, cache: Path) -> list:
    """While this conversion writes its tokenizer, another process converts `sibling_model` into
    the same cache and renames it into place first. Returns a list that is non-empty once it has."""
    original_save = type(tokenizer).save_pretrained
    sibling_ran = []

    def save_then_sibling_finishes(self, directory, *args, **kwargs):
        result = original_save(self, directory, *args, **kwargs)
        if not sibling_ran:
            sibling_ran.append(True)
            common.ensure_hf_model(sibling_model, cache)
        return result

    monkeypatch.setattr(type(tokenizer), "save_pretrained", save_then_sibling_finishes)
    return sibling_ran


def test_a_sibling_that_finishes_first_wins_and_nothing_is_deleted(tmp_path, common, monkeypatch, tokenizer):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"stand-in")
    cache = tmp_path / "hf"
    sibling_ran = _sibling_converts_first(common, monkeypatch, tokenizer, gguf, cache)
    assert common.ensure_hf_model(gguf, cache) == cache
    assert sibling_ran and (cache / "model.safetensors").is_file() and (cache / "converted_from.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "model.gguf"]


def test_a_sibling_that_converted_another_model_is_not_taken(tmp_path, common, monkeypatch, tokenizer):
    gguf, other = tmp_path / "model.gguf", tmp_path / "other.gguf"
    gguf.write_bytes(b"stand-in")
    other.write_bytes(b"another")
    cache = tmp_path / "hf"
    _sibling_converts_first(common, monkeypatch, tokenizer, other, cache)
    with pytest.raises(SystemExit, match="holds a conversion of .*other.gguf, not .*model.gguf"):
        common.ensure_hf_model(gguf, cache)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "model.gguf", "other.gguf"]
