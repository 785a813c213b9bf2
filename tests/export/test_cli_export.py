"""End-to-end: launch/export.py on runs of launch/train.py's built-in tiny model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TRAIN_FAST as FAST
from safetensors.torch import load_file

from apt_ds.cli.export import main as export_main
from apt_ds.cli.train import main as train_main
from apt_ds.export.merge import export_run, rebuild_trained_model
from apt_ds.io.metrics import read_metrics
from apt_ds.io.modeling import load_pretrained


def test_export_matches_training_time_model(trained_runs, tmp_path):
    model, state, _ = rebuild_trained_model(trained_runs / "nonuniform")
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        masked = model(input_ids=ids).logits
    generated = model.generate(ids[:1], max_new_tokens=20, do_sample=False)
    report = export_run(trained_runs / "nonuniform", tmp_path / "out")
    loaded = load_pretrained(tmp_path / "out")
    with torch.no_grad():
        exported = loaded(input_ids=ids).logits
    assert torch.allclose(exported, masked, atol=1e-4)
    assert torch.equal(loaded.generate(ids[:1], max_new_tokens=20, do_sample=False), generated)
    assert generated.shape[1] == ids.shape[1] + 20 or generated[0, -1] == model.generation_config.eos_token_id
    assert report["exported_params"] == report["final"]["total_params"] == sum(p.numel() for p in loaded.parameters())
    assert report["exported_params"] == read_metrics(trained_runs / "nonuniform" / "metrics.jsonl")[-1]["total_params"]
    assert report["final"]["block_params"] < report["original"]["block_params"]


def test_uniform_export_loads_with_stock_transformers(trained_runs, tmp_path):
    assert export_main([str(trained_runs / "uniform"), "--out", str(tmp_path / "u")]) == 0
    model, state, _ = rebuild_trained_model(trained_runs / "uniform")
    ids = torch.randint(0, 500, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    torch.save({"ids": ids, "expected": expected}, tmp_path / "ref.pt")
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'u')!r}).eval()\n"
        f"d = torch.load({str(tmp_path / 'ref.pt')!r}, weights_only=True)\n"
        "out = m(input_ids=d['ids']).logits\n"
        "assert 'apt_ds' not in sys.modules\n"
        "print(float((out - d['expected']).abs().max()))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.strip().splitlines()[-1]) < 1e-4


def test_export_refuses_existing_out_and_missing_checkpoint(trained_runs, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    assert export_main([str(trained_runs / "nonuniform"), "--out", str(tmp_path / "taken")]) == 2
    assert "exists (empty); pass --overwrite to replace it" in capsys.readouterr().err
    assert export_main([str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_export_of_a_missing_run_or_a_file_names_the_problem(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert export_main([str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
    assert f"{tmp_path / 'nothing'} does not exist: give the run directory" in capsys.readouterr().err
    assert export_main([str(tmp_path / "afile"), "--out", str(tmp_path / "x")]) == 2
    assert f"{tmp_path / 'afile'} is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_overwrite_keeps_files_an_export_did_not_write(trained_runs, tmp_path, capsys):
    """Results or a model card saved next to an export are refused by --overwrite, in one line,
    and nothing changes; the export's own files are replaced."""
    out = tmp_path / "e"
    assert export_main([str(trained_runs / "nonuniform"), "--out", str(out)]) == 0
    report = json.loads((out / "apt_export.json").read_text())
    assert sorted(report["files"]) == sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    for added in ("MODEL_CARD.md", "eval"):
        path = out / added
        path.mkdir() if added == "eval" else path.write_text("mine")
        assert export_main([str(trained_runs / "nonuniform"), "--out", str(out), "--overwrite"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"holds an export and also {added}, which an export does not write" in err[0], err
        assert path.exists()
        shutil.rmtree(path) if added == "eval" else path.unlink()
    assert export_main([str(trained_runs / "nonuniform"), "--out", str(out), "--overwrite"]) == 0
    # an export from before reports listed their files: told apart by the names exports give them
    report = json.loads((out / "apt_export.json").read_text())
    del report["files"]
    (out / "apt_export.json").write_text(json.dumps(report))
    for mine in ("notes.txt", "e-Q4_K_M.gguf", "my.model", "tokenizer_notes.txt", "model-card-notes.safetensors"):
        (out / mine).write_text("mine")
        assert export_main([str(trained_runs / "nonuniform"), "--out", str(out), "--overwrite"]) == 2
        assert f"also {mine}" in capsys.readouterr().err
        (out / mine).unlink()
    assert export_main([str(trained_runs / "nonuniform"), "--out", str(out), "--overwrite"]) == 0
    assert f"exported {report['final']['total_params']:,} parameters" in capsys.readouterr().err


def test_weights_that_do_not_fit_the_recorded_shapes_are_one_line(trained_runs, tmp_path):
    from apt_ds.io.modeling import ModelLoadError

    assert export_main([str(trained_runs / "nonuniform"), "--out", str(tmp_path / "e")]) == 0
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    config["apt_layer_shapes"][0]["ffn"] -= 8
    (tmp_path / "e" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"the weights do not fit config.json \(size mismatch"):
        load_pretrained(tmp_path / "e")


def test_export_of_a_stopped_run_warns(trained_runs, tmp_path, capsys):
    """A run that did not reach its last step exports its last checkpoint, and says so."""
    run = tmp_path / "run"
    shutil.copytree(trained_runs / "nonuniform", run)
    state = json.loads((run / "checkpoint" / "apt_state.json").read_text())
    state.update(step=4, finished=False)
    (run / "checkpoint" / "apt_state.json").write_text(json.dumps(state))
    assert export_main([str(run), "--out", str(tmp_path / "e")]) == 0
    err = capsys.readouterr().err
    assert "warning: the run stopped at step 4 of 8, so its last checkpoint was exported" in err
    assert "run again with --resume finishes it" in err
    assert json.loads((tmp_path / "e" / "apt_export.json").read_text())["steps"] == 8
    assert export_main([str(trained_runs / "nonuniform"), "--out", str(tmp_path / "f")]) == 0
    assert "warning" not in capsys.readouterr().err


def test_interrupted_export_leaves_nothing(trained_runs, tmp_path, monkeypatch):
    import apt_ds.export.writer as export_module

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        export_run(trained_runs / "nonuniform", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_export_from_plain_model_and_kept_units(trained_runs, tmp_path):
    """A plain model + the kept-unit record export without a run directory or DeepSpeed, and the
    result computes what the model masked to those units computes."""
    from apt_ds.algorithm.masks import UnitMasks
    from apt_ds.algorithm.units import ModelShape
    from apt_ds.io.modeling import build_tiny_model
    from apt_ds.io.tokenizer import load_tokenizer

    meta = json.loads((trained_runs / "nonuniform" / "checkpoint" / "apt_state.json").read_text())
    tokenizer = load_tokenizer(trained_runs / "nonuniform" / "tokenizer")
    original = build_tiny_model(vocab_size=len(tokenizer), seed=meta["train_config"]["seed"])
    original.save_pretrained(str(tmp_path / "plain"))
    tokenizer.save_pretrained(str(tmp_path / "plain"))
    masks = UnitMasks(ModelShape.from_model(original))
    kept = meta["kept"]
    masks.kv_group = [torch.zeros_like(m).index_fill_(0, torch.tensor(k), 1.0) for m, k in zip(masks.kv_group, kept["groups"])]
    masks.ffn_neuron = [torch.zeros_like(m).index_fill_(0, torch.tensor(k), 1.0) for m, k in zip(masks.ffn_neuron, kept["neurons"])]
    masks.hidden = torch.zeros_like(masks.hidden).index_fill_(0, torch.tensor(kept["hidden"]), 1.0)
    masks.refresh()
    masks.install(original)
    ids = torch.randint(0, 500, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = original.eval()(input_ids=ids).logits
    result = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parents[2] / "launch" / "export.py"), "--model",
         str(tmp_path / "plain"), "--kept", str(trained_runs / "nonuniform" / "checkpoint" / "apt_state.json"),
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    exported = load_pretrained(tmp_path / "out")
    report = json.loads((tmp_path / "out" / "apt_export.json").read_text())
    assert report["final"]["total_params"] == sum(p.numel() for p in exported.parameters())
    assert report["final"]["layers"] == meta["shape"]["layers"] and report["final"]["hidden"] == meta["shape"]["hidden"]
    with torch.no_grad():
        assert torch.allclose(exported(input_ids=ids).logits, expected, atol=1e-4)


def test_a_gguf_base_with_kept_units_exports_its_tokenizer(trained_runs, tmp_path, capsys):
    """--model BASE.gguf --kept: the tokenizer is inside the GGUF; both formats carry it."""
    from apt_ds.export.pruned import export_pruned
    from apt_ds.io.modeling import build_tiny_model
    from apt_ds.io.tokenizer import load_tokenizer

    meta = json.loads((trained_runs / "nonuniform" / "checkpoint" / "apt_state.json").read_text())
    tokenizer = load_tokenizer(trained_runs / "nonuniform" / "tokenizer")
    original = build_tiny_model(vocab_size=len(tokenizer), seed=meta["train_config"]["seed"])
    config = original.config
    everything = {"groups": [list(range(config.num_key_value_heads))] * config.num_hidden_layers,
                  "neurons": [list(range(config.intermediate_size))] * config.num_hidden_layers,
                  "hidden": list(range(config.hidden_size))}
    export_pruned(original, everything, tmp_path / "base", tokenizer_dir=trained_runs / "nonuniform" / "tokenizer",
                  format="gguf")  # the dense model as one GGUF file, its tokenizer inside
    base = next((tmp_path / "base").glob("*.gguf"))
    kept = str(trained_runs / "nonuniform" / "checkpoint" / "apt_state.json")
    text = "the quick brown fox"
    assert export_main(["--model", str(base.parent), "--kept", kept, "--out", str(tmp_path / "hf")]) == 0  # its folder
    assert load_tokenizer(tmp_path / "hf")(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert export_main(["--model", str(base), "--kept", kept, "--out", str(tmp_path / "g"), "--format", "gguf"]) == 0
    assert _gguf_tokens(next((tmp_path / "g").glob("*.gguf"))) == _gguf_tokens(base)  # a deci GGUF: read by gguf-py


def _gguf_tokens(path: Path) -> list[str]:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["tokenizer.ggml.tokens"]
    return [bytes(field.parts[index]).decode() for index in field.data]


def test_a_checkpoint_replaced_while_it_is_exported_is_read_again_whole(trained_runs, tmp_path, monkeypatch):
    """A run in training renames its next checkpoint into place (and deletes the last) while an export
    reads it: the export reads one checkpoint whole, never apt_state.json of one and tensors of the
    next (which failed as 'does not fit the rebuilt model', or mixed them silently)."""
    import apt_ds.export.merge as merge

    run = tmp_path / "run"
    shutil.copytree(trained_runs / "nonuniform", run)
    swaps = []

    def load_during_a_checkpoint(path, *args, **kwargs):
        if not swaps:  # the trainer's rename sequence (apt_ds.io.checkpoint), with another run's checkpoint
            swaps.append(path)
            shutil.copytree(trained_runs / "uniform" / "checkpoint", run / "checkpoint.tmp")
            (run / "checkpoint").rename(run / "checkpoint.old")
            (run / "checkpoint.tmp").rename(run / "checkpoint")
            shutil.rmtree(run / "checkpoint.old")
        return load_file(path, *args, **kwargs)

    monkeypatch.setattr(merge, "load_file", load_during_a_checkpoint)
    export_run(run, tmp_path / "out")
    assert swaps  # the swap happened during the read
    monkeypatch.undo()
    export_run(trained_runs / "uniform", tmp_path / "expected")
    got, expected = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("out", "expected"))
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_checkpoint_whose_shapes_contradict_its_config(trained_runs, tmp_path, capsys):

    broken = tmp_path / "broken"
    shutil.copytree(trained_runs / "nonuniform", broken)
    meta_path = broken / "checkpoint" / "apt_state.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"]["hidden"] += 1
    meta_path.write_text(json.dumps(meta))
    assert export_main([str(broken), "--out", str(tmp_path / "x")]) == 2
    assert "contradict" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_export_needs_no_deepspeed(trained_runs, tmp_path):
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from apt_ds.export.merge import export_run\n"
        f"export_run(Path({str(trained_runs / 'nonuniform')!r}), Path({str(tmp_path / 'o')!r}))\n"
        "assert 'deepspeed' not in sys.modules, 'export imported deepspeed'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("uniform", [False, True])
def test_mha_model_directory_run_exports_exactly(trained_runs, tmp_path, uniform):
    """An MHA LLaMA given as a local HF directory: train, export, same logits as training time."""

    from conftest import tiny_llama

    model_dir = tmp_path / "mha"
    tiny_llama("mha", vocab=512).save_pretrained(str(model_dir))
    for item in (trained_runs / "nonuniform" / "tokenizer").iterdir():
        shutil.copy2(item, model_dir / item.name)
    out = tmp_path / "run"
    flags = ["--uniform"] if uniform else []
    assert train_main([*FAST, *flags, "--target-density", "0.6", "--model", str(model_dir), "--out", str(out)]) == 0
    model, _, meta = rebuild_trained_model(out)
    assert meta["shape"]["layers"][0]["group_size"] == 1  # MHA: a KV group is one head
    ids = torch.randint(0, 500, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    export_run(out, tmp_path / "export")
    loaded = load_pretrained(tmp_path / "export")
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, expected, atol=1e-4)
    assert meta["shape"]["hidden"] <= 64 and read_metrics(out / "metrics.jsonl")[-1]["density"] <= 0.6 + 1e-9
