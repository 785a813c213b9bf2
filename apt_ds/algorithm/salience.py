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
- hidden channels: outputs of o_proj and down_proj (a post-LayerNorm encoder's: of the norm after
  each residual add, `LayerKind.hidden_sites`), the product taken per site and summed over the sites.
Each site counts the tokens of the sequence it runs over (a T5 decoder's: the target; salience_tokens).
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

import functools
from typing import Callable

import torch

from apt_ds.algorithm.finite import require_finite
from apt_ds.algorithm.kurtosis import column_power_sums, unit_kurtosis
from apt_ds.algorithm.salience_site import Scratch, SiteSums, effective_weight
from apt_ds.algorithm.salience_tokens import SIDES, SiteTokens
from apt_ds.algorithm.shrink import group_channels
from apt_ds.algorithm.units import ModelShape
from apt_ds.models import family_for, family_of

Reduce = Callable[[torch.Tensor], torch.Tensor]


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
        # False when the caller knows from the host batch that no position is padding: the sites
        # then skip the token weights (a multiply over every activation, at no change in the sums).
        self.batch_has_padding = True
        self.reset(shape)

    def reset(self, shape: ModelShape) -> None:
        """New shapes (after a shrink): fresh accumulators; EMA vectors are sliced by `keep`.

        Every accumulator of a step is a view into ONE fp32 buffer laid out by kind:
        act_abs [attn sites, ffn sites, 2L hidden sites], grad_abs [the same], act_sum [attn, ffn],
        tokens. A step's end then all-reduces, scores and zeroes whole kinds with a few operations
        instead of a few per site: on a GPU nearly every one is a kernel launch paid on the host
        (32 layers: about 580 operations dispatched per step, 4,743 when each site was scored alone)."""
        self.shape = shape
        layers, kinds = shape.layers, family_for(shape.family).kinds
        attn = [l.num_q_heads * l.head_dim for l in layers]
        ffn = [l.ffn for l in layers]
        # each unit layer's hidden sites (what its blocks add to the residual stream; two, or a T5
        # decoder self-attention's one), and the tokens each reads (a T5 decoder's: the target)
        sites_per_layer = [len(kinds[l.kind].hidden_sites) for l in layers]
        self._tokens = SiteTokens([SIDES.index(kinds[l.kind].side) for l in layers], sites_per_layer)
        self._hidden_first = [sum(sites_per_layer[:i]) for i in range(len(layers))]
        hidden = [shape.hidden] * sum(sites_per_layer)
        per_kind = sum(attn) + sum(ffn) + sum(hidden)
        self._channel_side = self._tokens.channel_sides(attn, ffn, hidden, self.device)
        self._sizes = {"attn": attn, "ffn": ffn, "hidden": hidden}
        self._spans = (sum(attn), sum(ffn), per_kind)  # the buffer's layout, read by end_step
        # each unit's layer, per kind, made once per shape: indexing with it spreads per-layer
        # means over the units without a host sync (repeat_interleave by counts would sync)
        self._unit_layer = {kind: torch.repeat_interleave(torch.arange(len(units)), torch.tensor(units)).to(self.device)
                            for kind, units in (("attn", [l.num_kv_groups for l in layers]), ("ffn", ffn))}
        slots = self._tokens.slots
        self._buffer = torch.zeros(3 * per_kind - sum(hidden) + slots, dtype=torch.float32, device=self.device)
        act, grad = self._buffer[:per_kind], self._buffer[per_kind : 2 * per_kind]
        sums = self._buffer[2 * per_kind : -slots]
        act_parts, grad_parts = act.split(attn + ffn + hidden), grad.split(attn + ffn + hidden)
        sum_parts = sums.split(attn + ffn)
        self._scratch = Scratch()  # the sites' temporaries on a CPU, at this shape's sizes (salience_site)
        site = functools.partial(SiteSums, scratch=self._scratch)
        self.attn_sites = [site(act_parts[i], grad_parts[i], sum_parts[i]) for i in range(len(layers))]
        self.ffn_sites = [site(act_parts[i], grad_parts[i], sum_parts[i]) for i in range(len(layers), 2 * len(layers))]
        self.hidden_sites = [site(a, g) for a, g in zip(act_parts[2 * len(layers):], grad_parts[2 * len(layers):])]
        self.tokens = self._buffer[-slots:]  # each side's, exact up to 2**24 tokens per step
        if not hasattr(self, "group_scores") or self.group_scores is None:
            self.group_scores = self.neuron_scores = self.hidden_scores = None

    # ---- hooks ---------------------------------------------------------------------------
    def install(self, model) -> None:
        """Register before deepspeed.initialize (see docs/DEEPSPEED_NOTES.md: weights gathered then)."""
        self.remove()
        self._handles.append(model.register_forward_pre_hook(self._mask_hook, with_kwargs=True, prepend=True))
        for index, unit in enumerate(family_of(model).unit_layers(model)):
            kind, layer, side = unit.kind, unit.module, self._tokens.layer_sides[index]
            inputs = [("attn_sites", "attn_output"), *([("ffn_sites", "ffn_down")] if kind.has_ffn else [])]
            for inner, role in inputs:
                module = kind.layer_module(layer, role)
                self._handles.append(module.register_forward_pre_hook(self._input_hook(inner, index, side), prepend=True))
                self._handles.append(module.register_forward_hook(self._weight_hook(inner, index), prepend=True))
            for number, role in enumerate(kind.hidden_sites):
                site = kind.layer_module(layer, role)
                self._handles.append(site.register_forward_hook(self._hidden_hook(self._hidden_first[index] + number, side),
                                                                prepend=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _collecting(self) -> bool:
        # Inside backward, a forward is gradient checkpointing's recomputation: its activations
        # were already counted in the real forward, whose tensors receive the gradients.
        return self.enabled and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1

    def _mask_hook(self, module, args, kwargs):
        """Keep the forward's token masks (batch, seq), so padding is not counted."""
        self._tokens.read_masks(kwargs, self.batch_has_padding)
        return None

    # Hooks look their site up at call time: a shrink replaces the site lists.
    def _input_hook(self, kind: str, index: int, side: int):
        def hook(module, args):
            if self._collecting():
                x = args[0]
                weights = self._tokens.weights_for(x, side)
                getattr(self, kind)[index].capture(x, weights)
                if kind == "attn_sites" and index == self._tokens.counting[side]:  # each side's tokens once a forward
                    self.tokens[side : side + 1] += self._tokens.count(x, side, weights)
            return None

        return hook

    def _hidden_hook(self, hidden_index: int, side: int):
        def hook(module, args, output):
            if self._collecting():
                self.hidden_sites[hidden_index].capture(output, self._tokens.weights_for(output, side))
            return None

        return hook

    def _weight_hook(self, kind: str, index: int):
        """The kurtosis statistics of the site's weight, once per shape (adapted: every step)."""
        def hook(module, args, output):
            if self._collecting():
                site = getattr(self, kind)[index]
                if self.use_kurtosis and site.stale_weights:
                    site.power_sums = column_power_sums(effective_weight(module))
                    site.stale_weights = False
                    site.weights_change = callable(getattr(module, "merged_weight", None))
            return None

        return hook

    # ---- per-step scores -----------------------------------------------------------------
    def end_step(self) -> None:
        """Reduce the step's sums across ranks, turn them into unit scores, update the EMA."""
        flat = self.reduce_sum(self._buffer)  # everything in one collective, identical on every rank
        sizes = self._sizes
        a, f, per_kind = self._spans
        slots = self._tokens.slots
        act, grad = flat[:per_kind], flat[per_kind : 2 * per_kind]
        sums, tokens = flat[2 * per_kind : -slots], flat[-slots:]
        if self._channel_side is not None:  # each channel divided by its own side's tokens
            tokens = tokens[self._channel_side]
        attn_tokens, ffn_tokens, hidden_tokens = ((tokens, tokens, tokens) if tokens.numel() == 1
                                                  else (tokens[:a], tokens[a : a + f], tokens[a + f :]))
        layers = self.shape.layers
        groups = self._kind_scores(act[:a], grad[:a], sums[:a], attn_tokens, self.attn_sites,
                                   [l.num_kv_groups for l in layers], [l.group_size * l.head_dim for l in layers],
                                   self._unit_layer["attn"])
        neurons = self._kind_scores(act[a : a + f], grad[a : a + f], sums[a : a + f], ffn_tokens, self.ffn_sites,
                                    sizes["ffn"], [1] * len(layers), self._unit_layer["ffn"])
        hidden_channels = self._channel_scores(act[a + f :], grad[a + f :], hidden_tokens).view(len(sizes["hidden"]), -1)
        hidden = sum(hidden_channels.unbind(0))  # site by site, in the order the hooks number them
        self._update_ema(groups, neurons, hidden)
        self._buffer.zero_()
        for site in self.attn_sites + self.ffn_sites:
            # A frozen weight's power sums hold until a shrink (which makes new sites):
            # recomputing them every step cost ~10% of a SmolLM2 step.
            site.stale_weights = site.weights_change

    def discard_step(self) -> None:
        """Leave this step out of the scores: its update was skipped (a NaN or inf loss or gradient),
        and its activation gradients would make every EMA NaN for good."""
        self._buffer.zero_()

    def require_finite_scores(self, what: str) -> None:
        """Raise NonFiniteError when a score is NaN or inf: an order over NaN is arbitrary, and a
        decision taken on it would remove units at random, for good."""
        if self.group_scores is None:
            return
        named = [*((f"KV-group scores of layer {l}", s) for l, s in enumerate(self.group_scores)),
                 *((f"FFN-neuron scores of layer {l}", s) for l, s in enumerate(self.neuron_scores)),
                 ("hidden-channel scores", self.hidden_scores)]
        require_finite(named, f"{what} refused", "the run is diverging (a lower learning rate, --lr, usually fixes it)")

    def _channel_scores(self, act_abs: torch.Tensor, grad_abs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        mean_abs = act_abs / tokens.clamp_min(1)  # tokens: this step's, summed over ranks
        return mean_abs * (grad_abs / self.world_size)

    def _kind_scores(self, act_abs, grad_abs, act_sum, tokens, sites, units: list[int], widths: list[int],
                     unit_layer: torch.Tensor) -> list[torch.Tensor]:
        """One kind's unit scores, every layer at once (its channels are consecutive in the
        buffer), returned per layer; layer by layer through the same code when the layers' unit
        widths differ or only some sites have power sums. Each number is computed by the same
        operations on the same values either way: on a CPU the results are bit-identical (a GPU's
        reduction over a view may round the last bit differently)."""
        channel = self._channel_scores(act_abs, grad_abs, tokens)
        outliers = self.use_kurtosis and self.kurtosis_weight > 0
        with_sums = [site.power_sums is not None for site in sites]
        if len(set(widths)) == 1 and (not outliers or all(with_sums) or not any(with_sums)):
            score = channel.reshape(-1, widths[0]).sum(-1)
            if outliers and all(with_sums):
                power_sums = torch.cat([site.power_sums for site in sites], dim=1)
                score = self._with_outliers(score, act_sum, tokens, power_sums, widths[0], units, unit_layer)
            return list(score.split(units))
        bounds = [n * w for n, w in zip(units, widths)]
        scores = []
        per_layer_tokens = tokens.split(bounds) if tokens.numel() > 1 else [tokens] * len(bounds)
        for c, m, t, site, n, w in zip(channel.split(bounds), act_sum.split(bounds), per_layer_tokens, sites, units, widths):
            score = c.reshape(-1, w).sum(-1)
            if outliers and site.power_sums is not None:
                one_layer = torch.zeros(n, dtype=torch.long, device=score.device)
                score = self._with_outliers(score, m, t, site.power_sums, w, [n], one_layer)
            scores.append(score)
        return scores

    def _with_outliers(self, score, act_sum, tokens, power_sums, width: int, units: list[int], unit_layer) -> torch.Tensor:
        """`score` (consecutive layers of `units` units) plus the outlier term, in each layer's
        first-order units (see the module docstring): it moves salience toward outlier units
        without changing how the layer's units weigh against others. `unit_layer`: each unit's
        layer, so per-layer means spread over the units without a host sync."""
        # No host check of the token count (a device sync): with no tokens the mean is 0, its
        # variance 0, and unit_kurtosis gives 0.
        mean_x = act_sum.double() / tokens.double().clamp_min(1)
        outlier = unit_kurtosis(mean_x, power_sums, rows=self.shape.hidden, unit_width=width).clamp_min(0).sqrt()
        mean_outlier = torch.stack([o.mean() for o in outlier.split(units)])[unit_layer]
        mean_score = torch.stack([self.kurtosis_weight * s.mean() for s in score.split(units)])[unit_layer]
        relative = torch.where(mean_outlier > 0, outlier / mean_outlier.clamp_min(1e-300), torch.zeros_like(outlier))
        return score + (mean_score * relative).to(score.dtype)

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
                new.take_power_sums(old, query_channels)
            for old, new, index in zip(old_ffn, self.ffn_sites, neuron_index):
                new.take_power_sums(old, index.to(torch.long))

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
