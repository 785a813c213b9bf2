"""The run's tokenizer: the model's own, or one trained on the data for the built-in tiny models."""

from __future__ import annotations

from pathlib import Path

from apt_ds.config import TrainConfig
from apt_ds.io.modeling import TINY_MODELS
from apt_ds.io.records import ROW_FIELDS
from apt_ds.io.templates import check_template
from apt_ds.io.tokenizer import load_tokenizer, train_sentencepiece_tokenizer

TOKENIZER_DIR = "tokenizer"  # in the run directory
# The built-in models' chat template: Zephyr's turn markers, each turn ended by EOS.
TINY_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
                      "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def prepare_tokenizer(args, out: Path, texts: list[str], train: TrainConfig, staging: Path):
    """Load (or, for the tiny model, train) the tokenizer, and check that it can format the data with
    train.template before any model is read. Writes nothing into --out: a trained tokenizer goes to
    `staging` until the run directory is prepared."""
    if args.model not in TINY_MODELS:
        tokenizer = load_tokenizer(args.model)
    elif args.resume and (out / TOKENIZER_DIR / "tokenizer_config.json").is_file():
        tokenizer = load_tokenizer(out / TOKENIZER_DIR)
    else:  # deterministic: every rank trains the same tokenizer (no shared write needed)
        tokenizer = train_sentencepiece_tokenizer(texts, staging, vocab_size=512)
        tokenizer.chat_template = TINY_CHAT_TEMPLATE  # so that conversations and --template chat run on it too
    # named by --model: the tiny model's tokenizer is in a temporary directory until the run is written
    check_template(train.template, tokenizer, tokenizer_name=f"of --model {args.model}")
    return tokenizer


def texts_for_tokenizer(records) -> list[str]:
    texts = []
    for row in records.select(range(min(len(records), 5000))):
        texts.append(" ".join(_row_text(row.get(k)) for k in ROW_FIELDS))
    return texts


def _row_text(value) -> str:
    """A field's text for training the tiny model's tokenizer (a message list: its contents)."""
    if isinstance(value, list):
        return " ".join(str(m.get("content") or m.get("value") or "") for m in value if isinstance(m, dict))
    return str(value or "")
