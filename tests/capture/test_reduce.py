"""Attention reduced as it is formed (podmonitor.capture.reduce) against the maps it replaces.

The head average must be the mean of the maps over the heads (the same bits: the POD sees the
same fields), the stability sums must give the literal section 10 formulas, and every producer
(the reference GPT, the ``sdpa`` recomputation) must reduce exactly what it would have returned.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from podmonitor.capture import SDPAAdapter
from podmonitor.capture.reduce import LayerReduction, ReducedAttention, Reduction, reducing
from podmonitor.engine.stability import StabilityAccumulator
from podmonitor.models.gpt import GPT, GPTConfig
from tests.engine.test_stability import literal, random_fields


def _report(sums, logits=None) -> dict:
    acc = StabilityAccumulator()
    acc.add_sums(sums, logits)
    return acc.compute().to_dict()


def _close(got: dict, ref: dict, rel: float = 1e-6) -> None:
    assert got["entropy"] == pytest.approx(ref["entropy"], rel=rel)
    assert got["sink_mass"] == pytest.approx(ref["sink"], rel=rel)
    assert got["mean_row_max"] == pytest.approx(ref["row_max"], rel=rel)
    assert got["max_prob"] == pytest.approx(ref["max_prob"], rel=rel)


@pytest.mark.parametrize("causal", [True, False])
def test_row_blocks_in_any_order_and_width_give_the_head_mean_and_the_literal_signals(causal):
    b, h, t = 3, 4, 150
    maps = random_fields(b, h, t, causal, seed=3)
    layer = LayerReduction(b, h, t, causal, maps.device)
    cuts = sorted(random.Random(0).sample(range(1, t), 9))
    blocks = list(zip([0, *cuts], [*cuts, t], strict=True))
    random.Random(1).shuffle(blocks)
    for r0, r1 in blocks:  # causal: only the keys the block can see (zeros right of r1)
        for s in (slice(0, 1), slice(1, 3)):
            layer.add(s, r0, maps[s, :, r0:r1, : (r1 if causal else t)])
    got = layer.result()
    assert torch.equal(got.average, maps.mean(dim=1))
    assert got.n_heads == h
    _close(_report(got.stability), literal(maps.numpy(), None, causal))


def test_a_subset_of_heads_is_averaged_and_every_head_keeps_its_signals():
    maps = random_fields(2, 4, 40, True, seed=4)
    layer = LayerReduction(2, 4, 40, True, maps.device, heads=[0, 2])
    layer.add_maps(maps, zeros_above_diagonal=True, rows_per_block=16)
    got = layer.result()
    assert torch.equal(got.average, maps[:, [0, 2]].mean(dim=1))
    _close(_report(got.stability), literal(maps.numpy(), None, True))


def test_a_sequence_with_nan_is_skipped_and_missing_rows_are_refused():
    maps = random_fields(3, 2, 30, True, seed=5)
    maps[1, 1, 20, 3] = float("nan")
    layer = LayerReduction(3, 2, 30, True, maps.device)
    layer.add_maps(maps, zeros_above_diagonal=True, rows_per_block=8)
    report = _report(layer.result().stability)
    assert report["n_snapshots"] == 2 and report["n_skipped_nonfinite"] == 1
    _close(report, literal(maps[[0, 2]].numpy(), None, True))
    short = LayerReduction(3, 2, 30, True, maps.device)
    short.add(slice(None), 0, maps[:, :, :10, :10])
    with pytest.raises(RuntimeError, match="30 of 90 rows"):
        short.result()


def test_selected_sequences_carry_their_own_sums():
    maps = random_fields(4, 3, 25, True, seed=6)
    layer = LayerReduction(4, 3, 25, True, maps.device)
    layer.add_maps(maps, zeros_above_diagonal=True)
    index = torch.tensor([0, 3])
    _close(_report(layer.result().stability.select(index)), literal(maps[[0, 3]].numpy(), None, True))


@pytest.mark.parametrize("parts", [False, True])
@pytest.mark.parametrize("attention", ["softmax", "ega"])
def test_reference_gpt_reduces_each_layer_as_it_forms_it(attention, parts, monkeypatch):
    from podmonitor.models import gpt

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(vocab_size=50, block_size=300, attention=attention)).eval()
    x = torch.randint(0, 50, (3, 293))  # three causal row blocks, the last one short
    if parts:  # each block's rows in parts of MIN_SUB_ROWS (as at long contexts with many heads)
        monkeypatch.setattr(gpt, "SUB_BLOCK_BYTES", 3 * model.config.n_head * gpt.MIN_SUB_ROWS * 293 * 4)
    with torch.no_grad():
        logits, _, maps = model(x, return_attention=True)
        reduction = Reduction()
        with reducing(reduction):
            logits_reduced, _, none = model(x, return_attention=True)
    assert none == [] and len(reduction.layers) == len(maps) == model.config.n_layer
    assert torch.equal(logits_reduced, logits)  # the same forward
    for att, layer in zip(maps, reduction.layers, strict=True):
        got = layer.result()
        assert torch.equal(got.average, att.mean(dim=1))  # the very fields the maps path averages
        _close(_report(got.stability), literal(att.numpy(), None, True), rel=1e-5)


def test_reference_gpt_keeps_its_maps_where_it_cannot_reduce():
    """Training with attention dropout needs the maps (dropout applies to them): nothing is reduced."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(vocab_size=50, block_size=64, dropout=0.1)).train()
    x = torch.randint(0, 50, (2, 64))
    reduction = Reduction()
    with torch.no_grad(), reducing(reduction):
        _, _, maps = model(x, return_attention=True)
    assert reduction.layers == [] and len(maps) == model.config.n_layer


class _Attention(nn.Module):
    """nanoGPT-style self-attention with a choice of SDPA call."""

    def __init__(self, mode: str, heads: int = 4, width: int = 32) -> None:
        super().__init__()
        self.mode, self.heads = mode, heads
        self.c_attn = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if self.mode == "is_causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.mode == "padding":
            keep = torch.ones(b, 1, 1, t, dtype=torch.bool)
            keep[0, ..., -5:] = False  # sequence 0 padded
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("mode", ["is_causal", "padding", "bidirectional"])
@pytest.mark.parametrize("chunk_bytes", [None, 4096])
def test_sdpa_reduction_equals_the_maps_it_replaces(mode, chunk_bytes):
    torch.manual_seed(1)
    module = _Attention(mode)
    x = torch.randn(3, 150, 32)
    captured = []
    for reduction in (None, Reduction()):
        adapter = SDPAAdapter() if chunk_bytes is None else SDPAAdapter(chunk_bytes=chunk_bytes)
        adapter.reduction = reduction
        with torch.no_grad(), adapter.capturing(module):
            out = module(x)
            captured.append(adapter.collect(module, None, out))
    maps, reduced = captured
    assert isinstance(reduced, ReducedAttention) and reduced.layer_names == maps.layer_names
    assert reduced.causal == maps.causal == (mode == "is_causal")
    if mode == "padding":  # sequence 0 has padded keys
        assert reduced.valid.tolist() == maps.valid.tolist() == [False, True, True]
    else:
        assert reduced.valid is None and maps.valid is None
    a = maps.fields[0]
    layer = reduced.layers[0]
    if chunk_bytes is None or mode != "is_causal":  # the same blocks of rows and keys: the same probabilities
        assert torch.equal(layer.average, a.mean(dim=1))
        assert torch.equal(reduced.logit_max[0], maps.logit_max[0])
    else:  # other row blocks: the same values up to rounding
        torch.testing.assert_close(layer.average, a.mean(dim=1), rtol=1e-5, atol=1e-7)
    ref = literal(a.numpy(), maps.logit_max[0].numpy(), mode == "is_causal")
    got = _report(layer.stability, reduced.logit_max[0])
    _close(got, ref, rel=1e-5)
    assert got["max_logit"] == pytest.approx(ref["max_logit"], rel=1e-5)
    assert np.isfinite(got["entropy_min"])
