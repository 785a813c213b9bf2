"""Profile chosen optimizer steps of a `launch/train.py` run with torch.profiler: where a step's
time goes (operators by CPU and device time), for APT against LoRA on the same settings.

    python benchmarks/step_profile.py --steps-to-profile 20 22 --table OUT/profile_apt.txt -- \
        --device cuda --model M --data D --steps 24 --out /tmp/run --overwrite

Everything after `--` is launch/train.py's command line; the run is the CLI's own, in this
process, with the trainer wrapped for the chosen steps [first, last): each profiled step is the
training step and what the loop does after it (a pruning event, or a decay-window step's decision
and mask refresh). Written: tables of the operators by self device time (on GPUs) and by self CPU
time, the profiled steps' wall times (device synchronised before and after each), and how many
optimizer steps the profile holds. On a GPU also the operations that made the host wait for the
device inside those steps (`torch.cuda.set_sync_debug_mode`), counted by the innermost apt_ds
line that called them: each stalls the launch queue that keeps a GPU busy.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


PACKAGE_DIR = str(ROOT / "apt_ds") + os.sep


def sync_site(stack: list[traceback.FrameSummary]) -> str:
    """Where a synchronising operation came from (`stack` outermost first): the innermost apt_ds
    frame (the operation itself is usually deep in torch), else the innermost frame."""
    for frame in reversed(stack):
        if frame.filename.startswith(PACKAGE_DIR):
            return f"{Path(frame.filename).relative_to(ROOT)}:{frame.lineno} ({frame.name})"
    frame = stack[-1]
    return f"{frame.filename}:{frame.lineno} ({frame.name})"


class SyncSites:
    """Counts the warnings of the sync debug mode ("warn") by `sync_site` between `on` and `off`.

    torch warns from C++ on each operation that makes the host wait for the device (a copy to
    the host, `.item()`, `nonzero`, a stream synchronize; not `torch.cuda.synchronize`); the
    warning reaches Python's `warnings.showwarning` with the calling Python stack. Those raised in
    autograd's backward threads are replayed at the `.backward()` call, and counted there."""

    MESSAGE = "called a synchronizing CUDA operation"

    def __init__(self, get_mode, set_mode):
        self.get_mode, self.set_mode = get_mode, set_mode
        self.counts: collections.Counter[str] = collections.Counter()
        self._context = None
        self._mode_before = None

    @classmethod
    def for_cuda(cls) -> SyncSites | None:
        """On a CUDA machine: counting that touches the device only once the run uses it (a
        --device cpu run there creates no CUDA context)."""
        import torch

        if not torch.cuda.is_available():
            return None

        def get_mode():
            return torch.cuda.get_sync_debug_mode() if torch.cuda.is_initialized() else 0

        def set_mode(mode):
            if torch.cuda.is_initialized():
                torch.cuda.set_sync_debug_mode(mode)

        return cls(get_mode, set_mode)

    def _show(self, message, category, filename, lineno, file=None, line=None):
        if self.MESSAGE in str(message):
            # the caller's frames without reading source lines (this runs inside the timed steps)
            frames = traceback.StackSummary.extract(traceback.walk_stack(sys._getframe(1)), lookup_lines=False)
            self.counts[sync_site([f for f in reversed(frames) if f.filename != warnings.__file__])] += 1
        else:
            self._previous(message, category, filename, lineno, file, line)

    def on(self) -> None:
        if self._context is not None:
            return
        self._context = warnings.catch_warnings()  # restores showwarning and the filters on exit
        self._context.__enter__()
        warnings.filterwarnings("always", message=self.MESSAGE)  # every occurrence; other warnings as before
        self._previous, warnings.showwarning = warnings.showwarning, self._show
        self._mode_before = self.get_mode()
        self.set_mode("warn")

    def off(self) -> None:
        if self._context is None:
            return
        self.set_mode(self._mode_before)
        self._context.__exit__(None, None, None)
        self._context = None

    def report(self) -> str:
        total = sum(self.counts.values())
        lines = [f"{count:6d}  {site}" for site, count in self.counts.most_common()]
        return (f"host waits for the device (synchronising operations) inside the profiled steps, counted while "
                f"CUDA was in use: {total}\n" + "\n".join(lines))


def profiled_train(train_argv: list[str], first: int, last: int, table: Path, rows: int = 40,
                   syncs: SyncSites | None = None) -> int:
    """`syncs`: what counts host waits (default: `SyncSites.for_cuda()`, none without CUDA)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from apt_ds.cli.train import main as train_main
    from apt_ds.training.trainer import APTrainer

    train_step, after_step = APTrainer._train_step, APTrainer._after_step
    wall: list[float] = []
    started: list[float] = []  # the start of the step being profiled
    opened: list[bool] = []  # [True] while the profiler is recording
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(activities=activities)
    syncs = syncs if syncs is not None else SyncSites.for_cuda()

    def sync() -> None:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def close() -> None:
        if syncs is not None:
            syncs.off()
        if opened:
            opened.pop()
            profiler.__exit__(None, None, None)

    # One profiled step = the training step and what follows it in the loop (a pruning event, or
    # a decay-window step's decision and mask refresh), so nothing between steps goes unaccounted.
    def wrapped_train_step(self, batches):
        if first <= self.step < last:  # self.step: the optimizer steps done, i.e. this step's index
            if not opened and not wall:  # the window's first step (also when a resumed run starts inside it)
                profiler.__enter__()
                opened.append(True)
            sync()
            if syncs is not None:  # this step and what follows it; not the logging and checkpoints between
                syncs.on()
            started[:] = [time.perf_counter()]
        return train_step(self, batches)

    def wrapped_after_step(self):
        record = after_step(self)
        if started:
            sync()
            wall.append(time.perf_counter() - started.pop())
            if syncs is not None:
                syncs.off()
            if self.step >= last or self.step >= self.train_config.steps:  # the window or the run is over
                close()
        return record

    APTrainer._train_step, APTrainer._after_step = wrapped_train_step, wrapped_after_step
    try:
        code = train_main(train_argv)
    finally:
        APTrainer._train_step, APTrainer._after_step = train_step, after_step
        close()  # the run failed inside the window
    if not wall:
        raise SystemExit(f"error: no step in [{first}, {last}) ran (steps are counted from 0; a resumed run "
                         f"starts where it stopped)")
    averages = profiler.key_averages()
    # one row per device type: the optimizer's CPU row counts each step once
    optimizer_steps = sum(e.count for e in averages if e.key.startswith("Optimizer.step#") and e.device_type == DeviceType.CPU)
    tables = [("self CPU time", averages.table(sort_by="self_cpu_time_total", row_limit=rows))]
    if ProfilerActivity.CUDA in activities:  # device time first: what the GPU was busy with
        tables.insert(0, ("self device time", averages.table(sort_by="self_device_time_total", row_limit=rows)))
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text(f"train: {' '.join(train_argv)}\n"
                     f"profiled steps [{first}, {last}), each with what follows it (event, or decision and mask "
                     f"refresh): wall s {[round(w, 4) for w in wall]}\n"
                     f"optimizer steps inside the profile: {optimizer_steps}\n"
                     + (f"\n== {syncs.report()}\n" if syncs is not None else "")
                     + "".join(f"\n== operators by {title}\n{text}\n" for title, text in tables))
    return code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps-to-profile", type=int, nargs=2, metavar=("FIRST", "LAST"), required=True,
                        help="profile the optimizer steps FIRST .. LAST-1 (counted from 0)")
    parser.add_argument("--table", type=Path, required=True, help="where the operator table goes")
    parser.add_argument("--rows", type=int, default=40)
    args, rest = parser.parse_known_args()
    if rest[:1] == ["--"]:
        rest = rest[1:]
    first, last = args.steps_to_profile
    if not 0 <= first < last:
        parser.error("--steps-to-profile needs 0 <= FIRST < LAST")
    sys.exit(profiled_train(rest, first, last, args.table, args.rows))


if __name__ == "__main__":
    main()
