"""Prompt templates: how an instruction row (instruction, input, output) becomes prompt and response text.

  * `alpaca` (default): the Alpaca prompt, the response right after "### Response:\\n";
  * `chat`: the tokenizer's own chat template (`apply_chat_template`), user message = instruction
    and input, assistant message = output; the response is the rendered assistant turn, so the
    model also learns the template's end-of-turn token;
  * `none`: instruction and input on lines of their own, the response on the next line; no
    other text.

Only instruction rows are templated: `prompt`/`completion` rows are already the text the data's
author wants (e.g. benchmarks/prepare_tasks.py's compact prompts) and plain `text` rows have no
prompt. The chat response is what the template renders after its generation prompt (the way TRL
splits a prompt from its completion), so every chat template works without `{% generation %}`
markers.
"""

from __future__ import annotations

from typing import NamedTuple

from apt_ds.config import TEMPLATES
from apt_ds.io.errors import DataError

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


class PromptResponse(NamedTuple):
    """A row as text. `prompt` None: plain text, learned as a whole.

    `framed`: the chat template wrote the sequence's start (its BOS, if any) and the end of the
    turn into the text, so the tokenizer's BOS and EOS are not added around it again.
    """

    prompt: str | None
    response: str
    framed: bool = False


def format_prompt(instruction: str, input: str = "") -> str:  # noqa: A002 - the Alpaca field name
    """The Alpaca prompt; the response follows it directly."""
    if input:
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input)
    return PROMPT_NO_INPUT.format(instruction=instruction)


def user_message(instruction: str, input: str = "") -> str:  # noqa: A002
    """Instruction and input as one message, a blank line between them."""
    return f"{instruction}\n\n{input}" if input else instruction


def check_template(template: str, tokenizer=None, tokenizer_name: str | None = None) -> None:
    """One-line DataError when `template` is unknown, or is `chat` for a tokenizer without a chat template.
    `tokenizer_name` says whose tokenizer it is (default: the path it was loaded from)."""
    if template not in TEMPLATES:
        raise DataError(f"unknown template {template!r}: use one of {', '.join(TEMPLATES)}")
    if template == "chat" and getattr(tokenizer, "chat_template", None) is None:
        name = tokenizer_name or getattr(tokenizer, "name_or_path", "") or "in use"
        raise DataError(f"--template chat: the tokenizer {name} has no chat template (chat_template in its "
                        "tokenizer_config.json); use --template alpaca or --template none")


def instruction_prompt_response(instruction: str, input: str, output: str, template: str,  # noqa: A002
                                tokenizer=None) -> PromptResponse:
    """An instruction row under `template` (see the module docstring); `chat` needs the tokenizer."""
    if template == "alpaca":
        return PromptResponse(format_prompt(instruction, input), output)
    if template == "none":
        return PromptResponse(user_message(instruction, input) + "\n", output)
    check_template(template, tokenizer)
    return chat_prompt_response(tokenizer, user_message(instruction, input), output)


def chat_prompt_response(tokenizer, user: str, assistant: str) -> PromptResponse:
    """(generation prompt of the user turn, the assistant turn rendered after it), as the template writes them."""
    messages = [{"role": "user", "content": user}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": assistant}], tokenize=False)
    if not full.startswith(prompt):
        raise DataError("--template chat: the tokenizer's chat template does not write the assistant turn after its "
                        "generation prompt, so the response cannot be told from the prompt; use --template alpaca "
                        "or --template none")
    return PromptResponse(prompt, full[len(prompt):], framed=True)
