"""Configuration of an APT run: every algorithm knob, validated on construction.

APTConfig holds APT's own knobs (never mixed into the DeepSpeed JSON); TrainConfig holds the
loop's knobs (steps, batch, learning rate, checkpoints). Both round-trip through JSON so a run
directory records exactly what produced it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from apt_ds.config.base import ConfigError, _JsonConfig, _require, check_field_types, field_error, help_field  # noqa: F401 (re-exported)
from apt_ds.models import ADAPTER_TARGETS, DEFAULT_ADAPTER_TARGETS

BASE_DTYPES = ("auto", "bf16", "fp16", "fp32")
BASE_QUANTS = ("none", "nf4", "fp4", "int8")  # bitsandbytes' storage of the frozen projections
TEMPLATES = ("alpaca", "chat", "none")
SCORE_NORMALIZATIONS = ("kind", "none")
SHAPE_METRICS = ("task", "kl")  # how uniform mode's shape trials score a shape (apt_ds.training.shape_trials)
# Fields whose default is derived from the run's length (APTConfig.for_steps); a LoRA run drops them.
SCHEDULE_FIELDS = ("pruning_start_step", "pruning_end_step", "num_pruning_events", "mask_decay_window", "mask_decay_step")
# What APTConfig.for_steps derives from the run's length when not given
STEP_SCALED_FIELDS = (*SCHEDULE_FIELDS, "distill_every")
# What --method lora sets, whatever else is given (APTConfig.as_lora)
LORA_SETTINGS = {"prune": False, "grow_ranks": False, "distill": False, "target_density": 1.0}


def default_warmup_steps(steps: int) -> int:
    return max(1, steps // 20)


def default_checkpoint_every(steps: int) -> int:
    return max(10, steps // 10)  # resumable without asking


@dataclass
class APTConfig(_JsonConfig):
    """APT's algorithm knobs (see docs/APT_SPEC.md for the meaning of each)."""

    _argument_group_name = "APT knobs (schedule defaults scale with --steps)"  # the --help section

    target_density: float = help_field("fraction of block parameters kept at the end, in (0, 1]", default=0.7)
    # The schedule's defaults scale with the run's length (for_steps); the help says how, the CLI shows it.
    pruning_start_step: int = help_field("optimizer step where the pruning phase starts (t0) (default: 10% of steps)",
                                         default=100)
    pruning_end_step: int = help_field("optimizer step of the last pruning event (t1) (default: 50% of steps)", default=1000)
    num_pruning_events: int = help_field("pruning events, evenly spaced in (t0, t1] (default: about one per 3 steps of the "
                                         "pruning phase, at most 16)", default=16)
    mask_decay_window: int = help_field("steps before each event in which leaving masks decay (default: the spacing "
                                        "between events - 1)", default=200)
    mask_decay_step: float = help_field("mask change per step inside the decay window (default: 1 / mask_decay_window)",
                                        default=0.01)
    prune: bool = help_field("prune at all (false gives plain LoRA with the same adapters)", default=True)
    prune_heads: bool = help_field("prune attention KV groups", default=True)
    prune_neurons: bool = help_field("prune FFN neurons", default=True)
    prune_hidden: bool = help_field("prune hidden (residual-stream) channels", default=True)
    uniform: bool = help_field("keep the same shape in every layer (exports as the family's stock transformers config)", default=False)
    score_normalization: str = help_field(
        "how scores of different unit kinds are made comparable before ranking: 'kind' scales each kind (KV groups, "
        "neurons, hidden channels) so its salience per parameter averages 1; 'none' ranks raw scores",
        choices=SCORE_NORMALIZATIONS, default="kind")
    shape_multiple: int = help_field(
        "FFN widths and the hidden size are kept at multiples of this (units pruned in blocks of it, by score; a "
        "dimension under 16 blocks uses the largest power of two giving 16; uniform mode's hidden size is a multiple "
        "of lcm(kept query heads, a block small enough for 16 choices)): matmuls run faster at aligned sizes and "
        "llama.cpp quantizes 32-wide blocks; 1 prunes single units as the paper does", default=32)
    uniform_shape_trials: int = help_field(
        "uniform mode: before each pruning event, this many of the best shapes by salience are measured on the "
        "step's micro-batches (one forward pass each; prune-then-tune: on its first calibration batch) and the "
        "lowest-scoring shape (uniform_shape_metric) is kept; 1 ranks shapes by salience alone", default=4)
    uniform_shape_metric: str = help_field(
        "what the shape trials score: 'task' the task loss on the supervised tokens; 'kl' the divergence "
        "KL(shape || current model) of next-token distributions over the step's tokens, for steps without labels "
        "(one more forward pass per micro-batch for the reference; about 1024 tokens per rank and step at most)",
        choices=SHAPE_METRICS, default="task")
    count_embeddings: bool = help_field("count the input and output embeddings in the density budget", default=False)
    adapter_targets: list[str] = help_field("Linear modules that get APT adapters", choices=ADAPTER_TARGETS,
                                            default_factory=lambda: list(DEFAULT_ADAPTER_TARGETS))
    adapter_rank: int = help_field("initial adapter rank", default=8)
    adapter_alpha: float = help_field("adapter scale numerator: s = alpha / initial rank", default=16.0)
    grow_ranks: bool = help_field("grow adapter ranks at pruning events", default=True)
    rank_budget_multiple: float = help_field("final tunable-parameter budget / initial", default=4.0)
    rank_cap: int = help_field("largest rank an adapter may grow to", default=64)
    salience_beta: float = help_field("EMA factor for salience and adapter importance", default=0.85)
    use_kurtosis: bool = help_field("add sqrt(kurtosis) outlier term to group/neuron salience", default=True)
    kurtosis_weight: float = help_field(
        "weight of the outlier term, in units of the layer's mean first-order salience (0.25: of 0, 0.25 and 1, the best "
        "non-uniform mean on SmolLM2 SST-2 over 3 seeds, scored on the same test rows; 0 was within the spread; "
        "docs/BENCHMARKS.md)", default=0.25)
    distill: bool = help_field("self-distillation from the last pruning event's snapshot", default=True)
    distill_every: int = help_field(
        "teacher pass on every k-th step of the pruning phase, counted from its start; the steps between train on "
        "the task loss alone (1: every step, as in the paper; the teacher forward costs about half a training step) "
        "(default: 4, or less when the pruning phase has under 16 steps)",
        default=4)
    distill_kl_weight: float = help_field("weight of the logit KL term inside the distillation loss", default=0.1)
    distill_mse_weight: float = help_field(
        "weight of the hidden-state MSE term (per token, relative to the teacher's mean square)", default=0.9)
    distill_temperature: float = help_field("softmax temperature of the KL term", default=2.0 / 3.0)
    distill_num_blocks: int = help_field("layer blocks; one layer is sampled per block for the MSE", default=4)
    transform_rank: int = help_field("adapter rank of the distillation transformation layer", default=8)

    def __post_init__(self) -> None:
        c = "APTConfig"
        self._check_types()
        _require(0.0 < self.target_density <= 1.0, c, "target_density", "in (0, 1]", self.target_density)
        _require(self.pruning_start_step >= 0, c, "pruning_start_step", ">= 0", self.pruning_start_step)
        _require(
            self.pruning_end_step > self.pruning_start_step,
            c, "pruning_end_step", f"> pruning_start_step ({self.pruning_start_step})", self.pruning_end_step,
        )
        _require(self.num_pruning_events >= 1, c, "num_pruning_events", ">= 1", self.num_pruning_events)
        _require(
            self.num_pruning_events <= self.pruning_end_step - self.pruning_start_step,
            c, "num_pruning_events", "<= pruning_end_step - pruning_start_step", self.num_pruning_events,
        )
        _require(self.score_normalization in SCORE_NORMALIZATIONS, c, "score_normalization", f"one of {SCORE_NORMALIZATIONS}",
                 self.score_normalization)
        _require(self.kurtosis_weight >= 0, c, "kurtosis_weight", ">= 0", self.kurtosis_weight)
        _require(self.shape_multiple >= 1, c, "shape_multiple", ">= 1", self.shape_multiple)
        _require(self.uniform_shape_trials >= 1, c, "uniform_shape_trials", ">= 1", self.uniform_shape_trials)
        _require(self.uniform_shape_metric in SHAPE_METRICS, c, "uniform_shape_metric", f"one of {SHAPE_METRICS}",
                 self.uniform_shape_metric)
        _require(self.mask_decay_window >= 0, c, "mask_decay_window", ">= 0", self.mask_decay_window)
        _require(0.0 < self.mask_decay_step <= 1.0, c, "mask_decay_step", "in (0, 1]", self.mask_decay_step)
        self.adapter_targets = tuple(self.adapter_targets)
        unknown = [t for t in self.adapter_targets if t not in ADAPTER_TARGETS]
        _require(not unknown, c, "adapter_targets", f"a subset of {list(ADAPTER_TARGETS)}", self.adapter_targets)
        _require(len(self.adapter_targets) > 0, c, "adapter_targets", "non-empty", self.adapter_targets)
        _require(self.adapter_rank >= 1, c, "adapter_rank", ">= 1", self.adapter_rank)
        _require(self.adapter_alpha > 0, c, "adapter_alpha", "> 0", self.adapter_alpha)
        _require(self.rank_budget_multiple >= 1.0, c, "rank_budget_multiple", ">= 1", self.rank_budget_multiple)
        if self.grow_ranks:  # the cap only limits growth
            _require(self.rank_cap >= self.adapter_rank, c, "rank_cap", f">= adapter_rank ({self.adapter_rank})", self.rank_cap)
        _require(0.0 <= self.salience_beta < 1.0, c, "salience_beta", "in [0, 1)", self.salience_beta)
        _require(self.distill_every >= 1, c, "distill_every", ">= 1", self.distill_every)
        for name in ("distill_kl_weight", "distill_mse_weight"):
            _require(getattr(self, name) >= 0, c, name, ">= 0", getattr(self, name))
        _require(self.distill_temperature > 0, c, "distill_temperature", "> 0", self.distill_temperature)
        _require(self.distill_num_blocks >= 1, c, "distill_num_blocks", ">= 1", self.distill_num_blocks)
        _require(self.transform_rank >= 1, c, "transform_rank", ">= 1", self.transform_rank)
        if self.prune and not (self.prune_heads or self.prune_neurons or self.prune_hidden):
            raise field_error(c, "prune_heads/prune_neurons/prune_hidden", "must not all be false when prune is true "
                              "(to prune nothing: --prune false, or --method lora)")

    @classmethod
    def for_steps(cls, total_steps: int, **overrides) -> "APTConfig":
        """Schedule defaults scaled to a run of `total_steps` optimizer steps.

        Warm up for 10% of the run, prune between 10% and 50%, then recover for the last half.
        The recovery phase runs at the final, smallest shape without the teacher pass, so a
        long one is what makes the whole run cheaper than LoRA; the cubic schedule removes
        most units early in the pruning phase anyway (SmolLM2 benchmark: ending at 70% left
        APT at 1.2x LoRA's CPU time, see docs/BENCHMARKS_HISTORY.md)."""
        if total_steps < 4:
            raise field_error("TrainConfig", "steps", f"must be >= 4 to warm up, prune and recover, got {total_steps}")
        # Each default is derived from the values given so far, so overriding one field keeps
        # the rest consistent with it.
        start = overrides.get("pruning_start_step", max(1, round(0.1 * total_steps)))
        if start >= total_steps:
            raise field_error("APTConfig", "pruning_start_step", f"must be < steps ({total_steps}), got {start}")
        end = overrides.get("pruning_end_step", max(start + 1, round(0.5 * total_steps)))
        span = max(1, end - start)
        events = overrides.get("num_pruning_events", min(16, span, max(1, span // 3)))
        spacing = span / max(1, events)
        window = overrides.get("mask_decay_window", max(0, int(spacing) - 1))
        # A teacher pass every 4th step, but at least ~4 of them in a short pruning phase
        # (a phase of 3 steps with distill_every=4 would never distil).
        distill_every = overrides.get("distill_every", max(1, min(4, span // 4)))
        defaults = dict(
            distill_every=distill_every,
            pruning_start_step=start,
            pruning_end_step=end,
            num_pruning_events=events,
            mask_decay_window=window,
            mask_decay_step=1.0 / window if window >= 1 else 1.0,
        )
        defaults.update(overrides)
        return cls(**defaults)

    def as_lora(self) -> "APTConfig":
        """The LoRA baseline: the same adapters, no pruning, no rank growth, no distillation."""
        return dataclasses.replace(self, **LORA_SETTINGS)


@dataclass
class TrainConfig(_JsonConfig):
    """Knobs of the training loop (independent of APT)."""

    _argument_group_name = "training loop"  # the --help section

    steps: int = help_field("optimizer steps, each of micro_batch_size x grad_accum_steps x ranks sequences (the "
                            "run prints how many epochs of the data's examples they are; --epochs N sets them from "
                            "the data instead)", default=60)
    micro_batch_size: int = help_field("sequences per micro-batch per rank", default=4)
    grad_accum_steps: int = help_field("micro-batches per optimizer step", default=1)
    lr: float = help_field("peak learning rate of adapters", default=2e-3)
    warmup_steps: int = help_field("linear LR warm-up steps (default: 5% of steps, at least 1)", default=5)
    weight_decay: float = help_field("AdamW weight decay", default=0.0)
    max_grad_norm: float = help_field("clip the global gradient norm to this before each step (0: no clipping)", default=1.0)
    max_skipped_steps: int = help_field("stop the run after this many optimizer steps in a row whose loss or gradient norm "
                                        "is NaN or inf; each such step's update is skipped, as DeepSpeed's loss scaler "
                                        "skips an overflowed step", default=3)
    max_seq_len: int = help_field("tokens per sequence: a longer instruction row loses prompt tokens from the left, one "
                                  "whose response alone does not fit is dropped, an unpacked text row is cut at the end "
                                  "(counts are printed and recorded in run.json)", default=256)
    template: str = help_field("how instruction/input/output rows become text: alpaca (the Alpaca prompt), chat (the "
                               "tokenizer's chat template, for chat models), none (prompt and response concatenated); the "
                               "loss is on the response either way. Conversation rows (messages, conversations) always "
                               "use the chat template", choices=TEMPLATES, default="alpaca")
    train_on_prompt: bool = help_field("learn every token of a supervised row: the prompt, and a conversation's system "
                                       "and user turns (default: the loss is on responses and assistant turns only, "
                                       "as TRL's assistant_only_loss and completion_only_loss)", default=False)
    seed: int = help_field("random seed (model init of adapters, data order, layer sampling)", default=0)
    log_every: int = help_field("write a metrics line every N steps", default=1)
    interval_memory_peaks: bool = help_field(
        "each metrics line also carries its own exact memory peak since the previous line (interval_peak_rss_mb; "
        "cuda_interval_peak_mb) by resetting the kernel's and CUDA's peak counters at each line; then getrusage, "
        "/usr/bin/time and torch.cuda.max_memory_allocated see only back to the last line, which is why it is off",
        default=False)
    checkpoint_every: int = help_field("save a resumable checkpoint every N steps (0: only at the end) (default: 10% of "
                                       "steps, at least 10)", default=0)
    device: str = help_field("where one process without DeepSpeed trains: auto (cuda when available, else cpu), cpu, "
                             "cuda or cuda:N; under DeepSpeed each rank uses its accelerator device", default="auto")
    base_dtype: str = help_field("dtype of the frozen base weights: auto (bf16 on GPUs, fp32 on CPU), bf16, fp16 (GPU "
                                 "only) or fp32; adapters always keep fp32 masters. Under DeepSpeed, bf16/fp16 become the "
                                 "JSON's precision section", choices=BASE_DTYPES, default="auto")
    base_quant: str = help_field("store the frozen projections (q/k/v/o, gate/up/down) quantized with bitsandbytes, "
                                 "QLoRA-style: nf4 or fp4 (4-bit blocks of 64) or int8 (LLM.int8 rows); quantized as "
                                 "they load; embeddings, norms and the LM head stay in --base-dtype, which is also the "
                                 "compute dtype; one process, ZeRO-1/2, or ZeRO-3 for nf4/fp4; launch/export.py "
                                 "--merge-into says how the export merges "
                                 "(docs/QUANTIZED_BASE.md)", choices=BASE_QUANTS, default="none")
    double_quant: bool = help_field("with a 4-bit --base-quant, quantize the blocks' scales too (QLoRA's double "
                                    "quantization, transformers' bnb_4bit_use_double_quant)", default=True)
    gradient_checkpointing: bool = help_field("recompute each decoder layer's activations in backward instead of keeping "
                                              "them (less memory, ~30% more compute); salience is unchanged", default=False)
    cudnn_attention: bool = help_field("true: attention on CUDA keeps PyTorch's own choice of kernels (cuDNN's first); "
                                       "false: cuDNN's attention kernels are off while training, as cuDNN plans each new "
                                       "attention shape and pruning events make new ones (an H100 ran APT's 48 steps at "
                                       "4 x 512 tokens 1.3x as long with them; one run each, docs/BENCHMARKS.md)",
                                       default=False)

    def __post_init__(self) -> None:
        c = "TrainConfig"
        self._check_types()
        _require(self.steps >= 1, c, "steps", ">= 1", self.steps)
        _require(self.micro_batch_size >= 1, c, "micro_batch_size", ">= 1", self.micro_batch_size)
        _require(self.grad_accum_steps >= 1, c, "grad_accum_steps", ">= 1", self.grad_accum_steps)
        _require(self.lr > 0, c, "lr", "> 0", self.lr)
        _require(self.warmup_steps >= 0, c, "warmup_steps", ">= 0", self.warmup_steps)
        _require(self.weight_decay >= 0, c, "weight_decay", ">= 0", self.weight_decay)
        _require(self.max_grad_norm >= 0 and math.isfinite(self.max_grad_norm), c, "max_grad_norm",
                 "a finite number >= 0 (0: no clipping)", self.max_grad_norm)
        _require(self.max_skipped_steps >= 1, c, "max_skipped_steps", ">= 1", self.max_skipped_steps)
        _require(self.max_seq_len >= 2, c, "max_seq_len", ">= 2", self.max_seq_len)
        _require(self.log_every >= 1, c, "log_every", ">= 1", self.log_every)
        _require(self.checkpoint_every >= 0, c, "checkpoint_every", ">= 0", self.checkpoint_every)
        _require(self.template in TEMPLATES, c, "template", f"one of {', '.join(TEMPLATES)}", self.template)
        _require(self.base_dtype in BASE_DTYPES, c, "base_dtype", f"one of {', '.join(BASE_DTYPES)}", self.base_dtype)
        _require(self.base_quant in BASE_QUANTS, c, "base_quant", f"one of {', '.join(BASE_QUANTS)}", self.base_quant)
        _require(_is_device_name(self.device), c, "device", "auto, cpu, cuda or cuda:N", self.device)


def _is_device_name(name: str) -> bool:
    kind, _, index = name.partition(":")
    return (name in ("auto", "cpu", "cuda")) or (kind == "cuda" and index.isdigit())


def check_schedule_fits(apt: APTConfig, train: TrainConfig) -> None:
    """A pruning phase that ends after the run would never reach the target density, silently
    (APTConfig's defaults are a 1000-step phase: use APTConfig.for_steps(train.steps))."""
    if apt.prune and apt.pruning_end_step > train.steps:
        raise field_error("APTConfig", "pruning_end_step", f"({apt.pruning_end_step}) must be <= steps ({train.steps}): "
                          "the run would end before reaching its target density (APTConfig.for_steps(steps) scales "
                          "the schedule to the run)")
