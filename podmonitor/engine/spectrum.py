"""Spectral concentration index T_spec and effective rank H*(eps) (METHOD.md section 5).

Vocabulary after WeightWatcher: every fitted exponent comes with its fit quality (R^2), the
number of points it used and a status; a failed fit says so and returns NaN, never a made-up
value (the published code returns T_spec = 1.00 when the fit fails).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SpectralFit:
    """Power-law fit ``lambda_k ~ c k^-beta`` of the leading eigenvalues.

    Attributes:
        beta: minus the OLS slope of ln lambda_k on ln k.
        t_spec: 1 / beta (inf when beta <= 0, i.e. a flat spectrum).
        r2: coefficient of determination of the fit.
        n_points: eigenvalues the fit used.
        status: "ok", "degenerate" (fewer than 3 eigenvalues above the floor) or "flat"
            (beta <= 0).
    """

    beta: float
    t_spec: float
    r2: float
    n_points: int
    status: str


def spectral_fit(eigenvalues: Tensor, k_fit: int = 30, floor: float = 1e-12) -> SpectralFit:
    """Fit T_spec on the first ``k_fit`` eigenvalues above ``floor * lambda_1``.

    Args:
        eigenvalues: (K,) non-negative eigenvalues in descending order.
        k_fit: K_fit.
        floor: relative floor.
    """
    lam = eigenvalues.detach().to(torch.float64).cpu()[:k_fit]
    if lam.numel() == 0 or not float(lam[0]) > 0:
        return SpectralFit(math.nan, math.nan, math.nan, 0, "degenerate")
    keep = lam > floor * lam[0]
    k = torch.arange(1, lam.numel() + 1, dtype=torch.float64)[keep]
    lam = lam[keep]
    if lam.numel() < 3:
        return SpectralFit(math.nan, math.nan, math.nan, int(lam.numel()), "degenerate")
    x, y = torch.log(k), torch.log(lam)
    xc, yc = x - x.mean(), y - y.mean()
    slope = float((xc * yc).sum() / (xc * xc).sum())
    ss_tot = float((yc * yc).sum())
    resid = yc - slope * xc
    r2 = 1.0 - float((resid * resid).sum()) / ss_tot if ss_tot > 0 else math.nan
    beta = -slope
    if not beta > 0:
        return SpectralFit(beta, math.inf, r2, int(lam.numel()), "flat")
    return SpectralFit(beta, 1.0 / beta, r2, int(lam.numel()), "ok")


@dataclass(frozen=True)
class EffectiveRank:
    """H*(eps) for several eps.

    Attributes:
        ranks: eps -> the smallest K with ``sum_{k > K} lambda_k <= eps * sum_k lambda_k``
            (None when the spectrum carries no energy).
        saturated: eps -> True when K reaches the number of non-zero eigenvalues ("needs every
            mode").
        n_nonzero: eigenvalues above the floor.
    """

    ranks: dict[float, int | None]
    saturated: dict[float, bool]
    n_nonzero: int


def effective_rank(eigenvalues: Tensor, eps: tuple[float, ...] = (0.10, 0.05, 0.01),
                   floor: float = 1e-12) -> EffectiveRank:
    """H*(eps) of a descending, non-negative spectrum (the published code returns K + 1)."""
    lam = eigenvalues.detach().to(torch.float64).cpu()
    total = float(lam.sum()) if lam.numel() else 0.0
    if not total > 0:
        return EffectiveRank({e: None for e in eps}, {e: False for e in eps}, 0)
    n_nonzero = int((lam > floor * lam[0]).sum())
    # tail[K] = sum_{k > K} lambda_k (1-based k), i.e. the sum of lam[K:], for K = 0..n.
    tail = torch.cat([lam.flip(0).cumsum(0).flip(0), torch.zeros(1, dtype=torch.float64)])
    ranks: dict[float, int | None] = {}
    saturated: dict[float, bool] = {}
    for e in eps:
        ok = torch.nonzero(tail <= e * total)
        k = int(ok[0]) if ok.numel() else lam.numel()
        ranks[e] = k
        saturated[e] = k >= n_nonzero
    return EffectiveRank(ranks, saturated, n_nonzero)
