"""ROUGE of a model's generations on seq2seq rows (`launch/evaluate.py MODEL --data FILE` with
input/target rows, apt_ds.io.seq2seq): greedy decoding (or beam search) in batches, scored with
Google's `rouge-score` as Hugging Face's summarization examples report it: the mean F1 x 100 of
rouge1, rouge2, rougeL and rougeLsum (which splits the texts into sentences at newlines), with
the Porter stemmer.

An encoder-decoder (T5) generates from its encoder's input; a causal LM (LLaMA, ...) continues
the input text, left-padded so that every row of a batch ends where generation starts, and only
the continuation is scored. The reference is the row's target text as written, not its cut ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from apt_ds.evaluation.errors import EvaluationError
from apt_ds.evaluation.harness import DTYPES
from apt_ds.models import family_of

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


@dataclass(frozen=True)
class RougeRequest:
    model: str
    data: str
    data_split: str | None = None
    limit: int | None = None  # the first N rows
    batch_size: int = 8
    max_input_len: int = 512  # T5's context; longer inputs are cut (counted in the report)
    max_new_tokens: int = 128
    num_beams: int = 1
    device: str | None = None
    dtype: str = "auto"


def rouge_scores(predictions: list[str], references: list[str]) -> dict[str, float]:
    """{rouge type: mean F1 x 100} of each prediction against its reference."""
    from rouge_score import rouge_scorer

    if len(predictions) != len(references) or not predictions:
        raise ValueError(f"ROUGE needs one prediction a reference: got {len(predictions)} and {len(references)}")
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    totals = dict.fromkeys(ROUGE_TYPES, 0.0)
    for prediction, reference in zip(predictions, references):
        for name, score in scorer.score(reference, prediction).items():  # (target, prediction), in that order
            totals[name] += score.fmeasure
    return {name: 100 * total / len(predictions) for name, total in totals.items()}


def rouge_report(request: RougeRequest) -> dict:
    """ROUGE of `request`'s model on its data, with the rows, model, data and generation settings."""
    from apt_ds.io.classification import classifier_family
    from apt_ds.io.data import load_records
    from apt_ds.io.hub import resolve_model
    from apt_ds.io.modeling import TINY_MODELS
    from apt_ds.io.seq2seq import seq2seq_texts, tokenize_seq2seq
    from apt_ds.io.tokenizer import load_tokenizer

    if request.model in TINY_MODELS:  # random weights and no tokenizer on disk: nothing to generate from
        raise EvaluationError(f"--model {request.model} is a built-in random model without a tokenizer: ROUGE needs a "
                              f"model directory (an export, T5 or a causal LM) holding its tokenizer")
    local = resolve_model(request.model, flag="model")  # a Hub name: its snapshot in the local cache
    if classifier_family(local) is not None:
        raise EvaluationError(f"{request.model} is a sequence classifier: ROUGE scores a model that generates text "
                              f"(T5, a causal LM); give the classifier its labelled rows")
    device = _device(request.device)
    records = load_records(request.data, split=request.data_split, flag="--data")
    if request.limit:  # before tokenizing: a quick check on a few rows of CNN/DailyMail reads only those
        records = records.select(range(min(request.limit, len(records))))
    tokenizer = load_tokenizer(local)
    max_input_len = _input_limit(local, request)
    # targets cut at the generation's length are those a generation cannot match whole (the floor
    # leaves room for the tokenizer's framing); the scores compare with the whole target text
    data = tokenize_seq2seq(records, tokenizer, max_input_len, max(request.max_new_tokens, 8), request.data)
    references = seq2seq_texts(records, request.data)[1]
    model = load_generator(local, DTYPES[request.dtype]).to(device).eval()
    predictions = generate(model, tokenizer, [example["input_ids"] for example in data.examples], request, device)
    return {"model": str(Path(local).resolve()), "data": request.data, "rows": len(predictions),
            **rouge_scores(predictions, references), "inputs_cut": data.cut_inputs, "max_input_len": max_input_len,
            "targets_over_max_new_tokens": data.cut_targets,
            "generator": "encoder-decoder" if model.config.is_encoder_decoder else "causal LM",
            "decoding": "greedy" if request.num_beams == 1 else "beam search", "num_beams": request.num_beams,
            "max_new_tokens": request.max_new_tokens, "batch_size": request.batch_size, "device": str(device)}


def _input_limit(directory: str, request: RougeRequest) -> int:
    """request.max_input_len, or less for a causal LM whose input and generation together would
    run past the positions it knows (context_length.known_positions): those were never trained."""
    import json

    from apt_ds.io.context_length import known_positions

    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):  # the model's load says what is wrong with the directory
        return request.max_input_len
    known = None if not isinstance(config, dict) or config.get("is_encoder_decoder") else known_positions(config)
    if known is None:
        return request.max_input_len
    room = known[0] - request.max_new_tokens
    if room < 2:  # at least a token of the input after the tokenizer's framing
        raise EvaluationError(f"--max-new-tokens {request.max_new_tokens} leaves no room for the input: {request.model} "
                              f"knows {known[0]} positions ({known[1]})")
    return min(request.max_input_len, room)


def load_generator(directory: str, dtype: torch.dtype | None = None):
    """apt_ds's loader (its families and exports), or transformers' seq2seq class for an
    encoder-decoder directory of a family apt_ds does not describe yet; never remote code."""
    from apt_ds.io.errors import ModelLoadError
    from apt_ds.io.modeling import load_pretrained
    from apt_ds.models import UnsupportedModelError

    try:
        return load_pretrained(directory, dtype=dtype)
    except (ModelLoadError, UnsupportedModelError):
        if not _is_encoder_decoder(directory):
            raise
    from transformers import AutoModelForSeq2SeqLM

    try:
        return AutoModelForSeq2SeqLM.from_pretrained(directory, dtype=dtype or "auto", trust_remote_code=False)
    except Exception as err:  # transformers raises many types for a directory it cannot read
        raise ModelLoadError(f"cannot load the encoder-decoder model in {directory}: {str(err).splitlines()[0]}") from None


def _is_encoder_decoder(directory: str) -> bool:
    from transformers import AutoConfig

    try:
        return bool(AutoConfig.from_pretrained(directory, trust_remote_code=False).is_encoder_decoder)
    except Exception:  # not a config transformers knows: load_pretrained's own error says what is wrong
        return False


@torch.no_grad()
def generate(model, tokenizer, inputs: list[list[int]], request: RougeRequest, device: torch.device) -> list[str]:
    """The model's text for each input, `request.batch_size` at a time."""
    encoder_decoder = model.config.is_encoder_decoder
    # transformers 5.25 sizes an encoder-decoder's cache for the encoder's depth (an IndexError for a
    # deeper decoder): a model whose stacks differ in depth generates without it, the same tokens at more compute
    stacks = family_of(model).stacks_for(model.config)
    use_cache = len({getattr(model.config, stack.count) for stack in stacks}) == 1
    pad_id = tokenizer.pad_token_id
    texts = []
    progress = tqdm(total=len(inputs), desc="generating", unit="row", leave=False, disable=None)  # None: off unless a terminal
    for start in range(0, len(inputs), request.batch_size):
        ids, mask = _padded(inputs[start:start + request.batch_size], pad_id, left=not encoder_decoder)
        # do_sample=False: a checkpoint's generation_config.json may ask for sampling
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             num_beams=request.num_beams, max_new_tokens=request.max_new_tokens, pad_token_id=pad_id,
                             use_cache=use_cache)
        if not encoder_decoder:
            out = out[:, ids.shape[1]:]  # the continuation only: the input is not the model's summary
        texts += tokenizer.batch_decode(out, skip_special_tokens=True)
        progress.update(len(out))
    progress.close()
    return texts


def _padded(rows: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded to the longest, on the right (an encoder's input) or on the left (a causal LM
    prompt, whose last token must be the one generation continues from), and their mask."""
    length = max(len(row) for row in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for index, row in enumerate(rows):
        at = slice(length - len(row), length) if left else slice(0, len(row))
        ids[index, at] = torch.tensor(row, dtype=torch.long)
        mask[index, at] = 1
    return ids, mask


def _device(name: str | None) -> torch.device:
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, ValueError):
        raise EvaluationError(f"--device {name!r} is not a device (cuda, cuda:N or cpu)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EvaluationError(f"--device {name}: no CUDA device is available here (use cpu)")
    if device.type not in ("cuda", "cpu"):
        raise EvaluationError(f"--device {name}: only cuda and cpu are supported")
    return device
