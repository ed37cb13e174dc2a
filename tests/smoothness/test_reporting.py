"""Scalars, layout, pictures and table of the smoothness results."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from podmonitor.reporting.smoothness import (
    smoothness_images,
    smoothness_layout,
    smoothness_markdown,
    smoothness_scalars,
)
from podmonitor.smoothness import AttentionCompanions, LayerSmoothness, growth_exponent


def _result(name: str, with_sigma: bool = True) -> LayerSmoothness:
    r = LayerSmoothness(name=name, kind="gpt", seq_len=64, n_sequences=2, causal=True, prefix_mode="prefix")
    r.companions = AttentionCompanions(entropy=0.8, p_norm=1.7, p_norm_max=2.0, n_heads=2, n_sequences=2, seq_len=64)
    if with_sigma:
        r.lengths = [16, 32, 64]
        r.sigma = [[1.0, 2.0], [1.5, 2.5], [2.0, 3.0]]
        r.sigma_mean = [1.5, 2.0, 2.5]
        r.sigma_max = [2.0, 2.5, 3.0]
        r.n_iter = [5, 3, 3]
        r.converged = [True, True, True]
        r.fit = growth_exponent(r.lengths, r.sigma_mean)
        r.monotone = True
    return r


def test_scalars_are_named_by_metric_then_layer_and_match_the_layout() -> None:
    s = smoothness_scalars(_result("h.0"), "h.0")
    assert s["smooth/sigma_n32/h.0"] == 2.0 and s["smooth/power_iters/h.0"] == 11.0
    # independent reference: the OLS line of ln sigma on ln n (np.polyfit) and its literal R^2
    ln_n, ln_s = np.log([16.0, 32.0, 64.0]), np.log([1.5, 2.0, 2.5])
    slope, intercept = np.polyfit(ln_n, ln_s, 1)
    r2 = 1.0 - np.sum((ln_s - (intercept + slope * ln_n)) ** 2) / np.sum((ln_s - ln_s.mean()) ** 2)
    assert s["smooth/alpha/h.0"] == pytest.approx(slope, rel=1e-12)
    assert s["smooth/alpha_r2/h.0"] == pytest.approx(r2, rel=1e-12)
    assert 0.0 < s["smooth/alpha_r2/h.0"] < 1.0  # three points off a line: a non-trivial R^2
    assert s["smooth/monotone/h.0"] == 1.0 and s["smooth/entropy/h.0"] == 0.8
    layout = smoothness_layout([16, 32, 64])
    patterns = [p for chart in layout["podmonitor smoothness"].values() for p in chart[1]]
    for tag in s:  # every tag lands on one chart
        assert sum(bool(re.search(p, tag)) for p in patterns) == 1, tag
    companions_only = smoothness_scalars(_result("h.1", with_sigma=False), "h.1")
    assert set(companions_only) == {"smooth/entropy/h.1", "smooth/p_norm/h.1", "smooth/p_norm_max/h.1"}


def test_degenerate_fit_logs_nan_not_a_number_made_up() -> None:
    r = _result("h.0")
    r.fit = growth_exponent([16, 32], [1.0, 2.0])
    s = smoothness_scalars(r, "h.0")
    assert math.isnan(s["smooth/alpha/h.0"]) and math.isnan(s["smooth/alpha_r2/h.0"])


def test_images_and_table() -> None:
    results = {"h.0": _result("h.0"), "h.1": _result("h.1", with_sigma=False)}
    images = smoothness_images(results)
    assert set(images) == {"smooth/sigma_vs_n_layers", "smooth/sigma_vs_n/h.0"}
    for img in images.values():
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
    table = smoothness_markdown(results, step=7)
    assert "at step 7" in table and table.count("\n| h.") == 2 and "σ(64)" in table
    assert smoothness_images({"h.1": _result("h.1", with_sigma=False)}) == {}
