"""benchmarks/gpu_wheels.py: what a GPU machine without network needs carried, worked out from the
packages installed here and the image's list (no download in these tests)."""

from __future__ import annotations

import pytest

from benchmarks import gpu_wheels

IMAGE = "absl-py, accelerate, numpy, torch, transformers, tokenizers, huggingface-hub, safetensors,\nPyYAML, tqdm"


def test_the_image_list_parses_in_every_form_it_comes_in(tmp_path):
    listed = tmp_path / "image.txt"
    listed.write_text(IMAGE)
    assert {"absl-py", "pyyaml", "huggingface-hub", "tqdm"} <= gpu_wheels.read_have(listed)
    frozen = tmp_path / "freeze.txt"
    frozen.write_text("Torch==2.11.0\n# a comment\nhuggingface_hub==1.33.0\n\n")
    assert gpu_wheels.read_have(frozen) == {"torch", "huggingface-hub"}


def test_what_the_image_lacks_is_carried_and_what_it_has_is_not(tmp_path):
    listed = tmp_path / "image.txt"
    listed.write_text(IMAGE)
    carried = gpu_wheels.to_carry("apt-ds", gpu_wheels.read_have(listed), ("transformers",))
    assert "deepspeed" in carried and "datasets" in carried  # apt-ds's own needs the image lacks
    assert "transformers" in carried  # held by the image, at a version under apt-ds's pin: named to carry
    assert not {"torch", "numpy", "tokenizers", "apt-ds"} & set(carried)
    assert all(carried[name] for name in carried)  # each at the version installed here
    assert "transformers" not in gpu_wheels.to_carry("apt-ds", gpu_wheels.read_have(listed), ())


def test_an_out_directory_with_other_files_is_refused_and_kept(tmp_path, capsys):
    listed = tmp_path / "image.txt"
    listed.write_text(IMAGE)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(SystemExit) as stop:
        gpu_wheels.main(["--have", str(listed), "--out", str(tmp_path / "mine")])
    assert stop.value.code == 2 and "holds other things than wheels" in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_an_out_link_is_refused_and_its_target_kept(tmp_path, capsys):
    listed = tmp_path / "image.txt"
    listed.write_text(IMAGE)
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "a.whl").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(SystemExit) as stop:
        gpu_wheels.main(["--have", str(listed), "--out", str(tmp_path / "link")])
    assert stop.value.code == 2 and "is a link" in capsys.readouterr().err
    assert (tmp_path / "target" / "a.whl").read_text() == "mine"


def test_an_unreadable_list_and_the_current_directory_are_one_line_each(tmp_path, monkeypatch, capsys):
    listed = tmp_path / "image.txt"
    listed.write_bytes(b"\xff\xfe not text")
    with pytest.raises(SystemExit) as stop:
        gpu_wheels.main(["--have", str(listed), "--out", str(tmp_path / "wheels"), "--dry-run"])
    assert str(stop.value.code).startswith("error: ") and "\n" not in str(stop.value.code)
    listed.write_text(IMAGE)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    with pytest.raises(SystemExit) as stop:
        gpu_wheels.main(["--have", str(listed), "--out", "."])
    assert stop.value.code == 2 and "is the current directory or holds it" in capsys.readouterr().err
    assert empty.is_dir()
