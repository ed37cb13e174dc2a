"""Naive numpy reference of scale-selective POD (METHOD.md sections 1-6).

This module is the independent oracle that the optimised engine
(``podmonitor.analyze``) is checked and benchmarked against. It is written the
way the published reference code computes things -- one FFT continuous wavelet
transform per query row per snapshot in a Python loop, the full
``N x L^2`` snapshot matrix, a dense ``N x N`` eigensolve -- but with the
corrected definitions of METHOD.md:

* the lag is the BACKWARD lag ``tau = i - j >= 0`` (never ``A[i, i + tau]``);
* the scalogram is computed for the fluctuations ``u_s = A_s - Abar``;
* dominant scales are local maxima of the scale energy (option ``"top"``
  gives the published top-M choice);
* ``T_spec`` is NaN with status ``"degenerate"`` when fewer than 3 points fit;
* ``H*(eps)`` is the smallest K meeting the tail criterion (not one more).

Keep it literal: every function should read like its formula. Nothing here is
optimised on purpose; speed is the engine's job.

Shapes used below: ``N`` snapshots, ``L`` sequence length, ``S`` scales.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

OMEGA0: float = 5.0
"""Centre angular frequency of the analytic Morlet wavelet."""

EPSILONS: tuple[float, ...] = (0.10, 0.05, 0.01)
"""Energy tolerances for the effective rank H*(eps)."""

REL_FLOOR: float = 1e-12
"""Eigenvalues at or below REL_FLOOR * lambda_1 count as zero."""


def default_scales(seq_len: int, n_scales: int = 20) -> np.ndarray:
    """Default scale grid 2**linspace(1, 6, n_scales), keeping scales <= L/2.

    Args:
        seq_len: sequence length L.
        n_scales: number of log-spaced scales before clipping.

    Returns:
        scales: (S,) float64, ascending.
    """
    scales = 2.0 ** np.linspace(1.0, 6.0, n_scales)
    return scales[scales <= seq_len / 2.0]


# ---------------------------------------------------------------------------
# Section 3: analytic Morlet CWT by FFT
# ---------------------------------------------------------------------------


def morlet_hat(scales: np.ndarray, n_fft: int, omega0: float = OMEGA0) -> np.ndarray:
    """Fourier transform of the scaled analytic Morlet wavelet.

    psihat_a(f) = sqrt(2 pi a) exp(-(2 pi f a - omega0)^2 / 2) for f > 0, else 0,
    with f = np.fft.fftfreq(n_fft) (cycles per sample).

    Args:
        scales: (S,) scales a in samples.
        n_fft: FFT length (2L).
        omega0: centre angular frequency.

    Returns:
        psihat: (S, n_fft) float64.
    """
    f = np.fft.fftfreq(n_fft)  # (n_fft,)
    psihat = np.zeros((len(scales), n_fft))
    for k, a in enumerate(scales):
        psihat[k] = np.sqrt(2.0 * np.pi * a) * np.exp(-((2.0 * np.pi * f * a - omega0) ** 2) / 2.0)
        psihat[k, f <= 0] = 0.0
    return psihat


def morlet_filters(scales: np.ndarray, n_fft: int, omega0: float = OMEGA0) -> np.ndarray:
    """The filter bank conj(psihat_a(f)) that multiplies the signal's FFT.

    Computed once per scale grid and reused for every row (as a filter bank).

    Returns:
        filters: (S, n_fft) complex128.
    """
    return np.conj(morlet_hat(scales, n_fft, omega0)).astype(np.complex128)


def morlet_cwt(
    x: np.ndarray,
    scales: np.ndarray,
    omega0: float = OMEGA0,
    filters: np.ndarray | None = None,
) -> np.ndarray:
    """Analytic Morlet CWT of ONE signal, by FFT with zero padding to 2L.

    W(a, .) = ifft(fft(pad(x, 2L)) * conj(psihat_a))[0:L].

    Args:
        x: (L,) real or complex signal.
        scales: (S,) scales.
        omega0: centre angular frequency.
        filters: optional precomputed (S, 2L) ``morlet_filters(scales, 2L, omega0)``.

    Returns:
        W: (S, L) complex128.
    """
    L = x.shape[0]
    n_fft = 2 * L
    if filters is None:
        filters = morlet_filters(scales, n_fft, omega0)  # (S, 2L)
    x_padded = np.concatenate([x, np.zeros(L, dtype=x.dtype)])  # (2L,)
    X = np.fft.fft(x_padded)  # (2L,)
    W = np.fft.ifft(X[None, :] * filters, axis=1)  # (S, 2L)
    return W[:, :L]


# ---------------------------------------------------------------------------
# Section 2: lag signals
# ---------------------------------------------------------------------------


def backward_lag_signal(field: np.ndarray, i: int) -> np.ndarray:
    """Backward lag signal of row i: d_i(tau) = A[i, i - tau] for 0 <= tau <= i, else 0.

    Args:
        field: (L, L) one snapshot (rows are queries).
        i: query row.

    Returns:
        d: (L,) float64.
    """
    L = field.shape[0]
    d = np.zeros(L)
    d[: i + 1] = field[i, i::-1]  # d[tau] = A[i, i - tau], tau = 0..i
    return d


def forward_lag_signal(field: np.ndarray, i: int) -> np.ndarray:
    """Forward lag signal of row i: d_i(tau) = A[i, i + tau] for 0 <= tau <= L-1-i, else 0.

    Only used for bidirectional (encoder) attention.

    Args:
        field: (L, L) one snapshot.
        i: query row.

    Returns:
        d: (L,) float64.
    """
    L = field.shape[0]
    d = np.zeros(L)
    d[: L - i] = field[i, i:]  # d[tau] = A[i, i + tau], tau = 0..L-1-i
    return d


def lag_signals_of_row(field: np.ndarray, i: int, causal: bool) -> list[np.ndarray]:
    """The one-sided lag signals of row i: [backward] if causal, else [backward, forward]."""
    if causal:
        return [backward_lag_signal(field, i)]
    return [backward_lag_signal(field, i), forward_lag_signal(field, i)]


# ---------------------------------------------------------------------------
# Section 3: scalogram, scale energy, dominant scales
# ---------------------------------------------------------------------------


def scalogram(snapshots: np.ndarray, scales: np.ndarray, causal: bool = True) -> np.ndarray:
    """S(a, tau) = mean over snapshots s and all L rows i of |W[d_i of snapshot s](a, tau)|^2.

    One FFT CWT per row per snapshot (per one-sided lag signal), in a loop.
    For bidirectional fields the backward and forward energies are summed.

    Args:
        snapshots: (N, L, L) fields (fluctuations u_s, or the mean field as N = 1).
        scales: (S,) scales.
        causal: causal (backward lag only) or bidirectional (both halves).

    Returns:
        S: (S, L) float64.
    """
    n_snap, L, _ = snapshots.shape
    filters = morlet_filters(scales, 2 * L)  # (S, 2L)
    S = np.zeros((len(scales), L))
    for s in range(n_snap):
        for i in range(L):
            for d in lag_signals_of_row(snapshots[s], i, causal):
                W = morlet_cwt(d, scales, filters=filters)  # (S, L)
                S += np.abs(W) ** 2
    return S / (n_snap * L)


def scale_energy(S: np.ndarray) -> np.ndarray:
    """E(a) = sum_tau S(a, tau). (S, L) -> (S,)."""
    return S.sum(axis=1)


def dominant_scales(
    scales: np.ndarray, energy: np.ndarray, m: int = 4, selection: str = "local_max"
) -> np.ndarray:
    """Dominant scales, ranked by energy descending.

    ``"local_max"``: interior k with E[k] > E[k-1] and E[k] > E[k+1]; an endpoint
    counts if it exceeds its one neighbour (a single-scale grid is its own
    maximum). At most m, fewer if fewer maxima. ``"top"``: the m most energetic.

    Args:
        scales: (S,) scales.
        energy: (S,) scale energy E(a).
        m: maximum number of dominant scales.
        selection: "local_max" or "top".

    Returns:
        dominant: (<= m,) scales, most energetic first.
    """
    n = len(scales)
    if selection == "top":
        candidates = list(range(n))
    elif selection == "local_max":
        candidates = []
        for k in range(n):
            left_ok = k == 0 or energy[k] > energy[k - 1]
            right_ok = k == n - 1 or energy[k] > energy[k + 1]
            if left_ok and right_ok:
                candidates.append(k)
    else:
        raise ValueError(f"unknown selection {selection!r}")
    # Stable sort: ties keep the smaller scale first.
    ranked = sorted(candidates, key=lambda k: -energy[k])
    return np.array([scales[k] for k in ranked[:m]], dtype=float)


def scale_centroid(scales: np.ndarray, energy: np.ndarray) -> float:
    """Energy-weighted scale centroid exp(sum E log a / sum E)."""
    total = float(np.sum(energy))
    if total <= 0.0:
        return float("nan")
    return float(np.exp(np.sum(energy * np.log(scales)) / total))


# ---------------------------------------------------------------------------
# Section 4: scale-selective filtering and POD
# ---------------------------------------------------------------------------


def lag_window(scale: float, L: int, window: str = "lowpass") -> np.ndarray:
    """Lag window w(tau) for tau = 0..L-1.

    ``"lowpass"``: exp(-tau^2 / (2 a^2)); ``"band"``: exp(-(tau - a)^2 / (2 (a/2)^2)).

    Returns:
        w: (L,) float64.
    """
    tau = np.arange(L, dtype=float)
    if window == "lowpass":
        return np.exp(-(tau**2) / (2.0 * scale**2))
    if window == "band":
        return np.exp(-((tau - scale) ** 2) / (2.0 * (scale / 2.0) ** 2))
    raise ValueError(f"unknown window {window!r}")


def filtered_fluctuations(
    fluctuations: np.ndarray, scale: float, causal: bool = True, window: str = "lowpass"
) -> np.ndarray:
    """Snapshot matrix U of lag-filtered fluctuations, u_s^m(i, j) = w(|i - j|) u_s(i, j).

    For causal fields the entries above the diagonal (j > i) are set to zero.

    Args:
        fluctuations: (N, L, L) u_s = A_s - Abar.
        scale: the dominant scale a*.
        causal: zero the upper triangle.
        window: "lowpass" or "band".

    Returns:
        U: (N, L*L) float64, row s is the flattened filtered fluctuation of snapshot s.
    """
    n_snap, L, _ = fluctuations.shape
    w = lag_window(scale, L, window)  # (L,)
    weight = np.zeros((L, L))
    for i in range(L):
        for j in range(L):
            if causal and j > i:
                continue
            weight[i, j] = w[abs(i - j)]
    U = np.zeros((n_snap, L * L))
    for s in range(n_snap):
        U[s] = (weight * fluctuations[s]).reshape(-1)
    return U


def pod(U: np.ndarray, n_modes: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """POD by the method of snapshots.

    C = U U^T / N; eigenvalues sorted descending, negatives clipped to 0;
    modes phi_k = U^T v_k / sqrt(N lambda_k) for the first n_modes eigenvalues
    with lambda_k > REL_FLOOR * lambda_1.

    Args:
        U: (N, D) snapshot matrix.
        n_modes: maximum number of modes to return.

    Returns:
        eigenvalues: (N,) float64, descending, >= 0.
        modes: (K, D) float64 unit-norm modes, K <= n_modes.
    """
    n_snap = U.shape[0]
    C = U @ U.T / n_snap  # (N, N)
    lam, V = np.linalg.eigh(C)  # ascending
    order = np.argsort(lam)[::-1]
    lam = np.clip(lam[order], 0.0, None)
    V = V[:, order]
    if lam[0] <= 0.0:
        return lam, np.zeros((0, U.shape[1]))
    keep = [k for k in range(min(n_modes, n_snap)) if lam[k] > REL_FLOOR * lam[0]]
    modes = np.zeros((len(keep), U.shape[1]))
    for r, k in enumerate(keep):
        modes[r] = U.T @ V[:, k] / np.sqrt(n_snap * lam[k])
    return lam, modes


def mode_lag_profile(mode: np.ndarray, L: int, causal: bool = True) -> np.ndarray:
    """phi_k(tau) = mean over rows i >= tau of phi_k(i, i - tau), sign-fixed.

    The sign is chosen so that the entry of largest |value| is positive. For
    bidirectional fields the forward entries phi_k(i, i + tau) enter the same mean.

    Args:
        mode: (L*L,) flattened mode.
        L: sequence length.
        causal: causal or bidirectional.

    Returns:
        profile: (L,) float64.
    """
    phi = mode.reshape(L, L)
    profile = np.zeros(L)
    for tau in range(L):
        values = [phi[i, i - tau] for i in range(tau, L)]
        if not causal and tau > 0:
            values += [phi[i - tau, i] for i in range(tau, L)]
        profile[tau] = np.mean(values)
    peak = int(np.argmax(np.abs(profile)))
    if profile[peak] < 0:
        profile = -profile
    return profile


# ---------------------------------------------------------------------------
# Section 5: spectral concentration index and effective rank
# ---------------------------------------------------------------------------


def spectral_fit(eigenvalues: np.ndarray, k_fit: int = 30) -> dict[str, Any]:
    """OLS fit of ln lambda_k on ln k, k = 1..k_fit among lambda_k > REL_FLOOR * lambda_1.

    Args:
        eigenvalues: (N,) descending eigenvalues.
        k_fit: maximum number of leading eigenvalues in the fit.

    Returns:
        dict with t_spec (1/beta), beta (-slope), r2, n_fit, status: "ok",
        "degenerate" (fewer than 3 points; t_spec, beta, r2 are NaN) or "flat"
        (beta <= 0; t_spec is inf).
    """
    lam1 = eigenvalues[0] if len(eigenvalues) else 0.0
    ks, logs = [], []
    for k in range(1, min(k_fit, len(eigenvalues)) + 1):
        if lam1 > 0 and eigenvalues[k - 1] > REL_FLOOR * lam1:
            ks.append(math.log(k))
            logs.append(math.log(eigenvalues[k - 1]))
    n_fit = len(ks)
    if n_fit < 3:
        nan = float("nan")
        return {"t_spec": nan, "beta": nan, "r2": nan, "n_fit": n_fit, "status": "degenerate"}
    x = np.array(ks)
    y = np.array(logs)
    x_mean, y_mean = x.mean(), y.mean()
    slope = float(np.sum((x - x_mean) * (y - y_mean)) / np.sum((x - x_mean) ** 2))
    intercept = y_mean - slope * x_mean
    ss_res = float(np.sum((y - (intercept + slope * x)) ** 2))
    ss_tot = float(np.sum((y - y_mean) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    beta = -slope
    if beta <= 0.0:  # flat spectrum (only possible when all fitted eigenvalues are equal)
        return {"t_spec": float("inf"), "beta": beta, "r2": r2, "n_fit": n_fit, "status": "flat"}
    return {"t_spec": 1.0 / beta, "beta": beta, "r2": r2, "n_fit": n_fit, "status": "ok"}


def effective_rank(
    eigenvalues: np.ndarray, epsilons: tuple[float, ...] = EPSILONS
) -> tuple[dict[float, int], dict[float, bool]]:
    """H*(eps) = smallest K with sum_{k > K} lambda_k <= eps * sum_k lambda_k.

    Saturated when K equals the number of eigenvalues > REL_FLOOR * lambda_1.

    Args:
        eigenvalues: (N,) descending eigenvalues.
        epsilons: tolerances.

    Returns:
        (ranks {eps: K}, saturated {eps: bool}).
    """
    total = float(np.sum(eigenvalues))
    lam1 = eigenvalues[0] if len(eigenvalues) else 0.0
    n_nonzero = int(np.sum(eigenvalues > REL_FLOOR * lam1)) if lam1 > 0 else 0
    ranks: dict[float, int] = {}
    saturated: dict[float, bool] = {}
    for eps in epsilons:
        K = 0
        while float(np.sum(eigenvalues[K:])) > eps * total:
            K += 1
        ranks[eps] = K
        saturated[eps] = K == n_nonzero
    return ranks, saturated


# ---------------------------------------------------------------------------
# Section 2 extras: attention distance and row entropy
# ---------------------------------------------------------------------------


def mean_attention_distance(fields: np.ndarray) -> float:
    """sum_j A[i, j] |i - j|, averaged over rows and snapshots. fields: (N, L, L)."""
    n_snap, L, _ = fields.shape
    keys = np.arange(L, dtype=float)
    total = 0.0
    for s in range(n_snap):
        for i in range(L):
            total += float(np.sum(fields[s, i] * np.abs(i - keys)))
    return total / (n_snap * L)


def row_entropy(fields: np.ndarray, causal: bool = True) -> float:
    """Normalised row entropy -sum_j A_ij ln A_ij / ln(keys of row i).

    Keys of row i: i + 1 (causal) or L (bidirectional). Averaged over rows with
    at least 2 keys and over snapshots; 0 ln 0 = 0.

    Args:
        fields: (N, L, L) raw attention probabilities.
        causal: causal or bidirectional.
    """
    n_snap, L, _ = fields.shape
    values = []
    for s in range(n_snap):
        for i in range(L):
            n_keys = i + 1 if causal else L
            if n_keys < 2:
                continue
            p = fields[s, i, :n_keys]
            p = p[p > 0]  # 0 ln 0 = 0
            h = -float(np.sum(p * np.log(p)))
            values.append(h / math.log(n_keys))
    return float(np.mean(values)) if values else float("nan")


# ---------------------------------------------------------------------------
# Section 6: cross-coherency
# ---------------------------------------------------------------------------


def cross_coherency(fields: np.ndarray, scale: float) -> np.ndarray:
    """gamma[i, j] = |<W_i(a,i) conj W_i(a,j)>_s| / sqrt(<|W_i(a,i)|^2>_s <|W_i(a,j)|^2>_s).

    W_i is the Morlet CWT (same FFT transform as the scalogram) of row i of the
    raw snapshot as a function of key position j. One FFT per row per snapshot.
    NaN where the denominator is 0.

    Args:
        fields: (N, L, L) raw snapshots.
        scale: the scale a (default choice: the top dominant scale).

    Returns:
        gamma: (L, L) float64 in [0, 1] (or NaN).
    """
    n_snap, L, _ = fields.shape
    filters = morlet_filters(np.array([scale]), 2 * L)  # (1, 2L)
    cross = np.zeros((L, L), dtype=complex)  # sum_s W_i(a, i) conj W_i(a, j)
    power = np.zeros((L, L))  # sum_s |W_i(a, j)|^2
    for s in range(n_snap):
        for i in range(L):
            W = morlet_cwt(fields[s, i], np.array([scale]), filters=filters)[0]  # (L,)
            cross[i] += W[i] * np.conj(W)
            power[i] += np.abs(W) ** 2
    cross /= n_snap
    power /= n_snap
    gamma = np.full((L, L), np.nan)
    for i in range(L):
        for j in range(L):
            denom = math.sqrt(power[i, i] * power[i, j])
            if denom > 0:
                gamma[i, j] = abs(cross[i, j]) / denom
    return gamma


# ---------------------------------------------------------------------------
# Everything together
# ---------------------------------------------------------------------------


def analyze_naive(
    fields: np.ndarray,
    scales: np.ndarray | None = None,
    causal: bool = True,
    n_dominant: int = 4,
    selection: str = "local_max",
    window: str = "lowpass",
    n_modes: int = 8,
    k_fit: int = 30,
    epsilons: tuple[float, ...] = EPSILONS,
    with_coherency: bool = True,
    with_field_stats: bool = True,
) -> dict[str, Any]:
    """Scale-selective POD of one layer's attention ensemble, the naive way.

    Args:
        fields: (N, L, L) float64 attention fields (rows are queries; causal
            fields have A[i, j] = 0 for j > i).
        scales: (S,) scale grid; default 2**linspace(1, 6, 20) clipped to <= L/2.
        causal: causal (backward lag) or bidirectional (both halves summed).
        n_dominant: M, the maximum number of dominant scales.
        selection: "local_max" (default) or "top".
        window: lag window, "lowpass" (default) or "band".
        n_modes: number of modes whose lag profiles are returned.
        k_fit: maximum number of eigenvalues in the T_spec fit.
        epsilons: tolerances of the effective rank.
        with_coherency: compute the cross-coherency image (slow part).
        with_field_stats: compute mean attention distance and row entropy.

    Returns:
        dict with scales (S,), scalogram (S, L), mean_scalogram (S, L),
        scale_energy (S,), dominant_scales (<= M,), scale_centroid, per_scale
        (list of dicts: scale, eigenvalues (N,), t_spec, beta, r2, n_fit,
        status, effective_rank {eps: K}, saturated {eps: bool},
        mode_lag_profiles (<= n_modes, L)), mean_attention_distance, entropy,
        coherency (L, L) or None.
    """
    fields = np.asarray(fields, dtype=np.float64)
    n_snap, L, L2 = fields.shape
    if L != L2:
        raise ValueError(f"fields must be (N, L, L), got {fields.shape}")
    if scales is None:
        scales = default_scales(L)
    scales = np.asarray(scales, dtype=float)

    # Section 1: Reynolds decomposition.
    mean_field = fields.mean(axis=0)  # (L, L)
    fluctuations = fields - mean_field[None]  # (N, L, L)

    # Section 3: scalograms, energy, dominant scales.
    S = scalogram(fluctuations, scales, causal)  # (S, L)
    S_mean = scalogram(mean_field[None], scales, causal)  # (S, L)
    E = scale_energy(S)
    dominant = dominant_scales(scales, E, n_dominant, selection)

    # Sections 4-5: per dominant scale, filtered POD and spectrum diagnostics.
    per_scale = []
    for a in dominant:
        U = filtered_fluctuations(fluctuations, a, causal, window)  # (N, L*L)
        lam, modes = pod(U, n_modes)
        fit = spectral_fit(lam, k_fit)
        ranks, saturated = effective_rank(lam, epsilons)
        profiles = np.array([mode_lag_profile(phi, L, causal) for phi in modes]).reshape(-1, L)
        per_scale.append(
            {
                "scale": float(a),
                "eigenvalues": lam,
                **fit,
                "effective_rank": ranks,
                "saturated": saturated,
                "mode_lag_profiles": profiles,
            }
        )

    result: dict[str, Any] = {
        "scales": scales,
        "scalogram": S,
        "mean_scalogram": S_mean,
        "scale_energy": E,
        "dominant_scales": dominant,
        "scale_centroid": scale_centroid(scales, E),
        "per_scale": per_scale,
        "mean_attention_distance": float("nan"),
        "entropy": float("nan"),
        "coherency": None,
    }
    if with_field_stats:
        result["mean_attention_distance"] = mean_attention_distance(fields)
        result["entropy"] = row_entropy(fields, causal)
    if with_coherency and len(dominant) > 0:
        result["coherency"] = cross_coherency(fields, float(dominant[0]))
    return result
