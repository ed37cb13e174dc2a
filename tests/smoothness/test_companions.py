"""Row entropy and ||P||_2 against literal formulas and known matrices."""

from __future__ import annotations

import math

import pytest
import torch

from podmonitor.smoothness import attention_companions, cesaro_matrix, row_entropy
from podmonitor.smoothness.companions import spectral_norm_p


def _literal_entropy(p: torch.Tensor, causal: bool) -> list[float]:
    T = p.shape[-1]
    out = []
    for i in range(T):
        keys = i + 1 if causal else T
        h = -sum(float(p[i, j]) * math.log(float(p[i, j])) for j in range(T) if float(p[i, j]) > 0)
        out.append(h / math.log(keys) if keys > 1 else math.nan)
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_row_entropy_matches_literal_formula(causal: bool) -> None:
    g = torch.Generator().manual_seed(0)
    T = 7
    logits = torch.randn(T, T, generator=g, dtype=torch.float64)
    if causal:
        logits = logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    p = torch.softmax(logits, -1)
    got = row_entropy(p, causal).tolist()
    for a, b in zip(got, _literal_entropy(p, causal), strict=True):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12)


def test_entropy_extremes_and_norm_bounds() -> None:
    n = 16
    uniform = torch.full((1, 1, n, n), 1.0 / n)
    comp = attention_companions(uniform, causal=False)
    assert comp.entropy == pytest.approx(1.0) and comp.p_norm == pytest.approx(1.0)
    cesaro = cesaro_matrix(n).view(1, 1, n, n)  # causal uniform: entropy 1 in every row
    comp = attention_companions(cesaro, causal=True)
    assert comp.entropy == pytest.approx(1.0) and comp.p_norm == pytest.approx(1.4677, abs=1e-4)
    sink = torch.zeros(1, 2, n, n)  # every query on key 0: one-hot rows, ||P|| = sqrt(n)
    sink[..., 0] = 1.0
    comp = attention_companions(sink, causal=True)
    assert comp.entropy == pytest.approx(0.0) and comp.p_norm == pytest.approx(math.sqrt(n))
    assert comp.n_heads == 2 and comp.seq_len == n
    eye = torch.eye(n).view(1, 1, n, n)
    assert float(spectral_norm_p(eye)) == pytest.approx(1.0)


def test_companions_reject_non_square() -> None:
    with pytest.raises(ValueError):
        attention_companions(torch.ones(1, 1, 3, 4) / 4, causal=False)
