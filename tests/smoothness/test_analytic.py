"""The analytic cases of METHOD.md section 8 and a constructed sqrt(n) worst case."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from podmonitor.smoothness import cesaro_matrix, cesaro_norm, growth_exponent, jacobian_spectral_norm
from podmonitor.smoothness.companions import spectral_norm_p

from .conftest import gpt_attention, gpt_value_output_norm, value_output_norm

#: ||C_n||_2 as listed in METHOD.md section 8 (4 decimals).
CESARO_LISTED = {16: 1.4677, 32: 1.5393, 64: 1.5979, 128: 1.6462, 256: 1.6864}


def _sigma(f, x: torch.Tensor) -> torch.Tensor:
    return jacobian_spectral_norm(f, x, n_iter=1000, tol=1e-7, generator=torch.Generator().manual_seed(0)).sigma


def _identical(n: int, c: int, seed: int = 0) -> torch.Tensor:
    """(1, n, C): n copies of one random token."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 1, c, generator=g).expand(1, n, c).contiguous()


def test_cesaro_norms_match_the_listed_values() -> None:
    for n, listed in CESARO_LISTED.items():
        assert abs(cesaro_norm(n) - listed) < 6e-5, (n, cesaro_norm(n))
    c = cesaro_matrix(5)  # C_ij = 1/i for j <= i, literally
    for i in range(5):
        for j in range(5):
            assert c[i, j].item() == pytest.approx(1.0 / (i + 1) if j <= i else 0.0)


@pytest.mark.parametrize("attention", ["softmax", "ega"])
def test_single_token_gives_value_output_norm_reference_gpt(attention: str) -> None:
    attn = gpt_attention(attention, gain=5.0)
    x = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(1))
    s = _sigma(lambda z: attn(z, return_attention=True)[0], x)
    expected = gpt_value_output_norm(attn)
    torch.testing.assert_close(s.double(), torch.full((3,), expected, dtype=torch.float64), rtol=1e-4, atol=0.0)


def test_single_token_gives_value_output_norm_multihead_attention() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 1, 8)
    s = _sigma(lambda z: mha(z, z, z, need_weights=True)[0], x)
    e = 8
    expected = value_output_norm(mha.in_proj_weight[2 * e :], mha.out_proj.weight)
    torch.testing.assert_close(s.double(), torch.full((2,), expected, dtype=torch.float64), rtol=1e-4, atol=0.0)


@pytest.mark.parametrize("n", [16, 32, 64])
def test_identical_tokens_unmasked_give_value_output_norm(n: int) -> None:
    """Bidirectional attention on n identical tokens: P uniform, ||P|| = 1, sigma = ||W_o W_v|| for every n."""
    torch.manual_seed(2)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_weight.mul_(5.0)  # sharp scores: would matter if the tokens differed
    x = _identical(n, 8, seed=n)
    s = _sigma(lambda z: mha(z, z, z, need_weights=True)[0], x)
    expected = value_output_norm(mha.in_proj_weight[16:], mha.out_proj.weight)
    assert float(s) == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("attention", ["softmax", "ega"])
def test_identical_tokens_causal_give_cesaro_norms(attention: str) -> None:
    """Causal attention on n identical tokens: P = C_n, sigma = ||C_n||_2 ||W_o W_v|| (listed values)."""
    attn = gpt_attention(attention, gain=5.0, block_size=256)
    vo = gpt_value_output_norm(attn)
    for n, listed in CESARO_LISTED.items():
        x = _identical(n, 8, seed=n)
        _, p = attn(x, return_attention=True)
        torch.testing.assert_close(p[0, 0].double(), cesaro_matrix(n), rtol=0, atol=1e-6)
        s = float(_sigma(lambda z: attn(z, return_attention=True)[0], x))
        assert s / vo == pytest.approx(listed, abs=2e-4), (n, s / vo)


def test_identical_tokens_causal_multihead_attention() -> None:
    torch.manual_seed(3)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    vo = value_output_norm(mha.in_proj_weight[16:], mha.out_proj.weight)
    for n in (16, 32, 64):
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)
        s = float(_sigma(lambda z, m=mask: mha(z, z, z, attn_mask=m, need_weights=True)[0], _identical(n, 8)))
        assert s / vo == pytest.approx(CESARO_LISTED[n], abs=2e-4)


def _attention_sink(n_embd: int = 8, sharpness: float = 40.0, seed: int = 0) -> nn.Module:
    """One-head causal attention in which every query attends (saturated) to the first token.

    q_i = beta u (constant), k_j = gamma x_j[0] u; tokens have x_j[0] = 1 for j = 1 and 0 after, so
    the score of key 1 exceeds the others by ``sharpness``: P = 1 e_1^T up to exp(-sharpness), whose
    spectral norm is sqrt(n). Then Df(X)[H] = P H (W_o W_v)^T and sigma(n) = sqrt(n) ||W_o W_v||.
    """
    attn = gpt_attention("softmax", n_embd=n_embd, n_head=1, block_size=256, seed=seed)
    c = n_embd
    with torch.no_grad():
        w = attn.c_attn.weight  # (3C, C): W_q, W_k, W_v
        b = attn.c_attn.bias
        w[: 2 * c].zero_()
        b[: 2 * c].zero_()
        b[0] = 1.0  # q = e_0 for every query
        w[c, 0] = sharpness * math.sqrt(c)  # k_j[0] = sharpness sqrt(C) x_j[0]
    return attn


def _sink_tokens(n: int, c: int = 8, seed: int = 0) -> torch.Tensor:
    x = torch.randn(1, n, c, generator=torch.Generator().manual_seed(seed))
    x[..., 0] = 0.0
    x[0, 0, 0] = 1.0
    return x


def test_constructed_worst_case_grows_like_sqrt_n() -> None:
    attn = _attention_sink()
    vo = gpt_value_output_norm(attn)
    lengths = [16, 32, 64, 128, 256]
    sigmas = []
    for n in lengths:
        x = _sink_tokens(n, seed=n)
        _, p = attn(x, return_attention=True)
        assert float(spectral_norm_p(p[0, 0])) == pytest.approx(math.sqrt(n), rel=1e-6)
        s = float(_sigma(lambda z: attn(z, return_attention=True)[0], x))
        assert s == pytest.approx(math.sqrt(n) * vo, rel=1e-4)
        sigmas.append(s)
    fit = growth_exponent(lengths, sigmas)
    assert fit.status == "ok"
    assert fit.alpha == pytest.approx(0.5, abs=1e-3)
    assert fit.r2 > 0.9999


def test_uniform_attention_does_not_grow() -> None:
    """Contrast with the worst case: without the sink the scores are constant, P = C_n whatever the
    tokens, f is linear and sigma(n) = ||C_n|| ||W_o W_v||: alpha ~ 0.05 (the slow growth of ||C_n||)."""
    attn = _attention_sink(sharpness=0.0)
    vo = gpt_value_output_norm(attn)
    lengths = [16, 32, 64, 128]
    sigmas = [float(_sigma(lambda z: attn(z, return_attention=True)[0], _sink_tokens(n, seed=n))) for n in lengths]
    for n, s in zip(lengths, sigmas, strict=True):
        assert s == pytest.approx(cesaro_norm(n) * vo, rel=1e-4)
    fit = growth_exponent(lengths, sigmas)
    assert 0.0 < fit.alpha < 0.1
