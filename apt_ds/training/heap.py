"""Give freed heap memory back to the operating system: after a pruning event and the steps that
follow it (`HeapSettling`), after loading, and as it is freed on CPU runs under ZeRO-3
(`large_allocations_returned`; there after every step as well).

PyTorch's CPU allocator sits on malloc. A shape change frees the old, larger weight and
optimizer tensors, but glibc keeps most of those pages in the process (they count in RSS)
until the heap is trimmed, so physical pruning would not lower the memory a job holds.
Measured on SmolLM2-135M/BoolQ (docs/BENCHMARKS_HISTORY.md): untrimmed, APT 0.7's RSS after its last
pruning event was 1.05x dense LoRA's (1,715 vs 1,634 MB); trimmed after each event, 0.90x.

The full garbage collection before the trim finds what a shape change leaves in reference
cycles: under DeepSpeed an old engine refers to itself and the parameters it managed carry
bound methods pointing back at it, so replaced weights are freed only by this collection. It
would also walk every object alive since start-up (transformers, DeepSpeed and a loaded
SmolLM2 make ~440k: 0.21 s a collection on a 2-vCPU EPYC), so the CLI runs training inside
`startup_objects_frozen()`, entered after the imports and before the model is loaded."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
from collections.abc import Iterator


def release_free_heap() -> bool:
    """Collect garbage and return free heap pages to the OS (glibc `malloc_trim(0)`).
    A no-op returning False on other C libraries and platforms."""
    gc.collect()
    return trim_free_heap()


def trim_free_heap() -> bool:
    """glibc's `malloc_trim(0)`: True if it gave pages back; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return False


class HeapSettling:
    """Trim the heap at the end of steps: of each of the first `steps` steps after a shape change,
    and of every step once `large_allocations_returned` has set the process's mmap threshold (CPU
    runs under ZeRO-3).

    After a pruning event the tensors change size, and the small allocations that glibc serves from
    its arenas (every block under the mmap threshold) no longer fit the holes the old sizes left:
    steps after an event carve new memory while the holes stay resident. Measured at the 1B shape
    on 2 ranks under ZeRO-3 (docs/BENCHMARKS.md), the steps after the last event rose by 28, 5 and
    8 MB with the live tensors constant, and were flat within 3 MB with a trim after each. At 3B
    the rise resumed once three trims were over (+33, +35, +16 MB a step): under ZeRO-3 on a CPU,
    where the threshold leaves only small blocks in the heap and a trim is cheap beside a step,
    every step trims. A trim only: the event's own release collected the garbage."""

    def __init__(self, steps: int = 3):
        self.steps, self.left = steps, 0

    def shape_changed(self) -> None:
        self.left = self.steps

    def step_done(self) -> None:
        if self.left or _threshold_fixed:
            self.left = max(0, self.left - 1)
            trim_free_heap()


MMAP_THRESHOLD = 2**20  # glibc serves every allocation of 1 MiB or more by mmap (M_MMAP_THRESHOLD)
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def large_allocations_returned(device, environ=os.environ) -> bool:
    """On a CPU under ZeRO-3, give every freed tensor of 1 MiB or more back to the OS at once (glibc
    `mallopt(M_MMAP_THRESHOLD, 1 MiB)`, which also stops glibc from raising that threshold).

    By default glibc raises its mmap threshold to the size of the last freed mmapped block (up to
    32 MiB), after which weights gathered and freed over and over (ZeRO-3 gathers every layer
    for each forward and backward) come from the heap and stay in it: measured on a 1B LLaMA
    shape, 2 ranks, ZeRO-3 (docs/BENCHMARKS.md), up to 2 GB of free heap per rank, resident, and
    steps after the last pruning event 0.5-0.9 GB higher; with the fixed threshold the step times
    were within 5% at 3B, and up to ~30% slower at 1B in one A/B run (docs/BENCHMARKS.md): host
    memory first, as a CPU run is memory-bound; `MALLOC_MMAP_THRESHOLD_=33554432` chooses speed. A
    GPU's weights are not in this heap: nothing is
    changed there, nor where the user chose a threshold (MALLOC_MMAP_THRESHOLD_, GLIBC_TUNABLES'
    glibc.malloc.mmap_threshold) or on other C libraries. True if set."""
    chosen = "MALLOC_MMAP_THRESHOLD_" in environ or "mmap_threshold" in environ.get("GLIBC_TUNABLES", "")
    if getattr(device, "type", device) != "cpu" or chosen or not sys.platform.startswith("linux"):
        return False
    global _threshold_fixed
    try:
        _threshold_fixed = bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):  # musl and others
        return False
    return _threshold_fixed


_threshold_fixed = False  # large_allocations_returned set it in this process (HeapSettling trims every step)


MALLINFO2_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


def malloc_counts() -> dict[str, int] | None:
    """glibc's own counts in bytes (`mallinfo2`: uordblks in use in the heap, fordblks free in it,
    hblkhd in mmapped blocks, ...); None on other C libraries and glibc before 2.33."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2_FIELDS]

    mallinfo2.restype = Mallinfo2
    info = mallinfo2()
    return {name: getattr(info, name) for name in MALLINFO2_FIELDS}


def import_training_libraries(with_deepspeed: bool) -> None:
    """Import now what training imports lazily anyway (transformers' model classes; DeepSpeed when
    asked for), so that `startup_objects_frozen`, entered next, hides their objects from the
    garbage collector. Measured on SmolLM2: the collection at a pruning event then walks 43k
    objects instead of 231k (0.03 s instead of 0.16 s on the 2-vCPU EPYC)."""
    # transformers is lazy: naming the classes imports them. The LR schedule's module imports peft,
    # and peft bitsandbytes where it is installed (80k objects that an event would walk otherwise).
    from transformers import (  # noqa: F401
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaForCausalLM,
        get_cosine_with_min_lr_schedule_with_warmup,
    )

    if with_deepspeed:
        from apt_ds.distributed.zero_comm import import_deepspeed

        import_deepspeed()


@contextlib.contextmanager
def startup_objects_frozen() -> Iterator[None]:
    """Hide every object alive now from the cyclic garbage collector until the block ends
    (`gc.freeze`), so that collections inside it only walk what the block created. Enter it
    before creating anything that may end up in garbage cycles (a model, an engine): frozen
    objects are still freed when their last reference goes, but a frozen cycle is not found
    until the block ends, and is collected then. A collection first, so that cycles already
    unreachable are not kept through the block.

    Where something else froze objects before (a pre-fork server; the H200 image's Python had 375
    frozen at start-up), the objects are frozen all the same, or every event's collection would walk
    the ~470k objects of a loaded 7B run (0.23-0.32 s an event there). `gc.unfreeze` cannot tell
    their freeze from ours, so the block ends with an unfreeze, a collection (the cycles the block
    left) and a freeze of what is still alive: theirs stay frozen, and so does whatever else is
    alive then. Blocks nest: an inner one leaves the outer one's state as it found it."""
    global _freezing
    frozen_before, freezing_before = gc.get_freeze_count(), _freezing
    gc.collect()
    try:
        gc.freeze()  # inside the try: an interrupt right after it still unfreezes
        _freezing = True
        yield
    finally:
        _freezing = freezing_before
        gc.unfreeze()
        gc.collect()
        if frozen_before:
            gc.freeze()


_freezing = False  # inside startup_objects_frozen's block


def freeze_prepared_data() -> bool:
    """Inside `startup_objects_frozen`'s block, hide from the collector what exists now as well:
    called once the training data is tokenized and before the model is built. The tokenized
    examples are a dict and two lists each, which every full collection at a pruning event would
    otherwise walk (40k packed examples of gpu_check's small random model: about 55 ms of
    collection an event on the 2-vCPU EPYC; it grows with the data set). The model and the engine
    come after, so their cycles stay visible: nothing alive here may later join a cycle with
    weights or an engine. A collection first, as on entry. Elsewhere (no block of ours) a no-op returning
    False: a freeze would outlive the caller."""
    if not _freezing:
        return False
    gc.collect()
    gc.freeze()
    return True
