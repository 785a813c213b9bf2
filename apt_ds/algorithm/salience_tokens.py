"""Which tokens a salience site counts. A decoder-only or encoder model's sites all read its input,
whose padding the forward's `attention_mask` marks. A T5 model's decoder sites read the target
sequence instead (`decoder_attention_mask`). Each side counts its own real tokens per step, so a
site's mean |X| is over the positions it saw, and an encoder unit's score is comparable with a
decoder unit's whatever the two sequence lengths are."""

from __future__ import annotations

import torch

SIDES = ("input", "target")  # a LayerKind's `side`
MASK_ARGUMENTS = ("attention_mask", "decoder_attention_mask")  # the forward's mask of each side


class SiteTokens:
    """The side of each unit layer (0: input, 1: target), the current forward's token masks and
    their (batch, seq, 1) weights, made once per forward, dtype and device."""

    def __init__(self, layer_sides: list[int], hidden_sites_per_layer: list[int]):
        self.layer_sides = layer_sides
        self.hidden_site_sides = [side for side, n in zip(layer_sides, hidden_sites_per_layer) for _ in range(n)]
        self.slots = 2 if any(layer_sides) else 1  # token counters at the end of the salience buffer
        # the attention site of each side that counts its tokens, once per forward
        self.counting = {side: layer_sides.index(side) for side in set(layer_sides)}
        self.masks: tuple = (None, None)
        self._weights: dict[tuple, torch.Tensor] = {}

    def channel_sides(self, attn: list[int], ffn: list[int], hidden: list[int], device) -> torch.Tensor | None:
        """The side of every channel of the activation buffer (the layers' attention channels, their
        FFN channels, then every hidden site's channels); None when every site reads the input (one
        counter, no indexing)."""
        if self.slots == 1:
            return None
        parts = [(n, side) for counts, sides in ((attn, self.layer_sides), (ffn, self.layer_sides),
                                                 (hidden, self.hidden_site_sides)) for n, side in zip(counts, sides)]
        return torch.cat([torch.full((n,), side, dtype=torch.long) for n, side in parts]).to(device)

    def read_masks(self, kwargs: dict, has_padding: bool) -> None:
        """Keep the forward's masks (batch, seq) of each side, so padding is not counted."""
        masks = [kwargs.get(name) if has_padding else None for name in MASK_ARGUMENTS]
        self.masks = tuple(m if isinstance(m, torch.Tensor) and m.dim() == 2 else None for m in masks)
        self._weights = {}

    def weights_for(self, x: torch.Tensor, side: int) -> torch.Tensor | None:
        """The token weights of activation `x` on `side`; None when there is no mask or it does not
        match x (batch, seq)."""
        mask = self.masks[side]
        if mask is None or mask.shape != x.shape[:-1]:
            return None
        key = (side, x.dtype, x.device)
        if key not in self._weights:
            self._weights[key] = mask.unsqueeze(-1).to(device=x.device, dtype=x.dtype)
        return self._weights[key]

    def count(self, x: torch.Tensor, side: int, weights: torch.Tensor | None) -> torch.Tensor | int:
        """The real tokens of `x` on `side` (its positions when there is no mask)."""
        return self.masks[side].sum() if weights is not None else x.numel() // x.shape[-1]
