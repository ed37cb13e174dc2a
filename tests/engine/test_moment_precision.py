"""The lag moments of float32 fields are computed with float32 products (``PODConfig.moment_dtype``
None): their error stays inside the rounding-error bound the configuration documents, against a
float64 numpy implementation of the formula; float64 fields, or ``moment_dtype=torch.float64``,
keep the products exact to float64.

The bound: each step rounds its centred signals to float32 (relative error u = 2**-24) and sums K
products in float32, so the moment of the batch differs from the exact one by at most
``(2 u + u**2 + gamma_K (1 + u)**2)`` times the moment of the absolute centred signals,
``gamma_K = K u / (1 - K u)`` (Higham, Accuracy and Stability of Numerical Algorithms, 3.1). The
between-group field of Chan et al.'s combination enters the last products as one more signal.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from podmonitor import PODAccumulator, PODConfig, analyze
from podmonitor.synthetic import layered_ensemble
from tests.conftest import literal_lag_signals, random_causal_fields

U32 = 2.0**-24


def _moment_and_abs(signals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sum_{s,i} d d^T and sum_{s,i} |d| |d|^T of (S, L, L) lag signals D[s, i, tau], in float64."""
    rows = signals.reshape(-1, signals.shape[-1])
    return rows.T @ rows, np.abs(rows).T @ np.abs(rows)


def _literal_moments(batches: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Centred backward lag moment of all fields (exact, float64) and the bound's weight: per batch,
    the absolute moment of the signals about the batch mean, plus that of the between-group field
    sqrt(n_a n_b / n) (mean_b - mean_a) from the second batch on."""
    every = np.concatenate(batches)
    centred = every - every.mean(axis=0)
    exact, _ = _moment_and_abs(literal_lag_signals(centred))
    weight = np.zeros_like(exact)
    n_a, mean_a = 0, None
    for b in batches:
        n_b, mean_b = b.shape[0], b.mean(axis=0)
        weight += _moment_and_abs(literal_lag_signals(b - mean_b))[1]
        if n_a:
            between = math.sqrt(n_a * n_b / (n_a + n_b)) * (mean_b - mean_a)
            weight += _moment_and_abs(literal_lag_signals(between[None]))[1]
            mean_a = (n_a * mean_a + n_b * mean_b) / (n_a + n_b)
        else:
            mean_a = mean_b
        n_a += n_b
    return exact, weight


def _bound(weight: np.ndarray, k: int) -> np.ndarray:
    gamma = k * U32 / (1 - k * U32)
    return (2 * U32 + U32**2 + gamma * (1 + U32) ** 2) * weight


@pytest.mark.parametrize("n_batches", [1, 3])
def test_float32_fields_take_float32_products_within_the_rounding_bound(n_batches):
    seq_len, n = 40, 24
    fields = random_causal_fields(n, seq_len, seed=7, temperature=0.3).float()
    batches = list(fields.chunk(n_batches))
    acc = PODAccumulator(PODConfig())
    for b in batches:
        acc.update(b)
    exact, weight = _literal_moments([b.double().numpy() for b in batches])
    got = acc.m2_back.numpy()
    assert acc.m2_back.dtype == torch.float64
    err = np.abs(got - exact)
    # K: every row of a batch (and the between-group field) may enter one product
    bound = _bound(weight, (n + 1) * seq_len) + 1e-13 * np.abs(exact).max()  # + float64's own slack
    assert np.all(err <= bound), float((err - bound).max())
    # the products did run in float32: the error is of float32's order, not float64's
    assert err.max() > 1e3 * 2.0**-53 * np.abs(exact).max()


def test_float64_products_for_float64_fields_and_on_request():
    seq_len, n = 40, 24
    fields = random_causal_fields(n, seq_len, seed=7, temperature=0.3)
    exact, _ = _literal_moments([fields.numpy()])
    scale = np.abs(exact).max()
    for cfg, given in ((PODConfig(), fields), (PODConfig(moment_dtype=torch.float64), fields.float())):
        acc = PODAccumulator(cfg)
        acc.update(given)
        reference = exact if given.dtype == torch.float64 else _literal_moments([given.double().numpy()])[0]
        np.testing.assert_allclose(acc.m2_back.numpy(), reference, rtol=0, atol=1e-12 * scale)


def test_bidirectional_forward_moment_within_the_rounding_bound():
    seq_len, n = 32, 16
    g = torch.Generator().manual_seed(3)
    fields = torch.softmax(torch.randn(n, seq_len, seq_len, generator=g, dtype=torch.float64) / 0.3, dim=-1)
    acc = PODAccumulator(PODConfig(causal=False))
    acc.update(fields.float())
    centred = fields.float().double().numpy()
    centred = centred - centred.mean(axis=0)
    exact, weight = _moment_and_abs(literal_lag_signals(centred, forward=True))
    err = np.abs(acc.m2_fwd.numpy() - exact)
    assert np.all(err <= _bound(weight, (n + 1) * seq_len) + 1e-13 * np.abs(exact).max())
    assert err.max() > 1e3 * 2.0**-53 * np.abs(exact).max()


def test_float32_products_leave_the_analysis_unchanged():
    """The scales chosen from the scalogram, and so every POD number, are those of exact moments."""
    fields = layered_ensemble(1, 48, 128, seed=2)[0].float()
    fast = analyze(fields, PODConfig(coherency=False))
    exact = analyze(fields, PODConfig(coherency=False, moment_dtype=torch.float64))
    assert fast.dominant_scales == exact.dominant_scales
    assert len(fast.per_scale) == len(exact.per_scale) > 0
    for f, e in zip(fast.per_scale, exact.per_scale, strict=True):
        assert f.scale == e.scale and f.t_spec == e.t_spec
        np.testing.assert_array_equal(f.eigenvalues.numpy(), e.eigenvalues.numpy())
    np.testing.assert_allclose(fast.scale_energy.numpy(), exact.scale_energy.numpy(), rtol=1e-5)
    assert not torch.equal(fast.scale_energy, exact.scale_energy)  # (the products did differ)


def test_moment_dtype_round_trips_and_is_checked():
    cfg = PODConfig(moment_dtype=torch.float32)
    assert PODConfig.from_dict(cfg.to_dict()) == cfg
    assert PODConfig.from_dict(PODConfig().to_dict()).moment_dtype is None
    with pytest.raises(ValueError, match="moment_dtype"):
        PODConfig(moment_dtype=torch.float16)
    assert PODConfig().moment_dtype_for(torch.bfloat16) == torch.float32
    assert PODConfig().moment_dtype_for(torch.float64) == torch.float64
    assert PODConfig(moment_dtype=torch.float64).moment_dtype_for(torch.float32) == torch.float64
