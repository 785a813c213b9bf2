"""One salience site's sums (apt_ds.algorithm.salience_site.SiteSums): exact in half precision,
and few operations per site for the hooks that call it every micro-batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import random_batch, tiny_llama

from apt_ds.algorithm.kurtosis import column_power_sums
from apt_ds.algorithm.salience import SalienceCollector
from apt_ds.algorithm.units import ModelShape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collection_adds_few_operations_per_layer_and_micro_batch(dtype):
    """The hooks' host cost: collecting one padded micro-batch (forward and backward) adds at most
    40 dispatched operations per layer over the same step with collection off (4 sites: |X| and,
    at two of them, X summed over real tokens; |dL/dX| summed): 34 here in fp32 and bf16, 33.5 of
    them computing (36 and 35.5 before X was weighted once for both sums). The einsum it replaced dispatched 101 (fp32) and 107 (bf16), of which 33 and
    39 computed: mostly views, which the dispatcher pays for but a GPU does not launch."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from _common import dispatched_operations

    model = tiny_llama("gqa").to(dtype)  # plain: every weight trains, so every site gets a gradient
    collector = SalienceCollector(ModelShape.from_model(model), beta=0.85, use_kurtosis=True)
    batch = random_batch(batch=3, length=9)
    batch["attention_mask"][1, 6:] = 0  # padded: the token-weighted path
    collector.install(model)
    model(**batch).loss.backward()  # the kurtosis power sums: once per shape, not per step
    counts = {}
    for enabled in (True, False):
        collector.enabled = enabled
        for views in (True, False):
            counts[enabled, views] = dispatched_operations(lambda: model(**batch).loss.backward(), views)
    collector.remove()
    layers = model.config.num_hidden_layers
    dispatched = (counts[True, True] - counts[False, True]) / layers
    computing = (counts[True, False] - counts[False, False]) / layers
    assert 0 < computing <= dispatched <= 40, counts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_activations_are_summed_without_rounding(dtype):
    """Padded bf16/fp16 activations: the sums equal an fp64 reference to fp32 precision (each
    site's sum used to be rounded to the activation dtype, and overflowed in fp16)."""
    collector = SalienceCollector(ModelShape.from_model(tiny_llama("gqa")), beta=0.85, use_kurtosis=False)
    site = collector.hidden_sites[0]
    gen = torch.Generator().manual_seed(0)
    x = (100 * torch.rand(8, 1024, site.act_abs.numel(), generator=gen)).to(dtype)  # fp16 sums pass 65,504
    mask = torch.ones(8, 1024)
    mask[3, 700:] = 0
    site.capture(x, mask.unsqueeze(-1).to(dtype))
    reference = (x.double().abs() * mask.double().unsqueeze(-1)).sum((0, 1))
    assert torch.isfinite(site.act_abs).all()
    torch.testing.assert_close(site.act_abs.double(), reference, rtol=1e-5, atol=0)
    with pytest.raises(AssertionError, match=r"\(batch, seq, 1\)"):
        site.capture(x, mask.to(dtype))  # a (batch, seq) mask would broadcast wrongly


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fused_abs_sum_of_cuda_gives_the_same_sums(dtype):
    """The CUDA path (one vector_norm reduction, no |x| temporary), run here on the CPU, against the
    CPU path and an fp64 reference."""
    from apt_ds.algorithm.salience_site import abs_sum

    gen = torch.Generator().manual_seed(1)
    x = (50 * torch.randn(4, 64, 96, generator=gen)).to(dtype)
    fused, plain = abs_sum(x, (0, 1), fused=True), abs_sum(x, (0, 1), fused=False)
    assert fused.dtype == plain.dtype == torch.float32 and fused.shape == (96,)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=0)
    torch.testing.assert_close(plain.double(), x.double().abs().sum((0, 1)), rtol=1e-5, atol=0)


def test_capture_leaves_the_activation_as_it_was():
    """|X| is taken in place only in a temporary (the token-weighted copy), never in the activation."""
    collector = SalienceCollector(ModelShape.from_model(tiny_llama("gqa")), beta=0.85, use_kurtosis=False)
    site = collector.attn_sites[0]
    x = torch.randn(2, 5, site.act_abs.numel(), generator=torch.Generator().manual_seed(2))
    before = x.clone()
    site.capture(x)
    assert torch.equal(x, before)
    site.capture(x, torch.ones(2, 5, 1))
    assert torch.equal(x, before)
    torch.testing.assert_close(site.act_abs, 2 * before.abs().sum((0, 1)))


def test_a_batch_known_to_have_no_padding_skips_the_token_weights_with_the_same_sums():
    """The trainer tells the collector from the host batch whether any position is padding; without
    padding the sites skip the token weights (a multiply over every activation) and sum the same."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from _common import dispatched_operations

    model = tiny_llama("gqa")
    collector = SalienceCollector(ModelShape.from_model(model), beta=0.85, use_kurtosis=True)
    batch = random_batch(batch=3, length=9)  # attention_mask all ones
    collector.install(model)
    model(**batch).loss.backward()  # the kurtosis power sums: once per shape
    buffers, counts = {}, {}
    for padded in (True, False):
        collector.batch_has_padding = padded
        collector._buffer.zero_()
        counts[padded] = dispatched_operations(lambda: model(**batch).loss.backward(), views=False)
        buffers[padded] = collector._buffer.clone()
    collector.remove()
    assert torch.equal(buffers[True], buffers[False]) and buffers[True].abs().sum() > 0
    assert counts[False] < counts[True]


def test_the_trainer_says_per_micro_batch_whether_it_is_padded(monkeypatch):
    """Every forward the collector sees was announced as padded exactly when its mask has a zero."""
    from apt_ds.config import APTConfig, TrainConfig
    from apt_ds.training.trainer import APTrainer

    seen = []
    hook = SalienceCollector._mask_hook

    def recording_hook(self, module, args, kwargs):
        if self.enabled:
            seen.append((self.batch_has_padding, bool((kwargs["attention_mask"] == 0).any())))
        return hook(self, module, args, kwargs)

    monkeypatch.setattr(SalienceCollector, "_mask_hook", recording_hook)

    def batches():
        for i in range(10**6):
            batch = random_batch(batch=2, length=8, seed=i)
            if i % 3 == 0:
                batch["attention_mask"][1, 5:] = 0
                batch["labels"][1, 5:] = -100
            yield batch

    apt, train = APTConfig.for_steps(12, target_density=0.7), TrainConfig(steps=12, grad_accum_steps=2, warmup_steps=2)
    trainer = APTrainer(tiny_llama("gqa"), apt, train, progress=False)
    trainer.train(batches())
    assert {padded for padded, _ in seen} == {True, False}
    assert all(announced == padded for announced, padded in seen)
    assert trainer.state.salience.batch_has_padding  # unknown again outside a training forward


def test_the_cpu_hooks_write_their_temporaries_into_one_reused_buffer():
    """|X| and the token-weighted X go to the collector's one scratch buffer on a CPU (made anew in
    every hook they left free heap behind, APT's peak above LoRA's): the same sums as new tensors
    give, and the same buffer on the next step."""
    model = tiny_llama("gqa")
    batch = random_batch(batch=3, length=9)
    batch["attention_mask"][1, 6:] = 0  # padded: the token-weighted path too
    sums = {}
    for reuse in (True, False):
        collector = SalienceCollector(ModelShape.from_model(model), beta=0.85, use_kurtosis=True)
        if not reuse:
            for site in collector.attn_sites + collector.ffn_sites + collector.hidden_sites:
                site.scratch = None
        collector.install(model)
        model(**batch).loss.backward()
        first = collector._scratch._buffer
        collector._buffer.zero_()
        model(**batch).loss.backward()
        collector.remove()
        sums[reuse] = collector._buffer.clone()
        assert (first is not None and collector._scratch._buffer is first) if reuse else first is None
    assert torch.equal(sums[True], sums[False]) and sums[True].abs().sum() > 0


@pytest.mark.parametrize("block", [1, 7, 64, 2**15, 2**22])
def test_power_sums_taken_in_blocks_are_the_whole_weights_sums(block):
    """The kurtosis power sums through two reused float64 buffers, in blocks of any size (a block
    under one row takes a row at a time), from fp32 and bf16 weights."""
    for weight in (torch.randn(37, 19), torch.randn(37, 19).bfloat16()):
        w = weight.double()
        expected = torch.stack([w.sum(0), (w**2).sum(0), (w**3).sum(0), (w**4).sum(0)])
        torch.testing.assert_close(column_power_sums(weight, block), expected, rtol=1e-12, atol=1e-12)
