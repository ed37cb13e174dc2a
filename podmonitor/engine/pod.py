"""Proper Orthogonal Decomposition by the method of snapshots (METHOD.md section 4).

For an ensemble of N filtered fluctuation snapshots ``u_s`` (flattened to rows of U, N x P):
``C = U U^T / N`` (Frobenius inner products), eigenvalues ``lambda_1 >= lambda_2 >= ... >= 0``,
modes ``phi_k = U^T v_k / sqrt(N lambda_k)`` with unit norm. POD optimality: the mean squared
error of reconstructing the ensemble from its first K modes is ``sum_{k > K} lambda_k``.

Snapshots are held as a list of chunks in lag-band form (see :class:`~podmonitor.engine.lags.LagBand`);
the Gram matrix is assembled block by block, so no N x P copy of the ensemble is ever made.

When a filtered snapshot has fewer entries than there are snapshots (D < N, e.g. short fields or
narrow windows), the same POD comes from the D x D covariance ``U^T U / N`` instead: it has the
same non-zero eigenvalues (``U U^T`` and ``U^T U`` share them), its eigenvectors are the modes, and
it costs O(N D^2) time and O(D^2) memory instead of O(N^2 D) and O(N^2).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

#: Target size of one centred, windowed block of snapshots (bytes).
BLOCK_BYTES = 64 * 2**20


@dataclass
class PODResult:
    """Eigen-decomposition of one snapshot ensemble.

    Attributes:
        eigenvalues: (N,) descending, non-negative (from the D x D covariance when D < N: its D
            eigenvalues, then N - D zeros).
        vectors: (N, N) eigenvectors v_k of C as columns, same order; None when the POD was
            computed from the covariance (then ``v_k = a_k / sqrt(N lambda_k)``).
        modes: (K, P) unit-norm spatial modes phi_k (K = the modes asked for, among those with
            lambda_k > floor * lambda_1).
        coefficients: (N, K) temporal coefficients ``a_k(s) = <u_s, phi_k> = sqrt(N lambda_k) v_k(s)``.
    """

    eigenvalues: Tensor
    vectors: Tensor | None
    modes: Tensor
    coefficients: Tensor


def _row_blocks(chunks: Sequence[Tensor], block_rows: int) -> list[list[tuple[int, int, int]]]:
    """Group the rows of consecutive chunks into blocks of at most ``block_rows`` rows.

    Returns:
        A list of blocks, each a list of (chunk index, first row, stop row) pieces.
    """
    blocks: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    filled = 0
    for c, chunk in enumerate(chunks):
        start = 0
        while start < chunk.shape[0]:
            take = min(chunk.shape[0] - start, block_rows - filled)
            current.append((c, start, start + take))
            filled += take
            start += take
            if filled == block_rows:
                blocks.append(current)
                current, filled = [], 0
    if current:
        blocks.append(current)
    return blocks


def _prepared(chunks: Sequence[Tensor], pieces: list[tuple[int, int, int]], center: Tensor | None,
              weights: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Concatenate the pieces of one block, restricted to the window width, centred and windowed."""
    width = weights.numel() if weights is not None else chunks[0].shape[1]
    first = chunks[pieces[0][0]]
    if len(pieces) == 1 and center is not None and first.dtype == dtype:  # centre while copying: one pass less
        c, r0, r1 = pieces[0]
        y = torch.sub(chunks[c][r0:r1, :width], center[:width].to(dtype))
    else:
        # every piece copied (and widened) straight into its rows of one block: no temporary per
        # piece, no concatenation
        y = torch.empty(sum(r1 - r0 for _, r0, r1 in pieces), width, dtype=dtype, device=first.device)
        at = 0
        for c, r0, r1 in pieces:
            y[at:at + r1 - r0].copy_(chunks[c][r0:r1, :width])
            at += r1 - r0
        if center is not None:
            y -= center[:width].to(dtype)
    if weights is not None:
        y *= weights.to(dtype)
    return y


def iter_prepared_blocks(chunks: Sequence[Tensor], center: Tensor | None, weights: Tensor | None,
                         dtype: torch.dtype) -> Iterator[tuple[int, Tensor]]:
    """Yield (first snapshot index, (b, P') block of centred, windowed snapshots)."""
    width = weights.numel() if weights is not None else chunks[0].shape[1]
    bytes_per_row = max(1, width * dtype.itemsize)
    block_rows = max(1, BLOCK_BYTES // bytes_per_row)
    first = 0
    for pieces in _row_blocks(chunks, block_rows):
        y = _prepared(chunks, pieces, center, weights, dtype)
        yield first, y
        first += y.shape[0]


def weighted_gram(chunks: Sequence[Tensor], center: Tensor | None, weights: Tensor | None,
                  dtype: torch.dtype = torch.float64) -> Tensor:
    """``G = Y Y^T`` with ``Y = (X[:, :P'] - center) * weights`` assembled block by block.

    Args:
        chunks: snapshot chunks, each (n_c, P); their rows in order form X (N, P).
        center: (P,) subtracted from every snapshot (the mean), or None.
        weights: (P',) per-entry weights (the lag window); only the first P' entries are used.
        dtype: accumulation dtype.

    Returns:
        (N, N) symmetric Gram matrix.
    """
    n_total = sum(int(c.shape[0]) for c in chunks)
    device = chunks[0].device
    gram = torch.zeros(n_total, n_total, dtype=dtype, device=device)
    width = weights.numel() if weights is not None else chunks[0].shape[1]
    bytes_per_row = max(1, width * dtype.itemsize)
    block_rows = max(1, BLOCK_BYTES // bytes_per_row)
    blocks = _row_blocks(chunks, block_rows)
    starts = [0]
    for pieces in blocks:
        starts.append(starts[-1] + sum(r1 - r0 for _, r0, r1 in pieces))
    for bi, pieces_i in enumerate(blocks):
        yi = _prepared(chunks, pieces_i, center, weights, dtype)
        si = slice(starts[bi], starts[bi + 1])
        gram[si, si] = yi @ yi.T
        for bj in range(bi):
            yj = _prepared(chunks, blocks[bj], center, weights, dtype)
            sj = slice(starts[bj], starts[bj + 1])
            g = yi @ yj.T
            gram[si, sj] = g
            gram[sj, si] = g.T
    return gram


def pod_from_gram(gram: Tensor, n_snapshots: int) -> tuple[Tensor, Tensor]:
    """Eigenvalues (descending, clipped at 0) and eigenvectors of ``C = G / N``."""
    c = gram / n_snapshots
    c = 0.5 * (c + c.T)
    evals, evecs = torch.linalg.eigh(c)
    return evals.flip(0).clamp_min(0), evecs.flip(1)


def snapshot_pod(chunks: Sequence[Tensor], *, center: Tensor | None = None,
                 weights: Tensor | None = None, n_modes: int = 8, floor: float = 1e-12,
                 dtype: torch.dtype = torch.float64) -> PODResult:
    """POD of the ensemble ``U = (X - center) * weights`` by the method of snapshots.

    Args:
        chunks: snapshot chunks (n_c, P) (a single (N, P) tensor may be passed as ``[U]``).
        center: (P,) mean to subtract (None: the rows are already fluctuations).
        weights: (P',) window weights on the first P' entries (None: all entries, weight 1).
        n_modes: how many leading modes to form.
        floor: modes are only formed for ``lambda_k > floor * lambda_1``.

    Returns:
        :class:`PODResult`.
    """
    n_total = sum(int(c.shape[0]) for c in chunks)
    width = weights.numel() if weights is not None else chunks[0].shape[1]
    single = n_total * width * dtype.itemsize <= BLOCK_BYTES
    if width < n_total:
        return covariance_pod(chunks, center=center, weights=weights, n_modes=n_modes, floor=floor, dtype=dtype)
    if single:  # one centred, windowed block serves both the Gram matrix and the modes
        y_all = _prepared(chunks, [(c, 0, int(ch.shape[0])) for c, ch in enumerate(chunks)], center, weights, dtype)
        gram = y_all @ y_all.T
    else:
        gram = weighted_gram(chunks, center, weights, dtype)
    evals, evecs = pod_from_gram(gram, n_total)
    lam1 = float(evals[0]) if evals.numel() else 0.0
    k = int(((evals > floor * lam1) & (evals > 0)).sum()) if lam1 > 0 else 0
    k = min(k, n_modes)
    modes = torch.zeros(k, width, dtype=dtype, device=gram.device)
    if k > 0:
        v = evecs[:, :k]
        blocks = [(0, y_all)] if single else iter_prepared_blocks(chunks, center, weights, dtype)
        for first, y in blocks:
            modes += v[first:first + y.shape[0]].T @ y
        scale = torch.sqrt(n_total * evals[:k])
        modes /= scale.unsqueeze(1)
        coefficients = v * scale
    else:
        coefficients = torch.zeros(n_total, 0, dtype=dtype, device=gram.device)
    return PODResult(evals, evecs, modes, coefficients)


def covariance_pod(chunks: Sequence[Tensor], *, center: Tensor | None = None, weights: Tensor | None = None,
                   n_modes: int = 8, floor: float = 1e-12, dtype: torch.dtype = torch.float64) -> PODResult:
    """The POD of :func:`snapshot_pod` from the D x D covariance ``U^T U / N`` (for D < N).

    ``U U^T`` and ``U^T U`` have the same non-zero eigenvalues; the unit eigenvectors of the
    covariance are the modes ``phi_k`` and the coefficients are the projections ``a_k = U phi_k``.

    Args:
        chunks, center, weights, n_modes, floor, dtype: as for :func:`snapshot_pod`.

    Returns:
        :class:`PODResult` with N eigenvalues (the D of the covariance, then N - D zeros) and no
        snapshot-space eigenvectors (``vectors`` None).
    """
    n_total = sum(int(c.shape[0]) for c in chunks)
    width = weights.numel() if weights is not None else chunks[0].shape[1]
    device = chunks[0].device
    single = n_total * width * dtype.itemsize <= BLOCK_BYTES
    if single:
        y_all = _prepared(chunks, [(c, 0, int(ch.shape[0])) for c, ch in enumerate(chunks)], center, weights, dtype)
        cov = y_all.T @ y_all
    else:
        cov = torch.zeros(width, width, dtype=dtype, device=device)
        for _, y in iter_prepared_blocks(chunks, center, weights, dtype):
            cov.addmm_(y.T, y)
    evals, evecs = pod_from_gram(cov, n_total)  # (D,), (D, D)
    lam1 = float(evals[0]) if evals.numel() else 0.0
    k = int(((evals > floor * lam1) & (evals > 0)).sum()) if lam1 > 0 else 0
    k = min(k, n_modes)
    modes = evecs[:, :k].T.contiguous()  # (K, D), unit norm
    coefficients = torch.zeros(n_total, k, dtype=dtype, device=device)
    if k > 0:
        blocks = [(0, y_all)] if single else iter_prepared_blocks(chunks, center, weights, dtype)
        for first, y in blocks:
            coefficients[first:first + y.shape[0]] = y @ evecs[:, :k]
    eigenvalues = torch.cat([evals, evals.new_zeros(max(0, n_total - width))])
    return PODResult(eigenvalues, None, modes, coefficients)


def mode_lag_profiles(modes: Tensor, lags: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    """``phi_k(tau) = mean_i phi_k(i, i - tau)`` over the rows where the entry exists.

    Args:
        modes: (K, P') modes in lag-band layout.
        lags: (P',) signed lag ``i - j`` of each entry.
        causal: profiles over tau = 0..T-1 if True, else over -(T-1)..T-1.

    Returns:
        lag_axis: (T',) the lags of the profile.
        profiles: (K, T') profiles.
    """
    lags = lags.to(modes.device)
    t_max = int(lags.abs().max()) + 1 if lags.numel() else 1
    lo = 0 if causal else -(t_max - 1)
    axis = torch.arange(lo, t_max, device=modes.device)
    idx = lags - lo
    sums = torch.zeros(modes.shape[0], axis.numel(), dtype=modes.dtype, device=modes.device)
    sums.index_add_(1, idx, modes)
    counts = torch.zeros(axis.numel(), dtype=modes.dtype, device=modes.device)
    counts.index_add_(0, idx, torch.ones_like(lags, dtype=modes.dtype))
    return axis, sums / counts.clamp_min(1)


def fix_signs(profiles: Tensor) -> Tensor:
    """(K,) signs (+1/-1) that make the largest-magnitude entry of each profile positive."""
    if profiles.numel() == 0:
        return torch.ones(profiles.shape[0], dtype=profiles.dtype, device=profiles.device)
    idx = profiles.abs().argmax(dim=1, keepdim=True)
    signs = torch.sign(profiles.gather(1, idx)).squeeze(1)
    return torch.where(signs == 0, torch.ones_like(signs), signs)
