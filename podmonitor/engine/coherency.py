"""Wavelet cross-coherency of attention rows (METHOD.md section 6).

``gamma_ij(a) = |<W_i(a, i) conj(W_i(a, j))>_s| / sqrt(<|W_i(a, i)|^2>_s <|W_i(a, j)|^2>_s)``
where ``W_i`` is the Morlet CWT of row i of a snapshot as a function of key position and
``<.>_s`` the mean over snapshots. Values lie in [0, 1] (Cauchy-Schwarz).

The transform of all rows is one real matrix product with the (L, 2L) matrix ``[K_a^T re | K_a^T im]``
of the transform (``W = X K_a^T``, K_a Toeplitz); for causal fields row i is zero beyond key i, so
a block of rows only needs the leading columns of X. The power ``sum_s |W_i(j)|^2`` needs every
transform; the cross term is linear in the rows: with ``c_si = W_si(i)`` and
``v_i = sum_s c_si x_si`` (one vector per row), ``sum_s c_si conj(W_si(j)) = (conj(K_a) v_i)_j``,
so it costs one (L, L) product per update instead of a pass over all transforms.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .lags import SUB_BYTES, LagBand
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
        op = cwt_operators(seq_len, self._scales, omega0)[0]  # (t, k) = kernel[(t - k) mod 2L]
        self._op_re_t = op.real.T.contiguous()  # (L keys, L positions)
        self._op_im_t = op.imag.T.contiguous()
        self._ops: dict[object, Tensor] = {}  # operators by width, diagonal indices by block
        self._band_indices: dict[tuple[int, ...], tuple[Tensor, Tensor]] = {}
        # How far right of its last key a row's transform is above REACH_TOL of the kernel's peak.
        kernel = op[:, 0].abs()  # |kernel[d]|, d = t >= 0
        above = torch.nonzero(kernel >= REACH_TOL * kernel.max()).flatten()
        self.reach = int(above.max()) if above.numel() else 0
        self.cross_re = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
        self.cross_im = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
        self.power = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)  # sum |W_i(j)|^2
        self.n = 0

    #: the three (L, L) ensemble sums kept between updates
    SUMS = ("cross_re", "cross_im", "power")

    @classmethod
    def state_bytes(cls, seq_len: int, dtype: torch.dtype) -> int:
        """Bytes of the sums kept between updates (three (L, L) arrays)."""
        return len(cls.SUMS) * seq_len * seq_len * dtype.itemsize

    @staticmethod
    def compute_bytes(seq_len: int, dtype: torch.dtype) -> int:
        """Bytes computing a map from stored snapshots needs: its three sums, the cross vectors and
        their products, the transform operator and one step of transforms (about 10 L^2 values; above
        :data:`FFT_ABOVE` the per-snapshot FFTs of (L, 2L) complex rows take more, about 18 L^2), plus
        three steps of ``SUB_BYTES``. ``benchmarks/bench_engine_parts.py --coherency-memory`` measures it."""
        per_l2 = 10 if seq_len <= FFT_ABOVE else 18
        return per_l2 * seq_len * seq_len * dtype.itemsize + 3 * SUB_BYTES

    def nbytes(self) -> int:
        """Bytes of the sums held now."""
        return sum(getattr(self, name).numel() * getattr(self, name).element_size() for name in self.SUMS)

    def merge(self, other: CoherencyAccumulator) -> None:
        """Add another accumulator's sums (same length and scale)."""
        for name in self.SUMS:
            getattr(self, name).add_(getattr(other, name).to(self.power.device))
        self.n += other.n

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

    def _operator(self, width: int) -> Tensor:
        """(L keys, 2 width): real then imaginary part of the transform at positions < width."""
        op = self._ops.get(width)
        if op is None:
            op = torch.cat([self._op_re_t[:, :width], self._op_im_t[:, :width]], dim=1)
            self._ops[width] = op
        return op

    def _add_block(self, rows: Tensor, start: int, width: int, v_re: Tensor, v_im: Tensor) -> None:
        """Add one block of query rows of a few snapshots.

        Args:
            rows: (B, r, k) rows ``start .. start + r`` of B snapshots, their first k keys (the
                rest is zero).
            start: the first row.
            width: positions computed (the rest carries no signal).
            v_re, v_im: (L, L) running ``v_i = sum_s W_si(i) x_si``, updated in place.
        """
        n_snap, n_rows, n_keys = rows.shape
        flat = rows.reshape(n_snap * n_rows, n_keys)
        w = flat @ self._operator(width)[:n_keys]  # (B r, 2 width): re | im
        key = ("diag", start, n_rows, width)
        at_row = self._ops.get(key)
        if at_row is None:  # W_si(i), real then imaginary part, within a snapshot's block of rows
            local = torch.arange(n_rows, device=rows.device)
            at_row = torch.cat([local * (2 * width) + start + local, local * (2 * width) + width + start + local])
            self._ops[key] = at_row
        c = w.view(n_snap, n_rows * 2 * width)[:, at_row].view(n_snap, 2, n_rows)  # (B, 2, r)
        v = torch.bmm(c.permute(2, 1, 0), rows.transpose(0, 1))  # (r, 2, k): sum_s c_s x_s per row
        v_re[start:start + n_rows, :n_keys] += v[:, 0]
        v_im[start:start + n_rows, :n_keys] += v[:, 1]
        sq = w.square_().view(n_snap, n_rows * 2 * width).sum(0).view(n_rows, 2, width)  # (sum over s first:
        self.power[start:start + n_rows, :width] += sq[:, 0] + sq[:, 1]  # a contiguous reduction)

    def _add_cross(self, v_re: Tensor, v_im: Tensor) -> None:
        """cross += V conj(K)^T, i.e. ``sum_s W_si(i) conj(W_si(j))`` for every (i, j)."""
        if self.seq_len > FFT_ABOVE:  # conj(K v) = conj(cwt(conj(v))), row by row, by FFT
            w = cwt(torch.complex(v_re, -v_im), self._scales, self.omega0)[:, 0, :]
            self.cross_re += w.real
            self.cross_im -= w.imag
            return
        op = self._operator(self.seq_len)  # [Kr^T | Ki^T]
        seq_len = self.seq_len
        a = v_re @ op  # [Vr Kr^T | Vr Ki^T]
        b = v_im @ op  # [Vi Kr^T | Vi Ki^T]
        # V conj(K)^T = (Vr Kr^T + Vi Ki^T) + 1j (Vi Kr^T - Vr Ki^T)
        self.cross_re += a[:, :seq_len] + b[:, seq_len:]
        self.cross_im += b[:, :seq_len] - a[:, seq_len:]

    def _batch_size(self) -> int:
        """Snapshots per step: the transforms of one block of rows stay within ``SUB_BYTES``."""
        rows = self._row_blocks()[0]
        per_snapshot = (rows[1] - rows[0]) * 2 * self.seq_len * self.power.element_size()
        return max(1, 2 * SUB_BYTES // max(1, per_snapshot))

    def update(self, fields: Tensor) -> None:
        """Add snapshots.

        Args:
            fields: (B, L, L) raw attention fields (rows are queries).
        """
        x = fields.to(self.power.dtype)
        v_re = torch.zeros_like(self.power)
        v_im = torch.zeros_like(self.power)
        if self.seq_len > FFT_ABOVE:
            self._add_fft(x, v_re, v_im)
        else:
            step = self._batch_size()
            for start, stop, n_keys, width in self._row_blocks():
                for s0 in range(0, x.shape[0], step):
                    self._add_block(x[s0:s0 + step, start:stop, :n_keys], start, width, v_re, v_im)
        self._add_cross(v_re, v_im)
        self.n += x.shape[0]

    def _add_fft(self, x: Tensor, v_re: Tensor, v_im: Tensor) -> None:
        """Add (B, L, L) snapshots by FFT: O(L^2 log L) per snapshot beats the O(L^3) matrix
        product at long lengths. ``v_re``, ``v_im`` as in :meth:`_add_block`."""
        diag = torch.arange(self.seq_len, device=x.device)
        for s in range(x.shape[0]):
            w = cwt(x[s], self._scales, self.omega0)[:, 0, :]  # (L rows, L positions)
            c = w[diag, diag]  # (L,)
            v_re.addcmul_(c.real.unsqueeze(1), x[s])
            v_im.addcmul_(c.imag.unsqueeze(1), x[s])
            self.power.addcmul_(w.real, w.real).addcmul_(w.imag, w.imag)

    def update_band(self, band: LagBand, entries: Tensor) -> None:
        """Add snapshots stored in lag-band form, without rebuilding the dense fields.

        Args:
            band: the layout of ``entries``.
            entries: (B, P') band entries (a prefix P' of the band; entries beyond it are zero).
        """
        v_re = torch.zeros_like(self.power)
        v_im = torch.zeros_like(self.power)
        if self.seq_len > FFT_ABOVE:
            step = max(1, SUB_BYTES // (self.seq_len * self.seq_len * self.power.element_size()))
            for s0 in range(0, entries.shape[0], step):
                self._add_fft(band.to_dense(entries[s0:s0 + step].to(self.power.dtype)), v_re, v_im)
            self._add_cross(v_re, v_im)
            self.n += entries.shape[0]
            return
        step = self._batch_size()
        dt = self.power.dtype
        for start, stop, n_keys, width in self._row_blocks():
            index, outside = self._band_index(band, entries.shape[1], start, stop, n_keys)
            for s0 in range(0, entries.shape[0], step):
                part = entries[s0:s0 + step]
                rows = torch.gather(part, 1, index.expand(part.shape[0], -1)).to(dt)
                rows.masked_fill_(outside, 0)
                self._add_block(rows.view(part.shape[0], stop - start, n_keys), start, width, v_re, v_im)
        self._add_cross(v_re, v_im)
        self.n += entries.shape[0]

    def _band_index(self, band: LagBand, width: int, start: int, stop: int, n_keys: int) -> tuple[Tensor, Tensor]:
        """Gather index (1, r k) into band entries for rows [start, stop), keys < k, and the mask of
        the (row, key) pairs outside the stored prefix (zero there)."""
        key = (band.seq_len, band.n_lags, band.causal, width, start, stop, n_keys)
        cached = self._band_indices.get(key)
        if cached is not None:
            return cached
        seq_len = self.seq_len
        device = self.power.device
        where = torch.full((seq_len * seq_len,), width, dtype=torch.int64)
        where[band.flat_index[:width]] = torch.arange(width)
        rows = torch.arange(start, stop).unsqueeze(1)
        keys = torch.arange(n_keys).unsqueeze(0)
        pos = where[(rows * seq_len + keys).reshape(-1)]
        outside = pos == width
        out = (pos.masked_fill(outside, 0).unsqueeze(0).to(device), outside.unsqueeze(0).to(device))
        if len(self._band_indices) > 64:
            self._band_indices.clear()
        self._band_indices[key] = out
        return out

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
