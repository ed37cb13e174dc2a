"""Analytic Morlet wavelet transform along the lag and the scalogram (METHOD.md section 3).

The transform is applied by FFT with the signal zero-padded to 2L::

    psihat_a(f) = sqrt(2 pi a) exp(-(2 pi f a - omega0)^2 / 2)   for f > 0, else 0
    W(a, .)     = IFFT(X * conj(psihat_a))[0:L],  X = FFT(pad(x, 2L)),  f = fftfreq(2L)

It is the same wavelet as pywt's ``cmor2.0-0.7958`` (bandwidth 2, centre frequency
omega0 / 2 pi) up to one constant factor.

The ensemble mean of ``|W|^2`` is a quadratic form of the lag second moment
``R = sum_{s,i} d_{s,i} d_{s,i}^T``: ``S(a, t) = (K_a R K_a^H)[t, t] / n_rows`` with ``K_a`` the
(L, L) matrix of the transform at scale a. The scalogram is therefore accumulated with O(L^2)
state, whatever the number of snapshots.
"""

from __future__ import annotations

import math
import threading
from functools import lru_cache

import torch
from torch import Tensor


def morlet_psihat(scales: Tensor, n_fft: int, omega0: float = 5.0) -> Tensor:
    """Fourier transform of the analytic Morlet at each scale.

    Args:
        scales: (S,) scales a.
        n_fft: FFT length (2L).
        omega0: centre frequency.

    Returns:
        (S, n_fft) real tensor, zero at f <= 0.
    """
    f = torch.fft.fftfreq(n_fft, dtype=scales.dtype, device=scales.device)  # (n_fft,)
    a = scales.unsqueeze(-1)  # (S, 1)
    psi = torch.sqrt(2.0 * math.pi * a) * torch.exp(-0.5 * (2.0 * math.pi * f * a - omega0) ** 2)
    return psi * (f > 0)


def cwt(signals: Tensor, scales: Tensor, omega0: float = 5.0) -> Tensor:
    """Continuous wavelet transform of real signals along their last axis.

    Args:
        signals: (..., L) real signals.
        scales: (S,) scales.

    Returns:
        (..., S, L) complex coefficients W(a, t).
    """
    seq_len = signals.shape[-1]
    n_fft = 2 * seq_len
    spectrum = torch.fft.fft(signals, n=n_fft)  # (..., 2L)
    psi = morlet_psihat(scales.to(signals.real.dtype), n_fft, omega0).to(signals.device)  # (S, 2L)
    coeffs = torch.fft.ifft(spectrum.unsqueeze(-2) * psi, dim=-1)  # conj(psi) = psi (real)
    return coeffs[..., :seq_len]


def cwt_operators(seq_len: int, scales: Tensor, omega0: float) -> Tensor:
    """The (S, L, L) complex matrices K_a with ``W(a, :) = K_a @ x`` for real signals of length L.

    Multiplying by ``conj(psihat)`` and inverting the FFT of length 2L is a circular convolution
    with ``k_a = IFFT(psihat_a)``, so ``K_a[t, tau] = k_a[(t - tau) mod 2L]`` (Toeplitz).
    """
    n_fft = 2 * seq_len
    kernel = torch.fft.ifft(morlet_psihat(scales, n_fft, omega0), dim=-1)  # (S, 2L)
    pos = torch.arange(seq_len, device=scales.device)
    index = (pos.unsqueeze(1) - pos.unsqueeze(0)) % n_fft  # (t, tau)
    return kernel[:, index]


@lru_cache(maxsize=2)
def _rotation_index(m: int) -> Tensor:
    """(M * M,) flat index of entry (f, g) of an (M, M) matrix in the (2M - 1, 2M - 1) array
    indexed by (d + M - 1, u - 2), d = f - g, u = f + g (f, g counted from 1)."""
    f = torch.arange(1, m + 1).unsqueeze(1)
    g = torch.arange(1, m + 1).unsqueeze(0)
    return ((f - g + m - 1) * (2 * m - 1) + (f + g - 2)).reshape(-1)


_ROTATED_LOCK = threading.Lock()  # one user of the kept rotated buffers at a time


@lru_cache(maxsize=1)
def _rotated_buffers(m: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """Two zero (2M - 1)^2 buffers for the real and imaginary rotated Rhat.

    :func:`scalogram_from_moment` writes only the entries at :func:`_rotation_index` (M), the same
    ones at every call, so the others stay zero and the buffers serve the next call without being
    zeroed and faulted in again (at L = 1024 two fresh 33 MB arrays per scalogram before). Kept
    for the last (M, dtype, device): 2 (2L - 3)^2 values (67 MB at L = 1024 in float64) until
    :func:`release_scalogram_buffers` (``PODMonitor`` calls it after each run's analysis).
    """
    n = (2 * m - 1) * (2 * m - 1)
    return torch.zeros(n, dtype=dtype, device=device), torch.zeros(n, dtype=dtype, device=device)


def release_scalogram_buffers() -> None:
    """Free the rotated buffers :func:`scalogram_from_moment` keeps between calls."""
    with _ROTATED_LOCK:
        _rotated_buffers.cache_clear()


def scalogram_from_moment(moment: Tensor, scales: Tensor, omega0: float, n_rows: float) -> Tensor:
    """Ensemble-mean scalogram from the lag second moment.

    With ``X_f`` the FFT (length 2L) of a lag signal, ``|W(a, t)|^2 = (2L)^-2 sum_{f,g} psi_f psi_g
    X_f conj(X_g) exp(2 pi i (f - g) t / 2L)``. Summed over signals, ``X_f conj(X_g)`` becomes
    ``Rhat = F R F^H`` (two FFTs of R, once), and for each scale the double sum is a sum over the
    diagonals ``d = f - g`` of ``psi psi^T * Rhat`` followed by one inverse FFT. The Morlet
    product factorises, ``psi_f psi_g = 2 pi a G_a(f + g) H_a(f - g)``, so the diagonal sums of
    all scales are one (S, 2M - 1) x (2M - 1, 2M - 1) product with a rotated Rhat (M = L - 1
    positive frequencies): O(L^2) per scale instead of the O(L^3) of ``diag(K_a R K_a^H)``.

    Args:
        moment: (L, L) symmetric ``R = sum over signals of d d^T``.
        scales: (S,) scales.
        omega0: Morlet centre frequency.
        n_rows: number of signals the moment sums over (the mean divides by it).

    Returns:
        (S, L) real scalogram ``S(a, t)`` = mean over the signals of ``|W(a, t)|^2``.
    """
    seq_len = moment.shape[-1]
    n_fft = 2 * seq_len
    scales = scales.to(moment.dtype)
    out = moment.new_zeros(len(scales), seq_len)
    if seq_len < 2 or len(scales) == 0:
        return out
    # Rhat[f, g] = sum_{tau, tau'} exp(-2 pi i f tau / 2L) R[tau, tau'] exp(+2 pi i g tau' / 2L),
    # needed only at f, g = 1..L-1: psihat is zero at f <= 0 (fftfreq(2L) index L is -1/2), so
    # the second transform runs on those rows only (each row's transform is the same on its own)
    pos = slice(1, seq_len)
    rows = torch.fft.fft(moment, n=n_fft, dim=0)[pos]  # (M, L), M = L - 1
    rhat = n_fft * torch.fft.ifft(rows, n=n_fft, dim=1)[:, pos]  # (M, M)
    m = seq_len - 1
    # psihat_a(f) psihat_a(g) = 2 pi a G_a(f + g) H_a(f - g) with Gaussians G and H: the sum over
    # each diagonal d = f - g is a sum over u = f + g, i.e. for all scales at once one product
    # G (S, U) @ Q^T (U, D) with Q[d, u] = Rhat[f, g] (a rotation of Rhat), then a scaling by H.
    rotation = _rotation_index(m).to(moment.device)
    a = scales.unsqueeze(1)  # (S, 1)
    u = torch.arange(2, 2 * m + 1, device=moment.device, dtype=moment.dtype)
    d = torch.arange(-(m - 1), m, device=moment.device, dtype=moment.dtype)
    g = torch.exp(-0.25 * (2.0 * math.pi * a * u / n_fft - 2.0 * omega0) ** 2)  # (S, U)
    h = 2.0 * math.pi * a * torch.exp(-0.25 * (2.0 * math.pi * a * d / n_fft) ** 2)  # (S, D)
    with _ROTATED_LOCK:
        q_re, q_im = _rotated_buffers(m, moment.dtype, moment.device)  # zero off the rotation
        q_re[rotation] = rhat.real.reshape(-1)
        q_im[rotation] = rhat.imag.reshape(-1)
        q_re = q_re.view(2 * m - 1, 2 * m - 1)  # (d + m - 1, u - 2)
        q_im = q_im.view(2 * m - 1, 2 * m - 1)
        diag_re = h * (g @ q_re.T)  # (S, D): sum over the diagonal d of psi psi^T * Rhat
        diag_im = h * (g @ q_im.T)
    at = (torch.arange(-(m - 1), m, device=moment.device) % n_fft)
    full_re = moment.new_zeros(len(scales), n_fft).index_copy_(1, at, diag_re)
    full_im = moment.new_zeros(len(scales), n_fft).index_copy_(1, at, diag_im)
    series = torch.fft.ifft(torch.complex(full_re, full_im), dim=-1)[:, :seq_len]  # (S, L)
    out = series.real / n_fft
    return out / max(n_rows, 1.0)


def dominant_scale_indices(energy: Tensor, n_dominant: int, method: str) -> list[int]:
    """Dominant scales of a scale-energy curve E(a).

    Args:
        energy: (S,) E(a) on the scale grid.
        n_dominant: M.
        method: "peaks": local maxima of E ranked by energy (an end of the grid counts when it
            exceeds its one neighbour; on a plateau the first scale counts), at most M and fewer
            if fewer maxima exist. "top": the M scales of largest energy.

    Returns:
        Indices into the grid, strongest first. Empty when E carries no energy.
    """
    e = energy.tolist()
    if not e or max(e) <= 0 or not all(math.isfinite(x) for x in e):
        return []
    if method == "top":
        order = sorted(range(len(e)), key=lambda k: -e[k])
        return [k for k in order if e[k] > 0][:n_dominant]
    if method != "peaks":
        raise ValueError(f"unknown dominant-scale method {method!r}")
    if len(e) == 1:
        return [0]
    last = len(e) - 1
    peaks = []
    for k, x in enumerate(e):
        left_ok = k == 0 or x > e[k - 1]
        if k == 0:
            right_ok = x > e[1]  # an end counts only when it exceeds its one neighbour
        elif k == last:
            right_ok = True
        else:
            right_ok = x >= e[k + 1]  # on a plateau the first scale counts
        if left_ok and right_ok and x > 0:
            peaks.append(k)
    peaks.sort(key=lambda k: -e[k])
    return peaks[:n_dominant]


def scale_centroid(energy: Tensor, scales: Tensor) -> float:
    """Energy-weighted scale centroid ``exp(sum E log a / sum E)``; NaN without energy."""
    total = float(energy.sum())
    if not total > 0:
        return float("nan")
    return float(torch.exp((energy * torch.log(scales)).sum() / total))
