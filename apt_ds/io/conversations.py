"""Conversations: chat rows rendered with the tokenizer's own chat template, learned on the assistant turns.

Three row formats hold a conversation (TRL's dataset_formats, torchtune's chat_dataset, axolotl):
  * `messages`: [{"role": "system" | "user" | "assistant", "content": ...}, ...] (TRL, OpenAI);
  * `conversations`: [{"from": "system" | "human" | "gpt", "value": ...}, ...] (ShareGPT);
  * `prompt` and `completion` whose values are message lists (TRL's conversational
    prompt-completion): the completion's turns follow the prompt's.
All three become the same message list, so the same conversation gives the same ids and mask.

The whole conversation is rendered once with `apply_chat_template` and tokenized once, as the
tokenizer renders it for generation. The learned tokens are each assistant message's content and
the end-of-turn token the template writes after it (`<|eot_id|>`, `<|im_end|>`, EOS, ...): their
characters are found in the rendered text (each message's content, searched after the generation
prompt of the messages before it), and a token is learned when it starts inside one of them.
The end of turn is what the template writes right after an assistant message up to its first
special token, read once per tokenizer from a probe conversation. `--train-on-prompt` learns
every token instead.

A conversation longer than max_seq_len keeps its first turns, cut after the last whole assistant
turn that fits; one whose first assistant turn does not fit is cut at max_seq_len when a learned
token remains, and dropped otherwise.
"""

from __future__ import annotations

from typing import NamedTuple

from apt_ds.io.errors import DataError

IGNORE_INDEX = -100
# ShareGPT's `from` values (and the roles they stand for), besides the roles themselves
ROLE_NAMES = {"system": "system", "developer": "system", "user": "user", "human": "user", "assistant": "assistant",
              "gpt": "assistant", "model": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
CONVERSATION_FIELDS = ("messages", "conversations")
_PROBE = ("apt-ds probe: user turn", "apt-ds probe: assistant turn")


def is_message_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def messages_of(row: dict, number: int) -> list[dict] | None:
    """The row's conversation as [{"role", "content", "learn"}], None when the row is not a
    conversation. `learn` is False for a prompt's messages (TRL's conversational prompt-completion
    learns the completion only) and for a turn marked `"weight": 0` or `"train": false` (axolotl's
    per-turn fields). DataError (one line naming the row) for a message without text, an unknown
    role, or a prompt and completion of which one is a message list and the other is not."""
    prompt, completion = row.get("prompt"), row.get("completion")
    if is_message_list(row.get("messages")):
        turns = [(turn, True) for turn in row["messages"]]
    elif is_message_list(row.get("conversations")):
        turns = [(turn, True) for turn in row["conversations"]]
    elif isinstance(prompt, list) and is_message_list(completion):
        turns = [*((turn, False) for turn in prompt), *((turn, True) for turn in completion)]
    elif isinstance(prompt, list) or isinstance(completion, list):
        raise DataError(f"row {number}: 'prompt' and 'completion' must both be text or both be message lists "
                        "(TRL's conversational prompt-completion), with at least one completion message")
    else:
        return None
    return [_message(turn, number, learn) for turn, learn in turns]


def _message(turn: dict, number: int, learn: bool) -> dict:
    role = turn.get("role") if turn.get("role") is not None else turn.get("from")
    content = turn.get("content") if turn.get("content") is not None else turn.get("value")
    if role not in ROLE_NAMES:
        raise DataError(f"row {number}: a message has role {role!r}; use system, user or assistant ('role'/'content', "
                        "TRL's messages) or system, human or gpt ('from'/'value', ShareGPT)")
    if not isinstance(content, str):
        raise DataError(f"row {number}: the content of a message with role {role} is {type(content).__name__}, not text "
                        "(lists of content parts are not read)")
    learn = learn and turn.get("weight") != 0 and turn.get("train") is not False
    return {"role": ROLE_NAMES[role], "content": content, "learn": learn}


class RenderedConversation(NamedTuple):
    """The template's text and the character spans [start, end) that are learned."""

    text: str
    learned: list[tuple[int, int]]
    unfound: int = 0  # learned assistant messages the template does not write as they are


class ChatRenderer:
    """Renders conversations with one tokenizer's chat template (see the module docstring)."""

    def __init__(self, tokenizer, tokenizer_name: str = ""):
        if getattr(tokenizer, "chat_template", None) is None:
            name = tokenizer_name or getattr(tokenizer, "name_or_path", "") or "in use"
            raise DataError(f"the data holds conversations, which are rendered with the tokenizer's chat template, and "
                            f"the tokenizer {name} has none (chat_template.jinja or tokenizer_config.json's chat_template): use a chat "
                            "model's tokenizer, or give instruction/output rows with --template alpaca or none")
        self.tokenizer = tokenizer
        self.end_of_turn = self._end_of_turn()

    def _render(self, messages: list[dict], number: int, generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as err:  # jinja's TemplateError, or raise_exception() in the template itself
            raise DataError(f"row {number}: the tokenizer's chat template refused the conversation: "
                            f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None

    def _end_of_turn(self) -> str:
        """What the template writes after an assistant message's content, up to and including its
        first special token ("" when it writes none: then only the content is learned)."""
        user, assistant = _PROBE
        text = self._render([{"role": "user", "content": user}, {"role": "assistant", "content": assistant}], number=0)
        after = text[text.rindex(assistant) + len(assistant):] if assistant in text else ""
        specials = {t for t in getattr(self.tokenizer, "all_special_tokens", []) if t}
        specials |= {str(t) for t in getattr(self.tokenizer, "added_tokens_decoder", {}).values() if str(t)}
        found = [(after.find(token), -len(token), token) for token in specials if token in after]
        if not found:
            return ""
        position, _, token = min(found)
        return after[: position + len(token)] if not after[:position].strip() else ""

    def render(self, messages: list[dict], number: int) -> RenderedConversation:
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]  # what the template reads
        text = self._render(plain, number)
        learned, cursor, unfound = [], 0, 0
        for index, message in enumerate(messages):
            content = message["content"].strip()  # templates often trim it (LLaMA-3's `| trim`)
            replies = message["role"] == "assistant" and message.get("learn", True)
            if not content:
                continue
            start = cursor
            if replies:  # after its generation prompt, where the template allows
                prompt = self._render(plain[:index], number, generation_prompt=True) if index else ""
                start = max(start, len(prompt) if text.startswith(prompt) else 0)
            position = text.find(content, start)
            if position < 0:
                unfound += replies  # e.g. a reasoning block the template rewrites: the row is skipped
                continue  # a system prompt the template rewrites: nothing to learn there
            cursor = position + len(content)
            if replies:
                learned.append((position, self._turn_end(text, cursor)))
                cursor = learned[-1][1]
        return RenderedConversation(text, learned, unfound)

    def _turn_end(self, text: str, end: int) -> int:
        """Where an assistant turn ending its text at `end` ends: after the end-of-turn token, with
        the whitespace before it (a reply's own trailing newline, Llama-2's space before EOS)."""
        token = self.end_of_turn.lstrip()
        after = len(text[end:]) - len(text[end:].lstrip()) + end
        return after + len(token) if token and text.startswith(token, after) else end


def encode_conversation(renderer: ChatRenderer, messages: list[dict], number: int, max_seq_len: int,
                        train_on_prompt: bool = False, stats=None) -> dict | None:
    """{input_ids, labels} of one conversation, cut at a turn boundary to max_seq_len; None when it
    has no assistant turn to learn, a reply the template rewrites, or nothing learned fits (each
    counted in `stats`, apt_ds.io.data.TruncationStats). A token is learned when it overlaps a
    learned span: a space the tokenizer merges into a reply's first word (`▁abcd`) goes with it."""
    rendered = renderer.render(messages, number)
    if rendered.unfound or not rendered.learned:
        if stats is not None:
            stats.count_without_reply(number) if not rendered.unfound else stats.count("rewritten", 0)
        return None
    ids, offsets = _tokens(renderer.tokenizer, rendered.text)
    learned = [any(start < e and end > s for s, e in rendered.learned) for start, end in offsets]
    turn_ends = [sum(1 for start, _ in offsets if start < end) for _, end in rendered.learned]
    labels = list(ids) if train_on_prompt else [i if keep else IGNORE_INDEX for i, keep in zip(ids, learned)]
    if len(ids) > max_seq_len:
        fitting = [end for end in turn_ends if end <= max_seq_len]
        cut = fitting[-1] if fitting else max_seq_len
        ids, labels = ids[:cut], labels[:cut]
        if all(label == IGNORE_INDEX for label in labels) or len(ids) < 2:
            if stats is not None:
                stats.count("turn_dropped", len(offsets))
            return None
        if stats is not None:
            stats.count("turns_cut" if fitting else "turn_cut_inside", len(offsets))
    return {"input_ids": ids, "labels": labels}


def _tokens(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of the rendered text, as apply_chat_template(tokenize=True) makes them (no special
    tokens added), and the characters [start, end) of each."""
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), [tuple(span) for span in encoded["offset_mapping"]]
    raise DataError(f"conversations need a fast tokenizer (tokenizer.json) to find the assistant turns' tokens; "
                    f"{type(tokenizer).__name__} is not one")
