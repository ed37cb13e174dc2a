"""Tests of Energy-Gated Attention: the gate against a from-the-definition reference,
causality of the default gate, the documented leak of the "window" gate."""

from __future__ import annotations

import math

import pytest
import torch

from podmonitor.models.gpt import GPT, CausalSelfAttention, EnergyGate, GPTConfig


def ega_config(gate: str = "causal", **kw: object) -> GPTConfig:
    base: dict[str, object] = dict(
        vocab_size=65,
        block_size=24,
        n_layer=2,
        n_head=2,
        n_embd=16,
        dropout=0.0,
        attention="ega",
        ega_gate=gate,
    )
    base.update(kw)
    return GPTConfig(**base)  # type: ignore[arg-type]


def perturb_(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            scale = 0.5 / math.sqrt(p.shape[-1]) if p.dim() >= 2 else 0.3
            p.add_(torch.randn(p.shape, generator=g) * scale)


def reference_ega(attn: CausalSelfAttention, x: torch.Tensor, gate: str, eps: float) -> torch.Tensor:
    """Ahat (B, nh, T, T) written from the definition with explicit loops, float64:
    z_ij = (e_j - mean(e_{<=i})) / sqrt(var(e_{<=i}) + eps) (causal) or over the whole
    window; g = sigmoid(alpha (z - tau)); Ahat_ij = A_ij g_ij / sum_k A_ik g_ik."""
    B, T, C = x.shape
    nh = attn.n_head
    hs = C // nh
    W, b = attn.c_attn.weight, attn.c_attn.bias
    We, be = attn.gate.energy.weight, attn.gate.energy.bias
    out = torch.zeros(B, nh, T, T, dtype=torch.float64)
    for bi in range(B):
        for h in range(nh):
            q = x[bi] @ W[h * hs : (h + 1) * hs].T + b[h * hs : (h + 1) * hs]
            k = x[bi] @ W[C + h * hs : C + (h + 1) * hs].T + b[C + h * hs : C + (h + 1) * hs]
            e = x[bi] @ We[h] + be[h]  # (T,)
            alpha, tau = attn.gate.alpha[h], attn.gate.tau[h]
            for i in range(T):
                stats = e[: i + 1] if gate == "causal" else e
                mean = stats.mean()
                std = torch.sqrt(((stats - mean) ** 2).mean() + eps)
                s = torch.stack([q[i] @ k[j] / math.sqrt(hs) for j in range(i + 1)])
                a = torch.softmax(s, dim=0)
                g = torch.sigmoid(alpha * ((e[: i + 1] - mean) / std - tau))
                out[bi, h, i, : i + 1] = a * g / (a * g).sum()
    return out


@pytest.mark.parametrize("gate", ["causal", "window"])
def test_gate_matches_reference(gate: str) -> None:
    torch.manual_seed(0)
    cfg = ega_config(gate)
    attn = CausalSelfAttention(cfg).double().eval()
    perturb_(attn)
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    with torch.no_grad():
        y_fused, _ = attn(x)
        y_math, att = attn(x, return_attention=True)
        ref = reference_ega(attn, x, gate, cfg.ega_eps)
        _, _, v = attn.qkv(x)
        y_ref = attn.merge_heads(ref @ v)
    torch.testing.assert_close(att, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(y_math, y_ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(y_fused, y_ref, atol=1e-12, rtol=1e-10)
    # the gate actually does something: Ahat differs from the ungated softmax attention
    attn.gate = None
    with torch.no_grad():
        _, plain = attn(x, return_attention=True)
    assert (plain - att).abs().max() > 1e-2


def test_gate_init_and_shapes() -> None:
    cfg = ega_config("causal")
    gate = EnergyGate(cfg)
    assert torch.all(gate.alpha == 2.0) and torch.all(gate.tau == 0.0)
    x = torch.randn(3, 10, 16)
    assert gate.log_gate(x).shape == (3, 2, 10, 10)  # causal: g depends on (i, j)
    gate.mode = "window"
    assert gate.log_gate(x).shape == (3, 2, 1, 10)  # window: one gate per key


def test_one_element_prefix_and_constant_energy_are_safe() -> None:
    """Identical inputs at every position (same token, zero position embedding) give
    constant energies: every prefix has zero variance, z = 0 and the gate is the same for
    all keys, so EGA reduces to plain attention -- here uniform causal attention (the
    Cesaro matrix C_ij = 1/i) -- and nothing is NaN. The first query (a 1-element prefix)
    always has z = 0."""
    torch.manual_seed(0)
    model = GPT(ega_config("causal")).eval()
    perturb_(model)
    with torch.no_grad():
        model.transformer.wpe.weight.zero_()
    idx = torch.full((2, 24), 7, dtype=torch.long)
    with torch.no_grad():
        _, _, atts = model(idx, return_attention=True)
        block = model.transformer.h[0]
        x = block.ln_1(model.transformer.wte(idx))
        z = block.attn.gate.standardised_energy(x)  # (B, nh, T, T)
    cesaro = torch.ones(24, 24).tril() / torch.arange(1, 25).unsqueeze(1)
    for a in atts:
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, cesaro.expand_as(a), atol=1e-4, rtol=0)  # fp32 noise / sqrt(eps)
    lower = torch.ones(24, 24, dtype=torch.bool).tril()  # entries j > i are masked anyway
    assert z[..., lower].abs().max() < 1e-3

    # random input: 1-element prefix gives z = 0; |z| <= sqrt(n) with the population std
    perturb_(model, seed=1)
    idx = torch.randint(0, 65, (2, 24))
    with torch.no_grad():
        x = block.ln_1(model.transformer.wte(idx) + model.transformer.wpe(torch.arange(24)))
        z = block.attn.gate.standardised_energy(x)
    assert torch.all(z[..., 0, 0] == 0)
    n = torch.arange(1, 25).view(24, 1)
    assert torch.all(z[..., lower].abs() <= n.sqrt().expand(24, 24)[lower] + 1e-4)


@pytest.mark.parametrize("pos_encoding", ["learned", "mope"])
def test_causal_gate_does_not_leak(pos_encoding: str) -> None:
    torch.manual_seed(0)
    model = GPT(ega_config("causal", pos_encoding=pos_encoding)).eval()
    perturb_(model)
    idx = torch.randint(0, 65, (2, 24), generator=torch.Generator().manual_seed(1))
    for t in (1, 10, 23):
        idx2 = idx.clone()
        idx2[:, t] = (idx[:, t] + 11) % 65
        with torch.no_grad():
            a, _ = model(idx)
            b, _ = model(idx2)
            _, _, atts_a = model(idx, return_attention=True)
            _, _, atts_b = model(idx2, return_attention=True)
        torch.testing.assert_close(a[:, :t], b[:, :t], atol=1e-6, rtol=0)
        for aa, ab in zip(atts_a, atts_b, strict=True):
            torch.testing.assert_close(aa[:, :, :t], ab[:, :, :t], atol=1e-6, rtol=0)


def test_window_gate_leaks_as_documented() -> None:
    """The published whole-window standardisation lets a LATER token change EARLIER
    logits: the "window" option is non-causal (documented in the GPT module)."""
    torch.manual_seed(0)
    model = GPT(ega_config("window")).eval()
    perturb_(model)
    idx = torch.randint(0, 65, (2, 24), generator=torch.Generator().manual_seed(1))
    t = 20
    idx2 = idx.clone()
    idx2[:, t] = (idx[:, t] + 11) % 65
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(idx2)
        _, _, atts = model(idx, return_attention=True)
    assert (a[:, :t] - b[:, :t]).abs().max() > 1e-4
    # ... although every attention matrix is still lower-triangular
    upper = torch.ones(24, 24, dtype=torch.bool).triu(1)
    assert all(torch.all(x[..., upper] == 0) for x in atts)


def test_gate_parameters_receive_gradients() -> None:
    torch.manual_seed(0)
    model = GPT(ega_config("causal")).train()
    idx = torch.randint(0, 65, (2, 24))
    _, loss = model(idx, idx)
    loss.backward()
    gate = model.transformer.h[0].attn.gate
    for p in (gate.alpha, gate.tau, gate.energy.weight, gate.energy.bias):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
