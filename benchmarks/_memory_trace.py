"""What a rank holds during a training step, from the allocator's own record (for
benchmarks/zero3_memory.py).

Two views, both per rank:
- **held** at a step's start: every tensor reachable from the trainer (the model's ZeRO-3
  partitions, gathered or persistent parameters, the engine's optimizer, the APT state, the
  teacher), by owner, each storage counted once;
- **the step**: torch's profiler with `profile_memory` records every CPU allocation and free with
  its size and the running total, inside the op and the Python frame that made it. Replayed, it
  gives the step's peak above its start and the allocations live at that moment, grouped by the
  frame that made them (DeepSpeed's gather, gloo's buffers, autograd's saved tensors, ...).
RSS minus what the allocator holds is the libraries and the heap that glibc keeps.
"""

from __future__ import annotations

import collections
import contextlib
import time

import torch

OWN_FRAMES = ("deepspeed/", "apt_ds/", "transformers/", "peft/", "bitsandbytes/")


def _storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # meta, sparse
        return None
    if tensor.device.type != "cpu" or storage.nbytes() == 0:
        return None
    return storage.data_ptr(), storage.nbytes()


def tensors_within(root, limit: int = 200_000):
    """Every tensor reachable from `root` through attributes, lists, tuples, sets and dicts
    (modules, optimizers, dataclasses), each object visited once."""
    seen, stack, found = set(), [root], []
    while stack and len(seen) < limit:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            extra = getattr(obj, "__dict__", None)  # ds_tensor and friends live on the parameter
            if extra:
                stack.extend(extra.values())
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
            stack.extend(k for k in obj if isinstance(k, torch.Tensor))
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack.extend(obj)
        elif isinstance(obj, torch.nn.Module):
            stack.extend(obj._parameters.values())
            stack.extend(obj._buffers.values())
            stack.extend(obj._modules.values())
            stack.extend(v for k, v in vars(obj).items() if not k.startswith("_"))
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("apt_ds", "deepspeed", "torch"):
            stack.extend(vars(obj).values())
    return found


def held_breakdown(trainer) -> dict[str, float]:
    """MiB held at this moment by owner, each storage counted once, owners in this order."""
    model = trainer.model
    counted: set[tuple[int, int]] = set()
    out: dict[str, float] = {}

    def count(name: str, tensors) -> None:
        total = 0
        for tensor in tensors:
            key = _storage_key(tensor)
            if key is not None and key not in counted:
                counted.add(key)
                total += key[1]
        out[name] = out.get(name, 0.0) + total / 2**20

    params = list(model.named_parameters())
    count("base weights: this rank's partitions", [p.ds_tensor for _, p in params if not p.requires_grad and hasattr(p, "ds_tensor")])
    count("adapters: partitions", [p.ds_tensor for _, p in params if p.requires_grad and hasattr(p, "ds_tensor")])
    count("parameters whole on the rank (gathered, persistent or not ZeRO-3)", [p.data for _, p in params])
    count("buffers (RoPE, masks registered on modules)", [b for b in model.buffers()])
    engine = getattr(trainer.backend, "engine", None)
    if engine is not None:
        count("optimizer: fp32 partitions, Adam moments, gradient partitions", tensors_within(engine.optimizer))
        count("engine: other", tensors_within({k: v for k, v in vars(engine).items() if k != "module"}))
    else:
        optimizer = getattr(trainer.backend, "optimizer", None)
        count("optimizer: Adam moments", tensors_within(optimizer))
        count("gradients", [p.grad for _, p in params if p.grad is not None])
    count("APT state: salience, masks, adapters' bookkeeping", tensors_within(trainer.state))
    count("rank-growth tuner", tensors_within(getattr(trainer, "tuner", None)))
    count("distillation (transform, teacher state)", tensors_within(getattr(trainer, "distiller", None)))
    count("trainer: other", tensors_within({k: v for k, v in vars(trainer).items()
                                            if k not in ("model", "backend", "state", "tuner", "distiller")}))
    return {k: round(v, 1) for k, v in out.items()}


def _label(event) -> tuple[str, str]:
    """(where: the innermost frame of apt_ds / DeepSpeed / transformers, or the autograd node;
    the op that allocated) for an allocation event."""
    op, where, node = "", "", event.parent
    while node is not None:
        name = node.name
        if not op and name.startswith("aten::"):
            op = name
        if "evaluate_function:" in name:
            return "backward: " + name.split("evaluate_function:")[1].strip(), op
        if ".py(" in name and any(tag in name for tag in OWN_FRAMES):
            where = name.split("site-packages/")[-1]
            break
        node = node.parent
    return where or "other", op


def module_at(event) -> str:
    node = event.parent
    while node is not None:
        if node.name.startswith("nn.Module: "):
            return node.name[len("nn.Module: "):]
        node = node.parent
    return ""


def replay(prof, top: int = 12) -> dict:
    """The step's allocator peak above its start (MiB) and what was live then, by allocating frame."""
    from torch._C._profiler import _EventType

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)

    events = sorted((e for e in walk(prof.profiler.kineto_results.experimental_event_tree())
                     if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == "cpu"),
                    key=lambda e: e.start_time_ns)
    live: dict[int, object] = {}
    total = peak = 0
    peak_live: dict[int, object] = {}
    peak_event = None
    for event in events:
        fields = event.typed[1]
        if fields.alloc_size > 0:
            missed = live.get(fields.ptr)  # its free was not recorded (another thread's): count it freed
            total += fields.alloc_size - (missed.typed[1].alloc_size if missed is not None else 0)
            live[fields.ptr] = event
        elif live.pop(fields.ptr, None) is not None:
            total += fields.alloc_size
        if total > peak:
            peak, peak_live, peak_event = total, dict(live), event
    groups: dict[tuple[str, str], list[int]] = {}
    for event in peak_live.values():
        entry = groups.setdefault(_label(event), [0, 0])
        entry[0] += event.typed[1].alloc_size
        entry[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {
        "peak_above_start_mb": round(peak / 2**20, 1),
        "at": (module_at(peak_event) + " / " + "".join(_label(peak_event))) if peak_event is not None else "",
        "net_after_mb": round(total / 2**20, 1),
        "live_at_peak": [{"where": w, "op": op, "mb": round(b / 2**20, 1), "count": n} for (w, op), (b, n) in ranked[:top]],
        "live_at_peak_rest_mb": round(sum(b for _, (b, _) in ranked[top:]) / 2**20, 1),
    }


@contextlib.contextmanager
def allocations_recorded():
    """Profile the block's CPU allocations (sizes, frames, module calls)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True, with_stack=True) as prof:
        yield prof


def rss_mb() -> dict[str, float]:
    from _common import proc_status_mb

    return {k: round(v, 1) for k, v in proc_status_mb("RssAnon", "VmHWM", "RssFile", "RssShmem").items()}


def mallinfo_mb() -> dict[str, float]:
    """glibc's own count: bytes in use by malloc (in the heap + mmapped) and free inside the heap."""
    from apt_ds.training.heap import malloc_counts

    counts = malloc_counts() or dict.fromkeys(("uordblks", "hblkhd", "fordblks"), 0)
    return {"malloc_in_use": round((counts["uordblks"] + counts["hblkhd"]) / 2**20, 1),
            "malloc_free_in_heap": round(counts["fordblks"] / 2**20, 1)}


def now() -> float:
    return time.time()


def large_tensors(min_mb: float = 256) -> list[dict]:
    """Tensors of `min_mb` MiB or more that Python can reach, with what refers to them (one level
    of referrers' types and, for dicts, the keys pointing at them): to find a buffer that outlives
    its use. Storages are reported once."""
    import gc

    found, seen = [], set()
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        key = _storage_key(obj)
        if key is None or key[1] < min_mb * 2**20 or key in seen:
            continue
        seen.add(key)
        referrers = []
        for ref in gc.get_referrers(obj):
            if isinstance(ref, dict):
                names = [k for k, v in ref.items() if v is obj][:3]
                referrers.append(f"dict{names}")
            elif type(ref).__name__ not in ("frame", "list") or len(referrers) < 8:
                referrers.append(type(ref).__module__ + "." + type(ref).__name__)
        found.append({"mb": round(key[1] / 2**20, 1), "shape": list(obj.shape), "referrers": referrers[:8]})
    return found
