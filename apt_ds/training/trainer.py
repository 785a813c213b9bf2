"""APTrainer: Algorithm 1 of APT, one loop for one process or a DeepSpeed engine.

Per optimizer step: forward/backward over the gradient-accumulation micro-batches (teacher
pass first when distilling), reduce salience and adapter importance across ranks, optimizer
step; in the window before a pruning event move masks toward the upcoming decision; at an
event snap masks, physically shrink, grow ranks, rebuild the optimizer carrying its state,
and snapshot the teacher. Everything the loop needs from the executor goes through `TrainingBackend`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable

import torch
from tqdm.auto import tqdm

from apt_ds.algorithm.distill import SelfDistiller, distilled_blocks
from apt_ds.algorithm.edits import merge_changes
from apt_ds.algorithm.pruner import AdaptivePruner, GradualMasker
from apt_ds.algorithm.quant import follow_codes
from apt_ds.algorithm.schedule import SparsityScheduler
from apt_ds.algorithm.state import APTModel
from apt_ds.algorithm.tuner import AdaptiveTuner
from apt_ds.config import APTConfig, TrainConfig, check_schedule_fits
from apt_ds.distributed.backend import LocalBackend, TrainingBackend
from apt_ds.distributed.placement import move_batch
from apt_ds.io.checkpoint import load_checkpoint
from apt_ds.io.checkpoint_save import repair_export_copy, save_checkpoint
from apt_ds.io.metrics import MetricsWriter, memory_mb
from apt_ds.io.quantized import check_quant_layout, quantization_record
from apt_ds.training.attention_kernels import training_attention_kernels
from apt_ds.training.divergence import DivergenceGuard, is_bad_step, kept_checkpoint_note
from apt_ds.training.evaluate import eval_metrics, mean_token_loss
from apt_ds.training.forward import (
    distilled_forward,
    enable_activation_checkpointing,
    has_padding,
    supervised_forward,
    supervised_positions,
    supervised_token_count,
    valid_token_count,
)
from apt_ds.training.heap import HeapSettling, release_free_heap
from apt_ds.training.laps import Laps
from apt_ds.training.lr_schedule import warmup_cosine
from apt_ds.training.out_files import check_unused_out_dir, next_micro_batches, quantized_base, write_rank_record
from apt_ds.training.progress import progress_fields
from apt_ds.training.shape_trials import measure_uniform_shape


class APTrainer:
    """One APT run on a model: adds adapters and masks, trains on micro-batches through a backend
    (LocalBackend, or DeepSpeedBackend under ZeRO), prunes at the schedule's events, grows ranks,
    distils, checkpoints into `out_dir`. `train(batches)` runs to `train.steps`; `resume(checkpoint)`
    first continues a run. Seeds torch's global RNG with `train.seed`. apt_ds.training.run (what
    launch/train.py runs) is the reference caller, building model, data and backend around it."""

    EVENT_PARTS = ("decide", "shape_change", "teacher_snapshot", "heap_release")  # an event's timed parts

    def __init__(self, model, apt: APTConfig, train: TrainConfig, backend: TrainingBackend | None = None,
                 out_dir: str | Path | None = None, eval_batches: list[dict] | None = None, progress: bool = True,
                 run_info: dict | None = None):
        check_schedule_fits(apt, train)
        self.apt_config, self.train_config = apt, train
        self.backend = backend or LocalBackend()
        self.out_dir = Path(out_dir) if out_dir else None
        self.eval_batches = eval_batches or []
        self.progress = progress
        self.run_info = {**(run_info or {}), **quantization_record(model, train)}  # the export re-quantizes as this
        self.quantized_base_at_start = quantized_base(model)  # this rank's share, for its rank record
        torch.manual_seed(train.seed)
        self.device = self.backend.device
        self.backend.place(model)  # before adapters and masks are made: they follow the model's device
        follow_codes(model)  # a quantized base's state too (a model quantized on the CPU, trained on a GPU)
        if train.gradient_checkpointing:
            # Non-reentrant: the first forward runs with gradients, so salience hooks see it once
            # (apt_ds.algorithm.salience skips the recomputation) and its tensors receive the gradients.
            enable_activation_checkpointing(model)
        self.state = APTModel(model, apt, seed=train.seed, reduce_sum=self.backend.all_reduce_sum,
                              world_size=self.backend.world_size, device=self.device)
        self.model = model
        self.schedule = SparsityScheduler(apt)
        self.pruner = AdaptivePruner(apt)
        self.masker = GradualMasker(apt.mask_decay_step)
        self.tuner = AdaptiveTuner(apt)
        self.distiller = SelfDistiller(apt, len(distilled_blocks(model)), seed=train.seed)
        self.growth_generator = torch.Generator().manual_seed(train.seed + 1)
        self.consumed_micro_batches = 0
        self.teacher_ready = False
        self.uniform_shapes: dict[int, tuple[int, int]] = {}  # event step -> (KV groups, hidden) chosen by loss
        self.trial_batches: list[dict] = []
        self.checkpoint_hooks: list = []  # called once each, on the main rank, after the next checkpoint
        self.history: list[dict] = []
        self.heap_settling = HeapSettling()  # trims after each event's first steps (apt_ds.training.heap)
        self.backend.attach(model, train.lr, warmup_cosine(train.warmup_steps, train.steps), train.weight_decay,
                            train.grad_accum_steps, max_grad_norm=train.max_grad_norm)
        self.divergence = DivergenceGuard(train, lambda: kept_checkpoint_note(self.out_dir), self.backend.is_main())
        self.metrics = MetricsWriter(self.out_dir / "metrics.jsonl" if self.out_dir and self.backend.is_main() else None)

    # ---- public ----------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.backend.optimizer_steps

    def resume(self, checkpoint_dir: str | Path) -> None:
        check_quant_layout(Path(checkpoint_dir), self.run_info)  # before any state is read into the trainer
        load_checkpoint(self, Path(checkpoint_dir))
        repair_export_copy(self, Path(checkpoint_dir))

    def train(self, batches: Iterable[dict], skip_consumed: bool = True) -> dict:
        """Train to `steps` on micro-batches (dicts of input_ids, attention_mask and labels, -100 where
        no loss is taken; an iterator, a list or a DataLoader). A resumed trainer skips the micro-batches
        it already consumed, unless the iterator already starts after them (`skip_consumed=False`)."""
        cfg, started, batches = self.train_config, time.perf_counter(), iter(batches)
        if self.out_dir and self.step == 0:
            check_unused_out_dir(self.out_dir, self.backend)
        next_micro_batches(batches, self.consumed_micro_batches if skip_consumed else 0, self.step, cfg.steps)
        # `with`: an error closes the bar first, so its message starts a line of its own
        with (training_attention_kernels(cfg.cudnn_attention),
              tqdm(total=cfg.steps, initial=self.step, disable=not (self.progress and self.backend.is_main()), desc="apt") as bar):
            while self.step < cfg.steps:
                record = self._train_step(batches)
                stop = self.divergence.observe(record)  # the error that ends a run of bad steps, else None
                if stop is None:
                    record.update(self._after_step())
                if (stop or record.get("skipped") or self.step % cfg.log_every == 0 or record.get("event")
                        or "shape_trials" in record or self.step == cfg.steps):
                    self._log(record)
                if stop:
                    raise stop
                bar.update(1)
                bar.set_postfix(progress_fields(record, self.state.density()))
                if self.out_dir and cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < cfg.steps:
                    self.save()
        final = {"step": self.step, "final": True, "density": self.state.density(), "world_size": self.backend.world_size,
                 "skipped_steps": self.divergence.total, **self._sizes(), **memory_mb(self.train_config.interval_memory_peaks)}
        if self.run_info.get("truncation"):  # what --max-seq-len cut from the training data
            final["truncation"] = self.run_info["truncation"]
        if self.eval_batches:
            final.update(eval_metrics(self, self.eval_batches))  # a classifier's eval_accuracy too
            self.backend.log_metrics({"step": self.step, "eval_loss": final["eval_loss"]})  # the monitor's last point
        final["train_time_s"] = time.perf_counter() - started  # this invocation's loop (a resumed run: since resuming)
        self.metrics.write(final)
        self.history.append(final)
        if self.out_dir:
            self.save()
            write_rank_record(self)
        return final

    def save(self) -> None:
        save_checkpoint(self, self.out_dir / "checkpoint")
        hooks, self.checkpoint_hooks = self.checkpoint_hooks, []
        for hook in hooks if self.backend.is_main() else []:
            hook()

    def evaluate(self, batches: list[dict] | None = None) -> float:
        """Mean token loss over `batches` (default: the eval batches), summed over ranks before dividing."""
        return mean_token_loss(self, self.eval_batches if batches is None else batches)

    # ---- one optimizer step --------------------------------------------------------------
    def _train_step(self, batches) -> dict:
        started = time.perf_counter()
        step = self.step
        collect = self.schedule.collects_salience(step)
        self.state.salience.enabled = collect
        mu = self.schedule.distill_weight(step) if self.teacher_ready else 0.0
        gas, world = self.train_config.grad_accum_steps, self.backend.world_size
        micro_batches = next_micro_batches(batches, gas, step, self.train_config.steps)
        self.trial_batches = micro_batches  # uniform shape trials measure on them (shape_trials)
        self.consumed_micro_batches += gas
        # Normalise by the GLOBAL token counts of this step, so that the gradient (and hence
        # salience) is the same however the global batch is split over ranks/micro-batches:
        # each micro-batch's mean loss is turned into its token sum / global token count.
        # Counts and logit positions come from the host batches; the only per-step device sync
        # besides the logged metrics is this 2-number all-reduce, needed to scale the losses.
        counts = torch.tensor([[supervised_token_count(b), valid_token_count(b)] for b in micro_batches], dtype=torch.float64)
        totals = self.backend.all_reduce_sum(counts.sum(0).clone()).clamp_min(1.0)
        positions = [supervised_positions(b) for b in micro_batches]
        sums = torch.zeros(3, dtype=torch.float32, device=self.device)  # token sums: task loss, distill KL, distill MSE
        for batch, batch_positions, (n_task, n_valid) in zip(micro_batches, positions, counts):
            self.state.salience.batch_has_padding = has_padding(batch)  # host numbers
            try:
                task_loss, kl_sum, mse_sum = self._losses(move_batch(batch, self.device), batch_positions, mu)
            finally:  # unknown again: any other forward's padding is left out
                self.state.salience.batch_has_padding = True
            if not n_task:  # no supervised tokens: its mean is 0/0 (a NaN it would be wrong to report)
                task_loss = torch.nan_to_num(task_loss)
            scaled = task_loss * float(n_task * world * gas / totals[0])
            if mu > 0:
                distill = kl_sum * float(world * gas / totals[0]) + mse_sum * float(world * gas / totals[1])
                scaled = (1 - mu) * scaled + mu * distill
            self.backend.backward(scaled)
            sums += torch.stack([task_loss.detach().float() * float(n_task), kl_sum.detach().float(), mse_sum.detach().float()])
        importance = None
        if collect and self.apt_config.grow_ranks:  # needs the gradients, which step() clears
            importance = self.tuner.held()
            self.tuner.accumulate(self.state.adapters, self.backend.full_param, self.backend.full_grad)
        lr = self.backend.lr
        self.backend.step()  # skips the update when the gradient norm is not finite
        task_sum, kl_total, mse_total = self.backend.all_reduce_sum(sums).double().tolist()  # the metrics: one read
        task_mean, distill_mean = task_sum / float(totals[0]), kl_total / float(totals[0]) + mse_total / float(totals[1])
        record = {
            "step": self.step, "loss": (1 - mu) * task_mean + mu * distill_mean, "task_loss": task_mean,
            "distill_loss": distill_mean, "mu": mu, "lr": lr, "grad_norm": self.backend.grad_norm,
        }
        # A bad step's activation gradients are NaN too: its salience and importance are left out, so
        # the scores stay those of the good steps (the same verdict on every rank: it is read from sums).
        bad = is_bad_step(record, self.backend.step_skipped)
        if collect:
            self.state.salience.discard_step() if bad else self.state.salience.end_step()
        if bad and importance is not None:
            self.tuner.restore(importance)
        return {**record, **({"skipped": True} if bad else {}), "step_time_s": time.perf_counter() - started}

    def _losses(self, batch: dict, positions: torch.Tensor, mu: float):
        """(mean task loss, distill KL token sum, distill MSE token sum) of one micro-batch on the device."""
        if mu <= 0:
            _, loss, _ = supervised_forward(self.backend.forward, batch, positions)
            zero = torch.zeros((), device=loss.device)
            return loss, zero, zero
        switches = [self.state.masks, self.state.salience]
        return distilled_forward(self.backend, self.distiller, self.model, switches, batch, positions)

    # ---- pruning events ------------------------------------------------------------------
    def _after_step(self) -> dict:
        step, record, scores = self.step, {"event": False}, self.state.salience
        self.heap_settling.step_done()
        if self.schedule.is_event(step) and scores.has_scores:
            record.update(self._pruning_event(step))
        elif self.schedule.in_decay_window(step) and scores.has_scores:
            started = time.perf_counter()
            decision = self._decide(self.schedule.next_event(step), record)
            self.masker.step_toward(self.state.masks, decision)
            record["mask_refresh_s"] = time.perf_counter() - started  # this step's decision + mask decay
        if self.apt_config.prune and not self.teacher_ready and step >= self.apt_config.pruning_start_step and self.apt_config.distill:
            self._snapshot_teacher()
        return record

    def _decide(self, event_step: int, record: dict):
        """The decision for the event at `event_step`. Uniform mode with shape trials measures
        its candidate shapes once per event, at the first decision for it (the trials go into
        `record`), and keeps that shape for the event; units within it follow the scores."""
        cfg, s = self.apt_config, self.state.salience
        s.require_finite_scores(f"the pruning decision for step {event_step}")
        target = self.schedule.density(event_step) * self.state.original_shape.budget_params(cfg.count_embeddings)
        args = (self.state.shape, s.group_scores, s.neuron_scores, s.hidden_scores, target, self.state.original_shape)
        if cfg.uniform and cfg.uniform_shape_trials > 1 and event_step not in self.uniform_shapes:
            measured = measure_uniform_shape(self, lambda: self.pruner.candidates(*args, count=cfg.uniform_shape_trials), event_step)
            if measured is not None:  # None: the step had nothing to measure on
                self.uniform_shapes[event_step], record["shape_trials"], record["shape_trials_s"] = measured
        return self.pruner.decide(*args, uniform_shape=self.uniform_shapes.get(event_step))

    def _pruning_event(self, step: int) -> dict:
        started = time.perf_counter()
        record = {}
        part = Laps(record, "event_", self.EVENT_PARTS)  # so a slow event says where it went (uniform trials: "decide")
        decision = self._decide(step, record)
        prints = self.backend.all_gather_object(decision.fingerprint())
        if len(set(prints)) != 1:
            raise RuntimeError(f"pruning decisions differ across ranks at step {step}: {prints}")
        self.masker.snap(self.state.masks, decision)
        part("decide")
        access = self.backend.param_access()

        def change_fn():
            change = self.state.shrink(decision, access) if decision.removes_anything() else {}
            growth = {}
            if self.apt_config.grow_ranks:
                plan = self.tuner.plan_growth(self.state.adapters, self.schedule.tuning_budget_multiple(step))
                for name in sorted(plan):  # same order on every rank: ZeRO-3 reads are collective
                    growth.update(self.state.grow_rank(name, plan[name], access, self.growth_generator))
            return merge_changes(change, growth)

        self.backend.apply_shape_change(change_fn)
        if len(set(self.backend.all_gather_object(self.state.shape_fingerprint()))) != 1:
            raise RuntimeError(f"shapes or ranks differ across ranks after the pruning event at step {step}")
        part("shape_change")
        if self.apt_config.distill:
            self._snapshot_teacher()
        part("teacher_snapshot")
        if decision.removes_anything():
            release_free_heap()  # the removed units' memory, or RSS would not drop (apt_ds.training.heap)
            self.heap_settling.shape_changed()
        part("heap_release")
        record.update({"event": True, "event_time_s": time.perf_counter() - started, "decision": decision.fingerprint()[:16]})
        if self.eval_batches:
            record.update(eval_metrics(self, self.eval_batches))
        return record

    def _snapshot_teacher(self) -> None:
        self.distiller.snapshot(self.model, self.backend.full_param)
        self.teacher_ready = True

    # ---- metrics -------------------------------------------------------------------------
    def _sizes(self) -> dict:
        state = self.state
        return {"block_params": state.block_params(), "total_params": state.shape.total_params(),
                "adapter_params": state.adapter_params(), "total_rank": state.total_rank()}

    def _log(self, record: dict) -> None:
        record.update(self._sizes())
        record["density"] = self.state.density()
        record["world_size"] = self.backend.world_size
        record["time"] = round(time.time(), 3)  # wall clock: lines up with external memory samples
        record.update(memory_mb(self.train_config.interval_memory_peaks))
        self.metrics.write(record)
        self.backend.log_metrics(record)  # DeepSpeed's monitor (TensorBoard, W&B, CSV) when its JSON enables one
        self.history.append(record)
