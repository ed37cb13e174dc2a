"""Spectral concentration index T_spec and effective rank H*(eps) (METHOD.md section 5): every fit
and rank function of the engine.

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


def sketch_effective_rank(eigenvalues: Tensor, lower: Tensor, error_bound: float, total: float,
                          eps: tuple[float, ...], resolved_rank: int
                          ) -> tuple[dict[float, int | None], dict[float, list[int | None]], dict[float, bool],
                                     dict[float, bool]]:
    """H*(eps) from sketch eigenvalues, with guaranteed bounds (METHOD.md section 5).

    With ``lower_k <= lambda_k <= lower_k + e`` and the exact total T: the top-K sum of the true
    eigenvalues lies in ``[S_K, S_K + min(K e, T - S_m)]`` (Ky Fan), ``S_K`` the top-K sum of
    ``lower`` and ``T - S_m`` the energy the sketch misses. So ``H_hi`` = the smallest K with
    ``T - S_K <= eps T`` is an upper bound, ``H_lo`` = the smallest K with
    ``T - S_K - min(K e, T - S_m) <= eps T`` a lower bound.

    Args:
        eigenvalues: (m,) estimates, descending.
        lower: (m,) guaranteed lower bounds, descending.
        error_bound: e.
        total: T, the exact sum of all eigenvalues.
        eps: the tolerances.
        resolved_rank: R.

    Returns:
        ranks: eps -> H*(eps) of the estimates when it is at most R, else None ("more than R").
        bounds: eps -> [H_lo, H_hi] (H_hi None when even all m sketch eigenvalues fall short).
        beyond: eps -> whether H*(eps) is beyond the resolved rank.
        saturated: eps -> False (a sketch cannot say that every mode is needed).
    """
    lam = eigenvalues.to(torch.float64)
    lo = lower.to(torch.float64)
    m = int(lam.numel())
    zero = torch.zeros(1, dtype=torch.float64)
    s_est = torch.cat([zero, lam.cumsum(0)])  # S_K for K = 0..m
    s_lo = torch.cat([zero, lo.cumsum(0)])
    missing = max(0.0, total - float(s_lo[-1]))
    k = torch.arange(m + 1, dtype=torch.float64)
    slack = torch.clamp(k * error_bound, max=missing)
    ranks: dict[float, int | None] = {}
    bounds: dict[float, list[int | None]] = {}
    beyond: dict[float, bool] = {}
    for e in eps:
        target = e * total

        def first(ok: Tensor) -> int | None:
            idx = torch.nonzero(ok)
            return int(idx[0]) if idx.numel() else None

        h_hi = first(total - s_lo <= target)
        h_lo = first(total - s_lo - slack <= target)
        if h_lo is None:  # even all m sketch eigenvalues plus the slack fall short
            h_lo = m + 1
        h_est = first(total - s_est <= target)
        if h_est is not None:  # the estimate's own H* lies within the guaranteed bounds
            h_est = max(h_est, h_lo) if h_hi is None else min(max(h_est, h_lo), h_hi)
        ok = total > 0 and h_est is not None and h_est <= resolved_rank
        ranks[e] = h_est if ok else None
        bounds[e] = [h_lo, h_hi]
        beyond[e] = total > 0 and not ok
    return ranks, bounds, beyond, {e: False for e in eps}


@dataclass(frozen=True)
class SpectrumSummary:
    """Fit and ranks of one scale's POD spectrum, exact or bounded.

    Attributes:
        fit: the power-law fit (on the resolved eigenvalues).
        effective_rank: eps -> H*(eps) (None: no energy, or beyond the resolved rank).
        saturated: eps -> whether H*(eps) needs every non-zero mode.
        n_nonzero: eigenvalues above the relative floor.
        resolved_rank: R (exact: the non-zero eigenvalues).
        effective_rank_bounds: eps -> [lower, upper] guaranteed bounds ([H, H] when exact).
        beyond_resolved: eps -> whether H*(eps) lies beyond R.
    """

    fit: SpectralFit
    effective_rank: dict[float, int | None]
    saturated: dict[float, bool]
    n_nonzero: int
    resolved_rank: int
    effective_rank_bounds: dict[float, list[int | None]]
    beyond_resolved: dict[float, bool]


def summarise_spectrum(eigenvalues: Tensor, *, lower: Tensor | None, error_bound: float, total: float,
                       k_fit: int, floor: float, eps: tuple[float, ...], resolve_factor: float) -> SpectrumSummary:
    """T_spec and H*(eps) of a POD spectrum: exact (``lower`` None) or known within ``error_bound``.

    Exact eigenvalues: the fit on the leading ``k_fit`` eigenvalues and :func:`effective_rank`.
    Bounded estimates (``lower_k <= lambda_k <= lower_k + error_bound``): the resolved rank R
    counts the estimates of at least ``resolve_factor * error_bound`` (all non-zero ones when the
    bound is 0), the fit uses only those, and :func:`sketch_effective_rank` gives H*(eps) with
    guaranteed bounds.

    Args:
        eigenvalues: (K,) descending.
        lower: (K,) guaranteed lower bounds, or None for exact eigenvalues.
        error_bound: e (0 for exact eigenvalues).
        total: the exact sum of all eigenvalues.
        k_fit, floor, eps: as in :class:`~podmonitor.engine.config.PODConfig`.
        resolve_factor: ``PODConfig.sketch_resolve_factor``.
    """
    lam = eigenvalues
    if lower is None:
        fit = spectral_fit(lam, k_fit, floor)
        er = effective_rank(lam, eps, floor)
        return SpectrumSummary(fit, er.ranks, er.saturated, er.n_nonzero, er.n_nonzero,
                               {e: [r, r] for e, r in er.ranks.items()}, {e: False for e in er.ranks})
    lam1 = float(lam[0]) if lam.numel() else 0.0
    n_nonzero = int((lam > floor * lam1).sum()) if lam1 > 0 else 0
    if error_bound > 0:
        resolved = int((lam >= resolve_factor * error_bound).sum())
    else:  # nothing was shrunk away: the estimates are the exact eigenvalues
        resolved = n_nonzero
    fit = spectral_fit(lam[:resolved], k_fit, floor)
    ranks, bounds, beyond, saturated = sketch_effective_rank(lam.cpu(), lower.cpu(), error_bound, total, eps,
                                                             resolved)
    if error_bound == 0:  # exact: "needs every mode" is decidable
        saturated = {e: r is not None and r >= n_nonzero for e, r in ranks.items()}
    return SpectrumSummary(fit, ranks, saturated, n_nonzero, resolved, bounds, beyond)
