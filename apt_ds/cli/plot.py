"""`launch/plot.py RUN [RUN...]` (or `apt-ds-plot`): PNGs of one or several runs (see --help). The numbers come from
apt_ds.cli.plot_data; this module only draws them and writes the files."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from apt_ds.cli.arguments import ArgumentParser, _HelpFormatter
from apt_ds.cli.plot_data import PlotInputError, RunData, read_run
from apt_ds.config import help_field
from apt_ds.io.run_dir import is_run_dir, replaced_folder, set_aside_note

CURVES_FILE, SHAPE_FILE = "curves.png", "shape.png"
PNG_SOFTWARE = "apt-ds plot"  # the PNGs' Software text chunk: what marks a file as ours to replace
DPI = 100
MAX_COLUMNS = 700  # about the heat map's width in pixels at DPI
KEPT_COLOR, REMOVED_COLOR = "#1f5f8b", "#e4e4e4"
DESCRIPTION = f"""Draw a run's curves and final shape into PNGs:
  {CURVES_FILE}  density, total adapter rank, training (task) loss and eval loss over the steps,
              pruning events as dotted lines; several runs are overlaid, named by directory
  {SHAPE_FILE}   each layer's kept KV groups and FFN neurons (original indices), one heat map per run
A run without a checkpoint yet gets its curves only."""


class _RawHelpFormatter(_HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The description's file list as written; flags as in every apt-ds command."""


@dataclass
class PlotArguments:
    """launch/plot.py: where the PNGs of one or several runs go (the runs are positional)."""

    _argument_group_name = "plot"

    out: Optional[str] = help_field("directory for the PNGs (created; PNGs this command wrote there before are replaced, "
                                    "other files of the same name are refused, except in a run's own RUN/plots) (default "
                                    "for one run: RUN/plots; required for several runs)", default=None)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser([PlotArguments], prog="launch/plot.py", description=DESCRIPTION,
                            formatter_class=_RawHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directory written by launch/train.py --out")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _plot(build_parser().parse_args(argv))
    except KeyboardInterrupt:  # each PNG is written to a temporary file and renamed into place
        print("interrupted; no plot was left half-written", file=sys.stderr)
        return 130


def _inside_another_run(out: Path, runs: list[Path]) -> str | None:
    """Inside a run, its own folders hold only what apt-ds writes there: the PNGs of a plotted run go
    in its plots/, nowhere deeper (RUN/plots/sub would make its --overwrite refuse it), and another
    run's plots/ keeps its own curves. A folder of the user's own (RUN/figures) is theirs: the run's
    --overwrite refuses to replace it, naming it."""
    resolved = out.resolve()
    plotted = {run.resolve() for run in runs}
    for run in (parent for parent in resolved.parents if is_run_dir(parent)):
        if resolved == run / "plots" and run not in plotted:
            return (f"--out {out} is the plots folder of the run {run}, which is not among the runs plotted (its own "
                    f"curves would be replaced); choose another directory")
        if (run / "plots") in resolved.parents:
            own = f"use {run / 'plots'} itself, or " if run in plotted else ""
            return (f"--out {out} is inside {run / 'plots'}, which holds only that run's plots (its --overwrite would "
                    f"refuse it); {own}choose another directory")
    return None


def _plot(args) -> int:
    if args.out is not None and not args.out.strip():  # Path("") is "."
        return _fail("--out is empty: give the directory for the PNGs")
    args.out = Path(args.out) if args.out is not None else None
    if args.out is None and len(args.runs) > 1:
        return _fail("plotting several runs needs --out DIR (where the PNGs go)")
    out = args.out if args.out is not None else Path(args.runs[0]) / "plots"
    for path in args.runs:  # a killed --overwrite start: say where the previous run is (train puts it back)
        if note := set_aside_note(Path(path)):
            print(note, file=sys.stderr)
    try:
        runs = [read_run(Path(path), name) for path, name in zip(args.runs, _names(args.runs))]
    except PlotInputError as err:
        return _fail(str(err))
    if out.exists() and not out.is_dir():  # checked before anything is drawn or written
        return _fail(f"--out {out} exists and is not a directory")
    if is_run_dir(out):  # PNGs among a run's files would make --overwrite refuse the run as not only apt-ds's
        return _fail(f"--out {out} is a run directory; its plots go to {out / 'plots'} (the default for one run)")
    folder = replaced_folder(out, tuple(Path(path) for path in args.runs), keep=frozenset({"plots"}))
    if folder is not None:  # e.g. RUN/checkpoint/, replaced whole at the run's next checkpoint
        return _fail(f"--out {out} is or is inside {folder}, which the run replaces whole (and the plots with it); "
                     f"choose a directory outside it")
    if problem := _inside_another_run(out, [Path(path) for path in args.runs]):
        return _fail(problem)
    names = [CURVES_FILE] + ([SHAPE_FILE] if any(run.shape is not None for run in runs) else [])
    runs_own = out.resolve() in {(Path(path) / "plots").resolve() for path in args.runs}  # RUN/plots, named or not
    foreign = [name for name in names if (out / name).exists() and not (runs_own or _ours(out / name))]
    if foreign:
        return _fail(f"--out {out} holds {' and '.join(foreign)}, which this command did not write (or an apt-ds before "
                     f"its PNGs were marked); move {'them' if len(foreign) > 1 else 'it'} away or choose another --out")
    for run in runs:
        for note in run.notes:
            print(f"note: {note}", file=sys.stderr)
    try:
        written = [_save(draw_curves(runs), out / CURVES_FILE)]
        with_shape = [run for run in runs if run.shape is not None]  # the others have a note already
        if with_shape:
            written.append(_save(draw_shapes(with_shape), out / SHAPE_FILE))
    except OSError as err:  # --out not writable, disk full: nothing half-written is left (see _save)
        return _fail(f"cannot write the plots to {out}: {err.strerror or err}")
    for path in written:
        print(path)
    return 0


def _ours(path: Path) -> bool:
    """A PNG this command wrote: its Software chunk says so. (Any file in a run's own RUN/plots may
    be replaced too: the folder belongs to the run, and plots from before the mark are there.)"""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.format == "PNG" and image.info.get("Software") == PNG_SOFTWARE
    except (OSError, Image.DecompressionBombError):  # not an image, unreadable, a directory, absurdly large
        return False


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _names(paths: list[str]) -> list[str]:
    """Legend labels: each run directory's name, or the path as given where two names clash."""
    names = [Path(path).resolve().name or path for path in paths]
    return [name if names.count(name) == 1 else path for name, path in zip(names, paths)]


def _save(figure, path: Path) -> Path:
    """Write `figure` as a PNG through a temporary file in the same directory, then rename: a
    reader (a README, a browser refreshing) never sees half an image, and a failure leaves none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")  # unique: two plots at once
    try:
        with open(tmp, "xb") as stream:  # not mkstemp: the PNG gets the umask's mode, not 0600
            figure.savefig(stream, format="png", dpi=DPI, metadata={"Software": PNG_SOFTWARE})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _figure(width: float, height: float):
    """A Figure on the Agg canvas, without pyplot: no display needed, no global figure list to leak."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _colors(count: int) -> list:
    from matplotlib import colormaps

    palette = colormaps["tab10"].colors
    return [palette[i % len(palette)] for i in range(count)]


# (metric, panel title, y label)
PANELS = (("density", "density (kept share of block parameters)", "density"),
          ("total_rank", "total adapter rank", "rank"),
          ("loss", "training loss (task loss, without distillation)", "loss"),
          ("eval_loss", "eval loss", "loss"))


def draw_curves(runs: list[RunData]):
    from matplotlib.lines import Line2D

    figure = _figure(10, 7)
    axes = figure.subplots(2, 2, sharex=True).ravel()
    for run, color in zip(runs, _colors(len(runs))):
        for ax in axes:
            for step in run.events:
                ax.axvline(step, color=color, linestyle=":", linewidth=0.8, alpha=0.5)
        _line(axes[0], run, "density", color, drawstyle="steps-post")
        if run.target_density is not None:
            axes[0].axhline(run.target_density, color=color, linestyle="--", linewidth=0.8, alpha=0.6)
        _line(axes[1], run, "total_rank", color, drawstyle="steps-post")
        # The task loss, not the logged objective: on distillation steps that mixes in the
        # distillation loss with a weight that swings from step to step (a saw of dips, no trend).
        _line(axes[2], run, "task_loss" if "task_loss" in run.curves else "loss", color, linewidth=1.0)
        _line(axes[3], run, "eval_loss", color, marker="o", markersize=3)
    for ax, (key, title, ylabel) in zip(axes, PANELS):
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    for ax in axes[2:]:
        ax.set_xlabel("step")
    if not any("eval_loss" in run.curves for run in runs):
        axes[3].text(0.5, 0.5, "no eval_loss logged\n(train with --eval-data)", ha="center", va="center",
                     transform=axes[3].transAxes, color="gray")
    keys = [Line2D([], [], color=color, label=run.name) for run, color in zip(runs, _colors(len(runs)))]
    keys.append(Line2D([], [], color="gray", linestyle=":", label="pruning event"))
    if any(run.target_density is not None for run in runs):
        keys.append(Line2D([], [], color="gray", linestyle="--", label="target density"))
    figure.legend(handles=keys, loc="outside upper center", ncols=min(len(keys), 5), fontsize=9, frameon=False)
    return figure


def _line(ax, run: RunData, key: str, color, **style) -> None:
    if key in run.curves:
        steps, values = run.curves[key]
        ax.plot(steps, values, color=color, **style)


def draw_shapes(runs: list[RunData]):
    """One row of two heat maps per run: KV groups (narrow) and FFN neurons, layers top to bottom."""
    from matplotlib.colors import LinearSegmentedColormap
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory

    # Continuous from removed to kept: where a wide FFN is drawn in fewer pixels than it has
    # neurons, a pixel's shade is the share of its neurons kept.
    # white: a unit this layer never had (layers of different original widths)
    colormap = LinearSegmentedColormap.from_list("kept", [REMOVED_COLOR, KEPT_COLOR]).with_extremes(bad="white")
    heights = [1.2 + 0.22 * run.shape.neurons.shape[0] for run in runs]
    figure = _figure(10, sum(heights) + 0.4)
    rows = figure.subfigures(len(runs), 1, height_ratios=heights, squeeze=False)[:, 0]
    for row, run in zip(rows, runs):
        shape = run.shape
        groups_ax, neurons_ax = row.subplots(1, 2, width_ratios=[1, 7], sharey=True)
        layers = shape.neurons.shape[0]
        for ax, matrix in ((groups_ax, shape.groups), (neurons_ax, _binned(shape.neurons))):
            # extent: the x axis counts original units even where columns are bins of them
            width = (shape.groups if ax is groups_ax else shape.neurons).shape[1]
            ax.imshow(matrix, aspect="auto", cmap=colormap, vmin=0, vmax=1, interpolation="nearest",
                      extent=(-0.5, width - 0.5, layers - 0.5, -0.5))
        step = max(1, layers // 16)
        groups_ax.set_yticks(range(0, layers, step))
        groups_ax.set_ylabel("layer")
        groups_ax.set_xlabel(f"KV group (x{shape.group_size} heads)", fontsize=8)
        groups_ax.set_xticks(range(shape.groups.shape[1]) if shape.groups.shape[1] <= 8 else [])
        neurons_ax.set_xlabel("FFN neuron (original index)", fontsize=8)
        kept_groups, kept_neurons = shape.kept_counts()
        total_groups, total_neurons = shape.total_counts()
        on_right = blended_transform_factory(neurons_ax.transAxes, neurons_ax.transData)
        fontsize = 8 if layers <= 24 else 6
        for layer in range(layers):
            neurons_ax.text(1.01, layer, f"{kept_groups[layer]}/{total_groups[layer]} g  "
                            f"{kept_neurons[layer]}/{total_neurons[layer]} n", transform=on_right,
                            va="center", fontsize=fontsize)
        density = run.curves.get("density", ([], [None]))[1][-1]
        title = f"{run.name}: hidden {shape.hidden_kept}/{shape.hidden_total}"
        row.suptitle(title + (f", density {density:.3f}" if density is not None else ""), fontsize=10)
    figure.legend(handles=[Patch(color=KEPT_COLOR, label="kept"), Patch(color=REMOVED_COLOR, label="removed")],
                  loc="outside lower center", ncols=2, fontsize=9, frameon=False)
    return figure


def _binned(matrix, most: int = MAX_COLUMNS):
    """At most `most` columns, each the share kept of a run of neighbouring units: a wider matrix
    drawn as is would be resampled by the renderer, which drops or blurs units (and rows)."""
    import numpy as np

    size = -(-matrix.shape[1] // most)  # units per column, rounded up
    if size <= 1:
        return matrix
    padded = np.full((matrix.shape[0], -(-matrix.shape[1] // size) * size), np.nan)
    padded[:, : matrix.shape[1]] = matrix
    bins = padded.reshape(matrix.shape[0], -1, size)
    counted = (~np.isnan(bins)).sum(axis=2)
    kept = np.nansum(bins, axis=2)
    return np.where(counted > 0, kept / np.maximum(counted, 1), np.nan)
