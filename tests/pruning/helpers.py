"""Synthetic attention ensembles with known structure, for the pruning tests."""

from __future__ import annotations

import torch


def causal_softmax(logits: torch.Tensor) -> torch.Tensor:
    """(..., L, L) logits -> causal attention probabilities (rows sum to 1, zero above the diagonal)."""
    L = logits.shape[-1]
    mask = torch.ones(L, L, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)


def low_rank_fields(n: int, L: int, n_patterns: int, seed: int, amplitude: float = 0.3,
                    pattern_seed: int | None = None) -> torch.Tensor:
    """(n, L, L) causal fields whose fluctuation is (to first order in ``amplitude``) spanned by
    ``n_patterns`` fixed logit patterns with random coefficients per snapshot (patterns drawn
    with ``pattern_seed``, default ``seed``; coefficients with ``seed``)."""
    gp = torch.Generator().manual_seed(seed if pattern_seed is None else pattern_seed)
    base = torch.randn(L, L, generator=gp, dtype=torch.float64)
    patterns = torch.randn(n_patterns, L, L, generator=gp, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed + 7919)
    coef = torch.randn(n, n_patterns, generator=g, dtype=torch.float64)
    logits = base + amplitude * torch.einsum("sk,kij->sij", coef, patterns)
    return causal_softmax(logits)
