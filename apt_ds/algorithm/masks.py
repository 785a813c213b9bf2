"""Per-unit gates multiplied into a forward pass (decoders and encoders: apt_ds.models).

- KV-group mask z_attn[l]: scales the query heads of each group at the input of o_proj;
- FFN-neuron mask z_ffn[l]: scales act(gate) * up at the input of down_proj;
- hidden mask z_hid, pre-norm decoders: scales the embedding output and every o_proj / down_proj
  output (what is added to the residual stream); RMSNorms then average x^2 over the kept
  channels only (divisor sum(z_hid)), so that removing a channel later gives the same numbers;
- hidden mask, post-LayerNorm encoders: every LayerNorm (the embeddings' and two a layer) takes
  its mean and variance over the kept channels and multiplies its output by z_hid, which is the
  residual stream: what a dense layer adds to a pruned channel is never read. The classifier's
  input is gated too (the pooler's tanh turns a pruned channel's bias into a non-zero input).

Masks are plain tensors held by `UnitMasks` (identical on every rank, saved with
checkpoints, never seen by ZeRO). A decay-window step leaves them views of one tensor (one update
for all of them, `GradualMasker.step_toward`): replace a mask rather than edit it in place while a
forward's graph is alive, or autograd's version check fails for all of them. An all-ones mask is
skipped entirely, so an unpruned model pays nothing for them. While masks decay (the window before each pruning event) every forward
multiplies them in, so what the hooks need is made once per mask update, not per call: the
masks cast to the activations' dtype, the KV-group mask expanded to o_proj's input channels and
the norms' divisor; on a GPU each of those would otherwise be a kernel launch in every layer.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from apt_ds.algorithm.units import ModelShape
from apt_ds.models import family_of


def is_binary(mask: torch.Tensor) -> bool:
    """Every entry 0 or 1: a mask that keeps or drops units outright (not mid-decay)."""
    return bool(((mask == 0) | (mask == 1)).all())


class UnitMasks:
    def __init__(self, shape: ModelShape, device: torch.device | str = "cpu"):
        self.device = torch.device(device)  # the model's: hooks multiply activations by masks
        self.reset(shape)
        self.enabled = True  # False while the distillation teacher runs
        self._handles: list = []
        self._norms: list = []  # the RMSNorms whose forward install routed

    def reset(self, shape: ModelShape) -> None:
        self.shape = shape
        self.kv_group = [torch.ones(layer.num_kv_groups, device=self.device) for layer in shape.layers]
        self.ffn_neuron = [torch.ones(layer.ffn, device=self.device) for layer in shape.layers]
        self.hidden = torch.ones(shape.hidden, device=self.device)
        self.refresh()

    def refresh(self) -> None:
        """Recompute which masks are not all-ones and drop what the hooks made from them: required
        after EVERY edit of a mask tensor, in place or not (after a pruning decision or a decay-
        window step's mask update, never inside a forward/backward); until then the forward keeps
        using the masks as they were. One host read for all 2 x layers + 1 masks: on a GPU each
        read waits for the device."""
        active = torch.stack([(m != 1).any() for m in self.tensors()]).tolist()
        layers = len(self.kv_group)
        self._hidden_active = active[0]
        self._group_active = active[1 : 1 + layers]
        self._neuron_active = active[1 + layers :]
        self._gates: dict[tuple, torch.Tensor] = {}  # (kind, layer, dtype) -> the factor a hook multiplies by

    # ---- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"hidden": self.hidden.to("cpu", copy=True)}
        for i, (g, f) in enumerate(zip(self.kv_group, self.ffn_neuron)):
            state[f"kv_group.{i}"] = g.to("cpu", copy=True)
            state[f"ffn_neuron.{i}"] = f.to("cpu", copy=True)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.hidden = state["hidden"].float().to(self.device, copy=True)
        self.kv_group = [state[f"kv_group.{i}"].float().to(self.device, copy=True) for i in range(len(self.kv_group))]
        self.ffn_neuron = [state[f"ffn_neuron.{i}"].float().to(self.device, copy=True) for i in range(len(self.ffn_neuron))]
        self.refresh()

    def is_binary(self) -> bool:
        return all(is_binary(t) for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """Every mask, in the order hidden, KV groups by layer, FFN neurons by layer."""
        return [self.hidden, *self.kv_group, *self.ffn_neuron]

    # ---- installation --------------------------------------------------------------------
    def install(self, model) -> None:
        """Register the gating hooks on a decoder model of a known family (idempotent)."""
        self.remove()
        family, hidden_out = family_of(model), self._hidden_output_hook
        pre_norm = family.norm_placement == "pre"  # the residual stream is what the blocks add
        if pre_norm:  # what the embedding puts in the residual stream (through T5's stacks' own views of it)
            embeddings = [family.embedding_module(model), *(model.get_submodule(a) for a in family.embedding_aliases)]
            self._handles += [module.register_forward_hook(hidden_out) for module in embeddings]
        for index, unit in enumerate(family.unit_layers(model)):
            kind, layer = unit.kind, unit.module
            head_dim, group_size = kind.head_geometry(layer)
            attn_output = kind.layer_module(layer, "attn_output")
            self._handles.append(attn_output.register_forward_pre_hook(self._group_input_hook(index, head_dim, group_size)))
            outputs = [attn_output]
            if kind.has_ffn:  # a T5 decoder block's self-attention unit layer has none
                ffn_down = kind.layer_module(layer, "ffn_down")
                self._handles.append(ffn_down.register_forward_pre_hook(self._neuron_input_hook(index)))
                outputs.append(ffn_down)
            if pre_norm:
                self._handles += [module.register_forward_hook(hidden_out) for module in outputs]
            for norm in kind.hidden_norms(layer):
                self._mask_norm(norm)
        for norm in family.outer_norms(model):
            self._mask_norm(norm)
        if family.head_input is not None:
            self._handles.append(model.get_submodule(family.head_input).register_forward_pre_hook(self._hidden_input_hook))

    def remove(self) -> None:
        """Undo `install` (nothing is undone when a norm's forward was replaced after it)."""
        for norm in self._norms:
            if not _routed_by(norm, self):
                raise RuntimeError(f"the forward of {type(norm).__name__} was replaced after these masks were installed "
                                   "(another wrapper, or other masks): remove that first")
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for norm in self._norms:
            own_forward = norm.forward.args[2]  # the instance forward it had before install, or None
            if own_forward is None:
                del norm.forward  # the class's forward again
            else:
                norm.forward = own_forward
        self._norms = []

    def _mask_norm(self, norm) -> None:
        """Route the RMSNorm's forward through `_routed_norm_forward` (set on the instance and
        undone by `remove`, as accelerate's hooks do). A forward hook would have to recompute the
        norm after the module computed it: twice the norm's passes over the activations, in
        every layer, on every step of a decay window. A partial holding the module and these
        masks, not a closure: a deep copy of the model then routes through its own copies."""
        norm.forward = functools.partial(_routed_norm_forward, norm, self, norm.__dict__.get("forward"))
        self._norms.append(norm)

    # ---- hooks ---------------------------------------------------------------------------
    def _gate(self, kind: str, index: int, dtype: torch.dtype, make) -> torch.Tensor:
        """The factor a hook multiplies by, made by `make()` on the first call after a mask update
        and kept until the next. Not kept when made under inference_mode: an inference tensor
        cannot be saved for a later backward."""
        key = (kind, index, dtype)
        gate = self._gates.get(key)
        if gate is None:
            gate = make().to(dtype)
            if not torch.is_inference_mode_enabled():
                self._gates[key] = gate
        return gate

    def _group_input_hook(self, index: int, head_dim: int, group_size: int):
        def hook(module, args):
            if not (self.enabled and self._group_active[index]):
                return None
            x = args[0]
            channel_mask = self._gate("group", index, x.dtype,
                                      lambda: self.kv_group[index].repeat_interleave(group_size * head_dim))
            return (x * channel_mask,) + tuple(args[1:])

        return hook

    def _neuron_input_hook(self, index: int):
        def hook(module, args):
            if not (self.enabled and self._neuron_active[index]):
                return None
            x = args[0]
            return (x * self._gate("neuron", index, x.dtype, lambda: self.ffn_neuron[index]),) + tuple(args[1:])

        return hook

    def _hidden_output_hook(self, module, args, output):
        if not (self.enabled and self._hidden_active):
            return None
        return output * self._gate("hidden", 0, output.dtype, lambda: self.hidden)

    def _hidden_input_hook(self, module, args):
        if not (self.enabled and self._hidden_active):
            return None
        x = args[0]
        return (x * self._gate("hidden", 0, x.dtype, lambda: self.hidden),) + tuple(args[1:])

    def _norm_over_kept(self, module, x: torch.Tensor) -> torch.Tensor:
        """The norm with its statistics taken over the kept channels only: LLaMA's RMSNorm (the
        mean of x^2), or a LayerNorm (mean and variance; its output gated by the mask, so that a
        removed channel's bias is not added to the residual stream)."""
        x32 = x.to(torch.float32)
        kept = self._gate("kept", 0, torch.float32, lambda: self.hidden.sum().clamp_min(1e-6))
        if isinstance(module, nn.LayerNorm):
            z = self._gate("hidden", 0, torch.float32, lambda: self.hidden)
            centred = (x32 - (x32 * z).sum(-1, keepdim=True) / kept) * z
            variance = centred.pow(2).sum(-1, keepdim=True) / kept
            normed = centred * torch.rsqrt(variance + module.eps)
            return ((normed * module.weight + module.bias) * z).to(x.dtype)
        variance = x32.pow(2).sum(-1, keepdim=True) / kept
        normed = x32 * torch.rsqrt(variance + module.variance_epsilon)
        return module.weight * normed.to(x.dtype)


def _routed_by(norm, masks: UnitMasks) -> bool:
    forward = norm.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _routed_norm_forward and forward.args[1] is masks


def _routed_norm_forward(norm, masks: UnitMasks, own_forward, hidden_states: torch.Tensor) -> torch.Tensor:
    """A masked RMSNorm's forward: its own (the class's, or the instance's before install) while
    the hidden mask is all ones or switched off, else the norm over the kept channels."""
    if masks.enabled and masks._hidden_active:
        return masks._norm_over_kept(norm, hidden_states)
    return own_forward(hidden_states) if own_forward is not None else type(norm).forward(norm, hidden_states)
