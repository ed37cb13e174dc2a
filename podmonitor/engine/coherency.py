"""Wavelet cross-coherency of attention rows (METHOD.md section 6).

``gamma_ij(a) = |<W_i(a, i) conj(W_i(a, j))>_s| / sqrt(<|W_i(a, i)|^2>_s <|W_i(a, j)|^2>_s)``
where ``W_i`` is the Morlet CWT of row i of a snapshot as a function of key position and
``<.>_s`` the mean over snapshots. Values lie in [0, 1] (Cauchy-Schwarz).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .wavelets import cwt

#: Target size of the complex transform of one sub-batch (bytes).
SUBBATCH_BYTES = 128 * 2**20


class CoherencyAccumulator:
    """Accumulates the three ensemble sums of the coherency at one scale.

    Args:
        seq_len: L.
        scale: the wavelet scale a.
        omega0: Morlet centre frequency.
        dtype: real dtype of the sums.
        device: where the sums live.
    """

    def __init__(self, seq_len: int, scale: float, omega0: float, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        self.seq_len = seq_len
        self.scale = float(scale)
        self.omega0 = float(omega0)
        self.dtype = dtype
        cdtype = torch.complex128 if dtype == torch.float64 else torch.complex64
        self.cross = torch.zeros(seq_len, seq_len, dtype=cdtype, device=device)  # sum W_i(i) conj W_i(j)
        self.power = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)  # sum |W_i(j)|^2
        self.n = 0

    def update(self, fields: Tensor) -> None:
        """Add snapshots.

        Args:
            fields: (B, L, L) raw attention fields.
        """
        seq_len = self.seq_len
        per_snapshot = seq_len * 2 * seq_len * 16
        sub = max(1, SUBBATCH_BYTES // per_snapshot)
        scales = torch.tensor([self.scale], dtype=self.dtype, device=fields.device)
        diag = torch.arange(seq_len, device=fields.device)
        for start in range(0, fields.shape[0], sub):
            x = fields[start:start + sub].to(self.dtype)
            w = cwt(x, scales, self.omega0)[..., 0, :]  # (b, L rows i, L positions j)
            wd = w[:, diag, diag]  # (b, L): W_i(a, i)
            self.cross += torch.einsum("bi,bij->ij", wd, w.conj())
            self.power += (w.real**2 + w.imag**2).sum(0)
            self.n += x.shape[0]

    def compute(self) -> Tensor:
        """(L, L) coherency gamma[i, j] in [0, 1]; NaN where a denominator is zero."""
        diag = torch.arange(self.seq_len, device=self.power.device)
        p_diag = self.power[diag, diag]  # (L,)
        denom = torch.sqrt(p_diag.unsqueeze(1) * self.power)
        gamma = self.cross.abs() / denom
        gamma = torch.where(denom > 0, gamma, torch.full_like(gamma, float("nan")))
        return gamma.clamp(max=1.0)
