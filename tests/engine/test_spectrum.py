"""T_spec power-law fit and effective rank H*(eps)."""

from __future__ import annotations

import math

import numpy as np
import torch

from podmonitor.engine.spectrum import effective_rank, spectral_fit


def test_spectral_fit_recovers_exact_power_law():
    for beta in (0.5, 1.0, 2.3):
        lam = torch.arange(1, 51, dtype=torch.float64) ** -beta * 7.0
        fit = spectral_fit(lam, k_fit=30)
        assert fit.status == "ok"
        assert abs(fit.beta - beta) < 1e-12
        assert abs(fit.t_spec - 1 / beta) < 1e-12
        assert abs(fit.r2 - 1.0) < 1e-12
        assert fit.n_points == 30


def test_spectral_fit_matches_numpy_polyfit_on_noisy_spectrum():
    rng = np.random.default_rng(0)
    lam = np.sort(np.arange(1, 41) ** -1.3 * np.exp(rng.normal(0, 0.2, 40)))[::-1].copy()
    fit = spectral_fit(torch.from_numpy(lam), k_fit=30)
    x, y = np.log(np.arange(1, 31)), np.log(lam[:30])
    slope, intercept = np.polyfit(x, y, 1)
    r2 = 1 - np.sum((y - (slope * x + intercept)) ** 2) / np.sum((y - y.mean()) ** 2)
    assert abs(fit.beta + slope) < 1e-10
    assert abs(fit.r2 - r2) < 1e-10


def test_spectral_fit_uses_only_eigenvalues_above_floor():
    lam = torch.tensor([1.0, 0.5, 0.25, 0.125, 1e-14, 0.0], dtype=torch.float64)
    fit = spectral_fit(lam, k_fit=30, floor=1e-12)
    assert fit.n_points == 4
    slope = np.polyfit(np.log([1, 2, 3, 4]), np.log([1.0, 0.5, 0.25, 0.125]), 1)[0]
    assert abs(fit.beta + slope) < 1e-12


def test_spectral_fit_degenerate_returns_nan_never_a_fallback():
    for lam in ([1.0, 0.5], [1.0, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0], []):
        fit = spectral_fit(torch.tensor(lam, dtype=torch.float64))
        assert fit.status == "degenerate"
        assert math.isnan(fit.t_spec) and math.isnan(fit.beta)


def test_spectral_fit_flat_spectrum():
    fit = spectral_fit(torch.ones(10, dtype=torch.float64))
    assert fit.status == "flat"
    assert math.isinf(fit.t_spec)


def literal_effective_rank(lam: np.ndarray, eps: float) -> int:
    total = lam.sum()
    for k in range(len(lam) + 1):
        if lam[k:].sum() <= eps * total:
            return k
    return len(lam)


def test_effective_rank_matches_literal_definition():
    rng = np.random.default_rng(1)
    for _ in range(20):
        lam = np.sort(rng.exponential(size=int(rng.integers(1, 40))) ** 3)[::-1].copy()
        er = effective_rank(torch.from_numpy(lam), (0.1, 0.05, 0.01))
        for e in (0.1, 0.05, 0.01):
            assert er.ranks[e] == literal_effective_rank(lam, e)


def test_effective_rank_is_the_minimum_not_one_more():
    # one mode carries everything: H* = 1 (the published code reports 2)
    er = effective_rank(torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    assert er.ranks == {0.1: 1, 0.05: 1, 0.01: 1}
    assert all(er.saturated.values())  # one non-zero mode, and it needs it
    er = effective_rank(torch.tensor([0.9, 0.05, 0.05], dtype=torch.float64))
    assert er.ranks[0.1] == 1 and er.ranks[0.05] == 2 and er.ranks[0.01] == 3
    assert not er.saturated[0.1] and er.saturated[0.01]


def test_effective_rank_without_energy():
    er = effective_rank(torch.zeros(4, dtype=torch.float64))
    assert er.ranks == {0.1: None, 0.05: None, 0.01: None}
    assert er.n_nonzero == 0
