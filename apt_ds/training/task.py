"""What a run learns, from the model's family: a decoder the next tokens of its data
(apt_ds.io.data), an encoder a class a sequence (apt_ds.io.classification, its classifier as
large as the data has classes), an encoder-decoder (T5) a target a row (apt_ds.io.seq2seq).
Also what an encoder or encoder-decoder run cannot do yet, refused in one line before anything
is written."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from apt_ds.algorithm.position_bias import BIAS_HEAD_INDEX
from apt_ds.config import APTConfig, ConfigError, TrainConfig
from apt_ds.io.classification import classifier_family, tokenize_classification
from apt_ds.io.data import TruncationStats, tokenize_dataset
from apt_ds.io.seq2seq import seq2seq_family, tokenize_seq2seq


@dataclass(frozen=True)
class TaskData:
    """The training examples, whether text rows were packed, and an encoder's class count (None: a causal LM)."""

    examples: list[dict]
    packed: bool
    num_labels: int | None = None


def classifies(model: str) -> bool:
    """`--model` is an encoder (a sequence classifier), from its config.json's model_type."""
    return classifier_family(model) is not None


def task_of(model: str) -> str:
    """What `--model` learns: lm, classification or seq2seq, from its config.json's model_type."""
    return "classification" if classifies(model) else "seq2seq" if seq2seq_family(model) is not None else "lm"


MODELS_OF = {"lm": "a causal LM (LLaMA, Mistral, Qwen)", "classification": "an encoder (BERT, RoBERTa)",
             "seq2seq": "an encoder-decoder (T5)"}


def check_task(args, train: TrainConfig | None = None, apt: APTConfig | None = None) -> None:
    """--task, where given, is the model's (a causal LM has no classifier, an encoder no LM head),
    and what the model's task does not support yet is refused."""
    wanted, task = getattr(args, "task", "auto"), task_of(args.model)
    if wanted not in ("auto", task):
        raise ConfigError(f"--task {wanted} needs {MODELS_OF[wanted]}: --model {args.model} is {MODELS_OF[task]}")
    if train is not None and task == "classification":
        check_encoder_options(args, train, apt)
    elif train is not None and task == "seq2seq":
        check_seq2seq_options(args, train, apt)


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
        classifier_family(args.model).check_adapter_targets(apt.adapter_targets)
    _refuse(args, "an encoder (a sequence classifier)", unsupported)


def _refuse(args, what: str, unsupported: list[tuple[bool, str]]) -> None:
    """One line naming every flag given that `what` does not train with yet."""
    named = [flag for given, flag in unsupported if given]
    if named:
        raise ConfigError(f"--model {args.model} is {what}, which trains without {', '.join(named)} so far")


def check_seq2seq_options(args, train: TrainConfig, apt: APTConfig | None) -> None:
    """What a T5 run does not support yet, named before any work."""
    unsupported = [(train.base_quant != "none", "--base-quant"),
                   (train.gradient_checkpointing, "--gradient-checkpointing"),
                   # the divergence trial reads next-token logits of a causal LM (logits_to_keep)
                   (apt is not None and apt.uniform and apt.uniform_shape_metric == "kl", "--uniform-shape-metric kl")]
    from transformers import AutoConfig

    config, family = AutoConfig.from_pretrained(args.model), seq2seq_family(args.model)
    if apt is not None:  # a target the model's layers lack (v1.0's FFN has no gate_proj) is refused now
        family.check_adapter_targets(apt.adapter_targets, config)
    if getattr(config, BIAS_HEAD_INDEX, None):  # its heads index its tables, not the run's original heads
        raise ConfigError(f"--model {args.model} is a T5 export with heads pruned per layer, which apt-ds does not "
                          f"train from yet: train from the model it was pruned from")
    _refuse(args, "an encoder-decoder (T5)", unsupported)


def check_decoder_start(model: str, tokenizer) -> None:
    """The batches start the decoder at the pad token (apt_ds.io.data.collate), as every T5 does."""
    import json
    from pathlib import Path

    start = json.loads((Path(model) / "config.json").read_text()).get("decoder_start_token_id")
    if start != tokenizer.pad_token_id:
        raise ConfigError(f"--model {model}: config.json's decoder_start_token_id ({start}) is not the tokenizer's pad "
                          f"token ({tokenizer.pad_token_id}); apt-ds starts a T5 decoder at its pad token, as T5 does")


def tokenize_for_task(args, records, tokenizer, train: TrainConfig, data_path: str, truncation: TruncationStats,
                      is_main: bool) -> TaskData:
    """The run's examples: a classifier's rows (a label each), a seq2seq model's (a target each), or
    tokenize_dataset's."""
    task = task_of(args.model)
    if task == "seq2seq":
        check_decoder_start(args.model, tokenizer)
        data = tokenize_seq2seq(records, tokenizer, train.max_seq_len, args.max_target_len, source=data_path)
        if (data.cut_inputs or data.cut_targets) and is_main:
            print(f"warning: of the {len(records)} rows of {data_path}, {data.cut_inputs} inputs were cut to --max-seq-len "
                  f"{train.max_seq_len} tokens and {data.cut_targets} targets to --max-target-len {args.max_target_len}",
                  file=sys.stderr)
        return TaskData(data.examples, packed=False)
    if task == "lm":
        examples = tokenize_dataset(records, tokenizer, train.max_seq_len, pack=not args.no_pack, source=data_path,
                                    stats=truncation, template=train.template, train_on_prompt=train.train_on_prompt,
                                    tokenizer_name=f"of --model {args.model}")
        return TaskData(examples, packed=not args.no_pack)
    data = tokenize_classification(records, tokenizer, train.max_seq_len, source=data_path)
    if data.cut and is_main:
        print(f"warning: {data.cut} of the {len(records)} rows of {data_path} were cut to --max-seq-len "
              f"{train.max_seq_len} tokens", file=sys.stderr)
    return TaskData(data.examples, packed=False, num_labels=data.num_labels)
