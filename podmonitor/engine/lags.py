"""Lag signals of attention fields (METHOD.md section 2) and the lag-band storage layout.

The lag is the BACKWARD lag ``tau = i - j >= 0``: how far back query ``i`` looks. The lag signal
of row ``i`` is ``d_i(tau) = A[i, i - tau]`` for ``0 <= tau <= i`` and 0 otherwise. (Reading
``A[i, i + tau]`` instead, as the published code does, reads the all-zero masked triangle of a
causal matrix.) Bidirectional fields add the forward half ``A[i, i + tau]`` as a second
one-sided signal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from ..hugepages import scratch


@lru_cache(maxsize=16)
def _lag_gather_index(seq_len: int, forward: bool, upper_is_zero: bool) -> tuple[Tensor, Tensor | None]:
    """Flat gather index and validity mask mapping (i, tau) -> (i, i -/+ tau).

    Returns:
        index: (L * L,) int64 flat indices into an (L, L) matrix, row-major over (i, tau).
        invalid: (L * L,) bool, True where the lag leaves the matrix; None when those entries
            already point at a zero (``upper_is_zero``: backward lags of a causal field read
            the strict upper triangle ``(i, L - 1)`` instead, which is zero).
    """
    i = torch.arange(seq_len).unsqueeze(1)  # (L, 1)
    tau = torch.arange(seq_len).unsqueeze(0)  # (1, L)
    j = i + tau if forward else i - tau  # (L, L)
    invalid = (j < 0) | (j >= seq_len)
    if upper_is_zero and not forward:
        j = torch.where(invalid, torch.full_like(j, seq_len - 1), j)  # invalid only for i < tau <= L-1
        return (i * seq_len + j).reshape(-1), None
    j = j.clamp(0, seq_len - 1)
    return (i * seq_len + j).reshape(-1), invalid.reshape(-1)


def lag_signals(fields: Tensor, *, forward: bool = False, upper_is_zero: bool = False) -> Tensor:
    """Backward (default) or forward lag signals of every row.

    Args:
        fields: (..., L, L) attention fields, rows are queries.
        forward: read ``A[i, i + tau]`` (the forward half of a bidirectional field) instead of
            the backward lag ``A[i, i - tau]``.
        upper_is_zero: the caller guarantees that nothing lies above the diagonal (a causal
            field); saves one pass over the data.

    Returns:
        (..., L, L) tensor ``D`` with ``D[..., i, tau] = A[..., i, i - tau]`` (zero where the lag
        leaves the matrix).
    """
    seq_len = fields.shape[-1]
    index, invalid = _lag_gather_index(seq_len, forward, upper_is_zero)
    flat = fields.reshape(*fields.shape[:-2], seq_len * seq_len)
    out = flat[..., index.to(fields.device)]
    if invalid is not None:
        out.masked_fill_(invalid.to(fields.device), 0)
    return out.reshape(fields.shape)


@lru_cache(maxsize=16)
def _upper_index(seq_len: int) -> Tensor:
    """(L (L - 1) / 2,) flat indices of the strict upper triangle of an (L, L) matrix."""
    rows, cols = torch.triu_indices(seq_len, seq_len, offset=1)
    return rows * seq_len + cols


#: Size of the temporaries of one step of the chunked passes below (bytes).
SUB_BYTES = 4 * 2**20

#: From this length on, the causality check and the causal entropy read fields in row blocks
#: (views of the lower or upper part only); below it, one pass over contiguous memory is faster
#: (measured on 2 cores: at L = 1024 the blocks save about 1 ms per field, at L <= 512 they cost).
BLOCKS_FROM = 768


def max_above_diagonal(fields: Tensor, n_blocks: int = 16) -> float:
    """Largest magnitude above the diagonal of (B, L, L) fields (0.0 for a causal field; NaN if a
    NaN lies above the diagonal).

    Works through the batch a few fields at a time (also for non-contiguous fields). Below
    :data:`BLOCKS_FROM` it gathers the strict upper triangle; from there on it reads it in
    ``n_blocks`` row blocks without copying: right of the diagonal square of block [r0, r1) lies
    the rectangle of rows r0..r1 and keys r1..L (a strided view), and only the diagonal squares
    are masked (copies of (L / n_blocks)^2 entries per field, so that many fields share a step).
    """
    seq_len = fields.shape[-1]
    if seq_len < 2 or fields.shape[0] == 0:
        return 0.0
    if seq_len < BLOCKS_FROM:
        return _max_above_diagonal_gathered(fields)
    edges = _panel_edges(seq_len, max(1, min(n_blocks, seq_len)))
    square = max(b - a for a, b in zip(edges, edges[1:], strict=False))
    step = max(1, SUB_BYTES // (square * square * fields.element_size()))
    peaks = []
    for start in range(0, fields.shape[0], step):
        part = fields[start:start + step]
        for r0, r1 in zip(edges, edges[1:], strict=False):
            if r1 <= r0:
                continue
            blocks = [torch.triu(part[:, r0:r1, r0:r1], 1)]  # the diagonal square's strict upper triangle
            if r1 < seq_len:
                blocks.append(part[:, r0:r1, r1:])
            for block in blocks:
                lo, hi = torch.aminmax(block)
                peaks.append(torch.maximum(lo.abs(), hi.abs()))  # (NaN propagates)
    peak = float(torch.stack(peaks).max())
    return math.nan if math.isnan(peak) else max(0.0, peak)


def _max_above_diagonal_gathered(fields: Tensor) -> float:
    """:func:`max_above_diagonal` by a gather of the strict upper triangle (short fields)."""
    seq_len = fields.shape[-1]
    index = _upper_index(seq_len).to(fields.device)
    step = max(1, SUB_BYTES // (index.numel() * fields.element_size()))
    out = 0.0
    for start in range(0, fields.shape[0], step):
        part = fields[start:start + step].reshape(-1, seq_len * seq_len)
        lo, hi = torch.aminmax(torch.gather(part, 1, index.unsqueeze(0).expand(part.shape[0], -1)))
        lo_f, hi_f = float(lo), float(hi)
        if math.isnan(lo_f) or math.isnan(hi_f):
            return math.nan
        out = max(out, abs(lo_f), abs(hi_f))
    return out


def _panel_edges(seq_len: int, n_panels: int) -> list[int]:
    """Lag edges of the column panels: panel p holds the lags in [edges[p], edges[p + 1])."""
    return [p * seq_len // n_panels for p in range(n_panels + 1)]


def lower_row_blocks(seq_len: int, causal: bool, n_blocks: int = 8) -> list[tuple[int, int]]:
    """Row blocks ``(r0, r1)`` whose rectangles ``[r0:r1, :r1]`` cover every entry a pass over a
    field must read: for causal fields from L = :data:`BLOCKS_FROM` on, the lower triangle in
    ``n_blocks`` blocks (about (n + 1) / 2n of the entries, 56 % for 8); else the whole field,
    ``[(0, L)]``."""
    if not causal or seq_len < BLOCKS_FROM:
        return [(0, seq_len)]
    edges = _panel_edges(seq_len, min(n_blocks, seq_len))
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]


#: Lags per column panel of the moment products that :meth:`LagShear.panels_for` aims at.
PANEL_WIDTH = 64


class LagShear:
    """Reusable workspace holding b fields in sheared layout, for lag moments without a gather.

    ``buf[i, s, L - 1 + j - i] = A_s[i, j]``: in row (i, s), column ``L - 1 - tau`` holds the
    backward lag signal ``d_{s,i}(tau) = A_s[i, i - tau]`` and column ``L - 1 + t`` the forward
    signal ``A_s[i, i + t]``; entries outside the field fall in padding that is zeroed once (a
    field slot when it is first loaded) and never written, so loading a batch is one strided copy
    (no index gather, no allocation).
    Rows ``i`` of all b fields are adjacent, so the rows ``i >= i0`` of the batch are one matrix.

    Moments use the triangular support of lag signals (row ``i`` has backward lags ``<= i``) in
    column panels: panel ``[c0, c1)`` of lags only meets rows ``i >= c0`` and lags ``< c1``, so
    about L^3 / 5 multiply-adds per field (see :meth:`panels_for`; the exact triangle is L^3 / 6)
    instead of L^3 for ``D^T D`` (the lower block triangle
    is computed and mirrored; each panel is one (panel x lags) product, the fast orientation).

    Args:
        seq_len: L.
        batch: b, the most fields loaded at once.
        dtype, device: of the workspace.
        n_panels: column panels of the moment products (default :meth:`panels_for`).
    """

    def __init__(self, seq_len: int, batch: int, dtype: torch.dtype, device: torch.device,
                 n_panels: int | None = None) -> None:
        n_panels = self.panels_for(seq_len) if n_panels is None else n_panels
        self.seq_len = seq_len
        self.batch = batch
        # 2L - 1 columns hold the lags; one spare zero column plus one cache line of padding keeps
        # the rows aligned without a row stride of a multiple of 4 KiB, which maps a panel's rows
        # onto the same cache sets (about 1.3x slower products at L = 256 in float64)
        self.width = self.row_width(seq_len, dtype)
        self.buf = scratch((seq_len, batch, self.width), dtype, device)
        self.loaded = 0
        self.zeroed = 0  # field slots [0, zeroed) hold zero padding (the rest is not read before)
        self.n_panels = max(1, min(n_panels, seq_len))
        self._staging: tuple[Tensor, Tensor] | None = None  # (see _add_product)

    @staticmethod
    def panels_for(seq_len: int) -> int:
        """The default number of column panels: ``L / PANEL_WIDTH`` within [8, 16].

        With p panels the products take ``sum_k (k + 1)(p - k) / p^3`` L^3 multiply-adds per field
        (0.234 L^3 for 8, 0.199 L^3 for 16, against the L^3 / 6 of the exact triangle): more
        panels waste less on the diagonal blocks, until the panels get too narrow for fast
        products. ``bench_engine_parts.py --compare`` on 2 cores, updates of N = 150 fields at
        L = 1024: 16 panels 1.745 s against 1.860 s for 8 (float64 fields), 1.165 s against 1.295 s
        (float32). Up to L = 575 it is 8, as before; in a one-off trial (not kept) 16 panels were no
        faster at L = 256 and 512, and 32 no faster at L = 1024.
        """
        return max(8, min(16, seq_len // PANEL_WIDTH))

    @staticmethod
    def row_width(seq_len: int, dtype: torch.dtype) -> int:
        """Entries per row and field of the workspace: 2L - 1 lags and padding (see ``__init__``)."""
        return 2 * seq_len + 64 // dtype.itemsize

    def load(self, fields: Tensor, subtract: Tensor | None = None, scratch: Tensor | None = None,
             blocks: list[tuple[int, int]] | None = None, at: int = 0) -> None:
        """Write (b', L, L) fields (minus an (L, L) field, e.g. the mean) into the buffer, from field
        slot ``at`` on (``at + b' <= b``); the moments then cover slots ``0 .. at + b' - 1``.

        ``at = 0`` replaces what was loaded; ``at = self.loaded`` appends, so that the fields of
        several small steps enter the same products (larger products are faster: at L = 1024 on 2
        cores about 20 % per field for 4 fields against 1). The products read the loaded rows as
        one matrix without a copy when every slot is loaded (``loaded == b``); otherwise they copy
        them first.

        ``scratch``: a (b', L, L) buffer (may be ``fields`` itself, which is then overwritten) for
        the difference in the dtype of the operands before its rounding to the buffer's dtype: the
        same values as one mixed-dtype subtraction, several times faster on CPU.
        ``blocks``: read and write only the rectangles ``[r0:r1, :r1]`` of these row blocks (see
        :func:`lower_row_blocks`; default: the whole field). For causal fields (zero above the
        diagonal, also ``subtract``) these hold every backward lag; the forward columns of the
        buffer are then left as they are (the backward moments never read them).
        """
        n, seq_len, width = fields.shape[0], self.seq_len, self.width
        if not 0 <= at <= self.batch - n:
            raise ValueError(f"LagShear holds at most {self.batch} fields, got {n} from slot {at}")
        if at + n > self.zeroed:  # (slots are zeroed as they are first used: a batch of a few
            self.buf[:, self.zeroed:at + n].zero_()  # fields does not zero the whole workspace)
            self.zeroed = at + n
        view = self.buf.as_strided((n, seq_len, seq_len), (width, self.batch * width - 1, 1),
                                   self.buf.storage_offset() + seq_len - 1 + at * width)
        for r0, r1 in blocks if blocks is not None else [(0, seq_len)]:
            into, given = view[:, r0:r1, :r1], fields[:, r0:r1, :r1]
            if subtract is None:
                into.copy_(given)
            elif scratch is not None and scratch.dtype != view.dtype:
                into.copy_(torch.sub(given, subtract[r0:r1, :r1], out=scratch[:, r0:r1, :r1]))
            else:
                torch.sub(given, subtract[r0:r1, :r1], out=into)
        self.loaded = at + n

    def _rows(self, first: int, stop: int, cols: slice) -> Tensor:
        """Rows i in [first, stop) of the loaded fields, columns ``cols``, as one (rows, k) matrix."""
        block = self.buf[first:stop, :self.loaded, cols]
        return block.reshape(-1, block.shape[-1])

    def _bounds(self) -> list[tuple[int, int]]:
        edges = _panel_edges(self.seq_len, self.n_panels)
        return [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]

    def add_backward_moment(self, out: Tensor) -> None:
        """Accumulate the backward lag moment of the loaded fields into ``out`` (L, L).

        ``out`` receives the lower panel triangle in reversed-lag order (index ``L - 1 - tau``);
        :meth:`finish` turns it into the symmetric moment ``R[tau, tau']``. ``out`` may have a
        wider dtype than the workspace (see :meth:`_add_product`).
        """
        seq_len = self.seq_len
        for c0, c1 in self._bounds():
            x = self._rows(c0, seq_len, slice(seq_len - c1, seq_len))  # lags < c1, reversed
            self._add_product(out[seq_len - c1:seq_len - c0, seq_len - c1:], x[:, :c1 - c0].T, x)

    def add_forward_moment(self, out: Tensor) -> None:
        """Accumulate the forward lag moment (lower panel triangle, lag order) into ``out`` (L, L)."""
        seq_len = self.seq_len
        for c0, c1 in self._bounds():
            x = self._rows(0, seq_len - c0, slice(seq_len - 1, seq_len - 1 + c1))  # lags < c1
            self._add_product(out[c0:c1, :c1], x[:, c0:c1].T, x)

    def _add_product(self, target: Tensor, a: Tensor, b: Tensor) -> None:
        """``target += a @ b``, the product in the workspace's dtype.

        A target of a wider dtype (float64 moments of float32 products) receives each product
        rounded once: formed in a staging buffer, widened exactly, then added (the same values as
        a mixed-dtype addition of the product, without its slow conversion loop).
        """
        if target.dtype == self.buf.dtype:
            target.addmm_(a, b)
            return
        shape = (a.shape[0], b.shape[1])
        size = shape[0] * shape[1]
        if self._staging is None or self._staging[1].dtype != target.dtype or self._staging[0].numel() < size:
            # the largest panel: (L / n_panels + 1) x L entries
            most = max(size, (self.seq_len // self.n_panels + 1) * self.seq_len)
            self._staging = (self.buf.new_empty(most), target.new_empty(most))
        narrow, wide = self._staging
        product = torch.mm(a, b, out=narrow[:size].view(shape))
        target += wide[:size].view(shape).copy_(product)

    def finish(self, partial: Tensor, backward: bool) -> Tensor:
        """The symmetric (L, L) moment from an accumulated lower panel triangle (a new tensor).

        Every entry whose row-lag panel is at most its column-lag panel (the upper panel blocks
        and the diagonal ones) is taken from the transposed entry, panel by panel in place in one
        copy: the values of ``torch.where(panel mask, moment.T, moment)`` without a pass that
        reads the whole matrix transposed.
        """
        moment = partial.flip(0, 1) if backward else partial.clone()
        edges = _panel_edges(self.seq_len, self.n_panels)
        for a, b in zip(edges, edges[1:], strict=False):
            if b > a:
                moment[a:b, b:].copy_(moment[b:, a:b].T)  # (reads the strict lower blocks only)
                moment[a:b, a:b].copy_(moment[a:b, a:b].T.clone())
        return moment


def lag_moment(signals: Tensor, *, n_blocks: int = 8) -> Tensor:
    """Second moment ``R = sum_{s, i} d_{s,i} d_{s,i}^T`` of one-sided lag signals.

    Uses the triangular support of backward lag signals (row ``i`` is zero beyond lag ``i``): row
    block ``r`` only touches the leading ``k_r x k_r`` corner of R, which saves about 60% of the
    flops of one dense ``D^T D``.

    Args:
        signals: (B, L, L) lag signals ``D[s, i, tau]`` with ``D[s, i, tau] = 0`` for ``tau > i``
            (backward signals; pass forward signals with their rows reversed).

    Returns:
        (L, L) symmetric moment matrix in the dtype of ``signals``.
    """
    n_snap, seq_len, _ = signals.shape
    out = signals.new_zeros(seq_len, seq_len)
    block = max(1, math.ceil(seq_len / n_blocks))
    for start in range(0, seq_len, block):
        stop = min(seq_len, start + block)
        rows = signals[:, start:stop, :stop].reshape(-1, stop)  # (B * rows, k)
        out[:stop, :stop].addmm_(rows.T, rows)
    return out


#: Rows of a band gather per field (see :meth:`LagBand.gather_into`).
GATHER_CHUNKS = 16


@dataclass(frozen=True)
class LagBand:
    """Lag-major layout of the entries of an (L, L) field whose lag ``|i - j|`` is below ``n_lags``.

    Entries are ordered by lag: all entries of lag 0 (the diagonal), then lag 1 (backward
    ``(i, i - 1)``, then forward ``(i, i + 1)`` for bidirectional fields), and so on. Restricting
    to lags below ``T <= n_lags`` is therefore the contiguous prefix ``[:offsets[T]]``.

    Attributes:
        seq_len: L.
        n_lags: number of stored lags (lags 0 .. n_lags - 1).
        causal: whether only backward lags are stored.
        flat_index: (P,) int64 indices into a flattened (L * L) field.
        rows, cols: (P,) int64 query and key positions of each stored entry.
        lag: (P,) int64 signed lag ``i - j`` of each entry.
        offsets: (n_lags + 1,) int64, entries with ``|lag| < T`` are ``[:offsets[T]]``.
    """

    seq_len: int
    n_lags: int
    causal: bool
    flat_index: Tensor
    rows: Tensor
    cols: Tensor
    lag: Tensor
    offsets: Tensor

    @property
    def size(self) -> int:
        """P, the number of stored entries per snapshot."""
        return int(self.flat_index.numel())

    def prefix(self, n_lags: int) -> int:
        """Number of leading entries whose lag magnitude is below ``n_lags``."""
        return int(self.offsets[min(max(n_lags, 0), self.n_lags)])

    def extract(self, fields: Tensor) -> Tensor:
        """(B, L, L) fields -> (B, P) band entries."""
        flat = fields.reshape(fields.shape[0], -1)
        return flat[:, self.flat_index.to(fields.device)]

    def to_dense(self, band: Tensor) -> Tensor:
        """(B, P') band entries (any prefix P' <= P) -> (B, L, L) fields, zero off the band."""
        n_snap, width = band.shape
        out = band.new_zeros(n_snap, self.seq_len * self.seq_len)
        out[:, self.flat_index[:width].to(band.device)] = band
        return out.reshape(n_snap, self.seq_len, self.seq_len)

    def gather_into(self, flat: Tensor, out: Tensor, index: Tensor | None = None) -> Tensor:
        """The band entries of (b, L * L) flattened fields into ``out`` (b, P), in its dtype.

        A gather of one row runs on one thread (its rows are its unit of work), and at long
        contexts an update hands over one field at a time: a single field's entries are gathered
        as ``GATHER_CHUNKS`` rows of a few thousand (the same values; at L = 1024 on 2 cores about
        twice as fast). Several fields are gathered as they are (there the chunks were slower).

        Args:
            flat: (b, L * L) fields, rows flattened.
            out: (b, P) destination with contiguous rows.
            index: :attr:`flat_index` already on the fields' device (default: moved here).
        """
        index = self.flat_index.to(flat.device) if index is None else index
        n, size = flat.shape[0], index.numel()
        chunks = max(1, min(GATHER_CHUNKS, size // 4096)) if n == 1 else 1
        width = size // chunks
        main = chunks * width
        parts = [(0, main, chunks, width)] + ([(main, size, 1, size - main)] if main < size else [])
        for lo, hi, c, w in parts:
            idx = index[lo:hi].view(1, c, w).expand(n, c, w)
            src = flat.unsqueeze(1).expand(n, c, flat.shape[1])
            if out.dtype == flat.dtype:
                torch.gather(src, 2, idx, out=out[:, lo:hi].view(n, c, w))
            else:
                out[:, lo:hi].view(n, c, w).copy_(torch.gather(src, 2, idx))
        return out

    @staticmethod
    def build(seq_len: int, n_lags: int, causal: bool) -> LagBand:
        """The band of lags ``0 .. n_lags - 1`` (clamped to [1, L]) of an (L, L) field.

        Built once per layout and shared by every accumulator of that layout (:func:`_build_band`,
        cached): its tensors are read-only.
        """
        return _build_band(seq_len, max(1, min(int(n_lags), seq_len)), bool(causal))


@lru_cache(maxsize=4)
def _build_band(seq_len: int, n_lags: int, causal: bool) -> LagBand:
    """:meth:`LagBand.build` without a Python loop over the lags.

    The entries come in segments, in order: lag 0; then for each lag tau >= 1 the backward
    entries ``(i, i - tau)``, i = tau .. L - 1, and (bidirectional fields) the forward entries
    ``(i, i + tau)``, i = 0 .. L - 1 - tau. Entry k of a segment of lag tau is row ``k + tau``,
    column ``k`` (backward) or row ``k``, column ``k + tau`` (forward).
    """
    taus = torch.arange(n_lags)
    if causal:
        seg_tau, seg_back = taus, torch.ones(n_lags, dtype=torch.bool)
    else:  # lag 0 once, then backward and forward segments of each lag
        seg_tau = torch.cat([taus[:1], taus[1:].repeat_interleave(2)])
        seg_back = torch.cat([torch.ones(1, dtype=torch.bool), torch.tensor([True, False]).repeat(n_lags - 1)])
    counts = seq_len - seg_tau  # (S,) entries per segment
    starts = torch.cumsum(counts, 0) - counts
    seg = torch.repeat_interleave(torch.arange(seg_tau.numel()), counts)  # (P,) segment of each entry
    k = torch.arange(int(counts.sum())) - starts[seg]
    tau, back = seg_tau[seg], seg_back[seg]
    rows = torch.where(back, k + tau, k)
    cols = torch.where(back, k, k + tau)
    per_lag = (seq_len - taus) * (1 if causal else torch.where(taus == 0, 1, 2))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(per_lag, 0)])
    return LagBand(
        seq_len=seq_len,
        n_lags=n_lags,
        causal=causal,
        flat_index=rows * seq_len + cols,
        rows=rows,
        cols=cols,
        lag=torch.where(back, tau, -tau),
        offsets=offsets,
    )


def window_support(scale: float, kind: str, tol: float) -> float:
    """Largest lag at which the lag window of ``scale`` is still >= ``tol`` (inf for tol = 0)."""
    if tol <= 0:
        return math.inf
    width = math.sqrt(2.0 * math.log(1.0 / tol))
    if kind == "lowpass":
        return scale * width
    if kind == "band":
        return scale + 0.5 * scale * width
    raise ValueError(f"unknown window kind {kind!r}")


def lag_window(lags: Tensor, scale: float, kind: str) -> Tensor:
    """Lag window w(tau) at scale a* (METHOD.md section 4).

    Args:
        lags: (...,) lags tau (signed lags use |tau|: a bidirectional field is windowed
            symmetrically).
        scale: a*.
        kind: "lowpass" ``exp(-tau^2 / (2 a*^2))`` or "band" ``exp(-(tau - a*)^2 / (2 (a*/2)^2))``.
    """
    tau = lags.abs().to(torch.float64)
    if kind == "lowpass":
        return torch.exp(-(tau**2) / (2.0 * scale**2))
    if kind == "band":
        return torch.exp(-((tau - scale) ** 2) / (2.0 * (0.5 * scale) ** 2))
    raise ValueError(f"unknown window kind {kind!r}")


def mean_attention_distance(mean_field: Tensor) -> float:
    """``sum_j A[i, j] |i - j|`` averaged over rows, for the (L, L) mean field.

    The quantity is linear in A, so its mean over snapshots is the value of the mean field.
    """
    seq_len = mean_field.shape[-1]
    pos = torch.arange(seq_len, device=mean_field.device, dtype=mean_field.dtype)
    dist = (pos.unsqueeze(1) - pos.unsqueeze(0)).abs()
    return float((mean_field * dist).sum(-1).mean())


#: Row blocks of the causal entropy pass (:func:`row_entropy`): fewer blocks evaluate a few more
#: zeros above the diagonal (p log p = 0 there, so the sums are the same bit for bit) in fewer,
#: larger operations (8 rather than 16 since 759234c; its commit message gives the timings).
ENTROPY_BLOCKS = 8


def plogp_(p: Tensor, out: Tensor) -> Tensor:
    """``p log p`` of finite probabilities ``p >= 0`` into ``out`` (same shape), 0 where p = 0.

    ``log(max(p, tiny)) * p``: the same value as ``xlogy(p, p)`` wherever p >= the dtype's smallest
    normal number (and within one such number below it), about 3x faster on CPU than ``xlogy``.
    """
    torch.clamp_min(p, torch.finfo(p.dtype).tiny, out=out)
    return out.log_().mul_(p)


def row_entropy(fields: Tensor, causal: bool, has_negative: bool | None = None,
                work: Tensor | None = None, upper_is_zero: bool = False) -> tuple[Tensor, Tensor]:
    """Row entropy normalised by the log of the number of keys of each row.

    Args:
        fields: (B, L, L) non-negative attention probabilities.
        causal: row ``i`` has ``i + 1`` keys if True, else L.
        has_negative: whether any entry is negative (negative entries are ignored); None = check.
        work: optional buffer with at least ``fields.numel()`` elements of the dtype of ``fields``
            for the entry-wise ``p log p`` (saves allocating a temporary as large as the fields).
        upper_is_zero: the caller guarantees that nothing lies above the diagonal (a causal
            field): from L = :data:`BLOCKS_FROM` on, ``p log p`` is then only evaluated on the row
            blocks' keys left of the block's end (:data:`ENTROPY_BLOCKS` blocks: (n + 1) / 2n of
            the entries, 56 % for 8); the others must read
            0 in ``work``, which holds when ``work`` was zeroed once and is reused for fields of
            this shape (or is None). The result is the same.

    Returns:
        sums: (L,) sum over the B snapshots of each row's normalised entropy (0 for rows with a
            single key, which have no entropy to normalise).
        valid: (L,) bool, rows with at least two keys.
    """
    seq_len = fields.shape[-1]
    if has_negative is None:
        has_negative = bool((fields < 0).any())
    p = fields.clamp_min(0) if has_negative else fields
    if upper_is_zero and seq_len >= BLOCKS_FROM:
        plogp = p.new_zeros(p.shape) if work is None else work.view(-1)[:p.numel()].view(p.shape)
        edges = _panel_edges(seq_len, min(ENTROPY_BLOCKS, seq_len))
        for r0, r1 in zip(edges, edges[1:], strict=False):
            if r1 > r0:  # rows r0..r1 have their keys below r1; beyond, plogp holds zeros
                block = p[..., r0:r1, :r1]
                plogp_(block, plogp[..., r0:r1, :r1])
    elif work is not None:  # (p log p of the zeros above a causal diagonal is 0)
        plogp = plogp_(p, work.view(-1)[:p.numel()].view(p.shape))
    else:
        plogp = plogp_(p, torch.empty_like(p))
    h = -plogp.sum(-1)  # (B, L)
    n_keys = torch.arange(1, seq_len + 1, device=fields.device) if causal else torch.full(
        (seq_len,), seq_len, device=fields.device
    )
    valid = n_keys >= 2
    norm = torch.log(n_keys.to(fields.dtype).clamp_min(2))
    return (h / norm).sum(0) * valid, valid
