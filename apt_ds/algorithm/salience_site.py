"""One salience hook site's running sums for a step: sum|X| and sum X over real tokens,
sum|dL/dX|, and the power sums of the site's weight (apt_ds.algorithm.salience)."""

from __future__ import annotations

import torch

from apt_ds.algorithm.quant import dense_weight


class Scratch:
    """One buffer, reused, for the hooks' activation-sized temporaries (|x|, x at real tokens) on a
    CPU. Made anew in every hook, they were allocated between the layers' activations of a forward
    and left free heap that glibc keeps resident: 10-12 MB over SmolLM2-135M's first salience
    steps, which APT held above LoRA until its first event (docs/BENCHMARKS.md). The buffer grows
    to the largest site's size and stays until the collector's next shape (`SalienceCollector.reset`,
    at every shrink): one temporary's memory, held instead of made."""

    def __init__(self):
        self._buffer: torch.Tensor | None = None
        self._views: dict[torch.Size, torch.Tensor] = {}  # a view per shape: made once, not per call (two dispatches)

    def like(self, x: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor of x's shape, dtype and device (a view of the buffer)."""
        buffer = self._buffer
        if buffer is None or buffer.numel() < x.numel() or buffer.dtype != x.dtype or buffer.device != x.device:
            self._views = {}
            buffer = self._buffer = None  # the old buffer goes before the new one is made
            self._buffer = buffer = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
        view = self._views.get(x.shape)
        if view is None:
            if len(self._views) >= 64:  # batch shapes vary: keep the dictionary small
                self._views = {}
            view = self._views[x.shape] = buffer[: x.numel()].view(x.shape)
        return view


class SiteSums:
    """Running sums for one hook site (one channel vector): fp32 views into the collector's one
    step buffer on the activations' device (see `SalienceCollector.reset`). `scratch`: the
    collector's, for temporaries on a CPU."""

    def __init__(self, act_abs: torch.Tensor, grad_abs: torch.Tensor, act_sum: torch.Tensor | None = None,
                 scratch: Scratch | None = None):
        self.act_abs, self.grad_abs, self.act_sum = act_abs, grad_abs, act_sum
        self.scratch = scratch if scratch is not None and act_abs.device.type == "cpu" else None
        self.power_sums: torch.Tensor | None = None  # (4, channels) float64 of the site's weight
        self.stale_weights = True  # power sums must be (re)computed at the next forward
        self.weights_change = False  # an adapter on the site's module: W changes every step

    def capture(self, x: torch.Tensor, token_weights: torch.Tensor | None = None) -> None:
        """Add a (batch, seq, channels) activation; `token_weights` (batch, seq, 1) in x's dtype is
        1 at real tokens, 0 at padding. The gradient needs no mask: a padded position reaches no
        loss term (its logits are not scored, and attention gives its key exactly zero weight), so
        its gradient is exactly 0.
        The padding is zeroed by the token weights (exact 0/1 factors) and the sums accumulate in
        fp32: the einsum this replaced rounded each site's sum to the activations' dtype (bf16:
        ~3e-3 relative error; fp16: inf past 65,504) and dispatched ~13 operations a site, mostly
        views, against 3-6 here (4 sites per layer and micro-batch)."""
        assert token_weights is None or token_weights.shape == (*x.shape[:-1], 1), "token weights are (batch, seq, 1)"
        dims = tuple(range(x.dim() - 1))
        with torch.no_grad():
            if token_weights is None:
                real = x
            else:
                real = x * token_weights if self.scratch is None else torch.mul(x, token_weights, out=self.scratch.like(x))
            if self.act_sum is not None:
                self.act_sum += real.sum(dims, dtype=torch.float32)
            self.act_abs += abs_sum(real, dims, in_place=real is not x, scratch=self.scratch)
            del real
        if x.requires_grad:
            x.register_hook(self._on_grad)

    def take_power_sums(self, old: "SiteSums", columns: torch.Tensor) -> None:
        """The power sums of `old`'s kept columns, unless they go stale every step anyway."""
        if old.power_sums is None or old.weights_change:
            return
        self.power_sums = old.power_sums[:, columns.to(old.power_sums.device)]
        self.stale_weights = False

    @torch.no_grad()  # a create_graph backward must not attach its graph to the step buffer
    def _on_grad(self, grad: torch.Tensor) -> None:
        self.grad_abs += abs_sum(grad, tuple(range(grad.dim() - 1)), scratch=self.scratch)


def abs_sum(x: torch.Tensor, dims: tuple[int, ...], in_place: bool = False, fused: bool | None = None,
            scratch: Scratch | None = None) -> torch.Tensor:
    """sum |x| over `dims`, accumulated in fp32.

    `fused` (default: on CUDA, for fp32/bf16/fp16) is one reduction, `linalg.vector_norm` of order
    1, which upcasts bf16/fp16 inside the kernel on CUDA and reads x once, where abs().sum() writes
    and reads back an |x| of x's size (a 7B down_proj input at 16 x 512 tokens is 180 MB, and a
    step has four sites a layer, forward and backward). Otherwise abs().sum(): vector_norm(ord=1)
    ran 4-10x slower on CPU (measured on (4, 64, 576..1536) activations), which alone cost ~7% of a
    SmolLM2 training step. `in_place`: x is a temporary the caller no longer needs (the unfused path
    takes |x| in it); `scratch`: otherwise |x| is written there rather than into a new tensor."""
    if fused is None:  # vector_norm refuses to narrow fp64 to fp32; fp64 keeps the plain path
        fused = x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if fused:
        return torch.linalg.vector_norm(x, 1, dims, dtype=torch.float32)
    if in_place:
        return x.abs_().sum(dims, dtype=torch.float32)
    return (x.abs() if scratch is None else torch.abs(x, out=scratch.like(x))).sum(dims, dtype=torch.float32)


def effective_weight(module) -> torch.Tensor:
    """The weight the forward pass applies (base + adapter update when the module has one)."""
    merged = getattr(module, "merged_weight", None)
    return merged() if callable(merged) else dense_weight(module.weight)
