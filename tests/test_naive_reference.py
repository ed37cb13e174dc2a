"""Checks of the naive reference (tests/naive_reference.py) against independent facts.

The naive reference is the oracle of the engine, so it is itself checked here
against things it does not compute: PyWavelets' CWT, the analytic position of
a planted oscillation's scale, and the POD optimality identity.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests import naive_reference as naive

pywt = pytest.importorskip("pywt")

SCALES = 2.0 ** np.linspace(1.0, 6.0, 20)


def _causal_softmax_ensemble(n: int, L: int, seed: int) -> np.ndarray:
    """(n, L, L) random causal attention fields: softmax of Gaussian scores over j <= i."""
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(n, L, L))
    scores = np.where(np.tril(np.ones((L, L), dtype=bool))[None], scores, -np.inf)
    A = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return A / A.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("period", [8.0, 16.0, 32.0])
def test_cwt_matches_pywavelets_on_sinusoid(period: float) -> None:
    L = 1024
    t = np.arange(L)
    x = np.cos(2.0 * np.pi * t / period)
    ours = np.abs(naive.morlet_cwt(x, SCALES))  # (S, L)
    coef, _ = pywt.cwt(x, SCALES, "cmor2.0-0.7958", method="fft")
    theirs = np.abs(coef)  # (S, L)

    centre = slice(320, L - 320)  # away from the edges (> 4 * largest relevant scale)
    profile_ours = ours[:, centre].mean(axis=1)
    profile_theirs = theirs[:, centre].mean(axis=1)
    assert np.argmax(profile_ours) == np.argmax(profile_theirs)

    # On every scale that carries the sinusoid (>= 5% of the peak response) the
    # ratio is one constant along t. Across scales the constants agree with
    # sqrt(2 pi) (the two normalisations) only to a few percent: pywt samples
    # its integrated wavelet coarsely at small scales.
    carrying = profile_ours >= 0.05 * profile_ours.max()
    assert carrying.sum() >= 3
    ratio = ours[carrying][:, centre] / theirs[carrying][:, centre]
    per_scale = ratio.mean(axis=1)
    assert np.all(ratio.std(axis=1) / per_scale < 1e-2)
    np.testing.assert_allclose(per_scale, math.sqrt(2.0 * math.pi), rtol=6e-2)


def test_cwt_of_complex_exponential_is_psihat() -> None:
    """Away from the edges, W(a, t) of exp(i w t) is psihat_a(w / 2 pi) exp(i w t).

    Scales below ~3.5 are left out: there psihat_a is still large at the Nyquist
    frequency, where the FFT truncates it, and the edge of the signal rings.
    """
    L, period = 512, 20.0
    w = 2.0 * np.pi / period
    t = np.arange(L)
    x = np.exp(1j * w * t)
    scales = SCALES[3:12]  # 3.5 .. 15
    W = naive.morlet_cwt(x, scales)  # (9, L)
    expected = np.sqrt(2.0 * np.pi * scales) * np.exp(-((w * scales - 5.0) ** 2) / 2)
    centre = slice(150, L - 150)
    np.testing.assert_allclose(W[:, centre], expected[:, None] * x[None, centre], atol=1e-6)


def test_backward_lag_signal_reads_below_diagonal() -> None:
    L = 6
    A = np.tril(np.arange(L * L, dtype=float).reshape(L, L) + 1.0)
    d = naive.backward_lag_signal(A, 3)
    np.testing.assert_array_equal(d, [A[3, 3], A[3, 2], A[3, 1], A[3, 0], 0.0, 0.0])
    assert naive.backward_lag_signal(A, 0)[1:].sum() == 0.0


def test_planted_lag_oscillation_peaks_at_its_scale() -> None:
    """Fluctuations c_s cos(2 pi tau / P + phi_s) in the lag peak at a ~= omega0 P / (2 pi)."""
    N, L = 8, 128
    rng = np.random.default_rng(1)
    i, j = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
    tau = i - j
    for period in (6.0, 12.0, 24.0):
        amp = rng.normal(size=N)
        phase = rng.uniform(0, 2 * np.pi, size=N)
        fields = amp[:, None, None] * np.cos(2 * np.pi * tau[None] / period + phase[:, None, None])
        fields = np.where(tau[None] >= 0, fields, 0.0)
        scales = naive.default_scales(L)
        S = naive.scalogram(fields - fields.mean(axis=0), scales)
        E = naive.scale_energy(S)
        expected = 5.0 * period / (2.0 * np.pi)
        peak = scales[np.argmax(E)]
        step = scales[1] / scales[0]
        assert expected / step <= peak <= expected * step
        dominant = naive.dominant_scales(scales, E, m=4)
        assert dominant[0] == peak


def test_pod_reconstruction_error_equals_tail_eigenvalues() -> None:
    N, L = 12, 16
    fields = _causal_softmax_ensemble(N, L, seed=2)
    u = fields - fields.mean(axis=0)
    U = naive.filtered_fluctuations(u, scale=4.0)  # (N, L*L)
    lam, modes = naive.pod(U, n_modes=N)
    total = lam.sum()
    # Method of snapshots: the eigenvalues are those of U U^T / N; rank <= N - 1.
    np.testing.assert_allclose(total, np.sum(U**2) / N, rtol=1e-12)
    assert lam[-1] <= 1e-12 * lam[0]
    np.testing.assert_allclose(modes @ modes.T, np.eye(len(modes)), atol=1e-10)
    for K in range(0, len(modes) + 1):
        basis = modes[:K]  # (K, D)
        residual = U - (U @ basis.T) @ basis
        error = np.sum(residual**2) / N
        assert abs(error - lam[K:].sum()) <= 1e-8 * total


def test_lag_filtered_causal_field_is_not_its_diagonal() -> None:
    N, L = 6, 32
    fields = _causal_softmax_ensemble(N, L, seed=3)
    U = naive.filtered_fluctuations(fields - fields.mean(axis=0), scale=8.0).reshape(N, L, L)
    off_diagonal = np.tril(np.ones((L, L)), -1).astype(bool)
    assert np.abs(U[:, off_diagonal]).sum() > 0.5 * np.abs(U).sum()
    assert np.all(U[:, np.triu(np.ones((L, L)), 1).astype(bool)] == 0.0)


def test_spectral_fit_and_effective_rank_on_known_spectra() -> None:
    lam = np.arange(1, 41, dtype=float) ** -2.0
    fit = naive.spectral_fit(lam)
    assert fit["status"] == "ok" and fit["n_fit"] == 30
    assert fit["t_spec"] == pytest.approx(0.5, rel=1e-12)
    assert fit["r2"] == pytest.approx(1.0, abs=1e-12)

    fit = naive.spectral_fit(np.array([1.0, 0.5, 0.0, 0.0]))
    assert fit["status"] == "degenerate" and math.isnan(fit["t_spec"]) and fit["n_fit"] == 2

    lam = np.array([5.0, 3.0, 1.0, 0.5, 0.5, 0.0])  # total 10
    ranks, saturated = naive.effective_rank(lam, (0.10, 0.05, 0.01))
    # tails: K=2 -> 2.0, K=3 -> 1.0, K=4 -> 0.5, K=5 -> 0.0
    assert ranks == {0.10: 3, 0.05: 4, 0.01: 5}
    assert saturated == {0.10: False, 0.05: False, 0.01: True}


def test_dominant_scales_local_maxima_and_top() -> None:
    scales = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    E = np.array([3.0, 1.0, 4.0, 2.0, 2.5, 5.0])
    np.testing.assert_array_equal(naive.dominant_scales(scales, E, m=4), [6.0, 3.0, 1.0])
    np.testing.assert_array_equal(naive.dominant_scales(scales, E, m=2), [6.0, 3.0])
    np.testing.assert_array_equal(
        naive.dominant_scales(scales, E, m=4, selection="top"), [6.0, 3.0, 1.0, 5.0]
    )
    assert naive.scale_centroid(scales, E) == pytest.approx(
        math.exp(np.sum(E * np.log(scales)) / E.sum())
    )


def test_analyze_naive_small_ensemble_is_consistent() -> None:
    N, L = 10, 32
    fields = _causal_softmax_ensemble(N, L, seed=4)
    out = naive.analyze_naive(fields)
    assert out["scalogram"].shape == (len(out["scales"]), L)
    assert 1 <= len(out["dominant_scales"]) <= 4
    for entry in out["per_scale"]:
        lam = entry["eigenvalues"]
        assert lam.shape == (N,) and np.all(np.diff(lam) <= 0) and np.all(lam >= 0)
        assert entry["mode_lag_profiles"].shape[1] == L
    gamma = out["coherency"]
    assert gamma.shape == (L, L)
    assert np.nanmax(gamma) <= 1.0 + 1e-12 and np.nanmin(gamma) >= 0.0
    np.testing.assert_allclose(np.diag(gamma), 1.0, atol=1e-12)
    # Uniform causal attention: distance (i/2 per row), entropy exactly 1.
    uniform = np.tril(np.ones((L, L))) / np.arange(1, L + 1)[:, None]
    assert naive.mean_attention_distance(uniform[None]) == pytest.approx(
        np.mean(np.arange(L) / 2.0)
    )
    assert naive.row_entropy(uniform[None]) == pytest.approx(1.0)
