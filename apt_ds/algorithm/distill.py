"""Self-distillation: the pruned student learns from its less-pruned self.

Teacher = the same network (frozen base shared, nothing copied) with the adapters' snapshot
from the last pruning event (`APTAdapter.teacher_A/B`), masks off, under no_grad.
Loss = kl_weight * KL(student || teacher at temperature T) * T^2 + mse_weight * MSE over
sampled layers: layers are split into blocks, one layer is sampled per block, and the
student's hidden state (the layer's output, before any final norm) passes through a
transformation layer (hidden -> hidden: the identity plus a low-rank adapter, `IdentityAdapter`)
before the MSE. The MSE is relative per token
(`relative_squared_error`): a deviation from the spec's plain MSE, see that function.
Whole layers are never removed, so a sampled teacher layer maps to the same student layer.
"""

from __future__ import annotations

import contextlib

import torch

from apt_ds.algorithm.adapters import APTAdapter, IdentityAdapter, find_adapters
from apt_ds.algorithm.kl import kl_divergence_from_logits
from apt_ds.config import APTConfig
from apt_ds.models import family_of

TRANSFORM_ATTR = "apt_distill_transform"  # submodule name; export drops it


def attach_transform(model, hidden: int, rank: int, alpha: float, seed: int,
                     device: torch.device | str = "cpu") -> IdentityAdapter:
    """The identity plus a trainable adapter, on `device`, registered on the model so one engine
    owns it (no hidden x hidden weight: `IdentityAdapter`)."""
    transform = IdentityAdapter.create(hidden, rank, alpha, torch.Generator().manual_seed(seed), device=device)
    setattr(model, TRANSFORM_ATTR, transform)
    return transform


def distilled_blocks(model):
    """The blocks whose outputs the hidden-state loss compares: the layers (a T5 model's decoder
    blocks, which run over the target positions the loss is taken on)."""
    family = family_of(model)
    return model.get_submodule(family.layer_paths[-1])


def relative_squared_error(student_h: torch.Tensor, teacher_h: torch.Tensor) -> torch.Tensor:
    """Per-token mean squared error divided by the teacher token's mean square: (batch, seq).

    Why relative: pretrained LLaMAs carry "massive activations" (SmolLM2-135M: ~24,000 at the
    first position of layers 15-25, against ~1-10 elsewhere). A plain MSE is then decided by
    that one token (distillation losses of 2,000 swamped the task loss in the benchmark), and
    the token's size says nothing about its importance: the next layer's RMSNorm divides it
    away. Dividing by the teacher's mean square (RMS squared) compares every token in the units
    the next layer sees.
    The teacher runs under no_grad, so the scale carries no gradient."""
    scale = teacher_h.pow(2).mean(-1).clamp_min(1e-12)
    return (student_h - teacher_h).pow(2).mean(-1) / scale


def student_adapters(model) -> dict[str, APTAdapter]:
    """The layers' adapters: not the distillation transform (by type, so under any module prefix)."""
    return {n: a for n, a in find_adapters(model).items() if not isinstance(a, IdentityAdapter)}


class SelfDistiller:
    """Teacher and student passes each keep the outputs of the sampled decoder layers through
    forward hooks (`teacher_mode`, `student_mode`), which `loss_sums` reads and drops.

    Hooks rather than `output_hidden_states`: transformers hands back the LAST layer's state after
    the model's final norm, not the layer's output, and the no_grad teacher would keep every
    layer's state alive until the loss (LLaMA-2-7B at 16 x 512 tokens: 33 x 67 MB in bf16)."""

    def __init__(self, config: APTConfig, num_layers: int, seed: int = 0):
        self.config = config
        self.num_layers = num_layers
        self.generator = torch.Generator().manual_seed(seed + 17)
        self._kept: dict[str, dict[int, torch.Tensor]] = {"teacher": {}, "student": {}}

    @contextlib.contextmanager
    def _keeping(self, model, layers: list[int], role: str):
        """Keep the outputs of decoder `layers` of the forward passes inside. The hooks go when the
        pass ends, before backward (transformers checkpoints a layer's `forward`, so its hooks are
        not re-run by the recompute anyway; a wrapper that checkpointed `__call__` would re-run
        them). What an earlier pass kept and no loss read is dropped first, so a layer this pass
        does not keep is an error, not a stale tensor; on failure whatever was kept goes too."""
        kept = self._kept[role]
        kept.clear()
        hooks, layers_of = [], distilled_blocks(model)
        try:
            for index in sorted(set(layers)):
                hooks.append(layers_of[index].register_forward_hook(self._keep(kept, index)))
            yield
        except BaseException:
            kept.clear()
            raise
        finally:
            for hook in hooks:
                hook.remove()

    @staticmethod
    def _keep(kept: dict[int, torch.Tensor], index: int):
        def hook(module, args, output):
            kept[index] = output[0] if isinstance(output, tuple) else output
        return hook

    def _layer_output(self, role: str, layer: int) -> torch.Tensor:
        kept = self._kept[role]
        if layer not in kept:
            mode = "teacher_mode" if role == "teacher" else "student_mode"
            raise ValueError(f"the {role}'s output of layer {layer} was not kept: run its forward under "
                             f"{mode}(..., layers) naming every sampled layer (kept: {sorted(kept)})")
        return kept[layer]

    def snapshot(self, model, read_param=None) -> None:
        """Freeze the current adapters as the teacher (called at each pruning event).

        `read_param(name, param)` returns a full tensor (ZeRO-3 partitions parameters)."""
        for name, adapter in student_adapters(model).items():
            if read_param is None:
                adapter.snapshot_teacher()
            else:
                adapter.snapshot_teacher(read_param(f"{name}.lora_A", adapter.lora_A), read_param(f"{name}.lora_B", adapter.lora_B))

    def sample_layers(self) -> list[int]:
        blocks = torch.arange(self.num_layers).tensor_split(min(self.config.distill_num_blocks, self.num_layers))
        return [int(block[torch.randint(len(block), (1,), generator=self.generator)]) for block in blocks]

    @contextlib.contextmanager
    def teacher_mode(self, model, switches, layers: list[int]):
        """Adapters read their snapshot; masks and salience hooks are switched off; the outputs
        of decoder `layers` are kept for the loss."""
        adapters = student_adapters(model).values()
        saved = [(s, s.enabled) for s in switches]
        try:
            for adapter in adapters:
                adapter.use_teacher = True
            for switch, _ in saved:
                switch.enabled = False
            with self._keeping(model, layers, "teacher"):
                yield
        finally:
            for adapter in adapters:
                adapter.use_teacher = False
            for switch, enabled in saved:
                switch.enabled = enabled

    def student_mode(self, model, layers: list[int]):
        """The student's forward: the outputs of decoder `layers` are kept for the loss."""
        return self._keeping(model, layers, "student")

    def loss_sums(self, model, student_out, teacher_out, layers: list[int], valid: torch.Tensor,
                  kl_positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Token SUMS of the two weighted terms: (kl_weight * T^2 * KL summed over `kl_positions`,
        mse_weight * per-token relative hidden-state MSE summed over `valid` positions, averaged over sampled layers).
        The outputs' logits give the KL; the layer outputs are those teacher_mode and student_mode kept.

        Sums, so the caller can divide by token counts of the whole (multi-rank) step. Logits are
        gathered at the KL positions first: the (positions x vocab) softmax temporaries cover only
        the distilled tokens (boolean indexing costs one device sync, on distillation steps only;
        masking instead would make the vocabulary-sized temporaries up to batch-size times larger)."""
        cfg = self.config
        temperature = cfg.distill_temperature
        positions = valid if kl_positions is None else kl_positions
        try:
            # KL(student || teacher), as the spec; apt_ds.algorithm.kl keeps no vocabulary-sized fp32 copies for backward
            kl_sum = kl_divergence_from_logits(student_out.logits[positions], teacher_out.logits[positions], temperature)
            kl_sum = kl_sum * temperature**2
            transform = getattr(model, TRANSFORM_ATTR)
            weights = valid.float()
            mse_sum = weights.new_zeros(())
            for layer in layers:
                student_h = transform(self._layer_output("student", layer)).float()
                teacher_h = self._layer_output("teacher", layer).float()
                mse_sum = mse_sum + (relative_squared_error(student_h, teacher_h) * weights).sum()
            mse_sum = mse_sum / max(1, len(layers))
        finally:  # emptied even when the loss fails: nothing kept stays alive
            for kept in self._kept.values():
                kept.clear()
        return cfg.distill_kl_weight * kl_sum, cfg.distill_mse_weight * mse_sum

    def loss(self, model, student_out, teacher_out, layers: list[int], valid: torch.Tensor,
             kl_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Distillation loss of one batch: KL mean over `kl_positions` + MSE mean over `valid`."""
        positions = valid if kl_positions is None else kl_positions
        kl_sum, mse_sum = self.loss_sums(model, student_out, teacher_out, layers, valid, kl_positions)
        return kl_sum / max(1, int(positions.sum())) + mse_sum / max(1, int(valid.sum()))
