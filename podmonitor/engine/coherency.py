"""Wavelet cross-coherency of attention rows (METHOD.md section 6).

``gamma_ij(a) = |<W_i(a, i) conj(W_i(a, j))>_s| / sqrt(<|W_i(a, i)|^2>_s <|W_i(a, j)|^2>_s)``
where ``W_i`` is the Morlet CWT of row i of a snapshot as a function of key position and
``<.>_s`` the mean over snapshots. Values lie in [0, 1] (Cauchy-Schwarz).

The transform of all rows is one pair of real matrix products with the (L, L) Toeplitz matrix
K_a of the transform (``W = X K_a^T``); for causal fields row i is zero beyond key i, so a block
of rows only needs the leading columns of X.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .wavelets import cwt, cwt_operators

#: Above this length the transform uses FFTs instead of the Toeplitz matrix product.
FFT_ABOVE = 512


class CoherencyAccumulator:
    """Accumulates the three ensemble sums of the coherency at one scale.

    Args:
        seq_len: L.
        scale: the wavelet scale a.
        omega0: Morlet centre frequency.
        dtype: real dtype of the sums and transforms.
        device: where the sums live.
        causal: rows are zero right of the diagonal (saves work; the result is the same).
    """

    def __init__(self, seq_len: int, scale: float, omega0: float, dtype: torch.dtype,
                 device: torch.device | str | None = None, causal: bool = False) -> None:
        self.seq_len = seq_len
        self.scale = float(scale)
        self.omega0 = float(omega0)
        self.causal = causal
        self._scales = torch.tensor([float(scale)], dtype=dtype, device=device)
        self._complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
        op = cwt_operators(seq_len, self._scales, omega0)[0]
        self._op_re_t = op.real.T.contiguous()  # (L keys, L positions)
        self._op_im_t = op.imag.T.contiguous()
        self.cross_re = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
        self.cross_im = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
        self.power = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)  # sum |W_i(j)|^2
        self.n = 0

    def _transform(self, fields: Tensor) -> tuple[Tensor, Tensor]:
        """(B, L, L) rows -> real and imaginary parts of W_i(a, j), each (B, L, L)."""
        n_snap, seq_len, _ = fields.shape
        if seq_len > FFT_ABOVE:
            # O(L^2 log L) per snapshot beats the O(L^3) matrix product at long lengths
            w = torch.empty(n_snap, seq_len, seq_len, dtype=self._complex_dtype, device=fields.device)
            for s in range(n_snap):
                w[s] = cwt(fields[s], self._scales, self.omega0)[:, 0, :]
            return w.real, w.imag
        if not self.causal:
            rows = fields.reshape(-1, seq_len)
            return ((rows @ self._op_re_t).reshape(fields.shape),
                    (rows @ self._op_im_t).reshape(fields.shape))
        w_re = torch.empty_like(fields)
        w_im = torch.empty_like(fields)
        block = max(1, math.ceil(seq_len / 8))
        for start in range(0, seq_len, block):
            stop = min(seq_len, start + block)
            rows = fields[:, start:stop, :stop].reshape(-1, stop)  # keys beyond stop are zero
            w_re[:, start:stop] = (rows @ self._op_re_t[:stop]).reshape(n_snap, stop - start, seq_len)
            w_im[:, start:stop] = (rows @ self._op_im_t[:stop]).reshape(n_snap, stop - start, seq_len)
        return w_re, w_im

    def update(self, fields: Tensor) -> None:
        """Add snapshots.

        Args:
            fields: (B, L, L) raw attention fields (rows are queries).
        """
        x = fields.to(self.power.dtype)
        w_re, w_im = self._transform(x)
        diag = torch.arange(self.seq_len, device=x.device)
        d_re = w_re[:, diag, diag]  # (B, L): W_i(a, i)
        d_im = w_im[:, diag, diag]
        # W_i(i) conj(W_i(j)) = (d_re w_re + d_im w_im) + 1j (d_im w_re - d_re w_im)
        self.cross_re += torch.einsum("bi,bij->ij", d_re, w_re) + torch.einsum("bi,bij->ij", d_im, w_im)
        self.cross_im += torch.einsum("bi,bij->ij", d_im, w_re) - torch.einsum("bi,bij->ij", d_re, w_im)
        self.power += w_re.square().sum(0) + w_im.square().sum(0)
        self.n += x.shape[0]

    def compute(self) -> Tensor:
        """(L, L) coherency gamma[i, j] in [0, 1]; NaN where a denominator is zero."""
        diag = torch.arange(self.seq_len, device=self.power.device)
        p_diag = self.power[diag, diag]  # (L,)
        denom = torch.sqrt(p_diag.unsqueeze(1) * self.power)
        gamma = torch.hypot(self.cross_re, self.cross_im) / denom
        gamma = torch.where(denom > 0, gamma, torch.full_like(gamma, float("nan")))
        return gamma.clamp(max=1.0)
