"""Export against the live run (probe), odd shapes, dtypes, shards, and every way an export
could destroy data or silently write a wrong model."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import check_against_probe
from safetensors.torch import load_file, save_file

from apt_ds.cli.export import main as export_main
from apt_ds.cli.train import main as train_main
from apt_ds.export.merge import export_run
from apt_ds.export.writer import weight_files
from apt_ds.io.modeling import load_pretrained

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "apt_ds" / "io" / "assets" / "demo.jsonl")
FAST = ["--steps", "8", "--max-seq-len", "32", "--micro-batch-size", "2", "--warmup-steps", "1"]
PROBE = ["--eval-data", DEMO, "--eval-examples", "4", "--save-eval-probe"]
# Long enough that the demo prompts are not all cut to the same length: the probe's batch is
# padded, so masked positions are exercised
UNTRUNCATED = ["--max-seq-len", "256"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("safety") / "run"
    assert train_main([*FAST, *PROBE, *UNTRUNCATED, "--target-density", "0.6", "--out", str(out)]) == 0
    assert not load_file(str(out / "eval_probe.safetensors"))["attention_mask"].bool().all()  # padding is present
    return out


def test_export_equals_the_live_run(run, tmp_path):
    assert export_main([str(run), "--out", str(tmp_path / "e")]) == 0
    check_against_probe(run, tmp_path / "e")


def test_uniform_shape_with_hidden_not_divisible_by_heads_still_loads(tmp_path):
    """Heads and neurons kept, hidden pruned: every layer alike, but hidden % heads != 0, which a
    plain LlamaConfig cannot express, so per-layer shapes are recorded and the loader works.
    Single units (--shape-multiple 1): aligned blocks keep this model's hidden size a multiple of 8."""
    out = tmp_path / "run"
    assert train_main([*FAST, *PROBE, "--target-density", "0.9", "--no-prune-heads", "--no-prune-neurons",
                       "--shape-multiple", "1", "--out", str(out)]) == 0
    report = export_run(out, tmp_path / "e")
    hidden, heads = report["final"]["hidden"], report["final"]["layers"][0]["group_size"] * report["final"]["layers"][0]["num_kv_groups"]
    assert report["uniform"] and hidden % heads  # the case under test
    assert not report["stock_loadable"]
    assert json.loads((tmp_path / "e" / "config.json").read_text())["apt_layer_shapes"]
    check_against_probe(out, tmp_path / "e")


def test_dtypes_and_overwriting_a_previous_export(run, tmp_path):
    out = tmp_path / "e"
    assert export_main([str(run), "--out", str(out)]) == 0
    fp32 = load_pretrained(out)
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        assert export_main([str(run), "--out", str(out), "--dtype", dtype, "--overwrite"]) == 0
        low = load_pretrained(out)
        assert all(p.dtype == torch_dtype for p in low.parameters())
        ids = torch.randint(0, 500, (1, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            diff = (low.float()(input_ids=ids).logits - fp32(input_ids=ids).logits).abs().max()
        assert diff < 0.5  # rounding of the weights only
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_sharded_export_loads_with_stock_transformers(run, tmp_path):
    assert export_main([str(run), "--out", str(tmp_path / "one")]) == 0
    assert export_main([str(run), "--out", str(tmp_path / "shards"), "--max-shard-size", "300KB"]) == 0
    shards = weight_files(tmp_path / "shards")
    assert len(shards) > 2 and (tmp_path / "shards" / "model.safetensors.index.json").is_file()
    probe = load_file(str(run / "eval_probe.safetensors"))
    torch.save({"ids": probe["input_ids"][:1, :8]}, tmp_path / "ids.pt")
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r}, weights_only=True)['ids']\n"
        "a, b = (AutoModelForCausalLM.from_pretrained(p).eval() for p in sys.argv[1:3])\n"
        "with torch.no_grad():\n"
        "    print(float((a(input_ids=ids).logits - b(input_ids=ids).logits).abs().max()))\n"
    )
    # uniform shapes are needed for stock loading: this run is not uniform, so compare with the apt loader
    # and check the index with stock safetensors loading of every shard
    merged = {}
    for shard in shards:
        merged.update(load_file(str(shard)))
    single = load_file(str(tmp_path / "one" / "model.safetensors"))
    assert merged.keys() == single.keys() and all(torch.equal(merged[k], single[k]) for k in single)
    uniform = tmp_path / "urun"
    assert train_main([*FAST, "--target-density", "0.6", "--uniform", "--out", str(uniform)]) == 0
    assert export_main([str(uniform), "--out", str(tmp_path / "u1")]) == 0
    assert export_main([str(uniform), "--out", str(tmp_path / "u2"), "--max-shard-size", "300KB"]) == 0
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "u1"), str(tmp_path / "u2")],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.strip().splitlines()[-1]) == 0.0


def test_killed_export_leaves_nothing_loadable_and_is_cleaned_up(run, tmp_path):
    """SIGKILL after the first weights file is written: no --out, the hidden temporary has no
    config.json (nothing loads it), and the next export removes it."""
    script = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "import apt_ds.export.merge as ex\n"
        "import apt_ds.export.writer as writer\n"
        "real = writer.save_file\n"
        "def save_then_die(*a, **k):\n"
        "    real(*a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "writer.save_file = save_then_die\n"
        f"ex.export_run(Path({str(run)!r}), Path({str(tmp_path / 'out')!r}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == -9
    assert not (tmp_path / "out").exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert leftovers and not any((p / "config.json").exists() for p in leftovers)
    assert export_main([str(run), "--out", str(tmp_path / "out")]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_overwrite_killed_between_renames_restores_the_previous_export(run, tmp_path, capsys):
    """A kill between `out -> .out.old-*` and `.out.tmp-* -> out` leaves no `out`: the next export
    puts the previous one back first (and so refuses to replace it without --overwrite)."""
    out = tmp_path / "e"
    assert export_main([str(run), "--out", str(out)]) == 0
    before = (out / "config.json").read_text()
    out.rename(tmp_path / ".e.old-abc")
    shutil.copytree(tmp_path / ".e.old-abc", tmp_path / ".e.tmp-abc")  # the complete new one, not renamed yet
    assert export_main([str(run), "--out", str(out)]) == 2
    assert "holds a previous export; pass --overwrite to replace it" in capsys.readouterr().err
    assert (out / "config.json").read_text() == before
    assert export_main([str(run), "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]


def test_probe_without_eval_data_is_refused(tmp_path, capsys):
    assert train_main([*FAST, "--save-eval-probe", "--out", str(tmp_path / "r")]) == 2
    assert "--eval-data" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_overwrite_never_deletes_what_is_not_an_export(run, tmp_path, capsys):
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    for out in (run, run.parent):  # the run itself, or a directory containing it
        assert export_main([str(run), "--out", str(out), "--overwrite"]) == 2
        assert "input" in capsys.readouterr().err
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    assert export_main([str(run), "--out", str(precious), "--overwrite"]) == 2
    assert "not an apt_ds export" in capsys.readouterr().err
    assert (precious / "notes.txt").read_text() == "keep me"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert export_main([str(run), "--out", str(a_file), "--overwrite"]) == 2
    assert "not a directory" in capsys.readouterr().err and a_file.read_text() == "x"


def test_export_is_readable_by_other_users(run, tmp_path):
    old = os.umask(0o022)
    try:
        assert export_main([str(run), "--out", str(tmp_path / "e")]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "e").stat().st_mode) == 0o755
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in (tmp_path / "e").iterdir())


def _broken_copy(run: Path, tmp_path: Path) -> Path:
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    return broken


def _drop_tensors(path: Path, predicate) -> None:
    tensors = load_file(str(path))
    save_file({k: v for k, v in tensors.items() if not predicate(k)}, str(path))


def _edit_meta(run: Path, edit) -> None:
    path = run / "checkpoint" / "apt_state.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize("damage, message", [
    (lambda r: _drop_tensors(r / "checkpoint" / "trainable.safetensors", lambda k: "layers.0." in k), "lacks"),
    (lambda r: save_file({"hidden": torch.ones(3)}, str(r / "checkpoint" / "masks.safetensors")), "masks"),
    (lambda r: _edit_meta(r, lambda m: m["kept"]["neurons"][0].append(10**6)), "inconsistent"),
    (lambda r: _edit_meta(r, lambda m: m.pop("run_info")), "run_info"),
    (lambda r: _edit_meta(r, lambda m: m["run_info"].update(model="tiny-mha")), "not the base model"),
    (lambda r: _edit_meta(r, lambda m: m["run_info"].update(model="/nonexistent/model")), "--model"),
    (lambda r: (r / "checkpoint" / "masks.safetensors").unlink(), "broken/checkpoint/masks.safetensors"),
])
def test_damaged_runs_give_one_line_and_write_nothing(run, tmp_path, capsys, damage, message):
    broken = _broken_copy(run, tmp_path)
    damage(broken)
    assert export_main([str(broken), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, err
    assert "/proc/" not in err  # the checkpoint is read through /proc/self/fd (apt_ds.io.pinned), named as the user's
    assert [p.name for p in tmp_path.iterdir()] == ["broken"]


def test_moved_run_exports_with_model_override(tmp_path, capsys):
    """The run records its base model's absolute path; a moved model is given with --model."""
    from conftest import tiny_llama

    model_dir = tmp_path / "base"
    tiny_llama("gqa", vocab=512).save_pretrained(str(model_dir))
    tokenizer_run = tmp_path / "tok"
    assert train_main(["--steps", "4", "--max-seq-len", "16", "--micro-batch-size", "2", "--warmup-steps", "1",
                       "--method", "lora", "--out", str(tokenizer_run)]) == 0
    for item in (tokenizer_run / "tokenizer").iterdir():
        shutil.copy2(item, model_dir / item.name)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:  # a relative --model
        assert train_main([*FAST, "--target-density", "0.7", "--model", "base", "--out", "run"]) == 0
    finally:
        os.chdir(cwd)
    info = json.loads((tmp_path / "run" / "checkpoint" / "apt_state.json").read_text())["run_info"]
    assert info["model"] == str(model_dir.resolve())
    model_dir.rename(tmp_path / "moved")
    assert export_main([str(tmp_path / "run"), "--out", str(tmp_path / "e1")]) == 2
    assert "--model" in capsys.readouterr().err
    assert export_main([str(tmp_path / "run"), "--model", str(tmp_path / "moved"), "--out", str(tmp_path / "e2")]) == 0
    # the same config and embedding but one retrained layer: not the base model
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "moved", other)
    weights = load_file(str(other / "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.weight"] += 0.01
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    assert export_main([str(tmp_path / "run"), "--model", str(other), "--out", str(tmp_path / "e3")]) == 2
    assert "not the base model" in capsys.readouterr().err
    # the run's base model is never an --out, even when it is itself an export
    assert export_main([str(tmp_path / "run"), "--model", str(tmp_path / "moved"), "--out", str(tmp_path / "moved"),
                        "--overwrite"]) == 2
    assert "input" in capsys.readouterr().err


@pytest.mark.parametrize("kept, message", [
    ([1, 2, 3], "malformed"),
    ("DUPLICATE", "twice"),
])
def test_bad_kept_records_give_one_line(run, tmp_path, capsys, kept, message):
    from apt_ds.io.modeling import build_tiny_model
    from apt_ds.io.tokenizer import load_tokenizer

    meta = json.loads((run / "checkpoint" / "apt_state.json").read_text())
    plain = tmp_path / "plain"
    build_tiny_model(vocab_size=len(load_tokenizer(run / "tokenizer")), seed=meta["train_config"]["seed"]).save_pretrained(str(plain))
    if kept == "DUPLICATE":
        kept = meta["kept"]
        kept["neurons"][1] = kept["neurons"][1] + kept["neurons"][1][:3]
    (tmp_path / "kept.json").write_text(json.dumps(kept))
    capsys.readouterr()  # save_pretrained's progress bar
    assert export_main(["--model", str(plain), "--kept", str(tmp_path / "kept.json"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_plain_model_with_saved_binary_masks(run, tmp_path, capsys):
    """--kept may be binary masks over the original model (.safetensors): the same export as the
    kept-index record; fractional masks are refused."""
    from apt_ds.algorithm.masks import UnitMasks
    from apt_ds.algorithm.units import ModelShape
    from apt_ds.io.modeling import build_tiny_model
    from apt_ds.io.tokenizer import load_tokenizer

    meta = json.loads((run / "checkpoint" / "apt_state.json").read_text())
    plain = tmp_path / "plain"
    model = build_tiny_model(vocab_size=len(load_tokenizer(run / "tokenizer")), seed=meta["train_config"]["seed"])
    model.save_pretrained(str(plain))
    masks = UnitMasks(ModelShape.from_model(model))
    kept = meta["kept"]
    masks.kv_group = [torch.zeros_like(m).index_fill_(0, torch.tensor(k), 1.0) for m, k in zip(masks.kv_group, kept["groups"])]
    masks.ffn_neuron = [torch.zeros_like(m).index_fill_(0, torch.tensor(k), 1.0) for m, k in zip(masks.ffn_neuron, kept["neurons"])]
    masks.hidden = torch.zeros_like(masks.hidden).index_fill_(0, torch.tensor(kept["hidden"]), 1.0)
    save_file(masks.state_dict(), str(tmp_path / "masks.safetensors"))
    capsys.readouterr()
    assert export_main(["--model", str(plain), "--kept", str(tmp_path / "masks.safetensors"), "--out", str(tmp_path / "m")]) == 0
    assert export_main(["--model", str(plain), "--kept", str(run / "checkpoint" / "apt_state.json"), "--out", str(tmp_path / "k")]) == 0
    a, b = load_file(str(tmp_path / "m" / "model.safetensors")), load_file(str(tmp_path / "k" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = masks.state_dict()
    state["hidden"][0] = 0.5
    save_file(state, str(tmp_path / "frac.safetensors"))
    capsys.readouterr()
    assert export_main(["--model", str(plain), "--kept", str(tmp_path / "frac.safetensors"), "--out", str(tmp_path / "f")]) == 2
    assert "binary" in capsys.readouterr().err and not (tmp_path / "f").exists()
    # A run's own checkpoint/masks.safetensors covers its PRUNED model: same names, shorter masks, all ones.
    # Its positions 0..n-1 are not the original units; it is refused, naming the file to give instead.
    own = load_file(str(run / "checkpoint" / "masks.safetensors"))
    assert any(len(own[f"ffn_neuron.{i}"]) < len(m) for i, m in enumerate(masks.ffn_neuron))  # the run pruned
    capsys.readouterr()
    assert export_main(["--model", str(plain), "--kept", str(run / "checkpoint" / "masks.safetensors"),
                        "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "masks must cover the original model" in err
    assert "checkpoint/apt_state.json instead" in err and not (tmp_path / "o").exists()
    # A compact export whose layers differ in width is a valid base: masks over ITS units are checked
    # layer by layer (its config.json's intermediate_size is one layer's), and a 0-d mask is one line.
    assert export_main([str(run), "--out", str(tmp_path / "compact")]) == 0
    from apt_ds.io.modeling import load_pretrained

    compact = load_pretrained(tmp_path / "compact")
    widths = [layer.mlp.up_proj.out_features for layer in compact.model.layers]
    assert len(set(widths)) > 1  # non-uniform
    ones = UnitMasks(ModelShape.from_model(compact)).state_dict()
    save_file(ones, str(tmp_path / "ones.safetensors"))
    assert export_main(["--model", str(tmp_path / "compact"), "--kept", str(tmp_path / "ones.safetensors"),
                        "--out", str(tmp_path / "again")]) == 0
    ones["hidden"] = torch.tensor(1.0)
    save_file(ones, str(tmp_path / "scalar.safetensors"))
    capsys.readouterr()
    assert export_main(["--model", str(tmp_path / "compact"), "--kept", str(tmp_path / "scalar.safetensors"),
                        "--out", str(tmp_path / "s")]) == 2
    assert "every mask must be a 1-D tensor" in capsys.readouterr().err and not (tmp_path / "s").exists()


def test_load_pretrained_takes_dtype_names_and_names_what_is_wrong(run, tmp_path):
    from apt_ds.io.modeling import ModelLoadError, load_pretrained

    assert export_main([str(run), "--out", str(tmp_path / "e")]) == 0
    assert next(load_pretrained(tmp_path / "e", dtype="bf16").parameters()).dtype == torch.bfloat16
    assert next(load_pretrained(tmp_path / "e", dtype="float16").parameters()).dtype == torch.float16
    assert next(load_pretrained(tmp_path / "e", dtype="FP16").parameters()).dtype == torch.float16
    for dtype in ("int8", "bf17", 3, "float8_e4m3fn"):
        with pytest.raises(ModelLoadError, match="is not a floating-point torch.dtype"):
            load_pretrained(tmp_path / "e", dtype=dtype)
    with pytest.raises(ModelLoadError, match="is an apt-ds run, not a model: export it first"):
        load_pretrained(run)
    (tmp_path / "e" / "config.json").write_text(json.dumps({**json.loads((tmp_path / "e" / "config.json").read_text()),
                                                            "apt_layer_shapes": [{"wrong": 1}]}))
    with pytest.raises(ModelLoadError, match="apt_layer_shapes is malformed"):
        load_pretrained(tmp_path / "e")
