"""Incremental scale-selective POD of one layer: :class:`PODAccumulator`.

torchmetrics-style ``update`` / ``compute`` / ``reset``, plus ``merge`` (for snapshots gathered on
several processes) and ``state_dict`` / ``load_state_dict`` (for checkpoints).

The accumulator holds, for a field of length L:

* the running state declared in :data:`~podmonitor.engine.running.RUNNING`: the mean field and
  the centred lag second moments (L, L), updated by Chan et al.'s pairwise formula (the
  scalograms need nothing else, so they are exact at any N with O(L^2) state), the sum of row
  entropies (L,) and the input counters; ``reset``, ``merge``, ``state_dict``, ``load_state_dict``
  and ``nbytes`` follow from that table;
* a snapshot store (:mod:`podmonitor.engine.store`): every snapshot in lag-band form ("exact"),
  or a Frequent Directions sketch of them ("sketch"); "auto" (default) is exact while the state
  plus compute's eigenproblem fit the memory budget (:mod:`podmonitor.engine.budget`), then
  turns the store into a sketch.

``compute`` is :func:`podmonitor.engine.analysis.analyse`. The cost of ``update`` depends on the
batch only (per field a sheared copy and the panel products of the lag moments, see
:class:`~podmonitor.engine.lags.LagShear`, each running quantity's step and a gather into the lag
band), not on how many snapshots were seen before.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..hugepages import scratch
from .analysis import analyse
from .budget import (
    MemoryBudgetError,
    auto_exact_limit,
    band_lags,
    budget_message,
    estimate_memory,
    exact_budgeted_bytes,
    no_sketch_message,
    sketch_rank_for,
)
from .config import PODConfig
from .lags import (
    SUB_BYTES,
    LagBand,
    LagShear,
    lag_moment,
    lag_signals,
    lower_row_blocks,
    max_above_diagonal,
)
from .report import PODReport
from .running import RUNNING, STEPPED, BatchStep, normalisation_tol
from .sketch import FrequentDirections
from .spectrum import sketch_effective_rank
from .store import SKETCH_FEED_BYTES, ExactStore, SketchStore, SnapshotStore, stored_dtype

__all__ = [
    "SKETCH_FEED_BYTES",
    "MemoryBudgetError",
    "PODAccumulator",
    "band_lags",
    "estimate_memory",
    "sketch_effective_rank",
    "sketch_rank_for",
]

#: 1: exact only; 2: sketch and auto modes, input counters; 3: normalisation counters. Older
#: states load: a running quantity absent from a state starts at its initial value.
STATE_VERSION = 3


def _as_tensor(fields: Any) -> Tensor:
    if isinstance(fields, np.ndarray):
        return torch.from_numpy(fields)
    if isinstance(fields, Tensor):
        return fields.detach()
    raise TypeError(f"fields must be a torch.Tensor or numpy.ndarray, got {type(fields).__name__}")


def field_sums(x: Tensor, dtype: torch.dtype,
               blocks: list[tuple[int, int]] | None = None) -> tuple[Tensor, Tensor]:
    """Row sums and the batch sum of (B, L, L) fields in ``dtype``, a few fields at a time.

    Args:
        x: (B, L, L) fields.
        dtype: the dtype of both results.
        blocks: row blocks ``(r0, r1)`` whose rectangles ``[r0:r1, :r1]`` hold every entry that is
            not exactly zero (:func:`~podmonitor.engine.lags.lower_row_blocks` of checked causal
            fields); the total adds only those (adding a zero leaves a sum as it is). Default:
            the whole field.

    Returns:
        row_sums: (B, L), the same sums as ``x.sum(-1, dtype=dtype)`` (to rounding).
        total: (L, L) ``sum_s x[s]`` in ``dtype``, the fields added one after another (the batch
            mean's numerator).

    The fields are converted into a reused buffer and used twice there (the total only when the
    conversion is exact, i.e. widens floating-point fields; narrowed fields are added as given, so
    that each addition rounds once): several times faster for float32 fields on CPU than
    mixed-dtype reductions, and one pass over the batch for both.
    """
    total = scratch(x.shape[1:], dtype, x.device).zero_()
    rects = [(0, x.shape[1])] if blocks is None else blocks

    def add(fields: Tensor) -> None:
        for field in fields:
            for r0, r1 in rects:
                total[r0:r1, :r1] += field[r0:r1, :r1]

    if x.dtype == dtype or x.numel() == 0:
        add(x)
        return x.sum(-1), total
    step = max(1, min(x.shape[0], SUB_BYTES // (dtype.itemsize * x.shape[1] * x.shape[2])))
    buf = scratch((step, *x.shape[1:]), dtype, x.device)
    out = torch.empty(x.shape[:2], dtype=dtype, device=x.device)
    widening = x.is_floating_point() and x.dtype.itemsize < dtype.itemsize
    for start in range(0, x.shape[0], step):
        stop = min(x.shape[0], start + step)
        part = buf[:stop - start].copy_(x[start:stop])
        torch.sum(part, dim=-1, out=out[start:stop])
        add(part if widening else x[start:stop])
    return out, total


#: The lag-moment products of an update take the fields of as many steps as fit in
#: ``SHEAR_FIELDS`` fields and ``SHEAR_BYTES`` of the sheared workspace
#: (:class:`~podmonitor.engine.lags.LagShear`; at least one step's): at L = 1024 four float32
#: fields at once took 0.73 s against 0.97 s for the products of 150 fields one at a time; at
#: L = 256 a step holds 8 fields already.
SHEAR_FIELDS = 4
SHEAR_BYTES = 36 * 2**20


def shear_fields(per_step: int, seq_len: int, dtype: torch.dtype) -> int:
    """The most fields the lag-moment products of an update take at once (see
    :data:`SHEAR_FIELDS`); at least ``per_step`` (one step's fields and the between-group field)."""
    per_field = seq_len * LagShear.row_width(seq_len, dtype) * dtype.itemsize
    return max(per_step, min(SHEAR_FIELDS, SHEAR_BYTES // per_field))


def _add_moments(shear: LagShear, back: Tensor, fwd: Tensor | None) -> None:
    """Add the lag moments of the fields loaded in ``shear`` to ``back`` (and ``fwd`` for
    bidirectional fields), then empty it."""
    if shear.loaded:
        shear.add_backward_moment(back)
        if fwd is not None:
            shear.add_forward_moment(fwd)
    shear.loaded = 0


class PODAccumulator:
    """Incremental scale-selective POD of one layer's attention ensemble.

    Feed it batches of fields with :meth:`update` as they arrive; :meth:`compute` returns the
    same :class:`PODReport` as :func:`podmonitor.analyze` on the concatenated ensemble.

    Args:
        config: engine settings (default :class:`PODConfig`).
        device: where the state lives; None = the device of the first batch.

    Attributes:
        seq_len, causal, band: the layout, fixed by the first batch (None before).
        store: the snapshot store (None before the first batch).
        n, mean_field, m2_back, m2_fwd, entropy_sum, n_skipped_nonfinite, n_negative,
        n_not_normalised, max_row_sum_error, input_dtypes: the running state
        (see :data:`~podmonitor.engine.running.RUNNING`).

    Example:
        >>> acc = PODAccumulator(PODConfig())
        >>> for batch in batches:          # each (B, L, L)
        ...     acc.update(batch)
        >>> report = acc.compute()
        >>> report.dominant_scales, report.t_spec
    """

    n: int
    mean_field: Tensor | None
    m2_back: Tensor | None
    m2_fwd: Tensor | None
    entropy_sum: Tensor | None
    n_skipped_nonfinite: int
    n_negative: int
    n_not_normalised: int
    max_row_sum_error: float
    input_dtypes: set[str]

    def __init__(self, config: PODConfig | None = None, *, device: torch.device | str | None = None) -> None:
        self.config = config or PODConfig()
        self._device = torch.device(device) if device is not None else None
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget every snapshot."""
        self.seq_len: int | None = None
        self.causal: bool | None = self.config.causal
        self.band: LagBand | None = None
        self.store: SnapshotStore | None = None
        for r in RUNNING:
            setattr(self, r.name, r.initial())
        # fixed once L and causality are known (set by _init_state): the sketch rank l
        # (sketch_rank_for, 0 when no sketch fits) and, in "auto" mode with a budget, the bytes
        # the exact phase may reach before switching (the budget less the future sketch)
        self._sketch_rank = 0
        self._exact_limit: int | None = None

    @property
    def mode(self) -> str:
        """"exact" while the snapshots are kept, "sketch" once they are sketched."""
        return "exact" if self.store is None else self.store.mode

    @property
    def device(self) -> torch.device:
        return self._device if self._device is not None else torch.device("cpu")

    @property
    def chunks(self) -> list[Tensor]:
        """The stored snapshots in lag-band form, (n_c, P) each (empty unless exact)."""
        return self.store.chunks if isinstance(self.store, ExactStore) else []

    @property
    def sketch(self) -> FrequentDirections | None:
        """The Frequent Directions sketch (None unless the store is a sketch)."""
        return self.store.sketch if isinstance(self.store, SketchStore) else None

    def nbytes(self) -> int:
        """Bytes held by the state now."""
        running = sum(int(v.numel() * v.element_size()) for r in RUNNING
                      if isinstance(v := getattr(self, r.name), Tensor))
        return running + (self.store.nbytes() if self.store is not None else 0)

    def _init_state(self, seq_len: int, causal: bool, device: torch.device) -> None:
        cfg = self.config
        self.seq_len = seq_len
        self.causal = causal
        self._device = device
        for r in RUNNING:
            if r.kind == "tensor":
                setattr(self, r.name, r.allocate(seq_len, causal, cfg.dtype, device))
        self.band = LagBand.build(seq_len, band_lags(cfg, seq_len), causal)
        self._sketch_rank = sketch_rank_for(seq_len, cfg, causal)
        self._exact_limit = cfg.memory_budget_bytes
        if cfg.mode == "auto":
            # leave room for the sketch (and streamed coherency) next to the snapshots when switching
            self._exact_limit = auto_exact_limit(seq_len, cfg, causal, self._sketch_rank)
        self.store = ExactStore(self.band, cfg, device)
        if cfg.mode == "sketch":
            self._start_sketch()

    def _start_sketch(self) -> None:
        """Turn the store into a sketch (the stored snapshots go into it).

        Raises:
            MemoryBudgetError: the budget cannot hold a sketch (see :func:`sketch_rank_for`).
        """
        assert self.seq_len is not None and self.causal is not None and isinstance(self.store, ExactStore)
        if self._sketch_rank == 0:  # sketch_rank_for(L, config, causal), computed once in _init_state
            raise MemoryBudgetError(no_sketch_message(self.seq_len, self.config, self.causal))
        self.store = self.store.to_sketch(self._sketch_rank)

    def _forget_layout(self) -> None:
        """Undo ``_init_state`` after a first batch that was not added (the counters are kept)."""
        counters = {r.name: getattr(self, r.name) for r in RUNNING if r.kind != "tensor"}
        self.reset()
        for name, value in counters.items():
            setattr(self, name, value)

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
        causal = self.causal
        # Causal fields (nothing above the diagonal in any field, finite or not: checked first) add
        # only the row blocks of their lower triangle to the batch total; otherwise the check runs
        # on the finite fields below.
        upper = None if causal is False else max_above_diagonal(x)  # (bidirectional: no need to look)
        blocks = lower_row_blocks(x.shape[1], True) if upper == 0 else None
        # A sum is finite iff every entry is (barring overflow, which the exact check catches); the
        # row sums also serve the normalisation check of the running state.
        row_sums, total = field_sums(x, self.config.dtype, blocks)  # (B, L), (L, L)
        finite = torch.isfinite(row_sums).all(dim=1)
        if not bool(finite.all()):
            finite = torch.isfinite(x).flatten(1).all(dim=1)
        n_bad = int((~finite).sum())
        if n_bad:
            x, row_sums = x[finite], row_sums[finite]
            total = field_sums(x, self.config.dtype, blocks)[1]
        if x.shape[0] == 0:
            self._merge_counts({"n_skipped_nonfinite": n_bad, "input_dtypes": {dtype_name}})
            return 0
        seq_len = x.shape[1]
        device = self._device if self._device is not None else x.device
        if upper is None:
            upper = 0.0
        elif upper != 0 and n_bad:  # (NaN or mass above the diagonal: look at the finite fields alone)
            upper = max_above_diagonal(x)
        if causal is None:
            causal = upper == 0
        elif causal and upper > 0:
            raise ValueError(
                f"field has mass above the diagonal (max {upper:.3g}) but is treated as causal"
                + (" (inferred from the first batch)" if self.config.causal is None else "")
                + ": pass PODConfig(causal=False) for bidirectional attention"
            )
        first = self.seq_len is None
        try:  # a first batch that is not added leaves the accumulator empty (its counters kept)
            if first:
                self._init_state(seq_len, causal, device)
            self._check_budget(x.shape[0], x.dtype)
            self._add_batch(x, causal, row_sums, total)
        except BaseException:
            if first:
                self._forget_layout()
            raise
        self._merge_counts({"n_skipped_nonfinite": n_bad, "input_dtypes": {dtype_name}})
        return x.shape[0]

    def _check_budget(self, n_new: int, input_dtype: torch.dtype) -> None:
        """Before ``n_new`` snapshots of ``input_dtype`` are added: switch to the sketch ("auto") or
        refuse, when the state plus the eigenproblem of ``compute`` would exceed the budget. The
        snapshots count as the bytes the store holds plus the new ones in the dtype it will keep
        them in (:func:`~podmonitor.engine.store.stored_dtype`).

        Raises:
            MemoryBudgetError: the budget cannot hold them (nothing has changed then).
        """
        cfg = self.config
        if cfg.memory_budget_bytes is None or not isinstance(self.store, ExactStore):
            return
        assert self.seq_len is not None and self.causal is not None and self.band is not None
        held = self.store.nbytes() + n_new * self.band.size * stored_dtype(cfg, input_dtype).itemsize
        need = exact_budgeted_bytes(self.n + n_new, self.seq_len, cfg, self.causal, held)
        # rank and limit are fixed after _init_state (no per-update recomputation)
        limit = self._exact_limit if self._exact_limit is not None else cfg.memory_budget_bytes
        if need <= limit:
            return
        if cfg.mode == "auto" and self._sketch_rank:
            self._start_sketch()
            return
        raise MemoryBudgetError(budget_message(n_new, self.n, self.seq_len, cfg, self.causal, held))

    def _add_batch(self, x: Tensor, causal: bool, row_sums: Tensor, total: Tensor) -> None:
        """Add (B, L, L) checked fields: moments about the batch mean, each running quantity's steps,
        the band entries to the store.

        ``row_sums`` (B, L) and ``total`` (L, L) are :func:`field_sums` of the fields.

        Works through the batch a few fields at a time (``SUB_BYTES`` of fields per step) in
        buffers allocated once per call: the input is converted to ``config.dtype`` and moved to
        the state's device one step at a time, never as a whole, and each step's temporaries stay
        in cache. Per step: the running quantities' steps and the band entries read the converted
        fields, then the fields are centred (in place when converted) and rounded once into the
        products' workspace, whose products take the fields of a few steps at once. Chan et al.'s
        between-group term ``n_a n_b / n`` times the lag moment of ``delta`` (the batch mean less
        the state's) enters the last products as one more field, ``sqrt(n_a n_b / n) delta``.
        The running state changes only at the end (a
        sketch store is fed every ``SKETCH_FEED_BYTES`` of band entries on the way).
        """
        assert self.band is not None and self.store is not None
        cfg = self.config
        dt, dev, seq_len, n_b = cfg.dtype, self.device, x.shape[1], x.shape[0]
        step = max(1, min(n_b, SUB_BYTES // (dt.itemsize * seq_len * seq_len)))
        # Centring about the batch's own mean makes each step's moment exact without the
        # between-group terms; one Chan et al. combination per batch merges it into the state.
        mean_b = total.to(dev).div_(n_b)
        assert self.mean_field is not None
        n_a = self.n
        # the between-group term as one more field (it vanishes for the first group)
        between = None if not n_a else torch.sub(mean_b, self.mean_field, out=scratch(mean_b.shape, dt, dev)).mul_(
            math.sqrt(n_a * n_b / (n_a + n_b)))
        # the products in the moment dtype (float32 for float32 captures, see PODConfig.moment_dtype);
        # each step's products are added to the batch's moments in dt
        md = cfg.moment_dtype_for(x.dtype)
        # the products take whole steps' fields at once (as many as shear_fields allows), in a
        # workspace of exactly that many slots, so that they read the loaded rows without a copy
        # (:meth:`LagShear.load`); the between-group field goes last, into the last group's room
        total_fields = n_b + (between is not None)
        most = shear_fields(step + 1, seq_len, md)
        slots = total_fields if total_fields <= most else step * max(1, most // step)
        shear = LagShear(seq_len, slots, md, dev)
        m2b_back = scratch((seq_len, seq_len), dt, dev).zero_()
        m2b_fwd = None if causal else scratch((seq_len, seq_len), dt, dev).zero_()
        batch = {r.name: r.allocate(seq_len, causal, dt, dev) for r in STEPPED}  # this batch's contributions
        work = scratch((step, seq_len, seq_len), dt, dev).zero_()  # (zeros: see row_entropy)
        # causal fields from BLOCKS_FROM on: conversion, centring and rounding read and write only
        # the row blocks that hold the lower triangle (the rest of convert stays zero)
        blocks = lower_row_blocks(seq_len, causal)
        convert = None if x.dtype == dt and x.device == dev else scratch(work.shape, dt, dev).zero_()
        # centred fields in dt before their rounding to md (the converted fields are centred in place)
        centred = convert if convert is not None or md == dt else scratch(work.shape, dt, dev)
        tol = normalisation_tol(x.dtype)
        # the batch's lag-band entries, handed to the store in parts of the size it asks for
        rows_per_feed, rows_dtype = self.store.feed(n_b, step, x.dtype)
        # (zeroed first: writing fresh pages inside the multi-threaded gather is several times
        # slower. Not advised as huge pages: this memory stays with the store, so no later batch
        # reuses it, and fresh huge pages can cost more than they save: on the development VM,
        # whose balloon device reports free pages to the host, `bench_engine_parts.py --compare`
        # measured the float64 update at L = 1024 at 1.73 s plain against 2.10 s advised, likely
        # because the host backs each freshly handed-out 2 MiB block anew)
        rows_buf = torch.empty((rows_per_feed, self.band.size), dtype=rows_dtype, device=dev).zero_()
        index = self.band.flat_index.to(dev)
        # the band entries straight from the input where it is already in the stored dtype and
        # place (float32 captures: the same values as the converted copy's, half the bytes)
        direct = x.dtype == rows_dtype and x.device == dev and x.is_contiguous()
        filled = 0
        for start in range(0, n_b, step):
            stop = min(n_b, start + step)
            part = x[start:stop]
            if convert is not None:
                for r0, r1 in blocks:
                    convert[:stop - start, r0:r1, :r1].copy_(part[:, r0:r1, :r1])
                part = convert[:stop - start]
            ctx = BatchStep(part, causal, work, tol, row_sums[start:stop].to(dev), blocks)
            for r in STEPPED:
                batch[r.name] = r.combine(batch[r.name], r.step(ctx))
            if filled + (stop - start) > rows_per_feed:
                self.store.add(rows_buf[:filled])
                filled = 0
            source = x[start:stop] if direct else part
            self.band.gather_into(source.reshape(stop - start, -1), rows_buf[filled:filled + stop - start], index)
            filled += stop - start
            # (rounded to md once; the products read the sheared copy, so part may be overwritten;
            # the fields of several steps enter the same products, which are faster when larger)
            if shear.loaded + (stop - start) > shear.batch:
                _add_moments(shear, m2b_back, m2b_fwd)
            shear.load(part, mean_b, scratch=None if centred is None else centred[:stop - start],
                       blocks=blocks, at=shear.loaded)
        if between is not None:  # Chan et al.'s between-group term, as one more field
            if shear.loaded == shear.batch:
                _add_moments(shear, m2b_back, m2b_fwd)
            shear.load(between.unsqueeze(0), blocks=blocks, at=shear.loaded)
        _add_moments(shear, m2b_back, m2b_fwd)
        self._combine(n_b, mean_b, shear.finish(m2b_back, backward=True),
                      None if m2b_fwd is None else shear.finish(m2b_fwd, backward=False), between_added=True)
        self._merge_counts(batch)
        self.store.add(rows_buf if filled == rows_per_feed else rows_buf[:filled])

    def _combine(self, n_b: int, mean_b: Tensor, m2b_back: Tensor, m2b_fwd: Tensor | None,
                 between_added: bool = False) -> None:
        """Merge a group of n_b snapshots (mean, centred moments) into the running state: the
        "moment" rows of the table, by Chan et al.'s pairwise formula (``between_added``: the
        moments already hold the between-group term)."""
        assert self.mean_field is not None and self.m2_back is not None
        n_a = self.n
        n = n_a + n_b
        delta = torch.sub(mean_b, self.mean_field, out=scratch(mean_b.shape, mean_b.dtype, mean_b.device))  # (L, L)
        w = n_a * n_b / n
        self.m2_back += m2b_back
        if n_a > 0 and not between_added:  # the between-group term vanishes for the first group
            self.m2_back += w * lag_moment(lag_signals(delta).unsqueeze(0))
        if self.m2_fwd is not None:
            assert m2b_fwd is not None
            self.m2_fwd += m2b_fwd
            if n_a > 0 and not between_added:
                self.m2_fwd += w * lag_moment(lag_signals(delta, forward=True).flip(0).unsqueeze(0))
        self.mean_field += torch.mul(delta, n_b / n, out=scratch(delta.shape, delta.dtype, delta.device))
        self.n = n

    def _merge_counts(self, group: dict[str, Any]) -> None:
        """Combine a group's values of the rows that are not moments (sums, maxima, unions)."""
        for r in RUNNING:
            if r.merge != "moment" and group.get(r.name) is not None:
                setattr(self, r.name, r.combine(getattr(self, r.name), group[r.name]))

    # ------------------------------------------------------------------ merge
    def merge(self, other: PODAccumulator) -> PODAccumulator:
        """Absorb another accumulator's snapshots (e.g. from another process); returns self.

        The result equals one accumulator fed self's snapshots, then other's (in sketch mode:
        within the error bound, which adds up: the merged sketch's Delta is the sum of both and
        of the merge's own shrinks). An exact accumulator merged with a sketch becomes a sketch.
        """
        counts = {r.name: getattr(other, r.name) for r in RUNNING if r.merge != "moment"}
        if other.seq_len is None:
            self._merge_counts(counts)
            return self
        if self.config != other.config:
            raise ValueError("cannot merge accumulators with different PODConfig")
        if self.seq_len is None:
            own = {r.name: getattr(self, r.name) for r in RUNNING if r.merge != "moment"}
            self.load_state_dict(other.state_dict())
            self._merge_counts(own)
            return self
        if other.seq_len != self.seq_len:
            raise ValueError(f"cannot merge accumulators of L = {self.seq_len} and L = {other.seq_len}")
        if other.causal != self.causal:
            raise ValueError("cannot merge a causal accumulator with a bidirectional one")
        assert other.mean_field is not None and other.m2_back is not None and other.store is not None
        assert self.store is not None and self.seq_len is not None and self.causal is not None
        dev = self.device
        self._combine(other.n, other.mean_field.to(dev), other.m2_back.to(dev),
                      None if other.m2_fwd is None else other.m2_fwd.to(dev))
        if isinstance(self.store, ExactStore) and isinstance(other.store, SketchStore):
            self._start_sketch()
        self.store.merge(other.store)
        budget = self.config.memory_budget_bytes
        if isinstance(self.store, ExactStore) and self.config.mode == "auto" and budget is not None \
                and self._sketch_rank \
                and exact_budgeted_bytes(self.n, self.seq_len, self.config, self.causal, self.store.nbytes()) > budget:
            self._start_sketch()
        self._merge_counts(counts)
        return self

    # ------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """Picklable state (tensors on their device; the snapshots as one (N, P) tensor)."""
        return {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "seq_len": self.seq_len,
            "causal": self.causal,
            **{r.name: r.saved(getattr(self, r.name)) for r in RUNNING},
            "mode": self.mode,
            **(self.store.state_dict() if self.store is not None else {"snapshots": None}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (the configuration must match; states of earlier versions load)."""
        if state.get("version") not in range(1, STATE_VERSION + 1):
            raise ValueError(f"unsupported PODAccumulator state version {state.get('version')}")
        saved = PODConfig.from_dict(state["config"])
        if saved != self.config:
            raise ValueError("the saved state was made with a different PODConfig")
        self.reset()
        if state["seq_len"] is None:
            self._merge_counts({r.name: r.restored(state[r.name], self.config.dtype, self.device)
                                for r in RUNNING if r.kind != "tensor" and r.merge != "moment" and r.name in state})
            return
        dev = self._device or state["mean_field"].device
        self._init_state(int(state["seq_len"]), bool(state["causal"]), torch.device(dev))
        for r in RUNNING:
            if r.name in state:  # absent from states saved before the row existed: initial value
                setattr(self, r.name, r.restored(state[r.name], self.config.dtype, self.device))
        if state.get("mode", "exact") == "sketch" and isinstance(self.store, ExactStore):
            self._start_sketch()  # an auto-mode state that had switched
        assert self.store is not None
        self.store.load_state_dict(state, self.n)

    # ---------------------------------------------------------------- compute
    def compute(self) -> PODReport:
        """Analyse every snapshot seen so far (METHOD.md sections 1 to 6; see
        :func:`podmonitor.engine.analysis.analyse`)."""
        return analyse(self)
