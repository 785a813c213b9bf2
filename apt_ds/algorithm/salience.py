"""Salience of every prunable unit, collected by hooks during ordinary training steps.

Per channel j and optimizer step: S_j = (mean_{b,t} |X_btj|) * (sum_{b,t} |dL/dX_btj|), over
the step's real tokens only (padding, as the batch's attention_mask marks it, is left out).
The loss is a mean over tokens, so the gradient sum does not grow with the tokens per step; the
activation factor is a mean for the same reason. With the spec's sum of |X| the first-order term
grew with the batch while the kurtosis term did not, so the batch size decided which kind of
unit was pruned (a deviation from the spec's formula, on purpose).
Accumulators and scores are fp32 tensors on the model's device: a step adds to them without
any host round trip; only pruning decisions read the scores on the host.
Both factors are summed over micro-batches and across data-parallel ranks BEFORE the
product, so scores do not depend on how the global batch is split. Sites:
- KV groups: input of o_proj (channels of the group's query heads, summed);
- FFN neurons: input of down_proj;
- hidden channels: outputs of o_proj and down_proj, the product taken per site and summed
  over the 2L sites.
Outlier term (groups, neurons): k = sqrt(max(kurtosis(O), 0)) with O = mean_{b,t}(X) * W over
the unit's own entries of W (o_proj columns of a group, the down_proj column of a neuron), added
as w * mean_layer(S) * k / mean_layer(k) (w = APTConfig.kurtosis_weight). The spec adds k itself:
k is scale-free while S is a loss change, so the sum meant whatever the batch size made it (the
reference's sum|X| made S ~10^3-10^4 times larger; our mean made k dominate, and non-uniform APT
0.7 on SST-2 fell from 0.82 to 0.73, one seed). In the layer's own units the term moves salience
toward outlier units and leaves the layer's total at (1 + w) x its first-order total. The
kurtosis needs only per-column power sums P_k[j] = sum_i W_ij^k (k = 1..4), read inside the
module's forward hook (where ZeRO-3 has the weight gathered), so no full weight is kept and
no collective hides in here.
Hooks run before the mask hooks (prepend=True): they see unmasked activations, and the
gradient that reaches them is mask-scaled, i.e. the score is the first-order loss change.
"""

from __future__ import annotations

from typing import Callable

import torch

from apt_ds.algorithm.shrink import group_channels
from apt_ds.algorithm.units import ModelShape

Reduce = Callable[[torch.Tensor], torch.Tensor]


class _Site:
    """Running sums for one hook site (one channel vector), fp32 on the activations' device."""

    def __init__(self, channels: int, device: torch.device, with_mean: bool = False):
        self.act_abs = torch.zeros(channels, dtype=torch.float32, device=device)
        self.grad_abs = torch.zeros(channels, dtype=torch.float32, device=device)
        self.act_sum = torch.zeros(channels, dtype=torch.float32, device=device) if with_mean else None
        self.power_sums: torch.Tensor | None = None  # (4, channels) float64 of the site's weight
        self.stale_weights = True  # power sums must be (re)computed at the next forward
        self.weights_change = False  # an adapter on the site's module: W changes every step

    def capture(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> None:
        """Add a (batch, seq, channels) activation; `token_mask` (batch, seq) is 1 at real tokens.
        The gradient needs no mask: a padded position reaches no loss term (its logits are not
        scored, and attention gives its key exactly zero weight), so its gradient is exactly 0."""
        detached = x.detach()
        if token_mask is not None and token_mask.shape == x.shape[:-1]:
            weights = token_mask.to(detached.dtype)
            self.act_abs += torch.einsum("...c,...->c", detached.abs(), weights).float()
            if self.act_sum is not None:
                self.act_sum += torch.einsum("...c,...->c", detached, weights).float()
        else:
            dims = tuple(range(x.dim() - 1))
            # abs().sum() rather than vector_norm(ord=1): the latter was 4-10x slower on CPU (measured
            # on (4, 64, 576..1536) activations), which alone cost ~7% of a SmolLM2 training step.
            self.act_abs += detached.abs().sum(dims, dtype=torch.float32)
            if self.act_sum is not None:
                self.act_sum += detached.sum(dims, dtype=torch.float32)
        if x.requires_grad:
            x.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        self.grad_abs += grad.detach().abs().sum(tuple(range(grad.dim() - 1)), dtype=torch.float32)

    def zero(self) -> None:
        for t in (self.act_abs, self.grad_abs, self.act_sum):
            if t is not None:
                t.zero_()


def column_power_sums(weight: torch.Tensor) -> torch.Tensor:
    """P[k-1, j] = sum_i W_ij^k for k = 1..4, the kurtosis sufficient statistics. float64: the
    central fourth moment is a difference of raw moments, which cancel badly in fp32; these
    are (4, channels) vectors computed once per shape, so the cost is nothing even on a GPU."""
    w = weight.detach().double()
    w2 = w * w
    return torch.stack([w.sum(0), w2.sum(0), (w2 * w).sum(0), (w2 * w2).sum(0)])


def unit_kurtosis(mean_x: torch.Tensor, power_sums: torch.Tensor, rows: int, unit_width: int) -> torch.Tensor:
    """Excess (Fisher) kurtosis of O = mean_x[j] * W[:, j] over each unit's columns.

    Units are consecutive blocks of `unit_width` columns. Uses biased moments (as
    scipy.stats.kurtosis with fisher=True, bias=True)."""
    m = mean_x.double()
    powers = torch.stack([m, m**2, m**3, m**4])  # (4, channels)
    raw = (powers * power_sums).reshape(4, -1, unit_width).sum(-1) / (rows * unit_width)
    m1, m2, m3, m4 = raw
    var = m2 - m1**2
    central4 = m4 - 4 * m1 * m3 + 6 * m1**2 * m2 - 3 * m1**4
    kurt = central4 / var.clamp_min(1e-300) ** 2 - 3.0
    return torch.where(var > 0, kurt, torch.zeros_like(kurt))


class SalienceCollector:
    """Hooks + EMA of unit scores. `reduce_sum` sums a tensor across data-parallel ranks."""

    def __init__(self, shape: ModelShape, beta: float, use_kurtosis: bool, reduce_sum: Reduce | None = None,
                 world_size: int = 1, device: torch.device | str = "cpu", kurtosis_weight: float = 0.25):
        self.beta, self.use_kurtosis, self.kurtosis_weight = beta, use_kurtosis, kurtosis_weight
        self.device = torch.device(device)
        self.reduce_sum = reduce_sum or (lambda t: t)
        self.world_size = world_size
        self.enabled = True
        self._handles: list = []
        self._token_mask: torch.Tensor | None = None  # the current forward's attention_mask
        self.reset(shape)

    def reset(self, shape: ModelShape) -> None:
        """New shapes (after a shrink): fresh accumulators; EMA vectors are sliced by `keep`."""
        self.shape = shape
        device = self.device
        self.attn_sites = [_Site(l.num_q_heads * l.head_dim, device, with_mean=True) for l in shape.layers]
        self.ffn_sites = [_Site(l.ffn, device, with_mean=True) for l in shape.layers]
        self.hidden_sites = [_Site(shape.hidden, device) for _ in range(2 * len(shape.layers))]
        self.tokens = torch.zeros(1, dtype=torch.float32, device=device)  # exact up to 2**24 tokens per step
        if not hasattr(self, "group_scores") or self.group_scores is None:
            self.group_scores = self.neuron_scores = self.hidden_scores = None

    # ---- hooks ---------------------------------------------------------------------------
    def install(self, model) -> None:
        """Register before deepspeed.initialize (see docs/DEEPSPEED_NOTES.md: weights gathered then)."""
        self.remove()
        self._handles.append(model.register_forward_pre_hook(self._mask_hook, with_kwargs=True, prepend=True))
        for index, layer in enumerate(model.model.layers):
            o_proj, down = layer.self_attn.o_proj, layer.mlp.down_proj
            for module, inner, outer in ((o_proj, "attn_sites", 2 * index), (down, "ffn_sites", 2 * index + 1)):
                self._handles.append(module.register_forward_pre_hook(self._input_hook(inner, index), prepend=True))
                self._handles.append(module.register_forward_hook(self._output_hook(inner, index, outer), prepend=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _collecting(self) -> bool:
        # Inside backward, a forward is gradient checkpointing's recomputation: its activations
        # were already counted in the real forward, whose tensors receive the gradients.
        return self.enabled and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1

    def _mask_hook(self, module, args, kwargs):
        """Keep the forward's attention_mask (batch, seq), so padding is not counted."""
        mask = kwargs.get("attention_mask")
        self._token_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        return None

    # Hooks look their site up at call time: a shrink replaces the site lists.
    def _input_hook(self, kind: str, index: int):
        def hook(module, args):
            if self._collecting():
                x, mask = args[0], self._token_mask
                if mask is not None and mask.shape != x.shape[:-1]:
                    mask = None
                getattr(self, kind)[index].capture(x, mask)
                if kind == "attn_sites" and index == 0:  # count tokens once per forward
                    self.tokens += mask.sum() if mask is not None else x.numel() // x.shape[-1]
            return None

        return hook

    def _output_hook(self, kind: str, index: int, hidden_index: int):
        def hook(module, args, output):
            if self._collecting():
                mask = self._token_mask
                self.hidden_sites[hidden_index].capture(output, mask if mask is not None and mask.shape == output.shape[:-1] else None)
                site = getattr(self, kind)[index]
                if self.use_kurtosis and site.stale_weights:
                    site.power_sums = column_power_sums(_effective_weight(module))
                    site.stale_weights = False
                    site.weights_change = callable(getattr(module, "merged_weight", None))
            return None

        return hook

    # ---- per-step scores -----------------------------------------------------------------
    def end_step(self) -> None:
        """Reduce the step's sums across ranks, turn them into unit scores, update the EMA."""
        sites = self.attn_sites + self.ffn_sites + self.hidden_sites
        # One flat all-reduce for everything: fewer collectives, identical on every rank.
        parts = [s.act_abs for s in sites] + [s.grad_abs for s in sites]
        parts += [s.act_sum for s in self.attn_sites + self.ffn_sites] + [self.tokens]
        flat = self.reduce_sum(torch.cat(parts))
        offset = 0
        for part in parts:
            part.copy_(flat[offset : offset + part.numel()])
            offset += part.numel()
        groups, neurons = [], []
        for layer, attn, ffn in zip(self.shape.layers, self.attn_sites, self.ffn_sites):
            group_width = layer.group_size * layer.head_dim
            groups.append(self._unit_scores(attn, group_width))
            neurons.append(self._unit_scores(ffn, 1))
        hidden = sum(self._channel_scores(site) for site in self.hidden_sites)
        self._update_ema(groups, neurons, hidden)
        for site in sites:
            site.zero()
            # A frozen weight's power sums hold until a shrink (which makes new sites):
            # recomputing them every step cost ~10% of a SmolLM2 step.
            site.stale_weights = site.weights_change
        self.tokens.zero_()

    def _channel_scores(self, site: _Site) -> torch.Tensor:
        mean_abs = site.act_abs / self.tokens.clamp_min(1)  # tokens: this step's, summed over ranks
        return mean_abs * (site.grad_abs / self.world_size)

    def _unit_scores(self, site: _Site, width: int) -> torch.Tensor:
        score = self._channel_scores(site).reshape(-1, width).sum(-1)
        if self.use_kurtosis and self.kurtosis_weight > 0 and site.power_sums is not None:
            # No host check of the token count (a device sync per layer): with no tokens the
            # mean is 0, its variance 0, and unit_kurtosis gives 0.
            mean_x = site.act_sum.double() / self.tokens.double().clamp_min(1)
            outlier = unit_kurtosis(mean_x, site.power_sums, rows=self.shape.hidden, unit_width=width).clamp_min(0).sqrt()
            # In the layer's first-order units (see the module docstring): the term moves salience
            # toward outlier units without changing how the layer's units weigh against others.
            mean_outlier = outlier.mean()
            relative = torch.where(mean_outlier > 0, outlier / mean_outlier.clamp_min(1e-300), torch.zeros_like(outlier))
            score = score + (self.kurtosis_weight * score.mean() * relative).to(score.dtype)
        return score

    def _update_ema(self, groups, neurons, hidden) -> None:
        if self.group_scores is None:
            self.group_scores, self.neuron_scores, self.hidden_scores = groups, neurons, hidden
            return
        b = self.beta
        self.group_scores = [b * old + (1 - b) * new for old, new in zip(self.group_scores, groups)]
        self.neuron_scores = [b * old + (1 - b) * new for old, new in zip(self.neuron_scores, neurons)]
        self.hidden_scores = b * self.hidden_scores + (1 - b) * hidden

    @property
    def has_scores(self) -> bool:
        return self.group_scores is not None

    # ---- after a shrink --------------------------------------------------------------------
    def keep(self, new_shape: ModelShape, group_index, neuron_index, hidden_index) -> None:
        """Removed units drop out of the EMA vectors; accumulators restart at the new shapes."""
        if self.group_scores is not None:
            self.group_scores = [s[i.to(s.device)] for s, i in zip(self.group_scores, group_index)]
            self.neuron_scores = [s[i.to(s.device)] for s, i in zip(self.neuron_scores, neuron_index)]
            self.hidden_scores = self.hidden_scores[hidden_index.to(self.hidden_scores.device)]
        old_shape, old_attn, old_ffn = self.shape, self.attn_sites, self.ffn_sites
        self.reset(new_shape)
        if len(hidden_index) == old_shape.hidden:
            # The weights lost columns only (their rows are the hidden channels, all kept), so each
            # kept column's power sums are unchanged: slicing saves recomputing them in float64 at
            # the next forward (~5 ms a site on SmolLM2, 2.4 s over its 8 events). A resumed run
            # recomputes them: equal up to float64 rounding (relative 4e-14 at most, measured),
            # far below anything that orders units.
            for layer, old, new, index in zip(old_shape.layers, old_attn, self.attn_sites, group_index):
                query_channels, _ = group_channels(index.to(torch.long).cpu(), layer.group_size, layer.head_dim)
                _carry_power_sums(old, new, query_channels)
            for old, new, index in zip(old_ffn, self.ffn_sites, neuron_index):
                _carry_power_sums(old, new, index.to(torch.long))

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.group_scores is None:
            return {}
        state = {"hidden": self.hidden_scores.cpu()}
        for i, (g, n) in enumerate(zip(self.group_scores, self.neuron_scores)):
            state[f"group.{i}"], state[f"neuron.{i}"] = g.cpu(), n.cpu()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if not state:
            self.group_scores = self.neuron_scores = self.hidden_scores = None
            return
        layers = len(self.shape.layers)
        self.hidden_scores = state["hidden"].float().to(self.device)
        self.group_scores = [state[f"group.{i}"].float().to(self.device) for i in range(layers)]
        self.neuron_scores = [state[f"neuron.{i}"].float().to(self.device) for i in range(layers)]


def _carry_power_sums(old: _Site, new: _Site, columns: torch.Tensor) -> None:
    """Give `new` the power sums of `old`'s kept columns, unless they go stale every step anyway."""
    if old.power_sums is None or old.weights_change:
        return
    new.power_sums = old.power_sums[:, columns.to(old.power_sums.device)]
    new.stale_weights = False


def _effective_weight(module) -> torch.Tensor:
    """The weight the forward pass applies (base + adapter update when the module has one)."""
    merged = getattr(module, "merged_weight", None)
    return merged() if callable(merged) else module.weight
