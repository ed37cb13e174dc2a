"""Growth exponent alpha (OLS of ln sigma on ln n) and the prefix grid."""

from __future__ import annotations

import math

import numpy as np
import pytest

from podmonitor.smoothness import growth_exponent, prefix_grid


@pytest.mark.parametrize("alpha", [0.0 + 1e-9, 0.25, 0.5, 1.0])
def test_exact_power_law_is_recovered(alpha: float) -> None:
    lengths = [16, 32, 64, 128, 256]
    fit = growth_exponent(lengths, [3.0 * n**alpha for n in lengths])
    assert fit.alpha == pytest.approx(alpha, abs=1e-9)
    assert fit.log_c == pytest.approx(math.log(3.0), abs=1e-9)
    assert fit.n_points == 5
    if fit.status == "ok":
        assert fit.r2 == pytest.approx(1.0, abs=1e-12)


def test_noisy_fit_matches_numpy_polyfit() -> None:
    rng = np.random.default_rng(0)
    n = np.array([16, 32, 64, 128])
    s = 0.7 * n**0.3 * np.exp(0.05 * rng.standard_normal(4))
    fit = growth_exponent(n.tolist(), s.tolist())
    slope, intercept = np.polyfit(np.log(n), np.log(s), 1)
    resid = np.log(s) - (intercept + slope * np.log(n))
    r2 = 1 - np.sum(resid**2) / np.sum((np.log(s) - np.log(s).mean()) ** 2)
    assert fit.status == "ok"
    assert fit.alpha == pytest.approx(slope, rel=1e-10)
    assert fit.log_c == pytest.approx(intercept, rel=1e-10)
    assert fit.r2 == pytest.approx(r2, rel=1e-10)
    assert 0.0 < fit.r2 < 1.0


def test_too_few_points_are_degenerate_not_made_up() -> None:
    fit = growth_exponent([16, 32], [1.0, 1.2])
    assert fit.status == "degenerate" and math.isnan(fit.alpha) and math.isnan(fit.r2)
    fit = growth_exponent([16, 32, 64], [1.0, float("nan"), 0.0])  # only one usable point
    assert fit.status == "degenerate" and fit.n_points == 1
    assert growth_exponent([16, 16, 16], [1.0, 2.0, 3.0]).status == "degenerate"  # no spread in n
    with pytest.raises(ValueError):
        growth_exponent([16, 32], [1.0])


def test_constant_sigma_has_zero_alpha_and_no_r2() -> None:
    fit = growth_exponent([16, 32, 64], [2.5, 2.5, 2.5])
    assert fit.status == "constant" and fit.alpha == pytest.approx(0.0, abs=1e-12) and math.isnan(fit.r2)


def test_prefix_grid() -> None:
    assert prefix_grid(128) == [16, 32, 64, 128]
    assert prefix_grid(256) == [16, 32, 64, 128, 256]
    assert prefix_grid(100) == [16, 32, 64, 100]
    assert prefix_grid(16) == [16]
    assert prefix_grid(10) == [10]
    assert prefix_grid(64, min_length=8) == [8, 16, 32, 64]
    with pytest.raises(ValueError):
        prefix_grid(0)
