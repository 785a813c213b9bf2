"""Command lines built from dataclasses: every flag, its type, choices and help come from a
field (transformers' HfArgumentParser reads them), so a knob is described in one place.

`explicit_values` tells which flags the user actually typed, so that a recipe file's values
are overridden only by those (argparse alone cannot tell "--steps 60" from the default 60)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from transformers import HfArgumentParser

from apt_ds.config import APTConfig, TrainConfig, help_field


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Appends each flag's default unless its help already says how the default is chosen
    ("default: 10% of --steps"), lets help texts contain '%', and prints a command's description
    (what it does, its most used flags) as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if text == argparse.SUPPRESS:
            return text
        text = text.replace("%", "%%")
        if isinstance(action, argparse._StoreFalseAction):  # HfArgumentParser's --no-x twin of a boolean --x
            return f"turn {action.dest.replace('_', '-')} off"
        if "default:" in text or action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class ArgumentParser(HfArgumentParser):
    """HfArgumentParser whose errors are one line like every other error here (no usage block)."""

    def __init__(self, dataclass_types, **kwargs):
        super().__init__(dataclass_types, **{"formatter_class": _HelpFormatter, **kwargs})
        for action in self._actions:
            # --max-seq-len first (the README's spelling; --max_seq_len still works) in usage and help
            action.option_strings.sort(key=lambda option: "_" in option)
            if action.nargs == "?" and action.const is True:  # a boolean flag: "--resume", not "--resume [RESUME]"
                action.metavar = "true|false"
        # Values that start with "-" and a digit are values, as Python 3.13's argparse reads them: here
        # `--max-shard-size -5MB` gets that flag's own error instead of "expected one argument"
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str):
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):  # a mistyped flag: name the closest real one
            import difflib

            unknown = next((a.split("=")[0] for a in message[len(prefix):].split() if a.startswith("--")), None)
            close = difflib.get_close_matches(unknown, list(self._option_string_actions), n=1) if unknown else []
            if close:
                message += f"; did you mean {close[0].replace('_', '-')}?"
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def parse_with_positional(parser: ArgumentParser, argv: Sequence[str] | None, cls, field_name: str, what: str):
    """`cls` from the command line, where `field_name` may also come as the first positional
    argument (launch/export.py RUN, launch/evaluate.py MODEL); both, and different, is an error."""
    namespace = vars(parser.parse_args(argv))
    positional, flag = namespace.pop(f"{field_name}_positional"), namespace[field_name]
    if positional and flag and positional != flag:
        parser.error(f"two {what}s given: {positional} and --{field_name.replace('_', '-')} {flag}")
    return cls(**{**namespace, field_name: flag or positional})


def explicit_values(build_parser: Callable[[], ArgumentParser], argv: Sequence[str] | None) -> dict:
    """The flags given on the command line, as {field name: value}; --help and bad flags exit here."""
    build_parser().parse_args(argv)  # --help, unknown flags and bad values are answered with the real defaults
    quiet = build_parser()
    not_given = object()  # not a string: argparse would run a string default through the flag's type
    quiet.set_defaults(**{f.name: not_given for cls in quiet.dataclass_types for f in dataclasses.fields(cls)})
    return {name: value for name, value in vars(quiet.parse_args(argv)).items() if value is not not_given}


@dataclass
class RunArguments:
    """What to train and where: the paths and modes around APTConfig and TrainConfig."""

    _argument_group_name = "run"

    model: str = help_field("local Hugging Face directory (LLaMA, Mistral, Qwen2/2.5, Qwen3; BERT, RoBERTa sequence "
                            "classifiers; T5 v1.0/v1.1), a .gguf file, a Hub name "
                            "org/name or org/name@revision already in the local Hugging Face cache (HF_HOME; nothing is "
                            "downloaded: docs/HUB_NAMES.md), or a built-in random small model: 'tiny' (LLaMA with GQA), "
                            "'tiny-mha' (one KV head per query head), 'tiny-mistral', 'tiny-qwen2', 'tiny-qwen3'",
                            default="tiny")
    data: Optional[str] = help_field("training data: JSONL/JSON with 'text', 'instruction'/'input'/'output', "
                                     "'prompt'/'completion' fields, or conversations ('messages' role/content, ShareGPT "
                                     "'conversations' from/value); a classifier's 'sentence' (or a pair) and 'label'; a "
                                     "T5's 'input' and 'target' (docs/DATA.md); a directory saved by `datasets`, or a Hub data set "
                                     "name org/name[@revision] already in the local cache (json/jsonl/parquet/csv files, "
                                     "or prepared by an earlier load_dataset; docs/HUB_NAMES.md) "
                                     "(default: the shipped demo data)", default=None)
    data_split: str = help_field("the split of --data to train on, where it has splits (a Hub data set, a saved "
                                 "DatasetDict)", default="train")
    eval_data: Optional[str] = help_field("held-out data (same formats); eval_loss (and a classifier's eval_accuracy) "
                                          "is logged at each pruning event and at the end", default=None)
    eval_data_split: Optional[str] = help_field("the split of --eval-data, where it has splits, e.g. validation "
                                                "(default: --data-split's)", default=None)
    out: str = help_field("run directory: metrics.jsonl, checkpoint/, tokenizer/", default="runs/demo")
    deepspeed: Optional[str] = help_field("DeepSpeed JSON (ds_configs/zero2.json, zero3.json, ...); omit for one process "
                                          "without DeepSpeed", default=None)
    method: str = help_field("apt, or lora: the same adapters with no pruning, no rank growth, no distillation",
                             choices=("apt", "lora"), default="apt")
    task: str = help_field("what the model learns: lm (next tokens: a causal LM's), classification (a class a row of "
                           "'sentence' or a pair ('sentence1'/'sentence2', GLUE's 'premise'/'hypothesis', ...) with an integer 'label': a BERT or RoBERTa model's), or "
                           "seq2seq (a summary a row of 'input'/'target', CNN/DailyMail's 'article'/'highlights' or XSum's "
                           "'document'/'summary': a T5 model's), or auto: the model's",
                           choices=("auto", "lm", "classification", "seq2seq"), default="auto")
    max_target_len: int = help_field("seq2seq: target tokens a row keeps (its input keeps --max-seq-len)", default=128)
    config: Optional[str] = help_field("recipe: a YAML (or JSON) file of any of these flags' fields, e.g. "
                                       "configs/llama2_7b_alpaca.yaml; flags given on the command line override it",
                                       default=None)
    resume: bool = help_field("continue the run in --out from its last checkpoint", default=False)
    overwrite: bool = help_field("replace a previous run in --out (only an apt-ds run directory or an empty one; anything "
                                 "else is refused). The old run is kept aside until the new one has written its first "
                                 "checkpoint, and put back if the new one fails before that", default=False)
    global_batch_size: Optional[int] = help_field("sequences per optimizer step over all ranks (sets --micro-batch-size)",
                                                  default=None)
    epochs: Optional[float] = help_field("passes over the data's examples (after packing; 0.5 allowed) instead of "
                                         "--steps: steps = ceil(epochs x examples / global batch), known once the data "
                                         "is read; the warm-up, checkpoint and pruning schedule defaults follow them",
                                         default=None)
    no_pack: bool = help_field("do not pack 'text' data into full blocks: one example per row (short rows packed make "
                               "few examples, and each step more of an epoch)", default=False)
    eval_examples: int = help_field("examples of --eval-data used per evaluation", default=64)
    save_eval_probe: bool = help_field("after training, write eval_probe.safetensors: the live model's logits on the "
                                       "first --eval-data batch and its 20-token greedy continuation of that batch's first "
                                       "row, to check an export against the run (needs --eval-data)", default=False)
    local_rank: Optional[int] = field(default=None, metadata={"help": argparse.SUPPRESS})  # set by DeepSpeed's launcher


# Recipe files describe a run, not one invocation of it: these stay command-line only.
COMMAND_LINE_ONLY = ("config", "resume", "overwrite", "local_rank")


TRAIN_DESCRIPTION = """\
Fine-tune a model with APT: adapters train on the frozen model while attention heads, FFN neurons
and hidden channels are pruned and physically removed, so the run ends with a smaller model
(export it with launch/export.py). LLaMA, Mistral, Qwen2/2.5, Qwen3; BERT/RoBERTa classifiers; T5.

most used:
  --model MODEL           local directory, cached Hub name, .gguf file, or a built-in tiny model
  --data DATA             JSONL/JSON rows, a saved `datasets` directory, or a cached Hub data set
  --out RUN               the run directory (metrics, checkpoint, plots)
  --target-density D      fraction of the blocks' parameters kept at the end
  --steps N, --epochs E   how long
  --config RECIPE.yaml    every flag from a recipe (configs/); flags given here override it
  --deepspeed JSON        run under DeepSpeed ZeRO (ds_configs/); omit for one process
  --resume                continue the run in --out from its last checkpoint
  --method lora           the LoRA baseline: same adapters, nothing pruned
Guide: docs/TRAINING.md. Every flag:"""


def build_train_parser() -> ArgumentParser:
    return ArgumentParser(
        [RunArguments, APTConfig, TrainConfig],
        prog="launch/train.py",
        usage="python launch/train.py [--model MODEL] [--data DATA] [--out RUN] [options]\n"
              "       deepspeed --num_gpus N launch/train.py --deepspeed ds_configs/zero3.json [options]",
        description=TRAIN_DESCRIPTION,
    )


@dataclass
class ExportArguments:
    """launch/export.py: a run (or a plain model plus the units to keep) to a compact dense model."""

    _argument_group_name = "export"

    out: str = help_field("output directory (must not exist unless --overwrite)")
    run_dir: Optional[str] = help_field("run directory written by launch/train.py (its checkpoint/ is read); also "
                                        "accepted as the first positional argument", default=None)
    model: Optional[str] = help_field("with a run: the run's base model, when it is no longer at the path the run recorded "
                                      "(a moved run). Without a run: a plain model directory (adapters merged or none) to "
                                      "prune with --kept", default=None)
    kept: Optional[str] = help_field("with --model: the units to keep, as a JSON of ORIGINAL unit indices (a run's "
                                     "checkpoint/apt_state.json, or {groups, neurons, hidden}) or as binary masks over the "
                                     "original model in a .safetensors (hidden, kv_group.<i>, ffn_neuron.<i>); needs no "
                                     "DeepSpeed", default=None)
    format: str = help_field("hf: a transformers directory (safetensors + config + tokenizer); gguf: a directory "
                             "OUT holding apt_export.json and one .gguf file named after OUT (--out m: m/m.gguf; "
                             "--out m.gguf: m.gguf/m.gguf) that llama.cpp (and llama-cpp-python, Ollama) runs: uniform models as "
                             "the family's architecture (llama, qwen2, qwen3), non-uniform ones as 'deci' with per-layer "
                             "head counts and FFN widths (docs/FAMILIES.md)",
                             choices=("hf", "gguf"), default="hf")
    dtype: str = help_field("dtype of the saved weights; q8_0 (8-bit blocks, llama.cpp's Q8_0) needs --format gguf",
                            choices=("fp32", "bf16", "fp16", "q8_0"), default="fp32")
    overwrite: bool = help_field("replace an existing --out that holds a previous export (refused when it also holds "
                                 "files the export did not write)", default=False)
    max_shard_size: str = help_field("largest safetensors shard (e.g. 500MB, 5GB); bigger models are written as shards "
                                     "plus model.safetensors.index.json", default="5GB")
    merge_into: Optional[str] = help_field("a run trained with --base-quant: merge the adapters into the dequantized "
                                           "weights the run trained on (the default: the export computes as the live "
                                           "model did; the codes are quantized again from the same files) or into the "
                                           "original full-precision weights (docs/QUANTIZED_BASE.md)",
                                           choices=("dequantized", "original"), default=None)


def build_export_parser() -> ArgumentParser:
    parser = ArgumentParser(
        [ExportArguments],
        prog="launch/export.py",
        usage="python launch/export.py RUN --out DIR [--format gguf] [options]\n"
              "       python launch/export.py --model BASE --kept KEPT --out DIR [options]",
        description="""\
Export a run as a merged, physically smaller, dense model: a transformers directory (safetensors,
config, tokenizer), or with --format gguf one llama.cpp file.

most used:
  RUN                     the run directory launch/train.py wrote
  --out DIR               where the export goes (must not exist unless --overwrite)
  --format gguf           one .gguf file for llama.cpp, llama-cpp-python, Ollama (decoders)
  --dtype DTYPE           the saved weights' dtype: fp32 (default), bf16, fp16; q8_0 with --format gguf
Guide: docs/EXPORT.md. Every flag:""",
    )
    parser.add_argument("run_dir_positional", nargs="?", metavar="RUN", help="same as --run-dir")
    return parser
