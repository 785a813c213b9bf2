"""Conversations (apt_ds.io.conversations): TRL `messages`, ShareGPT `conversations` and prompt/completion
message lists give the same ids and loss mask; the ids are the tokenizer's own rendering of the chat;
the learned tokens are exactly each assistant message's tokens and its end-of-turn token; long
conversations are cut at turn boundaries; rows without an assistant turn are skipped and counted."""

from __future__ import annotations

import json

import pytest

from apt_ds.io import data
from apt_ds.io.data import IGNORE_INDEX, DataError, load_records, tokenize_dataset

# LLaMA-3's template, without its tool and date handling
LLAMA3 = ("{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")
# Qwen2.5's, without tools: a default system prompt when the conversation has none
QWEN = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
        "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
        "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
# Qwen3's shape: the last assistant turn opens with an empty think block the generation prompt lacks
QWEN3 = ("{%- for message in messages %}{%- if message.role == 'assistant' and loop.last %}"
         "{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message.content + '<|im_end|>\n' }}{%- else %}"
         "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
         "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")

CONVERSATION = [{"role": "system", "content": "You sort letters."}, {"role": "user", "content": "Sort dcba."},
                {"role": "assistant", "content": "abcd"}, {"role": "user", "content": "And zyx?"},
                {"role": "assistant", "content": "xyz, sorted."}]
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


def _byte_level_bpe(specials: list[str], template: str, bos: str | None, eos: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(data.demo_data_path().read_text().splitlines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=specials[0])
    fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def chat_tokenizers():
    """LLaMA-3-style, Qwen2.5-style and Qwen3-style tokenizers, and each one's end-of-turn token."""
    llama = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    qwen = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return {"llama3": (_byte_level_bpe(llama, LLAMA3, "<|begin_of_text|>", "<|eot_id|>"), "<|eot_id|>"),
            "qwen2.5": (_byte_level_bpe(qwen, QWEN, None, "<|im_end|>"), "<|im_end|>"),
            "qwen3": (_byte_level_bpe(qwen, QWEN3, None, "<|im_end|>"), "<|im_end|>")}


def _formats(conversation: list[dict]) -> dict[str, dict]:
    """The same conversation in each accepted format."""
    split = max(i for i, m in enumerate(conversation) if m["role"] != "assistant") + 1
    return {"messages": {"messages": conversation},
            "sharegpt": {"conversations": [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in conversation]},
            "prompt/completion": {"prompt": conversation[:split], "completion": conversation[split:]}}


def _learned_runs(example: dict) -> list[list[int]]:
    """The runs of consecutive learned tokens."""
    runs, current = [], []
    for token, label in zip(example["input_ids"], example["labels"]):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            runs, current = [*runs, current], []
    return runs + ([current] if current else [])


@pytest.mark.parametrize("style", ["llama3", "qwen2.5", "qwen3"])
def test_every_format_gives_the_tokenizers_rendering_learned_on_the_assistant_turns(chat_tokenizers, style):
    tokenizer, end_of_turn = chat_tokenizers[style]
    examples = {name: tokenize_dataset([row], tokenizer, 512, pack=False)[0] for name, row in _formats(CONVERSATION).items()}
    first = examples["messages"]
    assert examples["sharegpt"] == first and examples["prompt/completion"]["input_ids"] == first["input_ids"]
    # prompt/completion learns the completion's turns only, as TRL does: the prompt's reply is context
    assert _learned_runs(examples["prompt/completion"]) == _learned_runs(first)[1:]
    assert first["input_ids"] == list(tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"])
    eot = tokenizer.convert_tokens_to_ids(end_of_turn)
    replies = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert _learned_runs(first) == [tokenizer(reply, add_special_tokens=False)["input_ids"] + [eot] for reply in replies]


def test_train_on_prompt_learns_every_token(chat_tokenizers):
    tokenizer, _ = chat_tokenizers["llama3"]
    (example,) = tokenize_dataset([{"messages": CONVERSATION}], tokenizer, 512, pack=False, train_on_prompt=True)
    assert example["labels"] == example["input_ids"]
    # instruction rows too: the prompt is learned
    (row,) = tokenize_dataset([{"instruction": "Sort dcba.", "output": "abcd"}], tokenizer, 512, pack=False,
                              train_on_prompt=True)
    assert row["labels"] == row["input_ids"]


def test_a_long_conversation_is_cut_after_its_last_whole_turn_that_fits(chat_tokenizers):
    tokenizer, _ = chat_tokenizers["qwen2.5"]
    (whole,) = tokenize_dataset([{"messages": CONVERSATION}], tokenizer, 512, pack=False)
    first_turn_end = len(tokenize_dataset([{"messages": CONVERSATION[:3]}], tokenizer, 512, pack=False)[0]["input_ids"]) - 1
    assert whole["input_ids"][first_turn_end - 1] == tokenizer.convert_tokens_to_ids("<|im_end|>")  # then its newline
    stats = data.TruncationStats()  # the second assistant turn's end of turn does not fit
    (cut,) = tokenize_dataset([{"messages": CONVERSATION}], tokenizer, len(whole["input_ids"]) - 3, pack=False, stats=stats)
    assert cut["input_ids"] == whole["input_ids"][:first_turn_end] and cut["labels"] == whole["labels"][:first_turn_end]
    assert _learned_runs(cut) == _learned_runs(whole)[:1]
    assert stats.turns_cut == 1 and "1 conversation was cut after the last whole turn that fits" in stats.message("d", 9)
    # the first assistant turn does not fit whole: cut inside it, while a learned token remains
    stats = data.TruncationStats()
    (inside,) = tokenize_dataset([{"messages": CONVERSATION}], tokenizer, first_turn_end - 2, pack=False, stats=stats)
    assert inside["input_ids"] == whole["input_ids"][: first_turn_end - 2] and stats.turn_cut_inside == 1
    # no learned token fits: dropped, and a data set of only such rows is one line
    with pytest.raises(DataError, match="every row was dropped"):
        tokenize_dataset([{"messages": CONVERSATION}], tokenizer, 8, pack=False)


def test_a_conversation_without_an_assistant_turn_is_skipped_and_counted(chat_tokenizers):
    tokenizer, _ = chat_tokenizers["llama3"]
    rows = [{"messages": CONVERSATION[:2]}, {"messages": CONVERSATION}, {"messages": CONVERSATION[:2]}]
    stats = data.TruncationStats()
    assert len(tokenize_dataset(rows, tokenizer, 512, pack=False, stats=stats)) == 1
    assert stats.without_reply == 2 and stats.to_dict()["without_reply"] == 2
    assert "2 conversations were skipped, having no assistant turn to learn (the first is row 1)" in stats.message("d", 512)
    with pytest.raises(DataError, match=r"^d: no conversation has an assistant turn to learn from \(1 without one\)$"):
        tokenize_dataset(rows[:1], tokenizer, 512, pack=False, source="d")


def test_a_tokenizer_without_a_chat_template_is_one_line_naming_template(tokenizer):
    assert tokenizer.chat_template is None
    with pytest.raises(DataError, match=r"^the data holds conversations, .* the tokenizer of --model m has none .*"
                                        r"--template alpaca or none$"):
        tokenize_dataset([{"messages": CONVERSATION}], tokenizer, 64, pack=False, tokenizer_name="of --model m")


@pytest.mark.parametrize("message, problem", [({"role": "robot", "content": "x"}, "has role 'robot'"),
                                              ({"role": "user", "content": 5}, "role user is int, not text")])
def test_a_malformed_message_is_one_line_naming_the_row(chat_tokenizers, message, problem):
    tokenizer, _ = chat_tokenizers["llama3"]
    with pytest.raises(DataError, match=rf"^row 2: .*{problem}"):
        tokenize_dataset([{"messages": CONVERSATION}, {"messages": [message, *CONVERSATION[2:]]}], tokenizer, 64, pack=False)


def test_conversation_files_load_in_every_format(tmp_path):
    for name, row in _formats(CONVERSATION).items():
        path = tmp_path / f"{name.replace('/', '_')}.jsonl"
        path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
        assert len(load_records(path)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": "hello"}) + "\n")
    with pytest.raises(DataError, match=r"^data file bad.jsonl: field 'messages' must hold lists of messages"):
        load_records(bad)


def test_a_run_trains_on_conversations_with_the_built_in_model(tmp_path):
    """End to end: ShareGPT rows with a system prompt and two exchanges train the tiny model (whose
    tokenizer has a chat template); the recipe key train_on_prompt is recorded."""
    from apt_ds.cli.train import main as train_main

    rows = [{"conversations": [{"from": "system", "value": "You sort letters."},
                               {"from": "human", "value": f"Sort {word}."}, {"from": "gpt", "value": "".join(sorted(word))},
                               {"from": "human", "value": "Reverse it."}, {"from": "gpt", "value": word[::-1]}]}
            for word in ("dcba", "zyx", "hgfe", "qpo", "lkji", "tsr") * 4]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert train_main(["--steps", "4", "--max-seq-len", "64", "--micro-batch-size", "2", "--data",
                       str(tmp_path / "chat.jsonl"), "--method", "lora", "--out", str(tmp_path / "run")]) == 0
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["train_config"]["train_on_prompt"] is False and record["truncation"]["without_reply"] == 0


# LLaMA-2-chat's shape: a space before the reply, a space and EOS after it
LLAMA2 = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] | trim + ' [/INST]' }}"
          "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] | trim + ' ' + eos_token }}{% endif %}{% endfor %}")
# Qwen's, with transformers' {% generation %} markers around what the assistant writes
QWEN_MARKED = ("{%- for message in messages %}{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}"
               "{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\n' }}{%- else %}"
               "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
               "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


def _check_reply_coverage(tokenizer, conversation, example, end_of_turn):
    """Every character of each reply and of the end-of-turn token after it is inside a learned token,
    and every learned token touches one of them."""
    from apt_ds.io.conversations import ChatRenderer, messages_of

    messages = messages_of({"messages": conversation}, 1)
    rendered = ChatRenderer(tokenizer).render(messages, 1)
    offsets = tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    learned = [tuple(span) for span, label in zip(offsets, example["labels"]) if label != IGNORE_INDEX]
    replies = [m["content"].strip() for m in conversation if m["role"] == "assistant"]
    assert len(rendered.learned) == len(replies)
    for (start, end), reply in zip(rendered.learned, replies):
        assert rendered.text[start:end].startswith(reply) and rendered.text[start:end].rstrip().endswith(end_of_turn)
        covered = set().union(*(range(s, e) for s, e in learned))
        assert set(range(start, end)) <= covered
    assert all(any(s < e2 and e > s2 for s2, e2 in rendered.learned) for s, e in learned)


def test_a_space_merged_into_a_replys_first_word_is_learned_with_it(tokenizer):
    """LLaMA-2's template writes ' ' + reply: sentencepiece makes '▁abcd' of the space and the word,
    a token that starts before the reply. It is learned (it overlaps the reply), as is ' </s>'."""
    import copy

    llama2 = copy.deepcopy(tokenizer)
    llama2.chat_template = LLAMA2
    conversation = [m for m in CONVERSATION if m["role"] != "system"]
    (example,) = tokenize_dataset([{"messages": conversation}], llama2, 512, pack=False)
    _check_reply_coverage(llama2, conversation, example, "</s>")
    first = _learned_runs(example)[0]
    assert llama2.convert_ids_to_tokens(first)[0].startswith("▁") and first[-1] == llama2.eos_token_id


def test_the_mask_equals_the_templates_own_assistant_mask(chat_tokenizers):
    """transformers' return_assistant_tokens_mask, from {% generation %} markers, marks the same tokens
    (a reply with a trailing newline included: its end of turn is still learned)."""
    tokenizer, _ = chat_tokenizers["qwen2.5"]
    marked = copy_with_template(tokenizer, QWEN_MARKED)
    conversation = [*CONVERSATION[:2], {"role": "assistant", "content": "abcd\n"}, *CONVERSATION[3:]]
    (example,) = tokenize_dataset([{"messages": conversation}], marked, 512, pack=False)
    own = marked.apply_chat_template(conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert example["input_ids"] == list(own["input_ids"])
    assert [label != IGNORE_INDEX for label in example["labels"]] == [bool(m) for m in own["assistant_masks"]]
    _check_reply_coverage(marked, conversation, example, "<|im_end|>")


def copy_with_template(tokenizer, template: str):
    import copy

    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def test_turns_marked_not_to_learn_and_replies_the_template_rewrites(chat_tokenizers):
    tokenizer, eot = chat_tokenizers["llama3"]
    weighted = [*CONVERSATION[:2], {"role": "assistant", "content": "abcd", "weight": 0}, *CONVERSATION[3:]]
    (example,) = tokenize_dataset([{"messages": weighted}], tokenizer, 512, pack=False)
    (whole,) = tokenize_dataset([{"messages": CONVERSATION}], tokenizer, 512, pack=False)
    assert example["input_ids"] == whole["input_ids"] and _learned_runs(example) == _learned_runs(whole)[1:]
    shouting = copy_with_template(tokenizer, LLAMA3.replace("message['content'] | trim", "message['content'] | upper"))
    stats = data.TruncationStats()
    rows = [{"messages": CONVERSATION}, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ABC"}]}]
    assert len(tokenize_dataset(rows, shouting, 512, pack=False, stats=stats)) == 1  # "ABC" is written as it is
    assert stats.rewritten == 1 and "1 conversation was skipped: the chat template does not write" in stats.message("d", 512)


def test_a_prompt_and_completion_of_different_kinds_is_one_line(chat_tokenizers):
    tokenizer, _ = chat_tokenizers["llama3"]
    for row in ({"prompt": CONVERSATION[:2], "completion": "abcd"}, {"prompt": "Sort dcba.", "completion": CONVERSATION[2:3]}):
        with pytest.raises(DataError, match=r"^row 1: 'prompt' and 'completion' must both be text or both be message lists"):
            tokenize_dataset([row], tokenizer, 512, pack=False)
