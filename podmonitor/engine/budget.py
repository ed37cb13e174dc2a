"""Memory planning of one layer's accumulator: what it stores, what the budget bounds, the sketch rank.

``PODConfig.memory_budget_bytes`` bounds the state kept between updates plus the eigenproblem
that ``compute`` builds from it (the part of compute that grows with N):

* exact store: ``F + N P s`` of state and ``2 min(N, P)^2 c`` for the N x N Gram matrix (or the
  D x D covariance when a filtered field has D < N entries) and its eigenvectors;
* sketch store: ``F + 2 P c + 2 l P s`` (+ the streamed coherency sums) and ``5 (2 l)^2 c`` for
  the sketch's Gram matrices;

with F the running tensors (:func:`~podmonitor.engine.running.fixed_state_bytes`), P the lag-band
entries of a field, c and s the bytes of ``dtype`` and ``storage_dtype``, l the sketch rank. With
``storage_dtype`` unset, s = c in the planner (:func:`estimate_memory`, :func:`sketch_rank_for`):
an upper bound for float32, float16 and bfloat16 fields, which the exact store keeps as given
(:func:`~podmonitor.engine.store.stored_dtype`). The accumulator's check before each update counts
the bytes its exact store really holds, plus the new batch in the dtype it will be kept in, so
narrow captures fill the budget with twice (float32) or four times (16-bit) as many snapshots
before the budget refuses them or auto mode switches to a sketch.
:func:`estimate_memory` also lists compute's other, bounded temporaries.
"""

from __future__ import annotations

import math

from .coherency import CoherencyAccumulator
from .config import PODConfig
from .lags import window_support
from .running import fixed_state_bytes
from .sketch import SKETCH_BLOCK_BYTES, FrequentDirections


class MemoryBudgetError(RuntimeError):
    """An update would make the accumulator exceed ``PODConfig.memory_budget_bytes``."""


def band_lags(config: PODConfig, seq_len: int) -> int:
    """How many lags the accumulator stores for length L: the support of the widest window."""
    scales = config.scales_for(seq_len)
    if not scales:
        return seq_len
    support = window_support(max(scales), config.window, config.window_tol)
    return seq_len if math.isinf(support) else min(seq_len, int(math.floor(support)) + 1)


def band_size(seq_len: int, band: int, causal: bool) -> int:
    """P, the entries of the lag band (lags below ``band``): sum over tau < band of (L - tau),
    twice for tau > 0 when bidirectional (closed form, no loop over the lags)."""
    band = max(0, min(band, seq_len))
    one_side = band * seq_len - band * (band - 1) // 2
    return one_side if causal or band == 0 else 2 * one_side - seq_len


def stored_entries(seq_len: int, config: PODConfig, causal: bool) -> int:
    """P for length L under ``config``: the lag-band entries each snapshot stores."""
    return band_size(seq_len, band_lags(config, seq_len), causal)


def fixed_bytes(seq_len: int, config: PODConfig, causal: bool) -> int:
    """F: the running tensors (mean field, lag moments, entropy sums), whatever N."""
    return fixed_state_bytes(seq_len, causal, config.dtype)


def streamed_coherency(config: PODConfig) -> bool:
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


def exact_budgeted_bytes(n_snapshots: int, seq_len: int, config: PODConfig, causal: bool,
                         snapshot_bytes: int | None = None) -> int:
    """What ``memory_budget_bytes`` bounds in exact mode: the state of N snapshots plus the
    eigenproblem that ``compute`` will build from them.

    ``snapshot_bytes``: what the N snapshots take in the store (the accumulator counts the dtypes
    it really keeps, :func:`~podmonitor.engine.store.stored_dtype`); default ``N P s``, the
    planner's upper bound."""
    p = stored_entries(seq_len, config, causal)
    if snapshot_bytes is None:
        snapshot_bytes = n_snapshots * p * config.resolved_storage_dtype.itemsize
    state = snapshot_bytes + fixed_bytes(seq_len, config, causal)
    return state + exact_eig_bytes(n_snapshots, p, config)


def sketch_budgeted_bytes(rank: int, seq_len: int, config: PODConfig, causal: bool) -> int:
    """What ``memory_budget_bytes`` bounds in sketch mode: the sketch (and streamed coherency sums),
    the O(L^2) state and the sketch's eigenproblems."""
    p = stored_entries(seq_len, config, causal)
    coh = CoherencyAccumulator.state_bytes(seq_len, config.dtype) if streamed_coherency(config) else 0
    sketch = FrequentDirections.state_bytes(p, rank, config.dtype, config.resolved_storage_dtype)
    return fixed_bytes(seq_len, config, causal) + coh + sketch + sketch_eig_bytes(rank, config)


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
    p = stored_entries(seq_len, config, causal)
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
    to the exact snapshots while these are fed into it. The budget itself without a sketch."""
    budget = config.memory_budget_bytes
    if budget is None or rank == 0:
        return budget
    return budget - (sketch_budgeted_bytes(rank, seq_len, config, causal) - fixed_bytes(seq_len, config, causal))


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

    Raises:
        MemoryBudgetError: "sketch" mode, and the budget holds no sketch.
    """
    from .pod import BLOCK_BYTES

    config = config or PODConfig()
    mode = mode or config.mode
    itemsize = config.dtype.itemsize
    p = stored_entries(seq_len, config, causal)
    fixed = fixed_bytes(seq_len, config, causal)
    modes = config.n_modes * (p + (seq_len * seq_len if config.keep_mode_fields else 0)) * itemsize
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
        raise MemoryBudgetError(no_sketch_message(seq_len, config, causal))
    if rank == 0:
        block = min(n_snapshots * p * itemsize, BLOCK_BYTES)
        eig = exact_eig_bytes(n_snapshots, p, config)  # N x N Gram (or D x D covariance) + eigenvectors
        coh = CoherencyAccumulator.compute_bytes(seq_len, config.dtype) if config.coherency else 0
        extra = 2 * block + eig + modes + coh
        return {"state": int(exact_state), "compute_extra": int(extra), "total": int(exact_state + extra),
                "budgeted": int(exact_budgeted), "sketch_rank": 0}
    coh_state = CoherencyAccumulator.state_bytes(seq_len, config.dtype) if streamed_coherency(config) else 0
    state = fixed + coh_state + FrequentDirections.state_bytes(p, rank, config.dtype, config.resolved_storage_dtype)
    eig = sketch_eig_bytes(rank, config)  # windowed Gram, un-windowed Gram, eigenvectors, compensation
    extra = eig + SKETCH_BLOCK_BYTES + modes + (seq_len * seq_len * itemsize if coh_state else 0)
    return {"state": int(state), "compute_extra": int(extra), "total": int(state + extra),
            "budgeted": int(sketch_budgeted_bytes(rank, seq_len, config, causal)), "sketch_rank": int(rank)}


def no_sketch_message(seq_len: int, config: PODConfig, causal: bool) -> str:
    """Why the budget holds no useful sketch at length L."""
    p = stored_entries(seq_len, config, causal)
    return (
        f"the memory budget of {config.memory_budget_bytes / 2**20:.1f} MiB "
        f"(PODConfig.memory_budget_bytes) cannot hold a useful sketch at L = {seq_len}: the O(L^2) "
        f"state takes {fixed_bytes(seq_len, config, causal) / 2**20:.1f} MiB and each sketch row "
        f"{p * config.resolved_storage_dtype.itemsize / 2**20:.2f} MiB (2 l rows are kept; auto mode needs "
        f"l >= 2 k_fit = {2 * config.k_fit})"
    )


def budget_message(n_new: int, n_kept: int, seq_len: int, config: PODConfig, causal: bool,
                   snapshot_bytes: int | None = None) -> str:
    """Why ``n_new`` more snapshots are refused (exact store, or auto mode without a useful sketch);
    ``snapshot_bytes`` as in :func:`exact_budgeted_bytes`, for all ``n_kept + n_new``."""
    n_total = n_kept + n_new
    p = stored_entries(seq_len, config, causal)
    need = exact_budgeted_bytes(n_total, seq_len, config, causal, snapshot_bytes)
    state = n_total * p * config.resolved_storage_dtype.itemsize if snapshot_bytes is None else snapshot_bytes
    hint = ("; PODConfig(mode='auto') or mode='sketch' keeps a bounded sketch instead"
            if config.mode == "exact" else "; " + no_sketch_message(seq_len, config, causal))
    return (
        f"storing {n_new} more snapshots (L = {seq_len}, {p} lag-band entries each) "
        f"would bring this accumulator to {need / 2**20:.1f} MiB ({state / 2**20:.1f} MiB of snapshots, "
        f"{exact_eig_bytes(n_total, p, config) / 2**20:.1f} MiB for the eigenproblem of compute), "
        f"over its budget of {config.memory_budget_bytes / 2**20:.1f} MiB (PODConfig.memory_budget_bytes); "
        f"{n_kept} snapshots are kept" + hint
    )
