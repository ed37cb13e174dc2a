"""Incremental scale-selective POD of one layer: :class:`PODAccumulator`.

torchmetrics-style ``update`` / ``compute`` / ``reset``, plus ``merge`` (for snapshots gathered on
several processes) and ``state_dict`` / ``load_state_dict`` (for checkpoints).

State, for a field of length L and N snapshots kept so far:

* the mean field (L, L) and the centred lag second moments (L, L) (backward, plus forward for
  bidirectional fields), updated by Chan et al.'s pairwise formula: the scalograms need nothing
  else, so they are exact at any N with O(L^2) state;
* the snapshots themselves in lag-band form (N x P, P <= L (L + 1) / 2 for causal fields): exact
  POD by the method of snapshots needs them, because the dominant scales, the mean and
  therefore the fluctuations are only known at the end ("exact" mode);
  or, in "sketch" mode, a centred Frequent Directions sketch of them (2 l x P, whatever N; see
  :mod:`podmonitor.engine.sketch`), with the exact per-entry variance so that energies stay exact;
  "auto" mode (default) is exact while the snapshots fit in the memory budget and switches to
  the sketch when they would not;
* the sum of row entropies (L,).

The cost of ``update`` depends on the batch only (per field a sheared copy and the panel products
of the lag moments, see :class:`~podmonitor.engine.lags.LagShear`, the entropies and a gather into
the lag band), not on how many snapshots were seen before.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .coherency import FFT_ABOVE, CoherencyAccumulator
from .config import PODConfig
from .lags import (
    SUB_BYTES,
    LagBand,
    LagShear,
    lag_moment,
    lag_signals,
    lag_window,
    max_above_diagonal,
    mean_attention_distance,
    row_entropy,
    window_support,
)
from .pod import fix_signs, mode_lag_profiles, snapshot_pod
from .report import PODReport, ScaleReport
from .sketch import FrequentDirections, sketch_pod
from .spectrum import effective_rank, spectral_fit
from .wavelets import dominant_scale_indices, scale_centroid, scalogram_from_moment

STATE_VERSION = 2  # version 1 (exact only) states still load

#: In sketch mode, band entries are fed to the sketch (and the streamed coherency) in parts of
#: at most this size (bytes), so that an update's temporaries stay bounded whatever the batch.
SKETCH_FEED_BYTES = 32 * 2**20

#: A snapshot counts as normalised when every row sums to 1 over its keys within
#: ``max(NORMALISATION_TOL, 4 eps)`` (eps of the input dtype: float16/bfloat16 entries round).
NORMALISATION_TOL = 1e-3


def normalisation_tol(dtype: torch.dtype) -> float:
    """Tolerance of ``|row sum - 1|`` for input of ``dtype`` (see :data:`NORMALISATION_TOL`)."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return max(NORMALISATION_TOL, 4 * eps)


class MemoryBudgetError(RuntimeError):
    """An update would make the accumulator's state exceed ``PODConfig.memory_budget_bytes``."""


def _as_tensor(fields: Any) -> Tensor:
    if isinstance(fields, np.ndarray):
        return torch.from_numpy(fields)
    if isinstance(fields, Tensor):
        return fields.detach()
    raise TypeError(f"fields must be a torch.Tensor or numpy.ndarray, got {type(fields).__name__}")


def band_lags(config: PODConfig, seq_len: int) -> int:
    """How many lags the accumulator stores for length L: the support of the widest window."""
    scales = config.scales_for(seq_len)
    if not scales:
        return seq_len
    support = window_support(max(scales), config.window, config.window_tol)
    return seq_len if math.isinf(support) else min(seq_len, int(math.floor(support)) + 1)


def _band_size(seq_len: int, band: int, causal: bool) -> int:
    """P, the entries of the lag band (lags below ``band``): sum over tau < band of (L - tau),
    twice for tau > 0 when bidirectional (closed form, no loop over the lags)."""
    band = max(0, min(band, seq_len))
    one_side = band * seq_len - band * (band - 1) // 2
    return one_side if causal or band == 0 else 2 * one_side - seq_len


def _fixed_state_bytes(seq_len: int, config: PODConfig, causal: bool) -> int:
    """State that does not grow with N: mean field, lag moments (L, L) and entropy sums (L,)."""
    itemsize = config.dtype.itemsize
    return (2 if causal else 3) * seq_len * seq_len * itemsize + seq_len * itemsize


def _streamed_coherency(config: PODConfig) -> bool:
    """In sketch mode the coherency is accumulated as the snapshots arrive, at a fixed scale only."""
    return config.coherency and config.coherency_scale is not None


def exact_eig_bytes(n_snapshots: int, width: int, config: PODConfig) -> int:
    """Bytes of the eigenproblem of the exact POD at N snapshots of ``width`` entries: the matrix and
    its eigenvectors, N x N (method of snapshots) or D x D (covariance, when D = width < N)."""
    k = min(n_snapshots, width)
    return 2 * k * k * config.dtype.itemsize


def sketch_eig_bytes(rank: int, config: PODConfig) -> int:
    """Bytes of the eigenproblems of a sketch POD: windowed and un-windowed Gram matrices of the
    2 l rows, their eigenvectors and the compensation (5 (2 l)^2 values)."""
    return 5 * (2 * rank) ** 2 * config.dtype.itemsize


def exact_budgeted_bytes(n_snapshots: int, seq_len: int, config: PODConfig, causal: bool) -> int:
    """What ``memory_budget_bytes`` bounds in exact mode: the state of N snapshots plus the
    eigenproblem that ``compute`` will build from them."""
    p = _band_size(seq_len, band_lags(config, seq_len), causal)
    state = n_snapshots * p * config.resolved_storage_dtype.itemsize + _fixed_state_bytes(seq_len, config, causal)
    return state + exact_eig_bytes(n_snapshots, p, config)


def sketch_budgeted_bytes(rank: int, seq_len: int, config: PODConfig, causal: bool) -> int:
    """What ``memory_budget_bytes`` bounds in sketch mode: the sketch (and streamed coherency sums),
    the O(L^2) state and the sketch's eigenproblems."""
    p = _band_size(seq_len, band_lags(config, seq_len), causal)
    coh = 3 * seq_len * seq_len * config.dtype.itemsize if _streamed_coherency(config) else 0
    sketch = FrequentDirections.state_bytes(p, rank, config.dtype, config.resolved_storage_dtype)
    return _fixed_state_bytes(seq_len, config, causal) + coh + sketch + sketch_eig_bytes(rank, config)


def sketch_rank_for(seq_len: int, config: PODConfig, causal: bool = True, *, auto: bool | None = None) -> int:
    """l, the rows of the sketch for length L under ``config`` (0 when no sketch fits the budget).

    Never more than P, the lag-band entries of a field: a sketch of l >= P rows holds the whole
    scatter (nothing is shrunk away), so more rows would be memory without use. Explicit
    ``sketch_rank`` wins otherwise. With a budget, the largest l whose sketch, O(L^2) state and
    eigenproblems (:func:`sketch_budgeted_bytes`) fit: in the whole budget in "sketch" mode, in
    half of what the budget leaves after the O(L^2) state in "auto" mode (so that the exact phase
    before the switch can use the other half; the switch then needs no approximation); without a
    budget, ``4 * k_fit``. In "auto" mode a sketch below ``2 * k_fit`` rows is not used unless it
    is lossless (l = P): 0 is returned, and the accumulator refuses instead, as in "exact" mode.
    """
    auto = config.mode == "auto" if auto is None else auto
    budget = config.memory_budget_bytes
    p = _band_size(seq_len, band_lags(config, seq_len), causal)
    if budget is None:
        return min(config.sketch_rank or 4 * config.k_fit, p)
    base = sketch_budgeted_bytes(0, seq_len, config, causal)  # everything but the rows and their Gram
    free = budget - base
    if config.sketch_rank is not None:
        rank = min(config.sketch_rank, p)
        return rank if sketch_budgeted_bytes(rank, seq_len, config, causal) <= budget else 0
    share = free // 2 if auto else free
    # largest l with 2 l P s + 20 l^2 c <= share (a quadratic; then checked exactly)
    s_item, c_item = config.resolved_storage_dtype.itemsize, config.dtype.itemsize
    a, b = 20 * c_item, 2 * p * s_item
    rank = int((-b + math.sqrt(b * b + 4 * a * max(share, 0))) // (2 * a)) if share > 0 else 0
    rank = min(rank, p)
    while rank > 0 and sketch_budgeted_bytes(rank, seq_len, config, causal) - base > share:
        rank -= 1
    if rank < 1 or (auto and rank < min(2 * config.k_fit, p)):
        return 0
    return rank


def auto_exact_limit(seq_len: int, config: PODConfig, causal: bool, rank: int) -> int | None:
    """In "auto" mode with a budget, the most :func:`exact_budgeted_bytes` may reach before the
    accumulator switches to a sketch of ``rank`` rows: the budget less the sketch's own parts
    (its rows, mean and scatter, streamed coherency sums and eigenproblems), which must fit next
    to the exact snapshots while these are fed into it. None without a budget or a sketch."""
    budget = config.memory_budget_bytes
    if budget is None or rank == 0:
        return budget
    return budget - (sketch_budgeted_bytes(rank, seq_len, config, causal) - _fixed_state_bytes(seq_len, config, causal))


def estimate_memory(seq_len: int, n_snapshots: int, config: PODConfig | None = None,
                    causal: bool = True, mode: str | None = None) -> dict[str, int]:
    """Bytes the accumulator needs for one layer.

    Args:
        seq_len: L.
        n_snapshots: N.
        config: the engine configuration.
        causal: causal (one triangle) or bidirectional (both) fields.
        mode: "exact", "sketch" or "auto" (the mode an "auto" accumulator ends in after N
            snapshots); None = ``config.mode``.

    Returns:
        dict with "state" (kept between updates: snapshots in lag-band form, or the sketch, plus
        the O(L^2) moments), "compute_extra" (transient during ``compute``: the eigenproblem,
        one windowed block, modes, coherency sums), "total", "budgeted" (what
        ``PODConfig.memory_budget_bytes`` bounds: the state plus the eigenproblem, the part of
        ``compute`` that grows with N) and "sketch_rank" (l, 0 in exact mode).
    """
    config = config or PODConfig()
    mode = mode or config.mode
    itemsize = config.dtype.itemsize
    band = band_lags(config, seq_len)
    p = _band_size(seq_len, band, causal)
    fixed = _fixed_state_bytes(seq_len, config, causal)
    modes = config.n_modes * (p + (seq_len * seq_len if config.keep_mode_fields else 0)) * itemsize
    from .pod import BLOCK_BYTES
    from .sketch import SKETCH_BLOCK_BYTES

    exact_state = n_snapshots * p * config.resolved_storage_dtype.itemsize + fixed
    exact_budgeted = exact_budgeted_bytes(n_snapshots, seq_len, config, causal)
    rank = 0
    if mode == "sketch":
        rank = sketch_rank_for(seq_len, config, causal, auto=False)
    elif mode == "auto" and config.memory_budget_bytes is not None:
        rank = sketch_rank_for(seq_len, config, causal, auto=True)
        limit = auto_exact_limit(seq_len, config, causal, rank)
        if limit is not None and exact_budgeted <= limit:
            rank = 0  # still exact after N snapshots
    if rank == 0 and mode == "sketch":
        raise MemoryBudgetError(_no_sketch_message(seq_len, config, causal))
    if rank == 0:
        block = min(n_snapshots * p * itemsize, BLOCK_BYTES)
        eig = exact_eig_bytes(n_snapshots, p, config)  # N x N Gram (or D x D covariance) + eigenvectors
        # coherency: its three sums, the cross vectors and their products, the transform operator
        # and one step of transforms (about 10 L^2 values; above FFT_ABOVE the per-snapshot FFTs
        # of (L, 2L) complex rows take more, about 18 L^2); benchmarks/bench_engine_parts.py
        # --coherency-memory measures it
        per_l2 = 10 if seq_len <= FFT_ABOVE else 18
        coh = per_l2 * seq_len * seq_len * itemsize + 3 * SUB_BYTES if config.coherency else 0
        extra = 2 * block + eig + modes + coh
        return {"state": int(exact_state), "compute_extra": int(extra), "total": int(exact_state + extra),
                "budgeted": int(exact_budgeted), "sketch_rank": 0}
    coh_state = 3 * seq_len * seq_len * itemsize if _streamed_coherency(config) else 0
    state = fixed + coh_state + FrequentDirections.state_bytes(p, rank, config.dtype, config.resolved_storage_dtype)
    eig = sketch_eig_bytes(rank, config)  # windowed Gram, un-windowed Gram, eigenvectors, compensation
    extra = eig + SKETCH_BLOCK_BYTES + modes + (seq_len * seq_len * itemsize if coh_state else 0)
    return {"state": int(state), "compute_extra": int(extra), "total": int(state + extra),
            "budgeted": int(sketch_budgeted_bytes(rank, seq_len, config, causal)), "sketch_rank": int(rank)}


def _no_sketch_message(seq_len: int, config: PODConfig, causal: bool) -> str:
    p = _band_size(seq_len, band_lags(config, seq_len), causal)
    s_itemsize = config.resolved_storage_dtype.itemsize
    return (
        f"the memory budget of {config.memory_budget_bytes / 2**20:.1f} MiB "
        f"(PODConfig.memory_budget_bytes) cannot hold a useful sketch at L = {seq_len}: the O(L^2) "
        f"state takes {_fixed_state_bytes(seq_len, config, causal) / 2**20:.1f} MiB and each sketch row "
        f"{p * s_itemsize / 2**20:.2f} MiB (2 l rows are kept; auto mode needs l >= 2 k_fit = "
        f"{2 * config.k_fit})"
    )


def sketch_effective_rank(eigenvalues: Tensor, lower: Tensor, error_bound: float, total: float,
                          eps: tuple[float, ...], resolved_rank: int
                          ) -> tuple[dict[float, int | None], dict[float, list[int | None]], dict[float, bool],
                                     dict[float, bool]]:
    """H*(eps) from sketch eigenvalues, with guaranteed bounds (METHOD.md section 5).

    With ``lower_k <= lambda_k <= lower_k + e`` and the exact total T: the top-K sum of the true
    eigenvalues lies in ``[S_K, S_K + min(K e, T - S_m)]`` (Ky Fan), ``S_K`` the top-K sum of
    ``lower`` and ``T - S_m`` the energy the sketch misses. So ``H_hi`` = the smallest K with
    ``T - S_K <= eps T`` is an upper bound, ``H_lo`` = the smallest K with
    ``T - S_K - min(K e, T - S_m) <= eps T`` a lower bound.

    Args:
        eigenvalues: (m,) estimates, descending.
        lower: (m,) guaranteed lower bounds, descending.
        error_bound: e.
        total: T, the exact sum of all eigenvalues.
        eps: the tolerances.
        resolved_rank: R.

    Returns:
        ranks: eps -> H*(eps) of the estimates when it is at most R, else None ("more than R").
        bounds: eps -> [H_lo, H_hi] (H_hi None when even all m sketch eigenvalues fall short).
        beyond: eps -> whether H*(eps) is beyond the resolved rank.
        saturated: eps -> False (a sketch cannot say that every mode is needed).
    """
    lam = eigenvalues.to(torch.float64)
    lo = lower.to(torch.float64)
    m = int(lam.numel())
    zero = torch.zeros(1, dtype=torch.float64)
    s_est = torch.cat([zero, lam.cumsum(0)])  # S_K for K = 0..m
    s_lo = torch.cat([zero, lo.cumsum(0)])
    missing = max(0.0, total - float(s_lo[-1]))
    k = torch.arange(m + 1, dtype=torch.float64)
    slack = torch.clamp(k * error_bound, max=missing)
    ranks: dict[float, int | None] = {}
    bounds: dict[float, list[int | None]] = {}
    beyond: dict[float, bool] = {}
    for e in eps:
        target = e * total

        def first(ok: Tensor) -> int | None:
            idx = torch.nonzero(ok)
            return int(idx[0]) if idx.numel() else None

        h_hi = first(total - s_lo <= target)
        h_lo = first(total - s_lo - slack <= target)
        if h_lo is None:  # even all m sketch eigenvalues plus the slack fall short
            h_lo = m + 1
        h_est = first(total - s_est <= target)
        if h_est is not None:  # the estimate's own H* lies within the guaranteed bounds
            h_est = max(h_est, h_lo) if h_hi is None else min(max(h_est, h_lo), h_hi)
        ok = total > 0 and h_est is not None and h_est <= resolved_rank
        ranks[e] = h_est if ok else None
        bounds[e] = [h_lo, h_hi]
        beyond[e] = total > 0 and not ok
    return ranks, bounds, beyond, {e: False for e in eps}


class PODAccumulator:
    """Incremental scale-selective POD of one layer's attention ensemble.

    Feed it batches of fields with :meth:`update` as they arrive; :meth:`compute` returns the
    same :class:`PODReport` as :func:`podmonitor.analyze` on the concatenated ensemble.

    Args:
        config: engine settings (default :class:`PODConfig`).
        device: where the state lives; None = the device of the first batch.

    Example:
        >>> acc = PODAccumulator(PODConfig())
        >>> for batch in batches:          # each (B, L, L)
        ...     acc.update(batch)
        >>> report = acc.compute()
        >>> report.dominant_scales, report.t_spec
    """

    def __init__(self, config: PODConfig | None = None, *, device: torch.device | str | None = None) -> None:
        self.config = config or PODConfig()
        self._device = torch.device(device) if device is not None else None
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget every snapshot."""
        self.seq_len: int | None = None
        self.causal: bool | None = self.config.causal
        self.n = 0
        self.n_skipped_nonfinite = 0
        self.input_dtypes: set[str] = set()
        self.n_negative = 0
        self.n_not_normalised = 0  # snapshots with a row that does not sum to 1 over its keys
        self.max_row_sum_error = 0.0  # the largest |row sum - 1| seen
        self.mean_field: Tensor | None = None  # (L, L)
        self.m2_back: Tensor | None = None  # (L, L) centred backward lag moment
        self.m2_fwd: Tensor | None = None  # (L, L) centred forward lag moment (bidirectional)
        self.entropy_sum: Tensor | None = None  # (L,)
        self.band: LagBand | None = None
        self.chunks: list[Tensor] = []  # exact mode: the snapshots in lag-band form, (n_c, P) each
        self.sketch: FrequentDirections | None = None  # sketch mode: replaces the chunks
        self.coherency_acc: CoherencyAccumulator | None = None  # sketch mode, fixed coherency_scale
        # fixed once L and causality are known (set by _init_state): the sketch rank l
        # (sketch_rank_for, 0 when no sketch fits) and, in "auto" mode with a budget, the bytes
        # the exact phase may hold before switching (the budget less the future sketch)
        self._sketch_rank = 0
        self._exact_limit: int | None = None

    @property
    def mode(self) -> str:
        """"exact" while the snapshots are kept, "sketch" once they are sketched."""
        return "exact" if self.sketch is None else "sketch"

    @property
    def device(self) -> torch.device:
        return self._device if self._device is not None else torch.device("cpu")

    def nbytes(self) -> int:
        """Bytes held by the state now."""
        tensors = [self.mean_field, self.m2_back, self.m2_fwd, self.entropy_sum, *self.chunks]
        if self.coherency_acc is not None:
            tensors += [self.coherency_acc.cross_re, self.coherency_acc.cross_im, self.coherency_acc.power]
        total = int(sum(t.numel() * t.element_size() for t in tensors if t is not None))
        return total + (self.sketch.nbytes() if self.sketch is not None else 0)

    def _init_state(self, seq_len: int, causal: bool, device: torch.device) -> None:
        dt = self.config.dtype
        self.seq_len = seq_len
        self.causal = causal
        self._device = device
        self.mean_field = torch.zeros(seq_len, seq_len, dtype=dt, device=device)
        self.m2_back = torch.zeros(seq_len, seq_len, dtype=dt, device=device)
        self.m2_fwd = None if causal else torch.zeros(seq_len, seq_len, dtype=dt, device=device)
        self.entropy_sum = torch.zeros(seq_len, dtype=dt, device=device)
        self.band = LagBand.build(seq_len, band_lags(self.config, seq_len), causal)
        cfg = self.config
        self._sketch_rank = sketch_rank_for(seq_len, cfg, causal)
        self._exact_limit = cfg.memory_budget_bytes
        if cfg.mode == "auto":
            # leave room for the sketch (and streamed coherency) next to the snapshots when switching
            self._exact_limit = auto_exact_limit(seq_len, cfg, causal, self._sketch_rank)
        if cfg.mode == "sketch":
            self._start_sketch()

    def _start_sketch(self) -> None:
        """Allocate the sketch (and the streamed coherency sums); the stored snapshots go into it.

        Raises:
            MemoryBudgetError: the budget cannot hold a sketch (see :func:`sketch_rank_for`).
        """
        assert self.seq_len is not None and self.band is not None and self.causal is not None
        cfg = self.config
        rank = self._sketch_rank  # sketch_rank_for(L, config, causal), computed once in _init_state
        if rank == 0:
            raise MemoryBudgetError(_no_sketch_message(self.seq_len, cfg, self.causal))
        self.sketch = FrequentDirections(self.band.size, rank, dtype=cfg.dtype,
                                         storage_dtype=cfg.resolved_storage_dtype, device=self.device)
        if _streamed_coherency(cfg):
            assert cfg.coherency_scale is not None
            self.coherency_acc = CoherencyAccumulator(self.seq_len, cfg.coherency_scale, cfg.omega0, cfg.dtype,
                                                      self.device, causal=self.causal)
        # the snapshots kept so far (auto mode), oldest first, each freed once it is in the sketch
        self.chunks.reverse()
        while self.chunks:
            chunk = self.chunks.pop()
            self._sketch_band_rows(chunk)
            del chunk

    def _sketch_band_rows(self, rows: Tensor) -> None:
        """Feed (b, P) lag-band snapshots to the sketch and, if streamed, to the coherency sums."""
        assert self.sketch is not None and self.band is not None
        self.sketch.update(rows)
        if self.coherency_acc is not None:
            self.coherency_acc.update_band(self.band, rows)

    # ----------------------------------------------------------------- update
    def _validate(self, fields: Any) -> Tensor:
        x = _as_tensor(fields)
        if x.is_complex() or not (x.is_floating_point() or x.dtype in (torch.int32, torch.int64)):
            raise TypeError(f"attention fields must be real floating point, got dtype {x.dtype}")
        if x.ndim == 2:
            x = x.unsqueeze(0)
        if x.ndim != 3:
            raise ValueError(
                f"expected fields of shape (N, L, L) (or one (L, L) field), got shape {tuple(x.shape)}"
            )
        if x.shape[1] != x.shape[2]:
            raise ValueError(f"attention fields must be square (L, L); got {x.shape[1]} x {x.shape[2]}")
        if self.seq_len is not None and x.shape[1] != self.seq_len:
            raise ValueError(
                f"field length changed: this accumulator holds L = {self.seq_len}, got L = {x.shape[1]}"
            )
        return x

    def update(self, fields: Tensor | np.ndarray) -> int:
        """Add a batch of snapshots.

        Args:
            fields: (B, L, L) or (L, L) attention fields of one layer (rows are queries), any real
                dtype (float16/bfloat16 are upcast to ``config.dtype``), torch or numpy.

        Returns:
            The number of snapshots taken (non-finite ones are skipped and counted in
            ``n_skipped_nonfinite``).

        Raises:
            ValueError: wrong shape, a length different from earlier batches, or mass above
                the diagonal of a field declared (or inferred) causal.
            TypeError: non-real input.
            MemoryBudgetError: the state plus the eigenproblem of ``compute`` would exceed
                ``config.memory_budget_bytes`` (nothing is added then; after a refused first
                batch the accumulator is empty, as before it).

        Every check runs before anything is added, so bad input leaves the accumulator as it
        was. A failure while adding (e.g. out of memory) leaves it as it was in exact mode; in
        sketch mode the sketch may already hold part of the batch: ``reset()`` then.
        """
        x = self._validate(fields)
        dtype_name = str(x.dtype).replace("torch.", "")
        # A sum is finite iff every entry is (barring overflow, which the exact check catches).
        finite = torch.isfinite(x.sum(dim=(1, 2)))
        if not bool(finite.all()):
            finite = torch.isfinite(x).flatten(1).all(dim=1)
        n_bad = int((~finite).sum())
        if n_bad:
            x = x[finite]
        if x.shape[0] == 0:
            self.n_skipped_nonfinite += n_bad
            self.input_dtypes.add(dtype_name)
            return 0
        seq_len = x.shape[1]
        device = self._device if self._device is not None else x.device
        upper = max_above_diagonal(x)
        causal = self.causal
        if causal is None:
            causal = upper == 0
        elif causal and upper > 0:
            raise ValueError(
                f"field has mass above the diagonal (max {upper:.3g}) but is treated as causal"
                + (" (inferred from the first batch)" if self.config.causal is None else "")
                + ": pass PODConfig(causal=False) for bidirectional attention"
            )
        any_negative = bool(x.amin() < 0)  # one reduction; count per snapshot only when needed
        n_negative = int((x < 0).flatten(1).any(dim=1).sum()) if any_negative else 0
        first = self.seq_len is None
        try:  # a first batch that is not added leaves the accumulator empty (its counters kept)
            if first:
                self._init_state(seq_len, causal, device)
            self._check_budget(x.shape[0])
            n_unnormalised = self._add_batch(x, causal, any_negative)
        except BaseException:
            if first:
                self._forget_layout()
            raise
        self.n_skipped_nonfinite += n_bad
        self.n_negative += n_negative
        self.n_not_normalised += n_unnormalised
        self.input_dtypes.add(dtype_name)
        return x.shape[0]

    def _check_budget(self, n_new: int) -> None:
        """Before ``n_new`` snapshots are added: switch to the sketch ("auto") or refuse, when the
        state plus the eigenproblem of ``compute`` would exceed the budget.

        Raises:
            MemoryBudgetError: the budget cannot hold them (nothing has changed then).
        """
        cfg = self.config
        budget = cfg.memory_budget_bytes
        if budget is None or self.sketch is not None:
            return
        assert self.band is not None and self.seq_len is not None and self.causal is not None
        n_total = self.n + n_new
        need = exact_budgeted_bytes(n_total, self.seq_len, cfg, self.causal)
        # rank and limit are fixed after _init_state (no per-update recomputation)
        rank = self._sketch_rank if cfg.mode == "auto" else 0
        limit = self._exact_limit if self._exact_limit is not None else budget
        if need <= limit:
            return
        if rank:
            self._start_sketch()
            return
        hint = ("; PODConfig(mode='auto') or mode='sketch' keeps a bounded sketch instead"
                if cfg.mode == "exact" else "; " + _no_sketch_message(self.seq_len, cfg, self.causal))
        state = n_total * self.band.size * cfg.resolved_storage_dtype.itemsize
        raise MemoryBudgetError(
            f"storing {n_new} more snapshots (L = {self.seq_len}, {self.band.size} lag-band entries each) "
            f"would bring this accumulator to {need / 2**20:.1f} MiB ({state / 2**20:.1f} MiB of snapshots, "
            f"{exact_eig_bytes(n_total, self.band.size, cfg) / 2**20:.1f} MiB for the eigenproblem of compute), "
            f"over its budget of {budget / 2**20:.1f} MiB (PODConfig.memory_budget_bytes); "
            f"{self.n} snapshots are kept" + hint
        )

    def _forget_layout(self) -> None:
        """Undo ``_init_state`` after a first batch that was not added (the counters are kept)."""
        skipped, dtypes = self.n_skipped_nonfinite, self.input_dtypes
        self.reset()
        self.n_skipped_nonfinite, self.input_dtypes = skipped, dtypes

    def _add_batch(self, x: Tensor, causal: bool, any_negative: bool) -> int:
        """Add (B, L, L) checked fields: moments about the batch mean, entropies, stored band entries.

        Returns:
            How many of the fields have a row whose sum over its keys is not 1 (see
            :func:`normalisation_tol`); the largest deviation goes into ``max_row_sum_error``.

        Works through the batch a few fields at a time (``SUB_BYTES`` of fields per step) in
        buffers allocated once per call: the input is converted to ``config.dtype`` and moved to
        the state's device one step at a time, never as a whole, and each step's temporaries stay
        in cache. The state changes only at the end (in sketch mode the sketch is fed every
        ``SKETCH_FEED_BYTES`` of band entries on the way).
        """
        assert self.band is not None and self.entropy_sum is not None
        cfg = self.config
        dt, dev, seq_len, n_b = cfg.dtype, self.device, x.shape[1], x.shape[0]
        s_dtype = cfg.resolved_storage_dtype
        step = max(1, min(n_b, SUB_BYTES // (torch.empty((), dtype=dt).element_size() * seq_len * seq_len)))
        # Centring about the batch's own mean makes each step's moment exact without the
        # between-group terms; one Chan et al. combination per batch merges it into the state.
        mean_b = torch.zeros(seq_len, seq_len, dtype=dt, device=dev)
        for start in range(0, n_b, step):
            mean_b += x[start:start + step].sum(0, dtype=dt).to(dev)
        mean_b /= n_b
        shear = LagShear(seq_len, step, dt, dev)
        m2b_back = torch.zeros(seq_len, seq_len, dtype=dt, device=dev)
        m2b_fwd = None if causal else torch.zeros(seq_len, seq_len, dtype=dt, device=dev)
        h_sum = torch.zeros(seq_len, dtype=dt, device=dev)
        work = torch.empty(step, seq_len, seq_len, dtype=dt, device=dev)
        convert = None if x.dtype == dt and x.device == dev else torch.empty_like(work)
        index = self.band.flat_index.to(dev).unsqueeze(0)
        # the batch's lag-band entries: kept (exact mode), or fed to the sketch a bounded part at a time
        sketch = self.sketch is not None
        store_dtype = dt if sketch else s_dtype
        rows_kept = n_b
        if sketch:
            row_bytes = self.band.size * torch.empty((), dtype=dt).element_size()
            rows_kept = min(n_b, max(step, SKETCH_FEED_BYTES // row_bytes))
        store = torch.empty(rows_kept, self.band.size, dtype=store_dtype, device=dev)
        filled = 0
        tol = normalisation_tol(x.dtype)
        n_unnormalised, worst = 0, 0.0
        for start in range(0, n_b, step):
            stop = min(n_b, start + step)
            part = x[start:stop]
            if convert is not None:
                part = convert[:stop - start].copy_(part)
            shear.load(part, mean_b)
            shear.add_backward_moment(m2b_back)
            if m2b_fwd is not None:
                shear.add_forward_moment(m2b_fwd)
            h_sum += row_entropy(part, causal, has_negative=any_negative, work=work)[0]
            # causal fields were checked to be zero above the diagonal: a full row sums its keys j <= i
            row_error = (part.sum(-1) - 1.0).abs().amax(-1)  # (b,)
            n_unnormalised += int((row_error > tol).sum())
            worst = max(worst, float(row_error.max()))
            flat = part.reshape(stop - start, -1)
            rows = index.expand(stop - start, -1)
            if sketch and filled + (stop - start) > rows_kept:
                self._sketch_band_rows(store[:filled])
                filled = 0
            target = store[filled:filled + stop - start]
            if store_dtype == dt:
                torch.gather(flat, 1, rows, out=target)  # (the fastest gather here)
            else:
                target.copy_(torch.gather(flat, 1, rows))
            filled += stop - start
        if sketch:
            self._sketch_band_rows(store[:filled])
        self._combine(n_b, mean_b, shear.finish(m2b_back, backward=True),
                      None if m2b_fwd is None else shear.finish(m2b_fwd, backward=False))
        self.entropy_sum += h_sum
        self.max_row_sum_error = max(self.max_row_sum_error, worst)
        if not sketch:
            self.chunks.append(store)
        return n_unnormalised

    def _combine(self, n_b: int, mean_b: Tensor, m2b_back: Tensor, m2b_fwd: Tensor | None) -> None:
        """Merge a group of n_b snapshots (mean, centred moments) into the running state."""
        assert self.mean_field is not None and self.m2_back is not None
        n_a = self.n
        n = n_a + n_b
        delta = mean_b - self.mean_field  # (L, L)
        w = n_a * n_b / n
        self.m2_back += m2b_back
        if n_a > 0:  # the between-group term vanishes for the first group
            self.m2_back += w * lag_moment(lag_signals(delta).unsqueeze(0))
        if self.m2_fwd is not None:
            assert m2b_fwd is not None
            self.m2_fwd += m2b_fwd
            if n_a > 0:
                self.m2_fwd += w * lag_moment(lag_signals(delta, forward=True).flip(0).unsqueeze(0))
        self.mean_field += delta * (n_b / n)
        self.n = n

    # ------------------------------------------------------------------ merge
    def merge(self, other: PODAccumulator) -> PODAccumulator:
        """Absorb another accumulator's snapshots (e.g. from another process); returns self.

        The result equals one accumulator fed self's snapshots, then other's (in sketch mode:
        within the error bound, which adds up: the merged sketch's Delta is the sum of both and
        of the merge's own shrinks). An exact accumulator merged with a sketch becomes a sketch.
        """
        if other.seq_len is None:
            self.n_skipped_nonfinite += other.n_skipped_nonfinite
            return self
        if self.config != other.config:
            raise ValueError("cannot merge accumulators with different PODConfig")
        if self.seq_len is None:
            self.load_state_dict(other.state_dict())
            return self
        if other.seq_len != self.seq_len:
            raise ValueError(f"cannot merge accumulators of L = {self.seq_len} and L = {other.seq_len}")
        if other.causal != self.causal:
            raise ValueError("cannot merge a causal accumulator with a bidirectional one")
        assert other.mean_field is not None and other.m2_back is not None and other.entropy_sum is not None
        dev = self.device
        self._combine(other.n, other.mean_field.to(dev), other.m2_back.to(dev),
                      None if other.m2_fwd is None else other.m2_fwd.to(dev))
        assert self.entropy_sum is not None
        self.entropy_sum += other.entropy_sum.to(dev)
        if self.sketch is None and other.sketch is not None:
            self._start_sketch()
        if self.sketch is not None:
            if other.sketch is not None:
                self.sketch.merge(other.sketch)
                if self.coherency_acc is not None and other.coherency_acc is not None:
                    for name in ("cross_re", "cross_im", "power"):
                        getattr(self.coherency_acc, name).add_(getattr(other.coherency_acc, name).to(dev))
                    self.coherency_acc.n += other.coherency_acc.n
            else:
                for chunk in other.chunks:
                    self._sketch_band_rows(chunk.to(dev))
        else:
            self.chunks.extend(c.to(dev) for c in other.chunks)
            budget = self.config.memory_budget_bytes
            if self.config.mode == "auto" and budget is not None and self._sketch_rank \
                    and exact_budgeted_bytes(self.n, self.seq_len, self.config, self.causal) > budget:
                self._start_sketch()
        self.n_skipped_nonfinite += other.n_skipped_nonfinite
        self.n_negative += other.n_negative
        self.n_not_normalised += other.n_not_normalised
        self.max_row_sum_error = max(self.max_row_sum_error, other.max_row_sum_error)
        self.input_dtypes |= other.input_dtypes
        return self

    # ------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """Picklable state (tensors on their device; the snapshots as one (N, P) tensor)."""
        return {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "seq_len": self.seq_len,
            "causal": self.causal,
            "n": self.n,
            "n_skipped_nonfinite": self.n_skipped_nonfinite,
            "n_negative": self.n_negative,
            "n_not_normalised": self.n_not_normalised,
            "max_row_sum_error": self.max_row_sum_error,
            "input_dtypes": sorted(self.input_dtypes),
            "mean_field": self.mean_field,
            "m2_back": self.m2_back,
            "m2_fwd": self.m2_fwd,
            "entropy_sum": self.entropy_sum,
            "snapshots": torch.cat(self.chunks) if len(self.chunks) > 1 else (self.chunks[0] if self.chunks else None),
            "mode": self.mode,
            # sketch mode: flat keys, so that a caller moving the top-level tensors (e.g. to the CPU
            # before a gather) moves these too
            **({} if self.sketch is None else {f"sketch_{k}": v for k, v in self.sketch.state_dict().items()}),
            **({} if self.coherency_acc is None else {
                "coherency_cross_re": self.coherency_acc.cross_re, "coherency_cross_im": self.coherency_acc.cross_im,
                "coherency_power": self.coherency_acc.power, "coherency_n": self.coherency_acc.n}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (the configuration must match)."""
        if state.get("version") not in (1, STATE_VERSION):
            raise ValueError(f"unsupported PODAccumulator state version {state.get('version')}")
        saved = PODConfig.from_dict(state["config"])
        if saved != self.config:
            raise ValueError("the saved state was made with a different PODConfig")
        self.reset()
        if state["seq_len"] is None:
            self.n_skipped_nonfinite = int(state["n_skipped_nonfinite"])
            return
        dev = self._device or state["mean_field"].device
        self._init_state(int(state["seq_len"]), bool(state["causal"]), torch.device(dev))
        self.n = int(state["n"])
        self.n_skipped_nonfinite = int(state["n_skipped_nonfinite"])
        self.n_negative = int(state.get("n_negative", 0))
        self.n_not_normalised = int(state.get("n_not_normalised", 0))  # absent before they were kept
        self.max_row_sum_error = float(state.get("max_row_sum_error", 0.0))
        self.input_dtypes = set(state.get("input_dtypes", []))
        self.mean_field = state["mean_field"].to(self.device, self.config.dtype).clone()
        self.m2_back = state["m2_back"].to(self.device, self.config.dtype).clone()
        self.m2_fwd = None if state["m2_fwd"] is None else state["m2_fwd"].to(self.device, self.config.dtype).clone()
        self.entropy_sum = state["entropy_sum"].to(self.device, self.config.dtype).clone()
        snaps = state["snapshots"]
        assert self.band is not None
        if state.get("mode", "exact") == "sketch":
            if self.sketch is None:  # an auto-mode state that had switched
                self._start_sketch()
            assert self.sketch is not None
            sk = {k[len("sketch_"):]: v for k, v in state.items() if k.startswith("sketch_")}
            if int(sk["n_cols"]) != self.band.size or int(sk["n"]) != self.n:
                raise ValueError("corrupt PODAccumulator state: the sketch does not match its counts")
            self.sketch.load_state_dict(sk)
            if self.coherency_acc is not None and "coherency_power" in state:
                for name in ("cross_re", "cross_im", "power"):
                    getattr(self.coherency_acc, name).copy_(state[f"coherency_{name}"])
                self.coherency_acc.n = int(state["coherency_n"])
            return
        self.chunks = [] if snaps is None else [snaps.to(self.device).clone()]
        if snaps is not None and (snaps.shape[0] != self.n or snaps.shape[1] != self.band.size):
            raise ValueError("corrupt PODAccumulator state: snapshot store does not match its counts")

    # ---------------------------------------------------------------- compute
    def compute(self) -> PODReport:
        """Analyse every snapshot seen so far (METHOD.md sections 1 to 6)."""
        t0 = time.perf_counter()
        cfg = self.config
        messages: list[str] = []
        if self.n_skipped_nonfinite:
            messages.append(f"{self.n_skipped_nonfinite} snapshot(s) with NaN/Inf entries were skipped")
        if self.n_negative:
            messages.append(
                f"{self.n_negative} snapshot(s) have negative entries: not probabilities "
                "(the entropy ignores negative entries)"
            )
        if self.n_not_normalised:
            messages.append(self._normalisation_message())
        if self.seq_len is None:
            return self._empty_report(messages)
        assert self.mean_field is not None and self.m2_back is not None and self.band is not None
        assert self.entropy_sum is not None and self.causal is not None
        seq_len, n, causal, dt, dev = self.seq_len, self.n, self.causal, cfg.dtype, self.device

        scales_list = cfg.scales_for(seq_len)
        scales = torch.tensor(scales_list, dtype=dt, device=dev)
        n_rows = float(n * seq_len)
        # Fluctuation scalogram from the centred lag moments; mean-field scalogram from Abar.
        scalogram = scalogram_from_moment(self.m2_back, scales, cfg.omega0, n_rows)
        d_mean = lag_signals(self.mean_field)
        mean_scalogram = scalogram_from_moment(d_mean.T @ d_mean, scales, cfg.omega0, float(seq_len))
        if self.m2_fwd is not None:
            scalogram += scalogram_from_moment(self.m2_fwd, scales, cfg.omega0, n_rows)
            d_mean_f = lag_signals(self.mean_field, forward=True)
            mean_scalogram += scalogram_from_moment(d_mean_f.T @ d_mean_f, scales, cfg.omega0, float(seq_len))
        energy = scalogram.sum(-1)
        mean_energy = mean_scalogram.sum(-1)

        valid_rows = (torch.arange(1, seq_len + 1, device=dev) >= 2) if causal else torch.full(
            (seq_len,), seq_len >= 2, device=dev)
        entropy_profile = torch.where(valid_rows, self.entropy_sum / n, torch.full_like(self.entropy_sum, math.nan))
        entropy = float(entropy_profile[valid_rows].mean()) if bool(valid_rows.any()) else math.nan

        status = "ok"
        dominant_idx: list[int] = []
        if not scales_list:
            status = "no_scales"
            messages.append(
                f"L = {seq_len} supports no scale of the grid (smallest {cfg.scales[0]:g} needs "
                f"L >= {cfg.scales[0] / cfg.max_scale_fraction:g})"
            )
        elif n < cfg.min_snapshots:
            status = "too_few_snapshots"
            messages.append(f"{n} snapshot(s): the POD needs at least {cfg.min_snapshots}")
        elif not float(energy.sum()) > self._rounding_floor(mean_energy):
            status = "zero_variance"
            messages.append("all snapshots are identical: the fluctuation field is zero")
        else:
            dominant_idx = dominant_scale_indices(energy, cfg.n_dominant, cfg.dominant_method)

        per_scale: list[ScaleReport] = []
        if status == "ok":
            center = self._band_mean() if self.sketch is None else None
            for k in dominant_idx:
                per_scale.append(self._analyse_scale(scales_list[k], center))
            if per_scale and per_scale[0].status != "ok":
                status = per_scale[0].status
                messages.append(f"top dominant scale: {per_scale[0].status}")
        if status == "ok" and self.n_not_normalised:
            status = "not_normalised"
        sketch_info = None
        if self.sketch is not None:
            sk = self.sketch
            sketch_info = {"rank": sk.rank, "rows": sk.n_rows, "delta_total": sk.delta_total,
                           "n_shrinks": sk.n_shrinks, "state_bytes": self.nbytes()}
            if cfg.sketch_rank is not None and sk.rank < cfg.sketch_rank:
                messages.append(f"sketch rank l = {sk.rank} instead of PODConfig.sketch_rank = {cfg.sketch_rank}: "
                                f"a field has only {self.band.size} stored entries, and a sketch of that many "
                                "rows is already lossless")
            head = per_scale[0] if per_scale else None
            messages.append(
                f"sketch mode (Frequent Directions, l = {sk.rank} rows, {sk.n_shrinks} shrinks): eigenvalues "
                "within error_bound of the exact POD, energies and scalograms exact"
                + ("" if head is None else
                   f"; at the top scale error_bound = {head.error_bound:.3g}, resolved rank R = {head.resolved_rank}")
            )
            if head is not None:
                for e, beyond in head.beyond_resolved.items():
                    if beyond:
                        lo = head.effective_rank_bounds[e][0]
                        messages.append(f"H*({e:g}) is more than the resolved rank R = {head.resolved_rank} "
                                        f"(guaranteed >= {lo})")
                if head.resolved_rank is not None and head.resolved_rank < cfg.k_fit:
                    messages.append(f"T_spec fitted on the {min(head.resolved_rank, cfg.k_fit)} resolved eigenvalues "
                                    f"(fewer than k_fit = {cfg.k_fit})")

        coherency, coh_scale = None, None
        if self.sketch is not None and cfg.coherency and self.coherency_acc is None:
            messages.append("coherency not computed: in sketch mode it needs a fixed PODConfig.coherency_scale "
                            "(the snapshots are not kept until the dominant scale is known)")
        elif cfg.coherency and n > 0 and (cfg.coherency_scale is not None or dominant_idx):
            coh_scale = cfg.coherency_scale if cfg.coherency_scale is not None else scales_list[dominant_idx[0]]
            coherency = self._coherency(coh_scale)
            if self.causal and bool(torch.isnan(coherency).any()):
                messages.append(
                    f"coherency: positions more than {self._coherency_reach} tokens right of a query "
                    "(where the wavelet no longer reaches any of its keys) are NaN"
                )
            if self.band.n_lags < seq_len:
                messages.append(
                    f"coherency computed over the stored lag band |i - j| < {self.band.n_lags}; "
                    "entries beyond it are NaN"
                )
        return PODReport(
            status=status,
            n_snapshots=n,
            n_skipped_nonfinite=self.n_skipped_nonfinite,
            seq_len=seq_len,
            causal=causal,
            scales=scales.cpu(),
            scalogram=scalogram.cpu(),
            mean_scalogram=mean_scalogram.cpu(),
            scale_energy=energy.cpu(),
            mean_scale_energy=mean_energy.cpu(),
            dominant_scales=[scales_list[k] for k in dominant_idx],
            scale_centroid=scale_centroid(energy, scales) if status not in ("no_scales", "zero_variance") else math.nan,
            per_scale=per_scale,
            mean_attention_distance=mean_attention_distance(self.mean_field),
            entropy=entropy,
            entropy_profile=entropy_profile.cpu(),
            coherency=None if coherency is None else coherency.cpu(),
            coherency_scale=coh_scale,
            mean_field=self.mean_field.cpu().clone(),
            config=cfg.to_dict(),
            messages=messages,
            analysis_seconds=time.perf_counter() - t0,
            mode=self.mode,
            sketch=sketch_info,
            n_not_normalised=self.n_not_normalised,
            max_row_sum_error=self.max_row_sum_error,
        )

    def _normalisation_message(self) -> str:
        keys = "j <= i" if self.causal or self.causal is None else "all j"
        return (
            f"{self.n_not_normalised} of {self.n} snapshot(s) have rows that do not sum to 1 over their keys "
            f"({keys}; largest |row sum - 1| = {self.max_row_sum_error:.3g}): not attention probabilities "
            "(raw scores, or heads summed instead of averaged?); the entropy and attention distance are "
            "not meaningful, the POD is of the fields as given"
        )

    def _rounding_floor(self, mean_energy: Tensor) -> float:
        """Fluctuation energy indistinguishable from rounding of the mean (relative (100 eps)^2)."""
        eps = torch.finfo(self.config.dtype).eps
        return float(mean_energy.sum()) * (100 * eps) ** 2

    def _band_mean(self) -> Tensor:
        """(P,) the mean field in lag-band layout."""
        assert self.band is not None and self.mean_field is not None
        return self.band.extract(self.mean_field.unsqueeze(0))[0]

    def _analyse_scale(self, scale: float, center: Tensor | None) -> ScaleReport:
        cfg = self.config
        assert self.band is not None and self.causal is not None and self.seq_len is not None
        support = window_support(scale, cfg.window, cfg.window_tol)
        n_lags = self.band.n_lags if math.isinf(support) else min(self.band.n_lags, int(math.floor(support)) + 1)
        width = self.band.prefix(n_lags)
        lags = self.band.lag[:width].to(self.device)
        weights = lag_window(lags, scale, cfg.window).to(cfg.dtype)
        if self.sketch is not None:
            return self._analyse_scale_sketch(scale, n_lags, lags, weights)
        res = snapshot_pod(self.chunks, center=center, weights=weights, n_modes=cfg.n_modes,
                           floor=cfg.eig_floor, dtype=cfg.dtype)
        lam = res.eigenvalues
        total = float(lam.sum())
        fit = spectral_fit(lam, cfg.k_fit, cfg.eig_floor)
        er = effective_rank(lam, cfg.eps, cfg.eig_floor)
        signs, axis, profiles, fields = self._signed_modes(res.modes, lags)
        return self._scale_report(
            scale, n_lags, lam, total, fit, axis, profiles, fields,
            effective_rank=er.ranks,
            saturated=er.saturated,
            n_nonzero=er.n_nonzero,
            coefficients=(res.coefficients * signs.unsqueeze(0)).cpu(),
            mode="exact",
            error_bound=0.0,
            resolved_rank=er.n_nonzero,
            effective_rank_bounds={e: [r, r] for e, r in er.ranks.items()},
            beyond_resolved={e: False for e in er.ranks},
        )

    def _signed_modes(self, modes: Tensor, lags: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Mode lag profiles with the sign convention applied: (signs (K,), lag axis, profiles (K, T),
        dense mode fields (K, L, L) or None unless ``keep_mode_fields``)."""
        assert self.band is not None and self.causal is not None
        axis, profiles = mode_lag_profiles(modes, lags, self.causal)
        signs = fix_signs(profiles)
        fields = self.band.to_dense(modes * signs.unsqueeze(1)) if self.config.keep_mode_fields else None
        return signs, axis, profiles * signs.unsqueeze(1), fields

    def _scale_report(self, scale: float, n_lags: int, lam: Tensor, total: float, fit: Any, axis: Tensor,
                      profiles: Tensor, fields: Tensor | None, **mode_specific: Any) -> ScaleReport:
        """The fields of a :class:`ScaleReport` common to exact and sketch mode, plus ``mode_specific``."""
        return ScaleReport(
            scale=scale,
            window=self.config.window,
            n_lags=n_lags,
            eigenvalues=lam.cpu(),
            energy_fractions=(lam / total).cpu() if total > 0 else torch.zeros_like(lam).cpu(),
            total_energy=total,
            t_spec=fit.t_spec,
            beta=fit.beta,
            r2=fit.r2,
            n_fit=fit.n_points,
            status=fit.status if total > 0 else "zero_variance",
            lags=axis.cpu(),
            mode_lag_profiles=profiles.cpu(),
            modes=None if fields is None else fields.cpu(),
            **mode_specific,
        )

    def _analyse_scale_sketch(self, scale: float, n_lags: int, lags: Tensor, weights: Tensor) -> ScaleReport:
        """The POD at one scale from the sketch, with its error bound, resolved rank and H*(eps) bounds."""
        cfg = self.config
        assert self.sketch is not None and self.band is not None and self.causal is not None
        res = sketch_pod(self.sketch, weights, n_modes=cfg.n_modes, floor=cfg.eig_floor)
        lam, lam_lo, err, total = res.eigenvalues, res.eigenvalues_lower, res.error_bound, res.total_energy
        lam1 = float(lam[0]) if lam.numel() else 0.0
        n_nonzero = int((lam > cfg.eig_floor * lam1).sum()) if lam1 > 0 else 0
        if err > 0:
            resolved = int((lam >= cfg.sketch_resolve_factor * err).sum())
        else:  # nothing was shrunk away: the sketch is the exact ensemble
            resolved = n_nonzero
        fit = spectral_fit(lam[:resolved], cfg.k_fit, cfg.eig_floor)
        ranks, bounds, beyond, saturated = sketch_effective_rank(lam.cpu(), lam_lo.cpu(), err, total, cfg.eps,
                                                                 resolved)
        if err == 0:  # exact: "needs every mode" is decidable
            saturated = {e: r is not None and r >= n_nonzero for e, r in ranks.items()}
        _, axis, profiles, fields = self._signed_modes(res.modes, lags)
        return self._scale_report(
            scale, n_lags, lam, total, fit, axis, profiles, fields,
            effective_rank=ranks,
            saturated=saturated,
            n_nonzero=n_nonzero,
            coefficients=None,
            mode="sketch",
            error_bound=err,
            eigenvalues_lower=lam_lo.cpu(),
            resolved_rank=resolved,
            effective_rank_bounds=bounds,
            beyond_resolved=beyond,
        )

    def _coherency(self, scale: float) -> Tensor:
        assert self.band is not None and self.seq_len is not None
        if self.coherency_acc is not None:  # sketch mode: streamed at the fixed coherency_scale
            acc = self.coherency_acc
        else:
            acc = CoherencyAccumulator(self.seq_len, scale, self.config.omega0, self.config.dtype, self.device,
                                       causal=bool(self.causal))
            for chunk in self.chunks:
                acc.update_band(self.band, chunk)
        gamma = acc.compute()
        self._coherency_reach = acc.reach if self.causal else None
        if self.band.n_lags < self.seq_len:
            pos = torch.arange(self.seq_len, device=gamma.device)
            far = (pos.unsqueeze(1) - pos.unsqueeze(0)).abs() >= self.band.n_lags
            gamma = gamma.masked_fill(far, math.nan)
        return gamma

    def _empty_report(self, messages: list[str]) -> PODReport:
        messages = messages + ["no finite snapshot was given"]
        empty = torch.zeros(0)
        return PODReport(
            status="empty", n_snapshots=0, n_skipped_nonfinite=self.n_skipped_nonfinite, seq_len=0,
            causal=bool(self.causal) if self.causal is not None else True, scales=empty,
            scalogram=torch.zeros(0, 0), mean_scalogram=torch.zeros(0, 0), scale_energy=empty,
            mean_scale_energy=empty, dominant_scales=[], scale_centroid=math.nan, per_scale=[],
            mean_attention_distance=math.nan, entropy=math.nan, entropy_profile=empty,
            coherency=None, coherency_scale=None, mean_field=torch.zeros(0, 0),
            config=self.config.to_dict(), messages=messages,
        )
