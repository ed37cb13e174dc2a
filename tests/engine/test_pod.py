"""Snapshot POD: optimality identity and modred-style invariants, against numpy's SVD."""

from __future__ import annotations

import numpy as np
import torch

import podmonitor.engine.pod as pod_module
from podmonitor import PODConfig, analyze
from podmonitor.engine.lags import lag_window
from podmonitor.engine.pod import mode_lag_profiles, snapshot_pod, weighted_gram
from tests.conftest import random_causal_fields


def literal_filtered_fluctuation(fields: np.ndarray, scale: float) -> np.ndarray:
    """u_s^m(i, j) = w(i - j) (A_s - Abar)(i, j), zero above the diagonal, flattened (N, L*L)."""
    n, seq_len, _ = fields.shape
    u = fields - fields.mean(0)
    i, j = np.meshgrid(np.arange(seq_len), np.arange(seq_len), indexing="ij")
    w = np.where(i >= j, np.exp(-((i - j) ** 2) / (2 * scale**2)), 0.0)
    return (u * w).reshape(n, -1)


def test_pod_identity_and_invariants_on_engine_output():
    fields = random_causal_fields(40, 24, seed=5, temperature=0.5)
    cfg = PODConfig(n_modes=39, n_dominant=2, coherency=False)
    report = analyze(fields, cfg)
    assert report.status == "ok"
    for sc in report.per_scale:
        u = literal_filtered_fluctuation(fields.numpy(), sc.scale)  # (N, P)
        n = u.shape[0]
        lam = sc.eigenvalues.numpy()
        modes = sc.modes.reshape(sc.modes.shape[0], -1).numpy()  # (K, L*L)
        coeffs = sc.coefficients.numpy()  # (N, K)
        # numpy SVD of the literal ensemble as the independent reference
        s = np.linalg.svd(u, compute_uv=False)
        np.testing.assert_allclose(lam[: len(s)], s**2 / n, rtol=1e-9, atol=1e-12 * lam[0])
        # trace identity: sum of eigenvalues = mean squared norm
        assert abs(lam.sum() - (u**2).sum() / n) <= 1e-12 * lam.sum()
        # at most N - 1 non-zero eigenvalues (the mean is removed)
        assert lam[-1] <= 1e-12 * lam[0]
        # orthonormal modes
        np.testing.assert_allclose(modes @ modes.T, np.eye(modes.shape[0]), atol=1e-10)
        # coefficients are projections of the snapshots on the modes
        np.testing.assert_allclose(coeffs, u @ modes.T, rtol=1e-9, atol=1e-12)
        # eigen-equation residual of C = U U^T / N
        c = u @ u.T / n
        v = coeffs / np.sqrt(n * lam[: coeffs.shape[1]])
        resid = np.linalg.norm(c @ v - v * lam[: coeffs.shape[1]], axis=0)
        assert resid.max() < 1e-10 * lam[0]
        # POD optimality identity: error with K modes = tail sum, to 1e-8 relative
        k_max = modes.shape[0]
        for k in (1, 2, 5, 10, k_max):
            recon = coeffs[:, :k] @ modes[:k]
            err = ((u - recon) ** 2).sum() / n
            tail = lam[k:].sum()
            assert abs(err - tail) <= 1e-8 * max(tail, 1e-300) + 1e-13 * lam.sum(), (k, err, tail)


def test_no_other_orthonormal_basis_does_better():
    fields = random_causal_fields(30, 16, seed=6)
    report = analyze(fields, PODConfig(n_modes=10, coherency=False))
    sc = report.per_scale[0]
    u = literal_filtered_fluctuation(fields.numpy(), sc.scale)
    n = u.shape[0]
    rng = np.random.default_rng(0)
    for k in (1, 3, 6):
        tail = sc.eigenvalues[k:].sum().item()
        for _ in range(20):
            # random orthonormal basis, and a perturbation of the POD basis
            q, _ = np.linalg.qr(rng.normal(size=(u.shape[1], k)))
            err = ((u - u @ q @ q.T) ** 2).sum() / n
            assert err >= tail - 1e-12
            pod_basis = sc.modes.reshape(sc.modes.shape[0], -1).numpy()[:k].T
            q2, _ = np.linalg.qr(pod_basis + 0.01 * rng.normal(size=pod_basis.shape))
            err2 = ((u - u @ q2 @ q2.T) ** 2).sum() / n
            assert err2 >= tail - 1e-12


def test_blockwise_gram_equals_direct_product(monkeypatch):
    x = torch.randn(37, 50, dtype=torch.float64)
    center = x.mean(0)
    w = torch.rand(30, dtype=torch.float64)
    y = (x[:, :30] - center[:30]) * w
    direct = y @ y.T
    chunks = [x[:5], x[5:6], x[6:30], x[30:]]
    monkeypatch.setattr(pod_module, "BLOCK_BYTES", 8 * 30 * 7)  # blocks of 7 rows across chunks
    torch.testing.assert_close(weighted_gram(chunks, center, w), direct, rtol=1e-12, atol=1e-12)
    res = snapshot_pod(chunks, center=center, weights=w, n_modes=5)
    u, s, vt = np.linalg.svd(y.numpy(), full_matrices=False)
    np.testing.assert_allclose(res.eigenvalues[:5].numpy(), s[:5] ** 2 / 37, rtol=1e-10)
    np.testing.assert_allclose(np.abs(res.modes.numpy()), np.abs(vt[:5]), atol=1e-9)


def test_mode_lag_profile_is_mean_over_existing_rows():
    seq_len = 6
    from podmonitor.engine.lags import LagBand

    band = LagBand.build(seq_len, seq_len, causal=True)
    field = torch.arange(seq_len * seq_len, dtype=torch.float64).reshape(1, seq_len, seq_len).tril()
    stored = band.extract(field)
    axis, prof = mode_lag_profiles(stored, band.lag, causal=True)
    for tau in range(seq_len):
        lit = np.mean([field[0, i, i - tau].item() for i in range(tau, seq_len)])
        assert abs(prof[0, tau].item() - lit) < 1e-12
    assert axis.tolist() == list(range(seq_len))


def test_lag_window_weights_applied_per_entry_lag():
    # engine eigenvalues at a scale equal those of the literal windowed ensemble (band window)
    fields = random_causal_fields(20, 20, seed=7)
    report = analyze(fields, PODConfig(window="band", coherency=False))
    sc = report.per_scale[0]
    n, seq_len, _ = fields.shape
    i, j = np.meshgrid(np.arange(seq_len), np.arange(seq_len), indexing="ij")
    w = np.where(i >= j, lag_window(torch.from_numpy(i - j), sc.scale, "band").numpy(), 0.0)
    u = ((fields.numpy() - fields.numpy().mean(0)) * w).reshape(n, -1)
    s = np.linalg.svd(u, compute_uv=False)
    np.testing.assert_allclose(sc.eigenvalues[:n].numpy(), s**2 / n, rtol=1e-9, atol=1e-14)


def test_pod_of_short_fields_from_the_covariance_against_numpy_eigh():
    # L = 10: 55 stored entries per snapshot, N = 150 snapshots: the POD is taken on the D x D
    # covariance. Reference: numpy's eigh of the literal covariance U^T U / N of the literal
    # filtered fluctuations (L^2 = 100 entries each, the 45 above the diagonal zero).
    fields = random_causal_fields(150, 10, seed=9, temperature=0.4)
    report = analyze(fields, PODConfig(n_modes=6, n_dominant=2, coherency=False))
    assert report.status == "ok"
    for sc in report.per_scale:
        u = literal_filtered_fluctuation(fields.numpy(), sc.scale)  # (N, 100)
        n = u.shape[0]
        evals, evecs = np.linalg.eigh(u.T @ u / n)
        evals, evecs = evals[::-1], evecs[:, ::-1]
        lam = sc.eigenvalues.numpy()
        assert lam.shape == (n,)
        d = 55  # L (L + 1) / 2 entries carry the window at every scale of L = 10
        np.testing.assert_allclose(lam[:d], evals[:d], rtol=1e-10, atol=1e-13 * evals[0])
        assert np.all(lam[d:] == 0)
        modes = sc.modes.reshape(sc.modes.shape[0], -1).numpy()  # (K, 100)
        np.testing.assert_allclose(np.abs(modes @ evecs[:, :6]), np.eye(6), atol=1e-8)  # same modes, up to sign
        np.testing.assert_allclose(sc.coefficients.numpy(), u @ modes.T, rtol=1e-9, atol=1e-13)
        for k in (1, 3, 6):  # POD optimality identity
            err = ((u - sc.coefficients.numpy()[:, :k] @ modes[:k]) ** 2).sum() / n
            assert abs(err - lam[k:].sum()) <= 1e-9 * lam.sum()
