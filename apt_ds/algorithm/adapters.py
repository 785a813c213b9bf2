"""APTAdapter: a frozen Linear plus a LoRA-style low-rank update whose rank can grow.

    y = W x + s * B (A x),   A: r x in,  B: out x r,  s = alpha / r0 (fixed when r grows)

The adapter is made by re-classing an existing nn.Linear in place, so the frozen `weight`
keeps its name and identity (state-dict keys stay `...q_proj.weight`, ZeRO-3 attributes
survive) and the new parameters are `lora_A` / `lora_B` next to it, as in PEFT.
A frozen snapshot of A/B (`teacher_A` / `teacher_B` buffers) serves self-distillation, so
the teacher shares the base weights instead of copying the model.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch import nn

from apt_ds.algorithm.edits import Grow, Keep, ShapeChange
from apt_ds.algorithm.quant import QuantizedLinear, dense_weight, frozen_linear
from apt_ds.models import family_of


class APTAdapter(nn.Linear):
    """A frozen nn.Linear plus a low-rank update: y = W x + b + scaling * B (A x), with A and B in
    fp32 and a frozen snapshot of them (`teacher_A/B`) that the self-distillation teacher reads.
    Made from an existing Linear by `APTAdapter.wrap(linear, rank, alpha)` (in place), never by
    the constructor; `grow_rank`, `merged_weight` and `merge_and_unwrap` change or fold it."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    scaling: float
    use_teacher: bool

    @classmethod
    def wrap(cls, linear: nn.Linear, rank: int, alpha: float, generator: torch.Generator | None = None,
             device: torch.device | str | None = None) -> "APTAdapter":
        """Turn `linear` into an adapter in place (weights frozen, B = 0: same function).

        A and B are fp32 whatever the base dtype (the trainable masters; DeepSpeed keeps its own
        fp32 masters and casts the model copy to its precision). `device`: where A and B live
        (default: the weight's; give it when the weight is a ZeRO-3 partition)."""
        if isinstance(linear, APTAdapter):
            raise TypeError("this Linear is already an APTAdapter: the model has APT adapters on it (one APTrainer per "
                            "model; a trained model is exported or merged first, apt_ds.export)")
        if type(linear) not in (nn.Linear, QuantizedLinear):
            raise TypeError(f"can only wrap a plain nn.Linear, got {type(linear).__name__}")
        try:
            rank = operator.index(rank)  # an int, or a numpy integer
        except TypeError:
            rank = 0
        if rank < 1 or not alpha > 0:
            raise ValueError(f"an adapter needs an integer rank >= 1 and alpha > 0, got rank {rank!r}, alpha {alpha!r}")
        linear.__class__ = cls
        adapter: APTAdapter = linear  # type: ignore[assignment]
        adapter.weight.requires_grad_(False)
        if adapter.bias is not None:
            adapter.bias.requires_grad_(False)
        adapter.scaling = alpha / rank
        adapter.use_teacher = False
        if device is None:
            device = adapter.weight.device if adapter.weight.device.type != "meta" else "cpu"
        a = _init_lora_a(torch.empty(rank, adapter.in_features, dtype=torch.float32), generator).to(device)
        adapter.lora_A = nn.Parameter(a)
        adapter.lora_B = nn.Parameter(torch.zeros(adapter.out_features, rank, dtype=torch.float32, device=device))
        adapter.register_buffer("teacher_A", a.detach().clone())
        adapter.register_buffer("teacher_B", torch.zeros_like(adapter.lora_B.detach()))
        return adapter

    @property
    def rank(self) -> int:
        return int(getattr(self.lora_A, "ds_shape", self.lora_A.shape)[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = frozen_linear(x, self.weight, self.bias)  # a quantized base weight too
        return base + self.low_rank_update(x).to(base.dtype)

    def low_rank_update(self, x: torch.Tensor) -> torch.Tensor:
        """s * B (A x) in the adapter's dtype, with the teacher's snapshot in teacher mode."""
        lora_a, lora_b = (self.teacher_A, self.teacher_B) if self.use_teacher else (self.lora_A, self.lora_B)
        return self.scaling * F.linear(F.linear(x.to(lora_a.dtype), lora_a), lora_b)

    # ---- teacher snapshot ----------------------------------------------------------------
    @torch.no_grad()
    def snapshot_teacher(self, lora_a: torch.Tensor | None = None, lora_b: torch.Tensor | None = None) -> None:
        """Copy A/B into the teacher buffers (pass full tensors when ZeRO-3 partitions them)."""
        self.teacher_A = (self.lora_A if lora_a is None else lora_a).detach().clone().to(self.teacher_A.dtype)
        self.teacher_B = (self.lora_B if lora_b is None else lora_b).detach().clone().to(self.teacher_B.dtype)

    # ---- shape changes -------------------------------------------------------------------
    @torch.no_grad()
    def grow_rank(self, new_rank: int, generator: torch.Generator | None = None) -> ShapeChange:
        """Append rank: new A rows random, new B columns zero, so the output is unchanged."""
        old = self.rank
        if new_rank < old:
            raise ValueError(f"grow_rank to {new_rank} < current rank {old}")
        if new_rank == old:
            return {}
        extra_a = _init_lora_a(torch.empty(new_rank - old, self.in_features, dtype=torch.float32), generator)
        extra_a = extra_a.to(self.lora_A.device, self.lora_A.dtype)
        self.lora_A = nn.Parameter(torch.cat([self.lora_A.detach(), extra_a], 0))
        extra_b = torch.zeros(self.out_features, new_rank - old, dtype=self.lora_B.dtype, device=self.lora_B.device)
        self.lora_B = nn.Parameter(torch.cat([self.lora_B.detach(), extra_b], 1))
        # The teacher snapshot keeps its own rank; pad it the same way (zeros in B: same function).
        self.teacher_A = torch.cat([self.teacher_A, extra_a.to(self.teacher_A.device, self.teacher_A.dtype)], 0)
        self.teacher_B = torch.cat([self.teacher_B, torch.zeros_like(extra_b, dtype=self.teacher_B.dtype, device=self.teacher_B.device)], 1)
        return {"lora_A": [Grow(0, new_rank)], "lora_B": [Grow(1, new_rank)]}

    @torch.no_grad()
    def keep_adapter_entries(self, out_index: torch.Tensor | None, in_index: torch.Tensor | None) -> ShapeChange:
        """Slice A's input columns / B's output rows to the kept units (frozen weight: caller)."""
        change: ShapeChange = {}
        if in_index is not None:
            self.lora_A = nn.Parameter(self.lora_A.detach().index_select(1, in_index.to(self.lora_A.device)).contiguous())
            self.teacher_A = self.teacher_A.index_select(1, in_index.to(self.teacher_A.device)).contiguous()
            change["lora_A"] = [Keep(1, in_index)]
        if out_index is not None:
            self.lora_B = nn.Parameter(self.lora_B.detach().index_select(0, out_index.to(self.lora_B.device)).contiguous())
            self.teacher_B = self.teacher_B.index_select(0, out_index.to(self.teacher_B.device)).contiguous()
            change["lora_B"] = [Keep(0, out_index)]
        return change

    # ---- merge -----------------------------------------------------------------------------
    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + s * B A, computed in fp32 and cast back to W's dtype (PEFT's rule on CPU); a
        quantized W is dequantized first (its compute dtype)."""
        weight = dense_weight(self.weight)
        return (weight.float() + self.merged_delta()).to(weight.dtype)

    @torch.no_grad()
    def merged_delta(self) -> torch.Tensor:
        """s * B A in fp32: what merging adds to the base weight."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scaling

    def merge_and_unwrap(self) -> nn.Linear:
        """Fold the adapter into the weight and turn this module back into a plain nn.Linear."""
        merged = self.merged_weight()
        self.weight = nn.Parameter(merged, requires_grad=False)
        for name in ("lora_A", "lora_B"):
            delattr(self, name)
        for name in ("teacher_A", "teacher_B"):
            self._buffers.pop(name, None)
        for name in ("scaling", "use_teacher"):
            self.__dict__.pop(name, None)
        self.__class__ = nn.Linear
        return self

    def adapter_params(self) -> int:
        return self.rank * (self.in_features + self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:.4g}"


class IdentityAdapter(APTAdapter):
    """An adapter on the identity: y = x + scaling * B (A x), with no base weight at all (`weight`
    is None). The self-distillation transform (hidden -> hidden, identity at the start) is one: an
    identity matrix would be a frozen hidden x hidden weight on every rank (32 MiB at LLaMA-2-7B in
    bf16, whole on each rank under ZeRO-2) and a matmul that changes nothing. Made by `create`."""

    @classmethod
    def create(cls, features: int, rank: int, alpha: float, generator: torch.Generator | None = None,
               device: torch.device | str = "cpu") -> "IdentityAdapter":
        linear = nn.Linear(features, features, bias=False, device="meta")  # only its shape is used
        adapter = cls.wrap(linear, rank, alpha, generator, device=device)
        adapter.weight = None  # nn.Module keeps the name, with no tensor behind it
        return adapter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.low_rank_update(x).to(x.dtype)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """I + s * B A in fp32 (the identity has no dtype of its own)."""
        return torch.eye(self.in_features, dtype=torch.float32, device=self.lora_A.device) + self.merged_delta()

    def merge_and_unwrap(self) -> nn.Linear:
        raise TypeError("an IdentityAdapter (the distillation transform) is dropped at export, not merged")


def _init_lora_a(tensor: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill a host tensor (the generator is a CPU one: the same values on every device)."""
    # PEFT's default: kaiming_uniform_(a=sqrt(5)) -> U(-1/sqrt(in), 1/sqrt(in)).
    bound = 1.0 / math.sqrt(tensor.shape[1])
    with torch.no_grad():
        tensor.uniform_(-bound, bound, generator=generator)
    return tensor


def add_adapters(model, targets, rank: int, alpha: float, seed: int = 0,
                 device: torch.device | str | None = None) -> dict[str, APTAdapter]:
    """Freeze the model and wrap every targeted projection of every layer (adapters on `device`)."""
    for param in model.parameters():
        param.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    family = family_of(model)
    family.check_adapter_targets(targets, model.config)
    # `q_proj` is BERT's attention.self.query too, and each of T5's attentions' q
    wrapped = {f"{unit.prefix}.{path}" for unit in family.unit_layers(model) for path in unit.kind.adapter_paths(targets)}
    adapters = {}
    for name, module in model.named_modules():  # in module order: the generator's draws as they always were
        if name in wrapped and isinstance(module, nn.Linear):
            adapters[name] = APTAdapter.wrap(module, rank, alpha, generator, device=device)
    if not adapters:
        raise ValueError(f"no Linear named {list(targets)} found inside model layers")
    return adapters


def find_adapters(model) -> dict[str, APTAdapter]:
    return {name: m for name, m in model.named_modules() if isinstance(m, APTAdapter)}


def merge_adapters(model) -> None:
    """Fold every layer adapter into its weight. A model still carrying the distillation transform
    (an IdentityAdapter, which has no weight to fold into) is refused before anything changes."""
    adapters = find_adapters(model)
    transform = next((name for name, module in adapters.items() if isinstance(module, IdentityAdapter)), None)
    if transform is not None:
        raise ValueError(f"{transform} is the distillation transform, which an export drops: remove it "
                         "before merging (apt_ds.export.merge does)")
    for module in adapters.values():
        module.merge_and_unwrap()
