"""SDPAAdapter and SDPAHeadMask against attention formed by hand (softmax of q k^T), METHOD.md section 11."""

from __future__ import annotations

import contextvars
import math
import warnings

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, TensorDataset

from podmonitor import PODConfig, PODMonitor, analyze
from podmonitor.capture import CapturedAttention, SDPAAdapter, SDPAHeadMask, TorchMHAAdapter, select_adapter
from podmonitor.capture.sdpa import CAUSAL_BLOCK_ROWS, DEFAULT_CHUNK_BYTES, SDPA, SDPACall, recompute
from podmonitor.pruning import HeadMasker
from tests.capture.sdpa_models import (
    GPT,
    GPTConfig,
    GQAAttention,
    NanoGPTModule,
    SlidingWindowAttention,
    TinyViT,
    gpt_by_hand,
)


def function_modes() -> list:
    return list(torch.overrides._get_current_function_mode_stack())


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Every test leaves no function mode and the original SDPA behind."""
    yield
    assert function_modes() == []
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def capture(module: nn.Module, *inputs, adapter: SDPAAdapter | None = None, **kw) -> tuple[CapturedAttention, object]:
    """(captured, output) of ``module(*inputs)`` under an SDPAAdapter, as the callback drives it."""
    adapter = adapter or SDPAAdapter()
    with torch.no_grad(), adapter.capturing(module):
        out = module(*inputs, **kw)
        cap = adapter.collect(module, None, out)
    return cap, out


def trainer(tmp_path, callbacks, **kw) -> L.Trainer:
    return L.Trainer(max_epochs=kw.pop("max_epochs", 2), accelerator="cpu", devices=1, logger=False,
                     callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=False, default_root_dir=str(tmp_path), **kw)


# ----------------------------------------------------------------------------- nanoGPT through the callback
def test_sdpa_nanogpt_through_the_callback_matches_attention_by_hand(tmp_path, monkeypatch):
    import podmonitor.engine.stability as stability

    checks = []  # the stability pass's check of the entries above the diagonal
    check = stability._right_of_blocks_zero
    monkeypatch.setattr(stability, "_right_of_blocks_zero", lambda *a: checks.append(1) or check(*a))
    L.seed_everything(0)
    model = NanoGPTModule()
    monitor = PODMonitor()  # default arguments
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Lightning's advice on workers and logging intervals
        trainer(tmp_path / "with", [monitor]).fit(model)
    names = ["model.transformer.h.0.attn", "model.transformer.h.1.attn"]
    assert sorted(monitor.last_reports) == names
    # the same 150 sequences (the first of the validation loader), attention formed by hand from the final weights
    x = torch.cat([b[0] for b in model.val_dataloader()])[:150]
    with torch.no_grad():
        logits_hand, maps = gpt_by_hand(model.model.eval(), x)
        torch.testing.assert_close(logits_hand, model.model(x), rtol=1e-4, atol=1e-5)  # the hand forward is right
    for name, att in zip(names, maps, strict=True):
        report = monitor.last_reports[name]
        assert report.n_snapshots == 150
        ref = analyze(att.mean(dim=1), PODConfig(causal=True))
        assert report.t_spec == pytest.approx(ref.t_spec, rel=1e-5)
        assert report.dominant_scales == pytest.approx(ref.dominant_scales, rel=1e-9)
        # per-head stability signals of the is_causal capture, which promises zeros above the diagonal
        # (so they are not checked there): the literal normalised row entropy, rows i >= 1
        a = att.double()
        t = a.shape[-1]
        plogp = torch.where(a > 0, a * a.clamp_min(1e-300).log(), torch.zeros_like(a))
        rows = -plogp[:, :, 1:, :].sum(-1) / torch.log(torch.arange(2, t + 1, dtype=torch.float64))
        stab = monitor.last_stability_reports[name]
        assert stab.entropy == pytest.approx(rows.mean(dim=(0, 2)).tolist(), rel=1e-5)
        assert stab.sink_mass_mean == pytest.approx(float(a[:, :, 1:, 0].mean()), rel=1e-5)
    assert checks == []

    # training is the same with and without the monitor: losses, validation losses and final logits identical
    L.seed_everything(0)
    plain = NanoGPTModule()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer(tmp_path / "without", []).fit(plain)
    assert model.train_losses == plain.train_losses and len(plain.train_losses) == 8
    assert model.val_losses == plain.val_losses
    with torch.no_grad():
        assert torch.equal(model.model.eval()(x), plain.model.eval()(x))


def test_sdpa_nanogpt_capture_equals_attention_by_hand_and_passes_output_through():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig()).eval()
    x = torch.randint(0, 16, (4, 32))
    with torch.no_grad():
        before = gpt(x)
        logits, maps = gpt_by_hand(gpt, x)
    cap, out = capture(gpt, x)
    assert torch.equal(out, before)
    assert cap.layer_names == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert cap.causal is True and cap.valid is None and cap.flagged == {}
    assert cap.zeros_above_diagonal is True  # is_causal calls, recomputed in row blocks
    assert cap.counters["captured_calls"] == 2 and cap.counters["cross_attention_calls"] == 0
    for f, ref in zip(cap.fields, maps, strict=True):
        torch.testing.assert_close(f, ref, rtol=1e-5, atol=1e-6)
        assert torch.all(f.triu(1) == 0)


def test_sdpa_adapter_is_chosen_by_auto_for_sdpa_models_only():
    assert isinstance(select_adapter(NanoGPTModule()), SDPAAdapter)
    assert select_adapter(NanoGPTModule()).last_resort is False
    assert isinstance(select_adapter(TinyViT()), SDPAAdapter)

    class MHAModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, batch_first=True), 1,
                                             enable_nested_tensor=False)

    assert isinstance(select_adapter(MHAModel()), TorchMHAAdapter)  # nn.MultiheadAttention keeps its adapter


# ----------------------------------------------------------------------------- semantics
class PaddedEncoder(nn.Module):
    """An encoder layer with a boolean key-padding mask (True = may attend) and a custom scale."""

    def __init__(self, dim: int = 16, num_heads: int = 4, scale: float = 0.3) -> None:
        super().__init__()
        self.num_heads, self.scale = num_heads, scale
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        keep = ~pad[:, None, None, :]  # (B, 1, 1, T)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=self.scale)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def by_hand(self, x: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        q, k, _ = self.qkv(x).reshape(B, T, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        logits = (q @ k.transpose(-1, -2)) * self.scale
        visible = ~pad[:, None, None, :].expand(B, self.num_heads, T, T)
        att = logits.masked_fill(~visible, -math.inf).softmax(-1)
        return att, logits.masked_fill(~visible, -math.inf).amax(dim=(-2, -1))


@pytest.mark.parametrize("chunk_bytes", [DEFAULT_CHUNK_BYTES, 1])
def test_sdpa_boolean_padding_mask_and_custom_scale(chunk_bytes):
    torch.manual_seed(0)
    enc = PaddedEncoder().eval()
    x = torch.randn(4, 10, 16)
    pad = torch.zeros(4, 10, dtype=torch.bool)
    pad[1, -3:] = True  # right padding
    pad[3, :2] = True  # left padding
    cap, _ = capture(enc, x, pad, adapter=SDPAAdapter(chunk_bytes=chunk_bytes))
    with torch.no_grad():
        att, lmax = enc.by_hand(x, pad)
    torch.testing.assert_close(cap.fields[0], att, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cap.logit_max[0], lmax, rtol=1e-5, atol=1e-6)
    assert cap.valid.tolist() == [True, False, True, False]  # padded sequences never enter a field
    assert cap.causal is False
    assert cap.layer_names == ["self"]  # the root module made the call
    assert float(cap.fields[0][1, :, :, -3:].abs().max()) == 0.0


@pytest.mark.parametrize("use_enable_gqa", [True, False])
def test_sdpa_grouped_query_attention(use_enable_gqa):
    torch.manual_seed(0)
    attn = GQAAttention(use_enable_gqa=use_enable_gqa).eval()
    x = torch.randn(2, 12, 32)
    cap, _ = capture(attn, x)
    with torch.no_grad():
        q = attn.q_proj(x).view(2, 12, 4, 8).transpose(1, 2)
        k = attn.k_proj(x).view(2, 12, 2, 8).transpose(1, 2)
        k = torch.stack([k[:, 0], k[:, 0], k[:, 1], k[:, 1]], dim=1)  # query heads 0, 1 share K/V head 0
        att = ((q @ k.transpose(-1, -2)) / math.sqrt(8)).masked_fill(torch.ones(12, 12).triu(1).bool(), -math.inf)
        att = att.softmax(-1)
    assert cap.fields[0].shape == (2, 4, 12, 12) and cap.causal is True and cap.flagged == {}
    torch.testing.assert_close(cap.fields[0], att, rtol=1e-5, atol=1e-6)


def test_sdpa_grouped_query_attention_both_ways_capture_the_same():
    torch.manual_seed(0)
    a = GQAAttention(use_enable_gqa=True).eval()
    b = GQAAttention(use_enable_gqa=False).eval()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 12, 32)
    cap_a, out_a = capture(a, x)
    cap_b, out_b = capture(b, x)
    torch.testing.assert_close(out_a, out_b)
    torch.testing.assert_close(cap_a.fields[0], cap_b.fields[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(cap_a.logit_max[0], cap_b.logit_max[0])


@pytest.mark.parametrize("chunk_bytes", [DEFAULT_CHUNK_BYTES, 1])
def test_sdpa_float_sliding_window_mask_as_litgpt_builds_it(chunk_bytes):
    torch.manual_seed(0)
    attn = SlidingWindowAttention(sliding_window_size=4).eval()
    x = torch.randn(3, 12, 16)
    cap, _ = capture(attn, x, adapter=SDPAAdapter(chunk_bytes=chunk_bytes))
    with torch.no_grad():
        q, k, _ = (z.view(3, 12, 2, 8).transpose(1, 2) for z in attn.qkv(x).split(16, -1))
        i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
        hidden = (j > i) | (i - j >= 4)
        att = ((q @ k.transpose(-1, -2)) / math.sqrt(8)).masked_fill(hidden, -math.inf).softmax(-1)
    torch.testing.assert_close(cap.fields[0], att, rtol=1e-5, atol=1e-6)
    assert cap.causal is True  # a lower-triangular mask
    assert cap.zeros_above_diagonal is False  # (only an is_causal call without a mask promises it)
    assert float(cap.fields[0][..., hidden].abs().max()) == 0.0
    assert cap.valid.tolist() == [True] * 3  # the window blocks no key for every query: no padding


class ALiBiAttention(nn.Module):
    """Bidirectional attention with an ALiBi bias (a float mask of finite values, one slope per head)."""

    def __init__(self, dim: int = 16, n_head: int = 4) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(dim, 3 * dim)
        self.register_buffer("slopes", 2.0 ** (-8.0 * torch.arange(1, n_head + 1) / n_head))

    def bias(self, t: int) -> torch.Tensor:
        pos = torch.arange(t)
        return -self.slopes[:, None, None] * (pos[None, :] - pos[:, None]).abs()  # (H, T, T)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in self.qkv(x).split(C, -1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias(T))


def test_sdpa_float_bias_mask_is_added_to_the_scores():
    torch.manual_seed(0)
    attn = ALiBiAttention().eval()
    x = torch.randn(2, 9, 16)
    cap, _ = capture(attn, x)
    with torch.no_grad():
        q, k, _ = (z.view(2, 9, 4, 4).transpose(1, 2) for z in attn.qkv(x).split(16, -1))
        logits = (q @ k.transpose(-1, -2)) / 2.0
        att = (logits + attn.bias(9)).softmax(-1)
    assert cap.flagged == {} and cap.causal is False and cap.valid.tolist() == [True, True]
    torch.testing.assert_close(cap.fields[0], att, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cap.logit_max[0], logits.amax(dim=(-2, -1)))  # q.k * scale, without the bias


def test_sdpa_timm_vit_block_non_causal():
    torch.manual_seed(0)
    vit = TinyViT().eval()
    img = torch.randn(2, 3, 16, 16)
    cap, out = capture(vit, img)
    assert cap.layer_names == ["blocks.0.attn", "blocks.1.attn"]
    assert cap.causal is False and cap.fields[0].shape == (2, 4, 17, 17)
    # the explicit (non-fused) path of the same block, with its attention recorded by hand
    block = vit.blocks[0]
    with torch.no_grad():
        x = vit.patch_embed(img).flatten(2).transpose(1, 2)
        x = torch.cat([vit.cls_token.expand(2, -1, -1), x], dim=1) + vit.pos_embed
        h = block.norm1(x)
        qkv = block.attn.qkv(h).reshape(2, 17, 3, 4, 8).permute(2, 0, 3, 1, 4)
        q, k = block.attn.q_norm(qkv[0]), block.attn.k_norm(qkv[1])
        att = ((q * block.attn.scale) @ k.transpose(-2, -1)).softmax(-1)
    torch.testing.assert_close(cap.fields[0], att, rtol=1e-5, atol=1e-6)
    for blk in vit.blocks:
        blk.attn.fused_attn = False
    with torch.no_grad():
        torch.testing.assert_close(vit(img), out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_bytes", [1, 3 * 64 * 4, 2 * 64 * 64 * 4])
def test_sdpa_chunked_recomputation_equals_one_chunk(chunk_bytes):
    """One query row at a time, three rows at a time, two heads at a time: the same maps."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=64, n_head=4)).eval()
    x = torch.randint(0, 16, (3, 64))
    whole, _ = capture(gpt, x)
    rows, _ = capture(gpt, x, adapter=SDPAAdapter(chunk_bytes=chunk_bytes))
    for a, b in zip(whole.fields, rows.fields, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(whole.logit_max, rows.logit_max, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("t", [1, 5, CAUSAL_BLOCK_ROWS, 300])
@pytest.mark.parametrize("chunk_bytes", [DEFAULT_CHUNK_BYTES, 1])
def test_sdpa_causal_calls_in_row_blocks_equal_the_same_call_with_a_causal_mask(dtype, t, chunk_bytes):
    """An ``is_causal`` call is recomputed in row blocks that read only the keys they can see; the
    same call written with an explicit lower-triangular mask takes the full-row path. The same
    maps and logit maxima to rounding (products of another shape and a softmax over fewer keys
    may round differently), zeros above the diagonal, and a literal float64 softmax agrees; a wrong
    output still fails the self-check."""
    g = torch.Generator().manual_seed(t)
    b, h, e = 2, 3, 8
    q, k, v = (torch.randn(b, h, t, e, generator=g, dtype=dtype) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    blocks = recompute(SDPACall.bind((q, k, v), {"is_causal": True}), out, chunk_bytes=chunk_bytes)
    tril = torch.ones(t, t, dtype=torch.bool).tril()
    full = recompute(SDPACall.bind((q, k, v), {"attn_mask": tril}), out, chunk_bytes=chunk_bytes)
    rtol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(blocks.probs, full.probs, rtol=rtol, atol=1e-7)
    torch.testing.assert_close(blocks.logit_max, full.logit_max, rtol=rtol, atol=1e-7)
    assert blocks.error < 1e-5 and full.error < 1e-5 and blocks.causal and blocks.padded is None
    assert torch.all(blocks.probs.triu(1) == 0)
    # the row-block path promises +0 above the diagonal (every bit zero); the masked path makes no promise
    assert blocks.zeros_above_diagonal and not full.zeros_above_diagonal
    above = torch.ones(t, t, dtype=torch.bool).triu(1)
    assert torch.count_nonzero(blocks.probs.view(torch.int32)[..., above]) == 0
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(e)
    literal = scores.masked_fill(~tril, -math.inf).softmax(-1)
    torch.testing.assert_close(blocks.probs.double(), literal, rtol=0, atol=1e-6)
    torch.testing.assert_close(blocks.logit_max.double(), scores.masked_fill(~tril, -math.inf).amax((-2, -1)),
                               rtol=1e-6, atol=1e-6)
    if t > 1:
        wrong = recompute(SDPACall.bind((q, k, v), {"is_causal": True}), out * 1.5, chunk_bytes=chunk_bytes)
        assert wrong.error > 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_sdpa_self_check_passes_in_other_dtypes(dtype):
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=128, n_embd=32, n_head=4)).eval()
    x = torch.randint(0, 16, (2, 128))
    with torch.no_grad():
        _, maps = gpt_by_hand(gpt.double(), x)
    gpt = gpt.to(dtype)
    cap, _ = capture(gpt, x)
    assert cap.flagged == {}, cap.flagged
    tol = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float64: 1e-6}[dtype]  # fields are float32
    for f, ref in zip(cap.fields, maps, strict=True):
        torch.testing.assert_close(f.double(), ref, rtol=0, atol=tol)


def test_sdpa_dropout_in_eval_is_checked_against_a_dropout_free_call():
    class AlwaysDropout(SlidingWindowAttention):
        def forward(self, x):
            B, T, C = x.shape
            q, k, v = (z.view(B, T, 2, C // 2).transpose(1, 2) for z in self.qkv(x).split(C, -1))
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True)  # also in eval

    torch.manual_seed(0)
    attn = AlwaysDropout().eval()
    x = torch.randn(2, 8, 16)
    cap, _ = capture(attn, x)
    assert cap.flagged == {} and cap.counters["dropout_calls"] == 1
    with torch.no_grad():
        q, k, _ = (z.view(2, 8, 2, 8).transpose(1, 2) for z in attn.qkv(x).split(16, -1))
        att = ((q @ k.transpose(-1, -2)) / math.sqrt(8)).masked_fill(torch.ones(8, 8).triu(1).bool(), -math.inf)
    torch.testing.assert_close(cap.fields[0], att.softmax(-1), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- self-check, cross-attention
SOFTCAP: contextvars.ContextVar[float | None] = contextvars.ContextVar("softcap", default=None)


class SoftCapKernel(TorchFunctionMode):
    """An attention library that serves SDPA calls itself, soft-capping the scores (Gemma-2 style)
    when the calling layer asks for it through a context variable: the scores are modified outside
    the call's arguments, so softmax(Q K^T * scale) V is not what the layer gets."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cap = SOFTCAP.get()
        if func is not SDPA or cap is None:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        s = cap * torch.tanh(s / cap)
        if kwargs.get("is_causal"):
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
        return s.softmax(-1) @ v


class CappedGPTAttention(nn.Module):
    def __init__(self, dim: int = 16, n_head: int = 2, cap: float | None = None) -> None:
        super().__init__()
        self.n_head, self.cap = n_head, cap
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in self.qkv(x).split(C, -1))
        token = SOFTCAP.set(self.cap)
        try:
            y = F.scaled_dot_product_attention(3.0 * q, k, v, is_causal=True)
        finally:
            SOFTCAP.reset(token)
        return x + y.transpose(1, 2).reshape(B, T, C)


def test_sdpa_self_check_flags_a_soft_capped_layer_and_reports_the_other():
    torch.manual_seed(0)
    model = nn.Sequential(CappedGPTAttention(cap=None), CappedGPTAttention(cap=2.0)).eval()
    x = torch.randn(2, 10, 16)
    adapter = SDPAAdapter()
    with SoftCapKernel():  # installed by the library, around the whole run
        cap, _ = capture(model, x, adapter=adapter)
        assert list(cap.flagged) == ["1"] and "self-check failed" in cap.flagged["1"]
        assert cap.layer_names == ["0"]
        # the flag sticks (the layers stay the same from batch to batch), even if a later batch would pass
        model[1].cap = None
        again, _ = capture(model, x, adapter=adapter)
        assert again.layer_names == ["0"] and list(again.flagged) == ["1"]
        # every layer capped: nothing to report, the reasons are in the error
        for m in model:
            m.cap = 2.0
        with pytest.raises(RuntimeError, match="every scaled_dot_product_attention layer .* flagged"):
            capture(model, x, adapter=SDPAAdapter())


class DecoderLayer(nn.Module):
    """Self-attention, cross-attention to an encoder memory, and a one-token step against a KV cache."""

    def __init__(self, dim: int = 16, n_head: int = 2) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(dim, 3 * dim)
        self.kv_mem = nn.Linear(dim, 2 * dim)

    def heads(self, z):
        B, T, C = z.shape
        return z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)

    def forward(self, x, memory):
        q, k, v = (self.heads(z) for z in self.qkv(x).split(x.shape[-1], -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mk, mv = (self.heads(z) for z in self.kv_mem(memory).split(x.shape[-1], -1))
        y = y + F.scaled_dot_product_attention(q, mk, mv)  # cross-attention: 10 queries, 7 keys
        y = y + F.scaled_dot_product_attention(q[:, :, -1:], k, v)  # decoding step: 1 query, 10 cached keys
        return y


def test_sdpa_cross_attention_and_kv_cache_calls_are_skipped_and_counted():
    torch.manual_seed(0)
    dec = nn.ModuleList([DecoderLayer(), DecoderLayer()]).eval()

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = dec

        def forward(self, x, mem):
            return [layer(x, mem) for layer in self.layers]

    cap, _ = capture(Wrapper(), torch.randn(2, 10, 16), torch.randn(2, 7, 16))
    assert cap.layer_names == ["layers.0", "layers.1"]
    assert cap.counters["cross_attention_calls"] == 4 and cap.counters["captured_calls"] == 2
    assert cap.flagged == {} and cap.causal is True


def test_sdpa_module_calling_twice_gets_a_call_index():
    class Twice(nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q) + F.scaled_dot_product_attention(q, q, q, is_causal=True)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Twice()

        def forward(self, q):
            return self.attn(q)

    cap, _ = capture(Outer(), torch.randn(1, 2, 6, 4))
    assert cap.layer_names == ["attn", "attn#1"]
    # one bidirectional and one causal call: no common flag, each layer's analysis reads its own
    assert cap.causal is None
    assert bool(cap.fields[0].triu(1).gt(0).any()) and not bool(cap.fields[1].triu(1).any())


# ----------------------------------------------------------------------------- last resort, errors, cleanup
def _attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


ATTEND = _attend  # a helper elsewhere in the code base (as torchtune's): the class source never names SDPA


class HelperAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = (z.view(1, x.shape[1], 2, 4).transpose(1, 2) for z in self.qkv(x).split(8, -1))
        return ATTEND(q, k, v)


class NoAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


def test_sdpa_last_resort_captures_a_model_calling_sdpa_through_a_helper():
    module = HelperAttention().eval()
    assert not SDPAAdapter.applies(module)
    adapter = select_adapter(module)
    assert isinstance(adapter, SDPAAdapter) and adapter.last_resort
    cap, _ = capture(module, torch.randn(1, 5, 8), adapter=adapter)
    assert cap.layer_names == ["self"] and cap.causal is True


def test_sdpa_last_resort_without_any_call_names_every_way_out():
    module = NoAttention()
    adapter = select_adapter(module)
    assert isinstance(adapter, SDPAAdapter) and adapter.last_resort
    with pytest.raises(RuntimeError) as err:
        capture(module, torch.randn(2, 8), adapter=adapter)
    message = str(err.value)
    for part in ("no torch.nn.functional.scaled_dot_product_attention call was intercepted", "'protocol'",
                 "'sdpa'", "'huggingface'", "'torch_mha'", "'function'", "attention_maps", "capture=fn"):
        assert part in message, part
    with pytest.raises(ValueError, match="'sdpa'.*scaled_dot_product_attention"):
        select_adapter(nn.Linear(3, 3))  # nothing of the user's own: no last resort either
    assert isinstance(select_adapter(HelperAttention(), "sdpa"), SDPAAdapter)  # forced by name


def test_sdpa_monitor_on_a_model_without_attention_warns_and_training_goes_on(tmp_path):
    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = NoAttention()

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=8)
    with pytest.warns(Warning, match="no torch.nn.functional.scaled_dot_product_attention call was intercepted"):
        trainer(tmp_path, [PODMonitor()], max_epochs=1).fit(Regressor(), data, data)


def test_sdpa_stop_restores_everything_after_an_exception_in_the_forward(assert_no_hooks):
    gpt = GPT(GPTConfig()).eval()
    adapter = SDPAAdapter()

    def boom(module, args, output):
        raise RuntimeError("boom")

    handle = gpt.transformer.h[1].attn.register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom"), adapter.capturing(gpt):
        gpt(torch.randint(0, 16, (2, 8)))
    handle.remove()
    assert not adapter.active and function_modes() == []
    assert_no_hooks(gpt)
    adapter.stop()  # idempotent
    adapter.stop()


def test_sdpa_no_interception_left_after_an_exception_in_the_validation_step(tmp_path, assert_no_hooks):
    class Failing(NanoGPTModule):
        def validation_step(self, batch, batch_idx):
            loss = super().validation_step(batch, batch_idx)
            if batch_idx == 1:
                raise RuntimeError("validation failed")
            return loss

    model = Failing()
    with pytest.raises(RuntimeError, match="validation failed"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer(tmp_path, [PODMonitor()], max_epochs=1).fit(model)
    assert function_modes() == []
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    assert_no_hooks(model)
    # the model runs plain SDPA afterwards: the same output as by hand
    x = torch.randint(0, 16, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(model.model.eval()(x), gpt_by_hand(model.model, x)[0], rtol=1e-4, atol=1e-5)


def test_sdpa_torch_compiled_module_is_captured_through_the_eager_module():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig()).eval()

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.compile(gpt, backend="eager")

        def forward(self, x):
            return self.model(x)

    holder = Holder()
    x = torch.randint(0, 16, (2, 32))
    with torch.no_grad():
        compiled_out = holder(x)
    cap, out = capture(holder, x)
    torch.testing.assert_close(out, compiled_out)
    assert cap.layer_names == ["model.transformer.h.0.attn", "model.transformer.h.1.attn"]  # no _orig_mod
    with torch.no_grad():
        _, maps = gpt_by_hand(gpt, x)
    for f, ref in zip(cap.fields, maps, strict=True):
        torch.testing.assert_close(f, ref, rtol=1e-5, atol=1e-6)
    assert torch._dynamo.eval_frame._stance.stance == "default"  # restored


# ----------------------------------------------------------------------------- head masking
def test_sdpa_head_mask_equals_zeroing_the_heads_slice_of_the_output_projection_input():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_head=4)).eval()
    x = torch.randint(0, 16, (3, 32))
    hs = 16 // 4
    with torch.no_grad():
        original = gpt(x)

    def zero_slice(h):
        def hook(module, args):
            y = args[0].clone()
            y[..., h * hs:(h + 1) * hs] = 0.0  # head h's slice of c_proj's input
            return (y,)
        return hook

    for layer, head in [(0, 1), (1, 3)]:
        proj = gpt.transformer.h[layer].attn.c_proj
        handle = proj.register_forward_pre_hook(zero_slice(head))
        with torch.no_grad():
            reference = gpt(x)
        handle.remove()
        masker = HeadMasker(gpt)
        assert masker.kind == "sdpa" and masker.n_heads == [4, 4]
        assert masker.layer_names == ["transformer.h.0.attn", "transformer.h.1.attn"]
        masker.apply({layer: [head]})
        with torch.no_grad():
            masked = gpt(x)
        assert torch.equal(masked, reference)
        assert not torch.equal(masked, original)
        masker.restore()
        with torch.no_grad():
            assert torch.equal(gpt(x), original)
    assert function_modes() == []


def test_sdpa_head_mask_with_capture_training_gradients_and_checkpoint():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_head=4))
    x = torch.randint(0, 16, (2, 32))
    masker = HeadMasker(gpt)
    masker.apply({0: [0, 2]})
    # capture while masked: the fields are the attention (unmasked), not flagged
    gpt.eval()
    cap, _ = capture(gpt, x)
    assert cap.flagged == {} and len(cap.fields) == 2
    # training sees the mask: the pruned heads' value weights get no gradient through the attention
    gpt.train()
    gpt(x).sum().backward()
    c_attn = gpt.transformer.h[0].attn.c_attn.weight.grad  # rows: q (16), k (16), v (16)
    hs = 4
    for h in (0, 2):
        assert float(c_attn[32 + h * hs: 32 + (h + 1) * hs].abs().max()) == 0.0
    assert float(c_attn[32 + 1 * hs: 32 + 2 * hs].abs().max()) > 0.0
    # a fresh model gets the same pruning from the state
    gpt.eval()
    twin = GPT(GPTConfig(n_head=4)).eval()
    twin.load_state_dict(gpt.state_dict())
    HeadMasker(twin).load_state_dict(masker.state_dict())
    with torch.no_grad():
        assert torch.equal(twin(x), gpt(x))
    masker.restore()


def test_sdpa_head_mask_gives_gradients_to_a_mask_variable():
    """Michel et al. importance: d loss / d xi through SDPAHeadMask equals the slice-scaling by hand."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_head=4)).eval()
    x = torch.randint(0, 16, (2, 32))
    xi = torch.ones(4, requires_grad=True)
    with SDPAHeadMask(gpt, {"transformer.h.1.attn": xi}):
        loss = gpt(x).pow(2).mean()
    (grad,) = torch.autograd.grad(loss, xi)
    xi_ref = torch.ones(4, requires_grad=True)

    def scale(module, args):
        return (args[0] * xi_ref.repeat_interleave(4),)

    handle = gpt.transformer.h[1].attn.c_proj.register_forward_pre_hook(scale)
    (grad_ref,) = torch.autograd.grad(gpt(x).pow(2).mean(), xi_ref)
    handle.remove()
    torch.testing.assert_close(grad, grad_ref)
    with pytest.raises(ValueError, match="no module path"):
        SDPAHeadMask(gpt, {"transformer.h.9.attn": [1.0]})
    one_head = SDPAHeadMask(gpt, {"transformer.h.0.attn": [1.0]})
    with pytest.raises(ValueError, match="4 heads"), torch.no_grad(), one_head:
        gpt(x)


# ----------------------------------------------------------------------------- Hugging Face, forced
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_sdpa_forced_on_hugging_face_sdpa_attention_matches_its_eager_attentions(arch):
    """capture='sdpa' on transformers' own SDPA path (4-d padding masks, Llama's grouped K/V) equals the
    probabilities the same model returns in eager mode with output_attentions=True."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=40,
                                                                     n_positions=32))
        names = ["transformer.h.0.attn", "transformer.h.1.attn"]
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=64,
            vocab_size=40, max_position_embeddings=32))
        names = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    model.eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 40, (3, 16))
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0  # right padding
    adapter = select_adapter(model, "sdpa")
    cap, _ = capture(model, adapter=adapter, input_ids=ids, attention_mask=mask)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert cap.layer_names == names and cap.flagged == {}
    assert cap.causal is True and cap.valid.tolist() == [True, False, True]
    for f, r in zip(cap.fields, ref, strict=True):
        torch.testing.assert_close(f[[0, 2]], r[[0, 2]], rtol=1e-5, atol=1e-6)  # the unpadded sequences


def test_sdpa_active_heads_names_match_the_captured_layers():
    from podmonitor.capture.sdpa import active_heads

    module = NanoGPTModule()
    masker = HeadMasker(module)
    masker.apply({1: [0]})
    x = torch.randint(0, 16, (2, 32))
    cap, _ = capture(module.model, x)
    assert active_heads(module) == {"model.transformer.h.1.attn": [False, True]}
    assert active_heads(module.model) == {"transformer.h.1.attn": [False, True]}  # relative to the module given
    assert set(active_heads(module.model)) <= set(cap.layer_names)
    masker.restore()
    assert active_heads(module) == {}


# ----------------------------------------------------------------------------- stability signals through SDPA
class PlantedAttention(nn.Module):
    """A causal SDPA layer of 3 heads with two planted behaviours (head size 8):

    head 0: logits growing by 10.6 per key position, so every row is all but one-hot on its latest
    key (entropy collapse);
    head 1: an attention sink, key 0 = s u and every query gets + s u (u the first basis vector), so
    q . k_0 ~ s^2 dominates each row; head 2: untouched.
    """

    n_head, hs, s = 3, 8, 8.0

    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(24, 72)
        self.c_proj = nn.Linear(24, 24)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, self.hs).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        q, k = q.clone(), k.clone()
        q[:, 0] = 0.0  # head 0 looks at the latest key only: logit_ij = 30 j / sqrt(8)
        q[:, 0, :, 1] = 10.0
        k[:, 0, :, 1] = 3.0 * torch.arange(t, dtype=k.dtype)
        u = torch.zeros(self.hs)
        u[0] = self.s
        q[:, 1] = q[:, 1] + u
        k[:, 1, 0] = u
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class PlantedLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 24)
        self.attn = PlantedAttention()
        self.head = nn.Linear(24, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        return self.head(x + self.attn(x))

    def _loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 16, (32, 24), generator=g)
        return DataLoader(TensorDataset(x, (x + 1) % 16), batch_size=16)

    def val_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 16, (160, 24), generator=g)
        return DataLoader(TensorDataset(x, (x + 1) % 16), batch_size=16)


def test_sdpa_stability_signals_through_the_callback_match_literal_formulas(tmp_path):
    """PODMonitor() on an SDPA model with a planted entropy collapse (head 0) and sink (head 1): the
    logged max logit, row entropy and sink mass equal the METHOD.md section 10 formulas written out
    on attention formed by hand from q and k (no SDPA)."""
    L.seed_everything(0)
    model = PlantedLM()
    monitor = PODMonitor()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer(tmp_path, [monitor], max_epochs=1).fit(model)
    rep = monitor.last_stability_reports["attn"]

    x = torch.cat([b[0] for b in model.val_dataloader()])[:150]
    with torch.no_grad():
        q, k, _ = model.attn.qkv(model.emb(x))
    t = x.shape[1]
    logits = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(PlantedAttention.hs)
    visible = torch.ones(t, t, dtype=torch.bool).tril()
    logits = logits.masked_fill(~visible, -math.inf)
    a = logits.softmax(-1).numpy()  # (150, 3, T, T)
    ent, sink, max_logit = [], [], []
    for h in range(3):
        rows = []
        for s_ in range(a.shape[0]):
            for i in range(1, t):  # rows with >= 2 visible keys
                p = a[s_, h, i, : i + 1]
                p = p[p > 0]
                rows.append(float(-(p * np.log(p)).sum() / math.log(i + 1)))
        ent.append(sum(rows) / len(rows))
        sink.append(float(a[:, h, 1:, 0].mean()))
        max_logit.append(float(logits[:, h].amax()))

    assert rep.n_snapshots == 150 and rep.n_heads == 3
    np.testing.assert_allclose(rep.entropy, ent, rtol=2e-4, atol=2e-6)
    np.testing.assert_allclose(rep.sink_mass, sink, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(rep.max_logit, max_logit, rtol=1e-5)
    assert rep.entropy_min == pytest.approx(min(ent), rel=2e-4, abs=2e-6)
    assert rep.entropy[0] < 0.05 < 0.5 < rep.entropy[2]  # the planted collapse is the layer's minimum
    assert rep.sink_mass[1] > 0.95 and rep.sink_mass_max == pytest.approx(rep.sink_mass[1])
    assert rep.max_logit_layer == pytest.approx(max(max_logit), rel=1e-5)
    logged = monitor.last_stability["attn"]  # what the sinks log, under the registry's keys
    assert logged["entropy_min_head"] == pytest.approx(min(ent), rel=2e-4, abs=2e-6)
    assert logged["max_logit"] == pytest.approx(max(max_logit), rel=1e-5)
    assert logged["sink_mass"] == pytest.approx(sum(sink) / 3, rel=1e-4)
