"""apt-ds-plot: PNGs from real run directories (the built-in tiny model, a few steps), the heat
map's numbers against the checkpoint's kept-units record, and one-line errors that write nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from apt_ds.cli.plot import main
from apt_ds.cli.plot_data import PlotInputError, curves_of, read_metrics_lines, read_run, shape_matrix
from apt_ds.io.run_dir import check_replaceable

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "apt_ds" / "io" / "assets" / "demo.jsonl"
FAST = ["--max-seq-len", "32", "--micro-batch-size", "2", "--warmup-steps", "1", "--eval-data", str(DEMO),
        "--eval-examples", "4"]


def _train(out: Path, *extra: str) -> Path:
    # launch/train.py, as a user runs it: the run directory's format is whatever training writes
    subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), *FAST, *extra, "--out", str(out)], check=True,
                   capture_output=True, cwd=ROOT)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    apt = _train(root / "apt", "--steps", "8", "--target-density", "0.6")
    lora = _train(root / "lora", "--steps", "4", "--method", "lora")
    return apt, lora


@pytest.fixture
def apt_copy(runs, tmp_path):
    """A copy of the APT run that a test may damage."""
    return Path(shutil.copytree(runs[0], tmp_path / "run"))


def _png_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as image:
        assert image.format == "PNG"
        size = image.size
        image.verify()  # the whole file decodes: not truncated
    return size


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_one_run_plots_into_run_plots(apt_copy, capsys):
    assert main([str(apt_copy)]) == 0
    out = apt_copy / "plots"
    assert _files(out) == ["curves.png", "shape.png"]  # and no temporary file left beside them
    for name in ("curves.png", "shape.png"):
        width, height = _png_size(out / name)
        assert 600 <= width <= 2000 and 200 <= height <= 2000, (name, width, height)
        assert (out / name).stat().st_size < 300_000
    assert capsys.readouterr().out.split() == [str(out / "curves.png"), str(out / "shape.png")]


def test_several_runs_one_heat_map_each(runs, tmp_path):
    apt, lora = runs
    assert main([str(apt), "--out", str(tmp_path / "one")]) == 0
    assert main([str(apt), str(lora), "--out", str(tmp_path / "two")]) == 0
    assert _files(tmp_path / "two") == ["curves.png", "shape.png"]
    one, two = _png_size(tmp_path / "one" / "shape.png"), _png_size(tmp_path / "two" / "shape.png")
    assert two[1] > 1.6 * one[1]  # a second row of heat maps, not one squeezed in
    assert _png_size(tmp_path / "two" / "curves.png")[0] >= 600


def test_plotted_run_can_still_be_overwritten(apt_copy):
    assert main([str(apt_copy)]) == 0
    check_replaceable(apt_copy)  # RUN/plots is part of the run: --overwrite replaces it with the run


def test_shape_matrix_counts_equal_the_kept_record(runs):
    meta = json.loads((runs[0] / "checkpoint" / "apt_state.json").read_text())
    kept, original = meta["kept"], meta["original_shape"]
    shape = shape_matrix(original, kept)
    assert shape.kept_counts() == ([len(g) for g in kept["groups"]], [len(n) for n in kept["neurons"]])
    assert shape.total_counts() == ([l["num_kv_groups"] for l in original["layers"]], [l["ffn"] for l in original["layers"]])
    assert sum(shape.kept_counts()[1]) < sum(shape.total_counts()[1])  # the run did prune neurons
    for layer, indices in enumerate(kept["neurons"]):
        assert np.flatnonzero(shape.neurons[layer] == 1.0).tolist() == indices  # the ORIGINAL indices, in place
    assert (shape.hidden_kept, shape.hidden_total) == (len(kept["hidden"]), original["hidden"])
    assert [len(n) for n in kept["neurons"]] == [l["ffn"] for l in meta["shape"]["layers"]]  # the record is the shape


def test_lora_run_has_the_full_shape_and_no_target(runs):
    run = read_run(runs[1], "lora")
    assert run.shape is not None and not run.events and run.target_density is None
    assert run.shape.kept_counts() == run.shape.total_counts()
    assert {"density", "total_rank", "loss", "eval_loss"} <= set(run.curves)


def test_curves_follow_the_metrics(runs):
    records = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    curves, events = curves_of(records)
    assert events == [r["step"] for r in records if r.get("event")] and events
    steps, values = curves["eval_loss"]
    assert steps[-1] == 8 and values[-1] == records[-1]["eval_loss"]  # the final line's evaluation
    assert curves["density"][0] == sorted(set(r["step"] for r in records))  # final repeats step 8: one point
    assert read_run(runs[0], "apt").target_density == 0.6


def test_shape_matrix_layers_of_different_widths():
    layer = {"num_kv_groups": 2, "group_size": 2, "head_dim": 8}
    original = {"hidden": 16, "vocab": 32, "tied_embeddings": False,
                "layers": [{**layer, "ffn": 6}, {**layer, "num_kv_groups": 1, "ffn": 4}]}
    shape = shape_matrix(original, {"groups": [[1], [0]], "neurons": [[0, 5], [1, 2, 3]], "hidden": [0, 3, 7]})
    assert shape.kept_counts() == ([1, 1], [2, 3]) and shape.total_counts() == ([2, 1], [6, 4])
    assert np.isnan(shape.neurons[1, 4:]).all() and np.isnan(shape.groups[1, 1])  # units layer 1 never had
    assert (shape.hidden_kept, shape.hidden_total) == (3, 16)
    with pytest.raises(PlotInputError, match="outside 0..3 in layer 1"):
        shape_matrix(original, {"groups": [[1], [0]], "neurons": [[0], [4]], "hidden": [0]})
    with pytest.raises(PlotInputError, match="layers"):
        shape_matrix(original, {"groups": [[1]], "neurons": [[0]], "hidden": [0]})


def _one_line_error(capsys, argv, out: Path) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert not out.exists()  # nothing written, not even the directory
    return err


@pytest.mark.parametrize("damage, message", [
    (lambda run: shutil.rmtree(run), "is not a directory"),
    (lambda run: (run / "metrics.jsonl").unlink(), "has no metrics.jsonl"),
    (lambda run: (run / "metrics.jsonl").write_text(""), "has no records yet"),
    (lambda run: (run / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n'), "line 2 is not JSON"),
    (lambda run: (run / "metrics.jsonl").write_text('[1, 2]\n'), "line 1 is not a metrics record"),
    (lambda run: (run / "checkpoint" / "apt_state.json").write_text("{"), "corrupt checkpoint"),
    (lambda run: (run / "checkpoint" / "apt_state.json").write_text('{"format": 1}'), "no 'original_shape' entry"),
])
def test_bad_run_is_one_line_and_writes_nothing(apt_copy, runs, tmp_path, capsys, damage, message):
    damage(apt_copy)
    out = tmp_path / "plots"
    assert message in _one_line_error(capsys, [str(runs[1]), str(apt_copy), "--out", str(out)], out)
    assert message in _one_line_error(capsys, [str(apt_copy)], apt_copy / "plots")


def test_several_runs_need_out(runs, capsys):
    assert "--out" in _one_line_error(capsys, [str(runs[0]), str(runs[1])], runs[0] / "plots")


def test_out_that_is_a_file(runs, tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    assert "cannot write" in _one_line_error(capsys, [str(runs[0]), "--out", str(tmp_path / "file" / "x")],
                                             tmp_path / "file" / "x")
    assert main([str(runs[0]), "--out", str(tmp_path / "file")]) == 2
    assert (tmp_path / "file").read_text() == "mine"


def test_out_inside_what_a_run_replaces_is_refused(apt_copy, runs, capsys):
    """RUN/checkpoint/ is replaced whole at the run's next checkpoint, and the plots with it; PNGs in
    RUN itself or deeper in its plots/ would make --overwrite refuse the run as holding more than
    apt-ds wrote."""
    other = Path(shutil.copytree(runs[1], apt_copy.parent / "other"))
    for out in (apt_copy / "checkpoint" / "p", apt_copy / "tokenizer", other / "checkpoint"):
        assert "which the run replaces whole" in _one_line_error(capsys, [str(apt_copy), "--out", str(out)], out / "curves.png")
    assert "is a run directory; its plots go to" in _one_line_error(capsys, [str(apt_copy), "--out", str(apt_copy)],
                                                                    apt_copy / "curves.png")
    # A run's plots/ is a plotted run's own: another run's would get this run's curves, and a folder
    # inside it would make that run's --overwrite refuse it (nothing written either way).
    assert "which is not among the runs plotted" in _one_line_error(capsys, [str(apt_copy), "--out", str(other / "plots")],
                                                                     other / "plots" / "curves.png")
    for out in (apt_copy / "plots" / "sub", other / "plots" / "sub"):
        err = _one_line_error(capsys, [str(apt_copy), "--out", str(out)], out / "curves.png")
        assert "which holds only that run's plots" in err
        assert ("itself, or" in err) == (out.parent.parent == apt_copy)  # offered only for a plotted run
    assert main([str(apt_copy), str(other), "--out", str(other / "plots")]) == 0  # both plotted: other's own folder
    assert main([str(apt_copy), "--out", str(other / "figures")]) == 0  # a folder of the user's own in a run


def test_run_without_checkpoint_gets_curves_and_a_note(apt_copy, capsys):
    shutil.rmtree(apt_copy / "checkpoint")
    assert main([str(apt_copy)]) == 0
    assert _files(apt_copy / "plots") == ["curves.png"]
    assert "no checkpoint yet" in capsys.readouterr().err


def test_torn_last_line_is_skipped_with_a_note(apt_copy):
    metrics = apt_copy / "metrics.jsonl"
    complete = len(metrics.read_text().splitlines())
    with metrics.open("a") as handle:
        handle.write('{"step": 9, "loss": 1.')  # a run killed mid-write
    records, note = read_metrics_lines(metrics)
    assert len(records) == complete and "unfinished last line" in note
    assert main([str(apt_copy)]) == 0


def test_wide_ffn_is_drawn_as_shares_of_bins():
    from apt_ds.cli.plot import _binned

    matrix = np.zeros((2, 1500))
    matrix[0, ::3] = 1.0  # a third kept, spread out
    matrix[1, :750] = 1.0  # the first half kept
    binned = _binned(matrix, most=700)
    assert binned.shape == (2, 500) and np.allclose(binned[0], 1 / 3)  # 3 neurons per column, one kept
    assert np.allclose(binned[1, :250], 1.0) and np.allclose(binned[1, 250:], 0.0)
    assert _binned(matrix[:, :700], most=700).shape == (2, 700)  # narrow enough: as is


def test_a_users_file_in_out_is_refused_and_our_own_plots_are_replaced(runs, tmp_path, capsys):
    """--out may hold PNGs this command wrote (re-plotting after more steps replaces them); a file
    of the same name that it did not write is refused, byte for byte unchanged."""
    out = tmp_path / "figures"
    out.mkdir()
    (out / "curves.png").write_bytes(b"my own figure")
    capsys.readouterr()
    assert main([str(runs[0]), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --out {out} holds curves.png, which this command did not write (or an apt-ds before its "
                   f"PNGs were marked); move it away or choose another --out"]
    assert _files(out) == ["curves.png"] and (out / "curves.png").read_bytes() == b"my own figure"

    mine = tmp_path / "mine"
    assert main([str(runs[0]), "--out", str(mine)]) == 0
    first = (mine / "shape.png").stat().st_mtime_ns
    assert main([str(runs[0]), str(runs[1]), "--out", str(mine)]) == 0  # its own files: replaced
    assert _files(mine) == ["curves.png", "shape.png"] and (mine / "shape.png").stat().st_mtime_ns != first
    with Image.open(mine / "shape.png") as image:
        assert image.info.get("Software") == "apt-ds plot"


def test_a_runs_own_plots_folder_is_replaced_however_it_is_named(apt_copy):
    """RUN/plots belongs to the run (plots from before the PNGs were marked live there): given as
    --out or by default, its files are replaced."""
    (apt_copy / "plots").mkdir()
    (apt_copy / "plots" / "curves.png").write_bytes(b"an unmarked plot")
    assert main([str(apt_copy), "--out", str(apt_copy / "plots")]) == 0
    assert _png_size(apt_copy / "plots" / "curves.png")[0] >= 600
    assert main(["--out", "", str(apt_copy)]) == 2  # "" is not the current directory
