"""Synthetic attention ensembles with planted structure (for tests, the demo and benchmarks).

Everything here is generated from a seed; nothing is downloaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def causal_mask(seq_len: int, device: torch.device | str | None = None) -> Tensor:
    """(L, L) bool, True on and below the diagonal."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()


def lag_matrix(seq_len: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """(L, L) backward lag ``tau = i - j`` of every entry."""
    pos = torch.arange(seq_len, dtype=dtype)
    return pos.unsqueeze(1) - pos.unsqueeze(0)


@dataclass(frozen=True)
class Oscillation:
    """A fluctuation of the lag signal: ``c * cos(2 pi tau / period) * exp(-(tau - lag)^2 / (2 width^2))``.

    ``c`` is drawn from N(0, amplitude^2) per snapshot and per query row (``per_row=True``) or
    per snapshot only, shared by all rows (``per_row=False``: the pattern is then one POD mode).
    """

    period: float
    lag: float
    width: float
    amplitude: float = 1.0
    per_row: bool = True


def oscillation_ensemble(n_snapshots: int, seq_len: int, patterns: list[Oscillation], *,
                         base_level: float = 1.0, seed: int = 0,
                         dtype: torch.dtype = torch.float64) -> Tensor:
    """Causal fields ``A_s = base + sum_p c_{s,i,p} pattern_p(i - j)``, zero above the diagonal.

    The base is the uniform causal attention ``1 / (i + 1)`` times ``base_level``; the fluctuation
    of each row is a random combination of the planted lag patterns, so the scale content of the
    fluctuation is known analytically (a cosine of period P peaks at Morlet scale
    ``a = (omega0 + sqrt(omega0^2 + 2)) / 2 * P / (2 pi)`` for this wavelet normalisation).

    Returns:
        (N, L, L) tensor.
    """
    g = torch.Generator().manual_seed(seed)
    tau = lag_matrix(seq_len, dtype)
    mask = causal_mask(seq_len)
    base = base_level / torch.arange(1, seq_len + 1, dtype=dtype).unsqueeze(1) * mask
    fields = base.expand(n_snapshots, seq_len, seq_len).clone()
    for p in patterns:
        shape = torch.cos(2 * math.pi * tau / p.period) * torch.exp(-((tau - p.lag) ** 2) / (2 * p.width**2))
        shape = shape * mask
        c = torch.randn(n_snapshots, seq_len if p.per_row else 1, 1, generator=g, dtype=dtype) * p.amplitude
        fields += c * shape
    return fields


def prescribed_spectrum_ensemble(n_snapshots: int, seq_len: int, eigenvalues: Tensor, *,
                                 n_lags: int, window: Tensor, seed: int = 0,
                                 base_level: float = 1.0) -> Tensor:
    """Causal ensemble whose windowed fluctuation has exactly the given POD eigenvalues.

    Builds orthonormal spatial modes psi_k supported on lags ``0 .. n_lags - 1`` and orthonormal
    temporal vectors v_k orthogonal to the constant (so the ensemble mean is the base field),
    and sets ``A_s = base + (sum_k sqrt(N lambda_k) v_k(s) psi_k) / w(i - j)``: after centring
    and multiplying by the lag window w, the snapshot correlation matrix is exactly
    ``sum_k lambda_k v_k v_k^T``.

    Args:
        n_snapshots: N (> number of eigenvalues).
        seq_len: L.
        eigenvalues: (K,) the prescribed spectrum.
        n_lags: support of the modes (lags below it).
        window: (n_lags,) the lag window w(tau) the analysis will use (must be > 0).
        seed: RNG seed.
        base_level: scale of the uniform causal mean field.

    Returns:
        (N, L, L) float64 fields.
    """
    n_modes = eigenvalues.numel()
    if n_modes >= n_snapshots:
        raise ValueError("need more snapshots than prescribed eigenvalues")
    g = torch.Generator().manual_seed(seed)
    dt = torch.float64
    tau = lag_matrix(seq_len, dt)
    support = (tau >= 0) & (tau < n_lags)
    n_entries = int(support.sum())
    if n_modes > n_entries:
        raise ValueError("more eigenvalues than entries in the lag support")
    psi, _ = torch.linalg.qr(torch.randn(n_entries, n_modes, generator=g, dtype=dt))  # (P, K)
    # temporal vectors orthonormal and orthogonal to the constant vector
    raw = torch.randn(n_snapshots, n_modes, generator=g, dtype=dt)
    raw = torch.cat([torch.ones(n_snapshots, 1, dtype=dt), raw], dim=1)
    q, _ = torch.linalg.qr(raw)
    v = q[:, 1:]  # (N, K)
    coeffs = v * torch.sqrt(n_snapshots * eigenvalues.to(dt))  # (N, K)
    filtered = coeffs @ psi.T  # (N, P)
    w = window.to(dt)[tau[support].long()]  # (P,)
    fields = torch.zeros(n_snapshots, seq_len, seq_len, dtype=dt)
    fields[:, support] = filtered / w
    base = base_level / torch.arange(1, seq_len + 1, dtype=dt).unsqueeze(1) * causal_mask(seq_len)
    return fields + base


def layered_ensemble(n_layers: int, n_snapshots: int, seq_len: int, seed: int = 0,
                     dtype: torch.dtype = torch.float64) -> list[Tensor]:
    """Softmax attention of a toy causal stack whose preferred scale grows with depth.

    Layer l attends to a Gaussian bump of lags centred near ``2 * 2^l`` with a width that grows
    with depth, plus an oscillating bias of period ``~1.2 * 2^(l + 1)`` whose amplitude and
    phase change from snapshot to snapshot and from row to row, plus random logits: early
    layers carry fine-scale fluctuations, late layers coarse ones, as in trained models.

    Returns:
        n_layers tensors of shape (N, L, L); rows sum to 1, zero above the diagonal.
    """
    g = torch.Generator().manual_seed(seed)
    tau = lag_matrix(seq_len, dtype)
    mask = causal_mask(seq_len)
    out = []
    for layer in range(n_layers):
        scale = 2.0 ** (1 + 4.0 * layer / max(1, n_layers - 1))  # 2 .. 32
        centre = 2.0 * scale
        bump = 3.0 * torch.exp(-((tau - centre) ** 2) / (2 * (0.75 * scale) ** 2))
        period = 1.2 * scale * 2.0
        amp = 1.0 + 0.5 * torch.randn(n_snapshots, seq_len, 1, generator=g, dtype=dtype)
        phase = 2 * math.pi * torch.rand(n_snapshots, 1, 1, generator=g, dtype=dtype)
        osc = amp * torch.cos(2 * math.pi * tau / period + phase)
        noise = 0.3 * torch.randn(n_snapshots, seq_len, seq_len, generator=g, dtype=dtype)
        logits = (bump + osc + noise).masked_fill(~mask, -math.inf)
        out.append(torch.softmax(logits, dim=-1))
    return out
