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

#: For causal rows, positions where the wavelet kernel is below this fraction of its peak for
#: every key of the row are not transformed: their coherency is NaN (no signal reaches them).
REACH_TOL = 1e-8


class CoherencyAccumulator:
    """Accumulates the three ensemble sums of the coherency at one scale.

    Args:
        seq_len: L.
        scale: the wavelet scale a.
        omega0: Morlet centre frequency.
        dtype: real dtype of the sums and transforms.
        device: where the sums live.
        causal: rows are zero right of the diagonal: keys beyond a block of rows are skipped, and
            positions more than ``reach`` right of a row (where the kernel is below
            :data:`REACH_TOL` of its peak) are not computed and come out NaN.
    """

    def __init__(self, seq_len: int, scale: float, omega0: float, dtype: torch.dtype,
                 device: torch.device | str | None = None, causal: bool = False) -> None:
        self.seq_len = seq_len
        self.scale = float(scale)
        self.omega0 = float(omega0)
        self.causal = causal
        self._scales = torch.tensor([float(scale)], dtype=dtype, device=device)
        self._complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
        op = cwt_operators(seq_len, self._scales, omega0)[0]  # (t, k) = kernel[(t - k) mod 2L]
        self._op_re_t = op.real.T.contiguous()  # (L keys, L positions)
        self._op_im_t = op.imag.T.contiguous()
        # How far right of its last key a row's transform is above REACH_TOL of the kernel's peak.
        kernel = op[:, 0].abs()  # |kernel[d]|, d = t >= 0
        above = torch.nonzero(kernel >= REACH_TOL * kernel.max()).flatten()
        self.reach = int(above.max()) if above.numel() else 0
        self.cross_re = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
        self.cross_im = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
        self.power = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)  # sum |W_i(j)|^2
        self.n = 0

    def _row_blocks(self) -> list[tuple[int, int, int, int]]:
        """(first row, stop row, keys used, positions computed) for each block of query rows."""
        seq_len = self.seq_len
        if seq_len > FFT_ABOVE:
            return [(0, seq_len, seq_len, seq_len)]
        block = max(1, math.ceil(seq_len / 8))
        out = []
        for start in range(0, seq_len, block):
            stop = min(seq_len, start + block)
            if self.causal:  # keys beyond stop are zero; positions beyond stop + reach carry no signal
                out.append((start, stop, stop, min(seq_len, stop + self.reach)))
            else:
                out.append((start, stop, seq_len, seq_len))
        return out

    def _transform(self, rows: Tensor, n_keys: int, width: int) -> tuple[Tensor, Tensor]:
        """(B, r, L) rows -> real and imaginary parts of W_i(a, j) for j < width, each (B, r, width)."""
        if self.seq_len > FFT_ABOVE:
            # O(L^2 log L) per snapshot beats the O(L^3) matrix product at long lengths
            w = torch.empty(*rows.shape, dtype=self._complex_dtype, device=rows.device)
            for s in range(rows.shape[0]):
                w[s] = cwt(rows[s], self._scales, self.omega0)[:, 0, :]
            return w.real[..., :width], w.imag[..., :width]
        n_snap, n_rows, _ = rows.shape
        flat = rows[..., :n_keys].reshape(-1, n_keys)
        w_re = (flat @ self._op_re_t[:n_keys, :width]).reshape(n_snap, n_rows, width)
        w_im = (flat @ self._op_im_t[:n_keys, :width]).reshape(n_snap, n_rows, width)
        return w_re, w_im

    def update(self, fields: Tensor) -> None:
        """Add snapshots.

        Args:
            fields: (B, L, L) raw attention fields (rows are queries).
        """
        x = fields.to(self.power.dtype)
        for start, stop, n_keys, width in self._row_blocks():
            w_re, w_im = self._transform(x[:, start:stop], n_keys, width)  # (B, r, width)
            rows = torch.arange(stop - start, device=x.device)
            d_re = w_re[:, rows, rows + start]  # (B, r): W_i(a, i)
            d_im = w_im[:, rows, rows + start]
            # W_i(i) conj(W_i(j)) = (d_re w_re + d_im w_im) + 1j (d_im w_re - d_re w_im)
            self.cross_re[start:stop, :width] += (torch.einsum("bi,bij->ij", d_re, w_re)
                                                  + torch.einsum("bi,bij->ij", d_im, w_im))
            self.cross_im[start:stop, :width] += (torch.einsum("bi,bij->ij", d_im, w_re)
                                                  - torch.einsum("bi,bij->ij", d_re, w_im))
            self.power[start:stop, :width] += w_re.square().sum(0) + w_im.square().sum(0)
        self.n += x.shape[0]

    def beyond_reach(self) -> Tensor:
        """(L, L) bool: positions a causal row's transform does not reach (j > i + reach)."""
        pos = torch.arange(self.seq_len, device=self.power.device)
        if not self.causal or self.seq_len > FFT_ABOVE:
            return torch.zeros(self.seq_len, self.seq_len, dtype=torch.bool, device=self.power.device)
        return pos.unsqueeze(0) > pos.unsqueeze(1) + self.reach

    def compute(self) -> Tensor:
        """(L, L) coherency gamma[i, j] in [0, 1]; NaN where a denominator is zero."""
        diag = torch.arange(self.seq_len, device=self.power.device)
        p_diag = self.power[diag, diag]  # (L,)
        denom = torch.sqrt(p_diag.unsqueeze(1) * self.power)
        gamma = torch.hypot(self.cross_re, self.cross_im) / denom
        gamma = torch.where(denom > 0, gamma, torch.full_like(gamma, float("nan")))
        return gamma.clamp(max=1.0).masked_fill(self.beyond_reach(), float("nan"))
