"""What a run learns, from the model's family: a decoder the next tokens of its data
(apt_ds.io.data), an encoder a class a sequence (apt_ds.io.classification, its classifier as
large as the data has classes). Also what an encoder run cannot do yet, refused in one line
before anything is written."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from apt_ds.config import APTConfig, ConfigError, TrainConfig
from apt_ds.io.classification import classifier_family, tokenize_classification
from apt_ds.io.data import TruncationStats, tokenize_dataset


@dataclass(frozen=True)
class TaskData:
    """The training examples, whether text rows were packed, and an encoder's class count (None: a causal LM)."""

    examples: list[dict]
    packed: bool
    num_labels: int | None = None


def classifies(model: str) -> bool:
    """`--model` is an encoder (a sequence classifier), from its config.json's model_type."""
    return classifier_family(model) is not None


def check_task(args) -> None:
    """--task, where given, is the model's: a causal LM has no classifier, an encoder no LM head."""
    wanted = getattr(args, "task", "auto")
    if wanted == "auto":
        return
    if wanted == "classification" and not classifies(args.model):
        raise ConfigError(f"--task classification needs a sequence classifier: --model {args.model} is a causal LM; "
                          f"give a BERT or RoBERTa model")
    if wanted == "lm" and classifies(args.model):
        raise ConfigError(f"--task lm needs a causal LM: --model {args.model} is an encoder (a sequence classifier); "
                          f"give a LLaMA, Mistral or Qwen model")


def check_encoder_options(args, train: TrainConfig, apt: APTConfig | None) -> None:
    """What a classifier run does not support yet, named before any work."""
    unsupported = [(train.base_quant != "none", "--base-quant"),
                   # checkpointing puts the model in training mode: BERT's dropout would reach the teacher and eval
                   (train.gradient_checkpointing, "--gradient-checkpointing"),
                   (apt is not None and apt.uniform and apt.uniform_shape_metric == "kl", "--uniform-shape-metric kl"),
                   # a uniform encoder keeps hidden = heads x head_dim (its config has no head_dim): both or neither
                   (apt is not None and apt.uniform and apt.prune_heads != apt.prune_hidden,
                    "--uniform with only one of heads and hidden channels pruned")]
    if apt is not None:  # `gate_proj` names nothing in BERT: refused before any work
        classifier_family(args.model).adapter_paths(apt.adapter_targets)
    named = [flag for given, flag in unsupported if given]
    if named:
        raise ConfigError(f"--model {args.model} is an encoder (a sequence classifier), which trains without "
                          f"{', '.join(named)} so far")


def tokenize_for_task(args, records, tokenizer, train: TrainConfig, data_path: str, truncation: TruncationStats,
                      is_main: bool) -> TaskData:
    """The run's examples: a classifier's rows (a label each), or tokenize_dataset's."""
    if not classifies(args.model):
        examples = tokenize_dataset(records, tokenizer, train.max_seq_len, pack=not args.no_pack, source=data_path,
                                    stats=truncation, template=train.template, train_on_prompt=train.train_on_prompt,
                                    tokenizer_name=f"of --model {args.model}")
        return TaskData(examples, packed=not args.no_pack)
    data = tokenize_classification(records, tokenizer, train.max_seq_len, source=data_path)
    if data.cut and is_main:
        print(f"warning: {data.cut} of the {len(records)} rows of {data_path} were cut to --max-seq-len "
              f"{train.max_seq_len} tokens", file=sys.stderr)
    return TaskData(data.examples, packed=False, num_labels=data.num_labels)
