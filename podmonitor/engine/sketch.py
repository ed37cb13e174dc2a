"""Bounded-memory POD: a centred, mergeable Frequent Directions sketch (METHOD.md section 4).

Exact POD by the method of snapshots keeps every snapshot (N x P numbers). The sketch keeps at
most ``2 l`` rows of P numbers instead, whatever N, plus the exact column mean and the exact
per-entry centred scatter (2 P numbers):

* **Frequent Directions** (Liberty 2013; Ghashami, Liberty, Phillips & Woodruff 2016): rows are
  appended to a buffer; when it holds ``2 l`` rows it is rotated to its singular basis and every
  squared singular value is reduced by ``delta = sigma_{l+1}^2`` (the ``(l+1)``-th largest), which
  leaves at most l non-zero rows. With ``A`` (N x P) the rows fed in and ``B`` the sketch,
  ``0 <= A^T A - B^T B <= Delta I`` with ``Delta = sum of the deltas``, and
  ``Delta <= ||A - A_k||_F^2 / (l + 1 - k)`` for every ``k <= l`` (each shrink removes at least
  ``(l + 1) delta`` of squared Frobenius norm). ``Delta`` is tracked, so the bound is computable.
* **Centring without knowing the mean.** Adding a batch Z = X_b - mean_old (b rows) to a centred
  scatter S of n_old rows gives ``S + Z^T (I - 1 1^T / n) Z`` (n = n_old + b); the rows
  ``y_i = z_i - c sum_j z_j`` with ``c = (1 - sqrt(1 - b / n)) / b`` have exactly that Gram, so the
  sketch receives b rows per batch and ``A^T A`` is the centred scatter of all snapshots. Merging
  two sketches appends the other's rows plus one between-group row
  ``sqrt(n_a n_b / n) (mean_b - mean_a)`` (Chan, Golub & LeVeque): the same guarantee holds for the
  merged sketch, with Delta the sum of both Deltas and of the merge's own shrinks.
* **Windows after the fact.** The dominant scales are known only at the end, so the sketch holds
  the un-windowed centred lag-band snapshots; the lag window at a scale is a diagonal
  ``W`` (entries <= 1), and ``0 <= W (A^T A - B^T B) W <= Delta I`` still holds. Its trace
  ``sum_p w_p^2 (m2_p - ||B[:, p]||^2)`` is exact (m2 is kept exactly), so the error bound at a scale
  is ``min(Delta, that trace) / N``, and the total energy ``sum_p w_p^2 m2_p / N`` is exact.
* **Compensation** (Desai, Ghashami & Phillips 2016, "compensative FD"): the top l directions of
  the sketch lost exactly Delta each while they were retained; adding Delta back to them keeps
  ``||A^T A - B'^T B'|| <= Delta`` and makes the leading eigenvalues far more accurate in practice.
  Reported eigenvalues are the compensated ones clipped into the guaranteed interval
  ``[lambda_hat_k, lambda_hat_k + error_bound]`` (``lambda_hat`` from the raw sketch, a lower bound).

All work runs on the device of the rows (CUDA when the model is on CUDA); only scalars
(the shrink amounts) and the final results leave it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

#: Size of one column block of rows processed at a time (bytes, in the compute dtype).
SKETCH_BLOCK_BYTES = 16 * 2**20


def _column_blocks(n_rows: int, n_cols: int, itemsize: int) -> list[tuple[int, int]]:
    """Column ranges such that an (n_rows, block) temporary stays under SKETCH_BLOCK_BYTES."""
    width = max(1, SKETCH_BLOCK_BYTES // max(1, n_rows * itemsize))
    return [(c0, min(n_cols, c0 + width)) for c0 in range(0, n_cols, width)]


def _stacked(rows: list[Tensor], c0: int, c1: int, dtype: torch.dtype) -> Tensor:
    """Columns c0:c1 of the row blocks, stacked: (m, c1 - c0) in ``dtype``."""
    parts = [r[:, c0:c1].to(dtype) for r in rows if r.shape[0]]
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def gram_of_rows(rows: list[Tensor], weights: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``G = (R W)(R W)^T`` of the stacked row blocks R, over the first P' = len(weights) columns.

    Args:
        rows: row blocks (m_b, P); stacked they form R (m, P).
        weights: (P',) column weights (the lag window), or None for all columns with weight 1.
        dtype: accumulation dtype.

    Returns:
        (m, m) symmetric Gram matrix.
    """
    m = sum(int(r.shape[0]) for r in rows)
    device = rows[0].device
    width = weights.numel() if weights is not None else rows[0].shape[1]
    gram = torch.zeros(m, m, dtype=dtype, device=device)
    itemsize = dtype.itemsize
    for c0, c1 in _column_blocks(m, width, itemsize):
        y = _stacked(rows, c0, c1, dtype)
        if weights is not None:
            y *= weights[c0:c1].to(device=device, dtype=dtype)
        gram.addmm_(y, y.T)
    return gram


def _eigh_desc(gram: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues (descending, clipped at 0) and eigenvectors of a symmetric matrix."""
    evals, evecs = torch.linalg.eigh(0.5 * (gram + gram.T))
    return evals.flip(0).clamp_min(0), evecs.flip(1)


class FrequentDirections:
    """Centred Frequent Directions sketch of a stream of snapshot rows (each of P entries).

    Keeps the exact count n, column mean (P,) and per-entry centred scatter m2 (P,), and a buffer
    of ``2 * rank`` rows (allocated once) of which the first ``n_rows`` are in use; their Gram
    approximates the centred scatter ``S = sum_s (x_s - mean)(x_s - mean)^T`` from below:
    ``0 <= S - B^T B <= delta_total I``. Until more than ``2 * rank`` rows have been fed it is exact.

    Args:
        n_cols: P, entries per row.
        rank: l, the rows kept after a shrink (the buffer holds 2 l).
        dtype: compute dtype (mean, m2, Gram matrices).
        storage_dtype: dtype of the buffer rows.
        device: where everything lives.

    Example:
        >>> fd = FrequentDirections(n_cols=P, rank=64)
        >>> for x in batches:        # each (b, P)
        ...     fd.update(x)
        >>> fd.delta_total, fd.rows()
    """

    def __init__(self, n_cols: int, rank: int, *, dtype: torch.dtype = torch.float64,
                 storage_dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        if rank < 1:
            raise ValueError(f"sketch rank must be >= 1, got {rank}")
        self.n_cols = int(n_cols)
        self.rank = int(rank)
        self.dtype = dtype
        self.storage_dtype = storage_dtype or dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.n = 0
        self.mean = torch.zeros(self.n_cols, dtype=dtype, device=self.device)  # (P,)
        self.m2 = torch.zeros(self.n_cols, dtype=dtype, device=self.device)  # (P,) centred scatter diagonal
        self.buffer = torch.zeros(2 * self.rank, self.n_cols, dtype=self.storage_dtype, device=self.device)
        self.n_rows = 0  # rows of the buffer in use
        self.delta_total = 0.0
        self.n_shrinks = 0

    # ------------------------------------------------------------------ sizes
    def rows(self) -> list[Tensor]:
        """The row blocks (here one (n_rows, P) view) whose Gram is the sketch of the scatter."""
        return [self.buffer[: self.n_rows]] if self.n_rows else []

    def nbytes(self) -> int:
        """Bytes held now (constant: the buffer is allocated once)."""
        tensors = [self.mean, self.m2, self.buffer]
        return int(sum(t.numel() * t.element_size() for t in tensors))

    @staticmethod
    def state_bytes(n_cols: int, rank: int, dtype: torch.dtype, storage_dtype: torch.dtype) -> int:
        """Bytes of the state: mean and m2 (2 P in ``dtype``) plus the 2 l x P buffer."""
        c = dtype.itemsize
        s = storage_dtype.itemsize
        return 2 * n_cols * c + 2 * rank * n_cols * s

    # ----------------------------------------------------------------- update
    def update(self, x: Tensor) -> None:
        """Add raw snapshot rows.

        Args:
            x: (b, P) snapshots (not centred); any float dtype, on any device (moved here).
        """
        x = x.to(device=self.device, dtype=self.dtype)
        b = int(x.shape[0])
        if b == 0:
            return
        n_new = self.n + b
        z = x - self.mean  # (b, P)
        s = z.sum(0)  # (P,)
        c = (1.0 - math.sqrt(1.0 - b / n_new)) / b
        y = z.sub_(c * s)  # rows with Gram Z^T (I - 1 1^T / n_new) Z
        self.m2 += y.square().sum(0)
        self.mean += s / n_new
        self.n = n_new
        self._append(y)

    def _append(self, y: Tensor) -> None:
        """Append centred rows (m, P), shrinking whenever the buffer of 2 l rows is full."""
        start = 0
        while start < y.shape[0]:
            space = 2 * self.rank - self.n_rows
            if space <= 0:
                self.shrink()
                continue
            stop = min(int(y.shape[0]), start + space)
            self.buffer[self.n_rows:self.n_rows + stop - start] = y[start:stop].to(self.storage_dtype)
            self.n_rows += stop - start
            start = stop

    def shrink(self) -> float:
        """Frequent Directions step: rotate to the singular basis, subtract sigma_{l+1}^2, keep l rows.

        Returns:
            delta, the amount subtracted from every squared singular value (0 when at most l rows
            are held: nothing to shrink).
        """
        m = self.n_rows
        if m <= self.rank:
            return 0.0
        rows = self.buffer[:m]
        gram = gram_of_rows([rows], None, self.dtype)  # (m, m)
        sig2, u = _eigh_desc(gram)
        delta = float(sig2[self.rank])
        keep = sig2[: self.rank]
        coef = torch.where(keep > delta, torch.sqrt((keep - delta).clamp_min(0) / keep.clamp_min(1e-300)),
                           torch.zeros_like(keep))
        mix = coef.unsqueeze(1) * u[:, : self.rank].T  # (l, m): new rows = mix @ rows
        itemsize = self.dtype.itemsize
        for c0, c1 in _column_blocks(m, self.n_cols, itemsize):
            # (l, w) product formed in full before it overwrites the block it reads
            self.buffer[: self.rank, c0:c1] = (mix @ rows[:, c0:c1].to(self.dtype)).to(self.storage_dtype)
        self.buffer[self.rank:m] = 0
        self.n_rows = self.rank
        self.delta_total += delta
        self.n_shrinks += 1
        return delta

    # ------------------------------------------------------------------ merge
    def merge(self, other: FrequentDirections) -> FrequentDirections:
        """Absorb another sketch of the same row space (e.g. from another process); returns self."""
        if other.n_cols != self.n_cols or other.rank != self.rank:
            raise ValueError(
                f"cannot merge sketches of P = {self.n_cols}, l = {self.rank} and P = {other.n_cols}, l = {other.rank}"
            )
        if other.n == 0:
            return self
        if self.n == 0:
            self.load_state_dict(other.state_dict())
            return self
        n_a, n_b = self.n, other.n
        n = n_a + n_b
        d = other.mean.to(self.device, self.dtype) - self.mean  # (P,)
        w = n_a * n_b / n
        self.m2 += other.m2.to(self.device, self.dtype) + w * d.square()
        self.mean += d * (n_b / n)
        self.n = n
        self.delta_total += other.delta_total
        self.n_shrinks += other.n_shrinks
        for r in other.rows():
            self._append(r.to(self.device))
        self._append((math.sqrt(w) * d).unsqueeze(0))  # the between-group row
        return self

    # ------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """Picklable state (the rows in use as one (n_rows, P) tensor)."""
        return {
            "n_cols": self.n_cols,
            "rank": self.rank,
            "n": self.n,
            "mean": self.mean,
            "m2": self.m2,
            "rows": self.buffer[: self.n_rows].clone(),
            "delta_total": self.delta_total,
            "n_shrinks": self.n_shrinks,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (same P and l)."""
        if int(state["n_cols"]) != self.n_cols or int(state["rank"]) != self.rank:
            raise ValueError("sketch state has a different number of entries or rank")
        rows = state["rows"]
        if rows.ndim != 2 or rows.shape[1] != self.n_cols or rows.shape[0] > 2 * self.rank:
            raise ValueError("corrupt sketch state: rows do not match P or exceed 2 l")
        self.n = int(state["n"])
        self.mean = state["mean"].to(self.device, self.dtype).clone()
        self.m2 = state["m2"].to(self.device, self.dtype).clone()
        self.buffer.zero_()
        self.buffer[: rows.shape[0]] = rows.to(self.device, self.storage_dtype)
        self.n_rows = int(rows.shape[0])
        self.delta_total = float(state["delta_total"])
        self.n_shrinks = int(state["n_shrinks"])


@dataclass
class SketchPOD:
    """POD of the windowed ensemble from a sketch, with its guarantees.

    Attributes:
        eigenvalues: (m,) estimates (compensated, clipped into the guaranteed interval), descending.
        eigenvalues_lower: (m,) raw sketch eigenvalues: ``lambda_hat_k <= lambda_k``.
        error_bound: e, with ``lambda_hat_k <= lambda_k <= lambda_hat_k + e`` for every k, so
            ``|lambda_k - eigenvalues_k| <= e``.
        total_energy: the exact ``sum_k lambda_k`` (trace), from the exact per-entry scatter.
        modes: (K, P') unit-norm approximate POD modes (compensated sketch).
    """

    eigenvalues: Tensor
    eigenvalues_lower: Tensor
    error_bound: float
    total_energy: float
    modes: Tensor


def sketch_pod(fd: FrequentDirections, weights: Tensor, *, n_modes: int = 8, floor: float = 1e-12,
               compensate: bool = True) -> SketchPOD:
    """Eigenvalues of ``C = U U^T / N`` for the windowed ensemble ``U = (X - mean) W``, from the sketch.

    Args:
        fd: the sketch of the centred lag-band snapshots.
        weights: (P',) lag-window weights of the first P' entries (all <= 1).
        n_modes: how many leading modes to form.
        floor: modes only for estimates above ``floor * lambda_1``.
        compensate: add the total shrinkage back to the top l directions (see the module notes).

    Returns:
        :class:`SketchPOD` (on the sketch's device).
    """
    n = fd.n
    dt = fd.dtype
    rows = fd.rows()
    width = weights.numel()
    w = weights.to(device=fd.device, dtype=dt)
    total = float((w.square() * fd.m2[:width]).sum()) / n
    if not rows:
        empty = torch.zeros(0, dtype=dt, device=fd.device)
        return SketchPOD(empty, empty, 0.0, total, torch.zeros(0, width, dtype=dt, device=fd.device))
    g_w = gram_of_rows(rows, w, dt)  # (m, m) Gram of the windowed sketch rows
    lam_lo, _ = _eigh_desc(g_w)
    lam_lo = lam_lo / n
    trace_gap = max(0.0, total - float(lam_lo.sum()))  # tr(W E W) / N, exact up to rounding
    err = min(fd.delta_total / n, trace_gap)
    mix = None
    if compensate and fd.delta_total > 0:
        g0 = gram_of_rows(rows, None, dt)  # un-windowed: the sketch's own singular basis
        sig2, u0 = _eigh_desc(g0)
        k = min(fd.rank, int((sig2 > 0).sum()))
        gain = torch.ones_like(sig2)
        gain[:k] = torch.sqrt((sig2[:k] + fd.delta_total) / sig2[:k])
        mix = (u0 * gain) @ u0.T  # (m, m): compensated rows = mix @ R
        g_c = mix @ g_w @ mix.T
        lam_c, v = _eigh_desc(g_c)
        lam_c = lam_c / n
    else:
        lam_c, v = _eigh_desc(g_w)
        lam_c = lam_c / n
    lam = torch.minimum(torch.maximum(lam_c, lam_lo), lam_lo + err)
    # modes phi_k = (M R W)^T v_k / sigma_k, sigma_k^2 = N lam_c_k, formed one column block at a time
    lam1 = float(lam_c[0]) if lam_c.numel() else 0.0
    k_modes = min(n_modes, int(((lam_c > floor * lam1) & (lam_c > 0)).sum())) if lam1 > 0 else 0
    modes = torch.zeros(k_modes, width, dtype=dt, device=fd.device)
    if k_modes:
        coef = v[:, :k_modes] if mix is None else mix.T @ v[:, :k_modes]  # (m, K)
        coef = coef / torch.sqrt(n * lam_c[:k_modes])
        itemsize = dt.itemsize
        for c0, c1 in _column_blocks(int(coef.shape[0]), width, itemsize):
            y = _stacked(rows, c0, c1, dt) * w[c0:c1]
            modes[:, c0:c1] = coef.T @ y
        modes /= modes.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return SketchPOD(lam, lam_lo, err, total, modes)
