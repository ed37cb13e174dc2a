"""TorchMHAAdapter against a manual recomputation of nn.MultiheadAttention's probabilities."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from podmonitor.capture import TorchMHAAdapter, select_adapter

B, T, E, H = 3, 10, 32, 4


class EncoderModule(nn.Module):
    """A LightningModule stand-in: validation_step runs a 2-layer nn.TransformerEncoder."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=64, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.encoder(
            batch["x"],
            mask=batch.get("mask"),
            src_key_padding_mask=batch.get("kpm"),
            is_causal=batch.get("is_causal"),
        )


def manual_attention(
    mha: nn.MultiheadAttention, x: torch.Tensor, mask: torch.Tensor | None, kpm: torch.Tensor | None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) per head from the in-projection, x (B, T, E) -> (B, H, T, T)."""
    d = E // H
    q, k, _ = (x @ mha.in_proj_weight.T + mha.in_proj_bias).split(E, dim=-1)
    q = q.view(B, T, H, d).transpose(1, 2)  # (B, H, T, d)
    k = k.view(B, T, H, d).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)  # (B, H, T, T)
    if mask is not None:
        scores = scores + mask
    if kpm is not None:
        scores = scores.masked_fill(kpm[:, None, None, :], -torch.inf)
    return scores.softmax(-1)


@pytest.fixture
def module() -> EncoderModule:
    torch.manual_seed(0)
    return EncoderModule().eval()


@pytest.fixture(autouse=True)
def fastpath_guard() -> Iterator[None]:
    """Every test leaves the global fast-path setting as it found it."""
    before = torch.backends.mha.get_fastpath_enabled()
    yield
    assert torch.backends.mha.get_fastpath_enabled() == before
    torch.backends.mha.set_fastpath_enabled(before)


def run_capture(module: EncoderModule, batch: dict):
    """The callback's sequence, recording each self-attention input with the test's own hooks."""
    inputs: list[torch.Tensor] = []
    probes = [
        layer.self_attn.register_forward_pre_hook(lambda m, a, kw: inputs.append(a[0]), with_kwargs=True)
        for layer in module.encoder.layers
    ]
    adapter = select_adapter(module)
    assert isinstance(adapter, TorchMHAAdapter)
    try:
        with torch.no_grad():
            adapter.start(module)
            outputs = module.validation_step(batch, 0)
            captured = adapter.collect(module, batch, outputs)
    finally:
        adapter.stop()
        for p in probes:
            p.remove()
    return captured, outputs, inputs


def test_torch_mha_fast_path_is_taken_without_capture_and_not_during(module, monkeypatch) -> None:
    calls = []
    fused = torch._transformer_encoder_layer_fwd

    def counting(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", counting)
    x = torch.randn(B, T, E)
    with torch.no_grad():
        plain = module.validation_step({"x": x}, 0)
    assert len(calls) == 2  # eval + no_grad: the fused kernel bypasses self_attn
    captured, outputs, _ = run_capture(module, {"x": x})
    assert len(calls) == 2  # not taken during capture
    torch.testing.assert_close(outputs, plain, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        module.validation_step({"x": x}, 0)
    assert len(calls) == 4  # taken again after stop


@pytest.mark.parametrize("fastpath_before", [True, False])
def test_torch_mha_matches_manual_recomputation(module, assert_no_hooks, fastpath_before) -> None:
    torch.backends.mha.set_fastpath_enabled(fastpath_before)
    try:
        x = torch.randn(B, T, E)
        captured, _, inputs = run_capture(module, {"x": x})
        assert torch.backends.mha.get_fastpath_enabled() is fastpath_before
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert captured.layer_names == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    assert captured.causal is False and captured.valid is None
    torch.testing.assert_close(inputs[0], x)
    for layer, field, inp in zip(module.encoder.layers, captured.fields, inputs, strict=True):
        assert field.shape == (B, H, T, T) and field.dtype == torch.float32
        with torch.no_grad():
            expected = manual_attention(layer.self_attn, inp, None, None)
        torch.testing.assert_close(field, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(field.sum(-1), torch.ones(B, H, T))
    assert_no_hooks(module)


def test_torch_mha_causal_mask_is_flagged_causal(module, assert_no_hooks) -> None:
    mask = nn.Transformer.generate_square_subsequent_mask(T)
    x = torch.randn(B, T, E)
    captured, _, inputs = run_capture(module, {"x": x, "mask": mask, "is_causal": True})
    assert captured.causal is True
    for layer, field, inp in zip(module.encoder.layers, captured.fields, inputs, strict=True):
        assert torch.all(field.triu(1) == 0)
        with torch.no_grad():
            expected = manual_attention(layer.self_attn, inp, mask, None)
        torch.testing.assert_close(field, expected, atol=1e-5, rtol=1e-5)
    # the same mask without the is_causal hint is still recognised (directly on a layer, which
    # does not infer the hint the way nn.TransformerEncoder does)
    layer = module.encoder.layers[0]
    adapter = TorchMHAAdapter()
    with torch.no_grad(), adapter.capturing(layer):
        layer(x, src_mask=mask)
        assert adapter.collect(layer, x, None).causal is True
    assert_no_hooks(module)


def test_torch_mha_key_padding_marks_sequences_invalid(module) -> None:
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1, -3:] = True  # sequence 1 ends with 3 padding tokens
    x = torch.randn(B, T, E)
    captured, _, inputs = run_capture(module, {"x": x, "kpm": kpm})
    assert captured.valid.tolist() == [True, False, True]
    assert captured.causal is False
    with torch.no_grad():
        expected = manual_attention(module.encoder.layers[0].self_attn, inputs[0], None, kpm)
    torch.testing.assert_close(captured.fields[0], expected, atol=1e-5, rtol=1e-5)
    assert torch.all(captured.fields[0][1, :, :, -3:] == 0)


def test_torch_mha_no_hooks_after_exception_in_forward(module, assert_no_hooks) -> None:
    adapter = select_adapter(module)
    bad = {"x": torch.randn(B, T, E), "mask": torch.zeros(T + 1, T + 1)}  # wrong mask shape: MHA raises
    with pytest.raises(RuntimeError, match="attn_mask"), torch.no_grad(), adapter.capturing(module):
        module.validation_step(bad, 0)
    assert_no_hooks(module)
    adapter.stop()  # idempotent
    with torch.no_grad():  # and the adapter is reusable
        with adapter.capturing(module):
            module.validation_step({"x": torch.randn(B, T, E)}, 0)
            assert len(adapter.collect(module, None, None).fields) == 2
    assert_no_hooks(module)


def test_torch_mha_start_failing_halfway_leaves_nothing(assert_no_hooks) -> None:
    class Refusing(nn.MultiheadAttention):
        def register_forward_hook(self, *args, **kwargs):
            raise RuntimeError("refused")

    module = nn.ModuleDict({"a": nn.MultiheadAttention(8, 2), "b": Refusing(8, 2)})
    adapter = TorchMHAAdapter()
    with pytest.raises(RuntimeError, match="refused"):
        adapter.start(module)
    assert_no_hooks(module)


def test_torch_mha_collect_without_forward_is_a_clear_error(module) -> None:
    adapter = TorchMHAAdapter()
    with adapter.capturing(module), pytest.raises(RuntimeError, match="saw no nn.MultiheadAttention"):
        adapter.collect(module, None, None)
    with pytest.raises(RuntimeError, match="start"):
        adapter.collect(module, None, None)


class DirectMHA(nn.Module):
    """User code calling nn.MultiheadAttention itself (batch_first=False), also as cross-attention."""

    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(E, H)
        self.cross = nn.MultiheadAttention(E, H)
        self.need_weights = need_weights

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> tuple:
        out, weights = self.attn(x, x, x, need_weights=self.need_weights)
        out2, cross_weights = self.cross(out, memory, memory)
        return out2, weights, cross_weights


@pytest.mark.parametrize("need_weights", [True, False])
def test_torch_mha_caller_gets_what_it_asked_for(need_weights, assert_no_hooks) -> None:
    torch.manual_seed(0)
    module = DirectMHA(need_weights).eval()
    x, memory = torch.randn(T, B, E), torch.randn(T + 2, B, E)  # (T, B, E): batch_first=False
    with torch.no_grad():
        plain = module(x, memory)
        adapter = TorchMHAAdapter()
        with adapter.capturing(module):
            during = module(x, memory)
            captured = adapter.collect(module, None, during)
    assert captured.layer_names == ["attn"]  # cross-attention is not captured
    assert captured.fields[0].shape == (B, H, T, T)
    torch.testing.assert_close(during[0], plain[0], atol=1e-5, rtol=1e-5)
    if need_weights:  # the head average, as asked
        torch.testing.assert_close(during[1], plain[1])
        torch.testing.assert_close(captured.fields[0].mean(1), plain[1])
    else:
        assert during[1] is None
    torch.testing.assert_close(during[2], plain[2])
    assert_no_hooks(module)


def test_torch_mha_decoder_layer_captures_self_attention_only(assert_no_hooks) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(E, H, dim_feedforward=64, batch_first=True).eval()
    tgt, memory = torch.randn(B, T, E), torch.randn(B, T + 3, E)
    mask = nn.Transformer.generate_square_subsequent_mask(T)
    adapter = select_adapter(layer)
    with torch.no_grad(), adapter.capturing(layer):
        layer(tgt, memory, tgt_mask=mask, tgt_is_causal=True)
        captured = adapter.collect(layer, None, None)
    assert captured.layer_names == ["self_attn"]
    assert captured.causal is True
    assert torch.all(captured.fields[0].triu(1) == 0)
    assert_no_hooks(layer)


def test_torch_mha_repeated_module_gets_numbered_names() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    module = nn.ModuleDict({"shared": mha})
    x = torch.randn(B, T, E)
    adapter = TorchMHAAdapter()
    with torch.no_grad(), adapter.capturing(module):
        y, _ = mha(x, x, x)
        mha(y, y, y)
        captured = adapter.collect(module, None, None)
    assert captured.layer_names == ["shared", "shared#1"]


def test_fast_path_restored_when_two_users_stop_in_the_order_they_started(module) -> None:
    """Two callbacks switch the fast path off around the same batch and stop in the order they
    started (Lightning calls batch-end hooks in list order): it must end up on again."""
    torch.backends.mha.set_fastpath_enabled(True)
    first, second = TorchMHAAdapter(), TorchMHAAdapter()
    first.start(module)
    second.start(module)  # sees the fast path already off
    assert torch.backends.mha.get_fastpath_enabled() is False
    first.stop()  # restores True
    second.stop()  # must not switch it off again
    assert torch.backends.mha.get_fastpath_enabled() is True
