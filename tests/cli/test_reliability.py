"""Bad input never costs data and never ends in a traceback.

Every case of the table below runs the real CLI (in process) in a directory that already holds
what a user has: their own files, a finished run, runs that were interrupted or damaged, an
export. Each must exit 2 with ONE line on stderr that names the problem, and leave every byte of
that directory as it was (names, sizes and contents: nothing created, nothing removed). The
kill/resume faults live in tests/distributed/test_distributed.py (SIGKILL mid-run, resume on fewer ranks) and
tests/export/test_export_safety.py (killed exports); disk-full, stops and --overwrite's recovery in
tests/cli/test_stops_and_full_disks.py.
docs/RELIABILITY.md lists all of them with what each leaves on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CLI_TEXT_ROWS as TEXT_ROWS
from conftest import RUN_FLAGS as BASE
from conftest import tree_digest

from apt_ds.cli.export import main as export_main
from apt_ds.cli.train import main as train_main

REPO = Path(__file__).resolve().parents[2]


def _write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value))


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A user's working directory: data, their files, a finished run, interrupted and damaged runs,
    an export, and a collection of bad input files."""
    root = tmp_path_factory.mktemp("home")
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in TEXT_ROWS))
    (root / "mine").mkdir()
    (root / "mine" / "thesis.tex").write_text("years of work")
    (root / ".git").mkdir()
    (root / "a_file").write_text("keep me")
    cwd = os.getcwd()
    os.chdir(root)  # the run records --data as given: resume cases run from here too
    try:
        assert train_main([*BASE, "--out", "run"]) == 0
        assert export_main(["run", "--out", "export"]) == 0
    finally:
        os.chdir(cwd)
    # A run killed before its first checkpoint: run.json and tokenizer, no checkpoint.
    (root / "no_checkpoint").mkdir()
    shutil.copy(root / "run" / "run.json", root / "no_checkpoint" / "run.json")
    # A run with a checkpoint at step 4 of 8 whose files were then damaged.
    for name, damage in (("torn_engine", "checkpoint/engine/trainable.safetensors"),
                         ("torn_masks", "checkpoint/masks.safetensors"),
                         ("torn_state", "checkpoint/apt_state.json")):
        shutil.copytree(root / "run", root / name)
        state = root / name / "checkpoint" / "apt_state.json"
        _write_json(state, {**json.loads(state.read_text()), "finished": False})
        target = root / name / damage
        target.write_bytes(target.read_bytes()[:100])
    # A run checkpointed by an earlier apt-ds, before kurtosis_weight and score_normalization existed.
    shutil.copytree(root / "run", root / "old_version")
    state = root / "old_version" / "checkpoint" / "apt_state.json"
    meta = {**json.loads(state.read_text()), "finished": False}
    meta["apt_config"] = {k: v for k, v in meta["apt_config"].items() if k not in ("kurtosis_weight", "score_normalization")}
    _write_json(state, meta)
    (root / "not_a_model").mkdir()
    (root / "not_a_model" / "weights.bin").write_text("")
    (root / "run_link").symlink_to("run")
    (root / "config_only").mkdir()
    shutil.copy(root / "export" / "config.json", root / "config_only" / "config.json")
    (root / "gpt2").mkdir()
    _write_json(root / "gpt2" / "config.json", {"model_type": "gpt2"})
    bad = root / "bad"
    bad.mkdir()
    (bad / "not_json.json").write_text("{steps: 8")
    (bad / "needs_model.yaml").write_text("model: null  # given on the command line\nsteps: 8\n")
    (bad / "resume.yaml").write_text("resume: true\n")
    (bad / "tabs.yaml").write_text("steps: 8\n\tlr: 0.1\n")
    for name, value in {"number.json": 42, "string.json": "hello", "list.json": [1, 2], "unknown.json": {"stepz": 8},
                        "typed.json": {"steps": "ten"}, "ds_stage7.json": {"zero_optimization": {"stage": 7}},
                        "ds_stage0.json": {"zero_optimization": {"stage": 0}}, "ds_list.json": [3],
                        "ds_zero_number.json": {"zero_optimization": 3},
                        "ds_clip.json": {"zero_optimization": {"stage": 2}, "gradient_clipping": 5.0},
                        "ds_bf16.json": {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}},
                        "ds_batch.json": {"zero_optimization": {"stage": 2}, "train_batch_size": "many"},
                        "ds_gas.json": {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 3},
                        "ds_auto.json": {"zero_optimization": {"stage": 2, "sub_group_size": "auto"}}}.items():
        _write_json(bad / name, value)
    (bad / "ds_not_json.json").write_text("{")
    (bad / "utf16.json").write_bytes('{"steps": 8}'.encode("utf-16"))  # what Notepad may save
    shutil.copy(root / "data.jsonl", bad / "other.jsonl")
    (bad / "empty.jsonl").write_text("")
    (bad / "no_fields.jsonl").write_text('{"foo": 1}\n')
    (bad / "torn.jsonl").write_text('{"text": "a"}\n{"text": \n')
    (bad / "latin1.jsonl").write_bytes('{"text": "a"}\n{"text": "caf\u00e9"}\n'.encode("latin-1"))  # not UTF-8
    (bad / "numbers.json").write_text("[1, 2, 3]")  # datasets reads it as a 'text' column of numbers
    (bad / "kept.json").write_text('{"groups": "all"}')
    (bad / "masks.pt").write_bytes(b"\x80\x04\x95\xfd" + bytes(range(256)))  # a pickle's first bytes: not text
    (bad / "twice.yaml").write_text("steps: 8\nlr: 0.001\nsteps: 6\n")
    (bad / "data_beside.yaml").write_text("data: data_beside.jsonl  # beside the recipe, not in the current directory\n")
    shutil.copy(root / "data.jsonl", bad / "data_beside.jsonl")
    (bad / "number_text.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": 5}\n')
    (bad / "no_rows.json").write_text("[]")
    import datasets

    datasets.Dataset.from_list([{"text": "a"}]).select([]).save_to_disk(str(bad / "no_rows_dataset"))
    (bad / "too_long.jsonl").write_text(json.dumps({"prompt": "p", "completion": "w " * 200}) + "\n")
    shutil.copytree(root / "run", root / "other_run")
    (bad / "empty_data.yaml").write_text('data: ""\nsteps: 8\n')
    (root / "other_tool").mkdir()  # another program's run.json: not an apt-ds run
    _write_json(root / "other_tool" / "run.json", {"tool": "other"})
    shutil.copytree(root / "run", root / "tokenizer_gone")
    (root / "tokenizer_gone" / "tokenizer" / "tokenizer.json").unlink()  # the tiny model is rebuilt from the run's tokenizer
    # An export into busy_export under way in another process (it holds the export lock beside it).
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; from apt_ds.io import run_lock; "
                               f"run_lock.acquire(Path({str(root / 'busy_export')!r}), 'export'); print('held', flush=True); "
                               "time.sleep(600)"], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert holder.stdout.readline().strip() == "held"
    yield root
    holder.kill()
    holder.wait()


def train(*argv: str) -> list[str]:
    return ["train", *BASE, *argv]


def train_global_batch(*argv: str) -> list[str]:
    """BASE without its --micro-batch-size, which --global-batch-size replaces (giving both is an error)."""
    at = BASE.index("--micro-batch-size")
    return ["train", *BASE[:at], *BASE[at + 2:], *argv]


def export(*argv: str) -> list[str]:
    return ["export", *argv]


# (case id, argv relative to the home directory, words the one line must contain)
CASES = [
    # --out: what it is and what is in it
    ("out-is-a-file", train("--out", "a_file"), "exists and is not a directory"),
    ("out-is-a-file-overwrite", train("--out", "a_file", "--overwrite"), "exists and is not a directory"),
    ("out-below-a-file", train("--out", "a_file/run"), "a_file is a file, not a directory"),
    ("out-empty", train("--out", ""), "--out is empty"),
    ("out-not-writable", train("--out", "/proc/self/apt-run"), "cannot write in /proc/self"),
    ("out-user-files", train("--out", "mine"), "is not empty and holds no apt-ds run"),
    ("out-user-files-overwrite", train("--out", "mine", "--overwrite"), "is not an apt-ds run directory (it holds thesis.tex)"),
    ("out-checkout-overwrite", train("--out", ".", "--overwrite"), "is not an apt-ds run directory"),
    ("out-previous-run", train("--out", "run"), "already holds a run; pass --resume"),
    ("out-run-without-checkpoint", train("--out", "no_checkpoint"), "stopped before its first checkpoint"),
    ("resume-run-without-checkpoint", train("--out", "no_checkpoint", "--resume"), "pass --overwrite instead of --resume"),
    ("resume-nothing", train("--out", "nothing_here", "--resume"), "holds no checkpoint"),
    ("resume-user-files", train("--out", "mine", "--resume"), "holds no checkpoint"),
    ("resume-and-overwrite", train("--out", "run", "--resume", "--overwrite"), "give one of them"),
    ("out-symlink-to-run-overwrite", train("--out", "run_link", "--overwrite"), "is a symbolic link"),
    # resume against a different or damaged run
    ("resume-changed-steps", ["train", *BASE[2:], "--steps", "12", "--out", "run", "--resume"], "changed: steps: 8 -> 12"),
    ("resume-changed-data", ["train", *BASE[:-1], "bad/other.jsonl", "--out", "torn_masks", "--resume"],
     "the run was trained on --data data.jsonl, not bad/other.jsonl"),
    ("resume-other-model", train("--model", "tiny-mha", "--out", "torn_masks", "--resume"), "is not the model this run"),
    ("resume-torn-engine", train("--out", "torn_engine", "--resume"), "cannot load optimizer/engine state"),
    ("resume-torn-masks", train("--out", "torn_masks", "--resume"), "corrupt checkpoint file"),
    ("resume-torn-state", train("--out", "torn_state", "--resume"), "corrupt checkpoint"),
    ("resume-earlier-apt-ds", train("--out", "old_version", "--resume"), "written by an earlier apt-ds"),
    # --config
    ("config-missing", train("--config", "bad/nope.json", "--out", "new"), "cannot read --config"),
    ("config-not-json", train("--config", "bad/not_json.json", "--out", "new"), "cannot read --config"),
    ("config-number", train("--config", "bad/number.json", "--out", "new"), "it holds a int"),
    ("config-string", train("--config", "bad/string.json", "--out", "new"), "it holds a str"),
    ("config-list", train("--config", "bad/list.json", "--out", "new"), "it holds a list"),
    ("config-unknown-field", train("--config", "bad/unknown.json", "--out", "new"),
     "unknown field 'stepz'; did you mean steps?"),
    ("recipe-needs-flag", train("--config", "bad/needs_model.yaml", "--out", "new"),
     "leaves model to the command line: give --model"),
    ("recipe-command-line-only", train("--config", "bad/resume.yaml", "--out", "new"), "resume is a command-line flag only"),
    ("recipe-bad-yaml", train("--config", "bad/tabs.yaml", "--out", "new"), "cannot read --config"),
    ("recipe-key-twice", train("--config", "bad/twice.yaml", "--out", "new"), "steps is given twice (lines 1 and 3): keep one"),
    ("recipe-relative-data", ["train", *BASE[:-2], "--config", "bad/data_beside.yaml", "--out", "new"],
     "--config bad/data_beside.yaml's data data_beside.jsonl does not exist; a recipe's relative paths are read from the current directory"),
    ("config-mistyped", train("--config", "bad/typed.json", "--out", "new"), "steps in --config bad/typed.json must be of type int"),
    # --model
    ("model-missing", train("--model", "nope", "--out", "new"), "--model nope does not exist"),
    ("model-a-file", train("--model", "a_file", "--out", "new"), "is not a .gguf file"),
    ("model-no-config", train("--model", "not_a_model", "--out", "new"), "has no config.json"),
    ("model-no-weights", train("--model", "config_only", "--out", "new"), "holds no *.safetensors weights"),
    ("model-is-a-run", train("--model", "run", "--out", "new"),
     "--model run is an apt-ds run, not a model: export it first (launch/export.py run --out DIR)"),
    ("model-another-programs-run-json", train("--model", "other_tool", "--out", "new"), "other_tool has no config.json"),
    ("out-inside-a-runs-checkpoint", train("--out", "run/checkpoint/sub"),
     "is or is inside"),
    ("model-not-llama", train("--model", "gpt2", "--out", "new"), "model_type 'gpt2' is not supported"),
    # --data / --eval-data
    ("data-missing", ["train", *BASE[:-1], "bad/nope.jsonl", "--out", "new"], "nope.jsonl"),
    ("data-empty", ["train", *BASE[:-1], "bad/empty.jsonl", "--out", "new"], "empty.jsonl"),
    ("data-no-usable-rows", ["train", *BASE[:-1], "bad/no_fields.jsonl", "--out", "new"], "no usable rows"),
    ("data-torn-json", ["train", *BASE[:-1], "bad/torn.jsonl", "--out", "new"], "torn.jsonl"),
    ("data-not-utf8", ["train", *BASE[:-1], "bad/latin1.jsonl", "--out", "new"],
     "latin1.jsonl is not UTF-8 text: byte 0xe9 on line 2"),
    ("data-list-of-numbers", ["train", *BASE[:-1], "bad/numbers.json", "--out", "new"],
     "numbers.json is a JSON list of int64 values: each row must be an object"),
    ("data-number-as-text", ["train", *BASE[:-1], "bad/number_text.jsonl", "--out", "new"],
     "field 'text' holds text mixed with other values (line 3: 5)"),
    ("eval-data-all-too-long", train("--eval-data", "bad/too_long.jsonl", "--out", "new"),
     "every row was dropped: its response alone exceeds --max-seq-len 32"),
    ("data-empty-flag", ["train", *BASE[:-1], "", "--out", "new"], "--data is empty"),  # an unset $DATA: not the demo data
    ("config-empty-flag", train("--config", "", "--out", "new"), "--config is empty"),
    ("recipe-empty-data", ["train", *BASE[:-2], "--config", "bad/empty_data.yaml", "--out", "new"],
     "--config bad/empty_data.yaml: data is empty: give a path, or remove the key for its default"),
    ("data-json-no-rows", ["train", *BASE[:-1], "bad/no_rows.json", "--out", "new"], "data file no_rows.json has no rows"),
    ("data-saved-dataset-no-rows", ["train", *BASE[:-1], "bad/no_rows_dataset", "--out", "new"],
     "holds a saved dataset with no rows"),
    ("eval-data-missing", train("--eval-data", "bad/nope.jsonl", "--out", "new"), "--eval-data bad/nope.jsonl does not exist"),
    ("eval-examples-zero", train("--eval-data", "data.jsonl", "--eval-examples", "0", "--out", "new"), "--eval-examples must be >= 1"),
    ("probe-without-eval-data", train("--save-eval-probe", "--out", "new"), "--save-eval-probe needs --eval-data"),
    # --deepspeed JSON: refused before a process group or a model exists
    ("ds-missing", train("--deepspeed", "bad/nope.json", "--out", "new"), "file not found"),
    ("ds-not-json", train("--deepspeed", "bad/ds_not_json.json", "--out", "new"), "invalid JSON at line 1"),
    ("ds-not-object", train("--deepspeed", "bad/ds_list.json", "--out", "new"), "top level must be a JSON object"),
    ("ds-stage-7", train("--deepspeed", "bad/ds_stage7.json", "--out", "new"), "stage must be 1, 2 or 3 (got 7)"),
    ("ds-stage-0", train("--deepspeed", "bad/ds_stage0.json", "--out", "new"), "stage must be 1, 2 or 3 (got 0)"),
    ("ds-zero-not-object", train("--deepspeed", "bad/ds_zero_number.json", "--out", "new"), "zero_optimization must be an object"),
    ("ds-clipping-contradicts", train("--deepspeed", "bad/ds_clip.json", "--out", "new"), "gradient_clipping=5.0 contradicts"),
    ("ds-bf16-vs-base-dtype", train("--deepspeed", "bad/ds_bf16.json", "--base-dtype", "fp32", "--out", "new"),
     "bf16.enabled=true contradicts --base-dtype fp32"),
    ("ds-batch-not-int", train("--deepspeed", "bad/ds_batch.json", "--out", "new"), "train_batch_size='many' is not a positive integer"),
    ("ds-accumulation-contradicts", train("--deepspeed", "bad/ds_gas.json", "--out", "new"), "gradient_accumulation_steps=3 contradicts"),
    ("ds-auto-unsupported", train("--deepspeed", "bad/ds_auto.json", "--out", "new"), "\"auto\" is not supported for zero_optimization.sub_group_size"),
    # flags and values
    ("flag-unknown", train("--target-densty", "0.5", "--out", "new"), "unrecognized arguments: --target-densty"),
    ("base-dtype-unknown", train("--base-dtype", "fp8", "--out", "new"), "invalid choice: 'fp8'"),
    ("base-dtype-fp16-on-cpu", train("--base-dtype", "fp16", "--device", "cpu", "--out", "new"), "fp16 is not supported on CPU"),
    *([("device-cuda-without-cuda", train("--device", "cuda", "--out", "new"), "no CUDA device is visible")]
      if not torch.cuda.is_available() else []),
    ("device-unknown", train("--device", "tpu", "--out", "new"), "--device must be auto, cpu, cuda or cuda:N"),
    ("density-above-one", train("--target-density", "1.5", "--out", "new"), "--target-density must be in (0, 1]"),
    ("density-zero", train("--target-density", "0", "--out", "new"), "--target-density must be in (0, 1]"),
    ("density-unreachable", train("--target-density", "0.01", "--out", "new"), "is below what this model can be pruned to"),
    ("steps-too-few", train("--steps", "2", "--out", "new"), "--steps must be >= 4"),
    ("steps-not-a-number", train("--steps", "many", "--out", "new"), "invalid int value: 'many'"),
    ("lr-negative", train("--lr", "-1", "--out", "new"), "--lr must be > 0"),
    ("warmup-not-shorter-than-run", train("--warmup-steps", "8", "--out", "new"), "--warmup-steps (8) must be < steps (8)"),
    ("max-seq-len-one", train("--max-seq-len", "1", "--out", "new"), "--max-seq-len must be >= 2"),
    ("micro-batch-zero", train("--micro-batch-size", "0", "--out", "new"), "--micro-batch-size must be >= 1"),
    ("max-grad-norm-inf", train("--max-grad-norm", "inf", "--out", "new"), "--max-grad-norm must be a finite number"),
    ("global-batch-zero", train_global_batch("--global-batch-size", "0", "--out", "new"), "--global-batch-size must be >= 1"),
    ("config-not-utf8", train("--config", "bad/utf16.json", "--out", "new"), "cannot read --config"),
    ("ds-not-utf8", train("--deepspeed", "bad/utf16.json", "--out", "new"), "cannot read it as UTF-8 JSON text"),
    ("global-and-micro-batch", train("--global-batch-size", "4", "--micro-batch-size", "1", "--out", "new"),
     "--micro-batch-size 1 sets it directly: give one of them"),
    ("global-batch-indivisible", train_global_batch("--global-batch-size", "3", "--grad-accum-steps", "2", "--out", "new"), "not divisible"),
    ("pruning-ends-after-run", train("--pruning-end-step", "20", "--out", "new"), "--pruning-end-step (20) must be <= steps"),
    ("rank-cap-below-rank", train("--rank-cap", "2", "--out", "new"), "--rank-cap must be >= adapter_rank"),
    ("adapter-target-unknown", train("--adapter-targets", "qq_proj", "--out", "new"), "invalid choice: 'qq_proj'"),
    ("max-seq-len-past-positions", train("--max-seq-len", "100000", "--out", "new"),
     "--max-seq-len 100000 is longer than --model tiny knows (max_position_embeddings is 512)"),
    # export
    ("export-no-arguments", export("--out", "new"), "give either RUN_DIR"),
    ("export-run-missing", export("nope", "--out", "new"), "nope"),
    ("export-run-without-checkpoint", export("no_checkpoint", "--out", "new"), "no_checkpoint"),
    ("export-out-user-files", export("run", "--out", "mine"), "is not an apt_ds export"),
    ("export-out-user-files-overwrite", export("run", "--out", "mine", "--overwrite"), "is not an apt_ds export"),
    ("export-out-previous-export", export("run", "--out", "export"), "holds a previous export; pass --overwrite"),
    ("export-out-is-the-run", export("run", "--out", "run", "--overwrite"), "is or contains the input"),
    ("export-out-in-checkpoint", export("run", "--out", "run/checkpoint/e"), "which the run replaces whole"),
    ("export-out-in-another-run", export("run", "--out", "other_run/checkpoint/e"), "which the run replaces whole"),
    ("export-out-is-a-file", export("run", "--out", "a_file", "--overwrite"), "exists and is not a directory"),
    ("export-out-empty", export("run", "--out", ""), "--out is empty"),
    ("export-out-below-a-file", export("run", "--out", "a_file/sub"), "--out a_file/sub: a_file is a file, not a directory"),
    ("export-kept-tiny-model", export("--model", "tiny", "--kept", "run/checkpoint/apt_state.json", "--out", "new"),
     "--model tiny is the built-in random model, which --kept cannot export"),
    ("export-dtype-unknown", export("run", "--out", "new", "--dtype", "fp8"), "invalid choice: 'fp8'"),
    ("export-shard-size-garbage", export("run", "--out", "new", "--max-shard-size", "huge"), "max-shard-size"),
    ("export-torn-checkpoint", export("torn_masks", "--out", "new"), "torn_masks"),
    ("export-kept-with-run", export("run", "--kept", "bad/kept.json", "--out", "new"), "--kept is for exporting a plain model"),
    ("export-shard-size-negative", export("run", "--out", "new", "--max-shard-size", "-5MB"),
     "--max-shard-size must be a positive size in KB, MB, GB or TB (powers of 1000) such as 500MB or 5GB, got '-5MB'"),
    ("export-tokenizer-removed", export("tokenizer_gone", "--out", "new"), "the run trained with: its files were changed or removed"),
    ("export-other-tiny-variant", export("run", "--model", "tiny-mha", "--out", "new"),
     "model tiny-mha is not the base model this run was trained from"),
    ("export-model-empty", export("run", "--model", "", "--out", "new"), "--model is empty"),
    ("export-base-is-a-run", export("run", "--model", "other_run", "--out", "new"), "--model other_run is an apt-ds run"),
    ("export-shard-size-with-gguf", export("run", "--out", "new", "--format", "gguf", "--max-shard-size", "1GB"),
     "--max-shard-size applies to --format hf"),
    ("export-kept-pickle", export("--model", "export", "--kept", "bad/masks.pt", "--out", "new"),
     "cannot read --kept bad/masks.pt: it is not JSON text"),
    ("export-kept-bad-record", export("--model", "export", "--kept", "bad/kept.json", "--out", "new"), "kept"),
    ("export-out-being-written", export("run", "--out", "busy_export"), "--out busy_export is being written by another export (PID"),
]


@pytest.mark.parametrize("argv, words", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_gives_one_line_and_changes_nothing(home, argv, words, capsys, monkeypatch, request):
    monkeypatch.chdir(home)
    before = tree_digest(home)
    main = train_main if argv[0] == "train" else export_main
    capsys.readouterr()
    try:
        code = main(argv[1:])
    except SystemExit as exit_info:  # argparse's own exit (with OneLineParser's one line)
        code = exit_info.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert tree_digest(home) == before
    if os.environ.get("APT_DS_RECORD_ERRORS"):  # docs/RELIABILITY.md's table is made from these lines
        with open(os.environ["APT_DS_RECORD_ERRORS"], "a") as record:
            record.write(json.dumps({"case": request.node.callspec.id, "argv": argv, "error": err[0]}) + "\n")


@pytest.mark.parametrize("change, words", [
    (["--steps", "12"], "changed: steps: 8 -> 12"),
    (["--micro-batch-size", "4"], "must keep the global batch (2 = micro 2"),
    (["--data", "bad/other.jsonl"], "the run was trained on --data data.jsonl, not bad/other.jsonl"),
], ids=["steps", "global-batch", "data"])
def test_resume_with_changed_settings_fails_before_the_data_is_read(home, change, words, capsys, monkeypatch):
    """The command line's settings are compared with the checkpoint's first: a mistyped --resume
    fails at once, not after a large data set is read and tokenized, and changes nothing."""
    from apt_ds.training import run as run_module

    def must_not_run(*args, **kwargs):
        raise AssertionError("the data was read before the settings were checked")

    monkeypatch.chdir(home)
    monkeypatch.setattr(run_module, "load_records", must_not_run)
    monkeypatch.setattr(run_module, "tokenize_for_task", must_not_run)
    before = tree_digest(home)
    capsys.readouterr()
    assert train_main([*BASE, *change, "--out", "torn_masks", "--resume"]) == 2  # argparse: the last value wins
    assert words in capsys.readouterr().err
    assert tree_digest(home) == before


def test_the_table_is_large_and_every_case_distinct():
    assert len(CASES) >= 40
    assert len({case[0] for case in CASES}) == len(CASES) and len({tuple(case[1]) for case in CASES}) == len(CASES)
