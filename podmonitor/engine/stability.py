"""Stability signals of attention, per layer and head, from the captured fields (METHOD.md section 10).

Cheap early warnings of the instabilities practitioners watch for (Dehghani et al. 2023; Wortsman
et al. 2023; Zhai et al. 2023, entropy collapse; Xiao et al. 2023, attention sinks):

- max attention logit: max over snapshots, queries and visible keys of q.k * scale (needs the
  scores: given by adapters that recompute attention, e.g. the ``sdpa`` adapter's ``logit_max``);
- normalised row entropy H_i = -sum_j A[i, j] log A[i, j] / log(n_i), with n_i the number of
  visible keys of row i (i + 1 for causal attention, T otherwise): its mean per head, and per
  layer the mean and the minimum over heads (an entropy collapse is a sharp drop of the minimum);
- sink mass: A[i, 0] averaged over the queries i >= 1;
- largest probability: the largest A[i, j] (and the mean over rows of the row maximum).

Rows with a single visible key (query 0 of causal attention) are excluded from the entropy
(log(1) = 0: the normalisation is undefined) and from the probability maxima (trivially 1).
Visible keys are those the causal structure allows: a model with a sliding window or another
mask sees fewer, so its normalised entropy is measured against the larger count.

Example:
    >>> acc = StabilityAccumulator()
    >>> acc.update(fields, logit_max=captured.logit_max[0], causal=True)  # (B, H, T, T), (B, H)
    >>> acc.compute().to_dict()["entropy_min"]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..hugepages import scratch
from .lags import max_above_diagonal, plogp_

_STATE_VERSION = 1


#: Rows per block of the entropy pass (a block's float32 and float64 work stays in cache).
ROWS_PER_BLOCK = 64


def _row_blocks(first: int, t: int, causal: bool) -> list[tuple[int, int, int]]:
    """``(r0, r1, k)``: rows ``[r0, r1)`` covering ``first..t-1`` in blocks of
    :data:`ROWS_PER_BLOCK`, with ``k`` the keys a block reads (``r1`` when causal, else ``t``)."""
    return [(r0, min(t, r0 + ROWS_PER_BLOCK), min(t, r0 + ROWS_PER_BLOCK) if causal else t)
            for r0 in range(first, t, ROWS_PER_BLOCK)]


#: the signed integer type of each floating element size, to read a float's sign bit
_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _right_of_blocks_zero(fields: Tensor, blocks: list[tuple[int, int, int]]) -> bool:
    """Whether every key right of the causal row blocks (rows ``[r0, r1)``, keys ``k..T-1``) is
    +0 in the whole (B, H, T, T) batch; one transfer for the batch.

    Two plain reductions per strided view instead of ``count_nonzero``'s comparison of every
    entry: no entry has its sign bit set (the integer view of
    the same bits is >= 0: every entry is +0, positive, +inf or a NaN without sign), and their sum
    is 0, which entries of one sign reach only when all are +0 (NaN or inf make it non-zero). A -0
    therefore counts as not zero; the caller then sums those keys too, which changes nothing.
    """
    t = fields.shape[-1]
    views = [fields[:, :, r0:r1, k:] for r0, r1, k in blocks if k < t]
    if not views or fields.numel() == 0:
        return True
    bits = _SAME_WIDTH_INT[fields.element_size()]
    signed = torch.stack([v.view(bits).amin() for v in views]).amin() < 0
    total = torch.stack([v.sum() for v in views]).sum()
    return not bool(signed | (total != 0))


def _first_row(t: int, causal: bool) -> int:
    """The first row whose normalised entropy is defined (at least 2 visible keys)."""
    return 1 if causal else (0 if t > 1 else t)


@dataclass
class StabilitySums:
    """One layer's per-sequence contributions to the stability sums, before the finiteness
    decision (:meth:`StabilityAccumulator.add_sums`).

    Attributes:
        entropy: (B, H) float64, sum over the rows with >= 2 visible keys of the normalised row entropy.
        row_max_sum: (B, H) float64, sum over those rows of the row maximum.
        row_max_peak: (B, H) float32, the largest of those row maxima (-inf without such rows).
        sink: (B, H) float64, sum of A[i, 0] over the queries i >= 1.
        check: (B,) float64, finite exactly when every entry of the sequence is (a sum that every
            entry enters, through ``p log p`` (or ``p c``, :func:`softmax_plogp_rows`) or directly).
        causal: whether row i has i + 1 visible keys (else T).
        seq_len: T.
    """

    entropy: Tensor
    row_max_sum: Tensor
    row_max_peak: Tensor
    sink: Tensor
    check: Tensor
    causal: bool
    seq_len: int

    def select(self, index: Tensor) -> StabilitySums:
        """The sums of the sequences ``index`` (b,)."""
        pick = [x.index_select(0, index.to(x.device)) for x in
                (self.entropy, self.row_max_sum, self.row_max_peak, self.sink, self.check)]
        return StabilitySums(*pick, causal=self.causal, seq_len=self.seq_len)


def softmax_plogp_rows(probs: Tensor, centred: Tensor, row_max: Tensor, work: Tensor | None = None) -> Tensor:
    """``sum_j p_j log p_j`` of each row of probabilities formed as ``p = softmax(c)``, from the
    argument ``c`` of the softmax instead of a logarithm per entry.

    With ``c`` the scores less their row maximum (so ``max_j c_j = 0``) and ``Z = sum_j exp(c_j)``,
    ``log p_j = c_j - log Z`` and the largest probability is ``1 / Z``, hence
    ``sum_j p_j log p_j = sum_j p_j c_j + log max_j p_j``: one dot product per row (about a sixth
    of the time of ``p log p`` and its sum on CPU). Centring keeps the terms ``p_j c_j`` small
    where logits are large. Keys masked out must hold a finite ``c`` (their ``p`` is 0).

    Args:
        probs: (..., k) float32 probabilities ``softmax(centred)``.
        centred: (..., k) float32 scores less their row maximum.
        row_max: (...) ``probs.amax(-1)``.
        work: optional float32 buffer of at least ``probs.numel()`` elements for the products
            (a reused one saves faulting in a fresh temporary as large as the block).

    Returns:
        (...) float64, ``sum_j p_j log p_j`` (within a few float32 roundings of each term).
    """
    products = torch.mul(probs, centred, out=None if work is None else work[:probs.numel()].view(probs.shape))
    return products.sum(dim=-1).double() + row_max.double().log()


class StabilityRows:
    """Builds the :class:`StabilitySums` of one layer's (B, H, T, T) attention from its row blocks,
    in any order, so that a capture forming the probabilities block by block need not keep them
    (:class:`podmonitor.capture.reduce.LayerReduction`); :meth:`StabilityAccumulator.update` uses
    it on whole maps.

    Example:
        >>> rows = StabilityRows(b=2, h=12, t=1024, causal=True, device=torch.device("cpu"))
        >>> rows.add(slice(0, 2), slice(0, 12), r0, block)  # block (2, 12, r1 - r0, k), zeros right of k
        >>> acc.add_sums(rows.sums())
    """

    def __init__(self, b: int, h: int, t: int, causal: bool, device: torch.device) -> None:
        self.t, self.causal = t, causal
        self.first = _first_row(t, causal)
        zeros = torch.zeros((b, h), dtype=torch.float64, device=device)
        self.entropy, self.row_max_sum, self.sink = zeros, zeros.clone(), zeros.clone()
        self.row_max_peak = torch.full((b, h), -math.inf, dtype=torch.float32, device=device)
        self.check = torch.zeros(b, dtype=torch.float64, device=device)
        # log of each row's visible keys (row i: i + 1 when causal, else T)
        self.log_n = (torch.log(torch.arange(1, t + 1, device=device, dtype=torch.float64)) if causal
                      else torch.full((t,), math.log(max(t, 1)), device=device, dtype=torch.float64))
        self.work: Tensor | None = None  # float32 scratch for p log p, reused (grown as needed)

    def add(self, seqs: slice, heads: slice, r0: int, block: Tensor, rest: Tensor | None = None,
            centred: Tensor | None = None) -> None:
        """Add the rows ``[r0, r0 + rows)`` of the sequences ``seqs`` and heads ``heads``.

        Args:
            seqs, heads: which part of the (B, H) sums the block belongs to.
            r0: the block's first row.
            block: (b, h, rows, k) float32 probabilities of the keys ``[0, k)``; every key right of
                ``k`` holds +0 unless given in ``rest``. Each row, sequence and head is added once.
            rest: (b, h, rows, T - k) float32, the keys right of ``k`` when they are not all +0.
            centred: (b, h, rows, k) float32, where the capture formed ``block`` as
                ``softmax(centred)``: the scores less their row maximum (0 at the maximum, finite
                at masked keys, whose probability is 0). The entropy then needs no logarithm per
                entry (:func:`softmax_plogp_rows`). Not with ``rest``.
        """
        rows = block.shape[-2]
        if r0 < 1 <= r0 + rows and block.shape[-1] > 0:  # sink mass: A[i, 0] over the queries i >= 1
            self.sink[seqs, heads] += block[..., max(0, 1 - r0):, 0].sum(dim=-1, dtype=torch.float64)
        elif r0 >= 1 and block.shape[-1] > 0:
            self.sink[seqs, heads] += block[..., 0].sum(dim=-1, dtype=torch.float64)
        skip = max(0, self.first - r0)  # rows without a defined entropy (query 0 of causal attention)
        if skip:
            self.add_head_rows(seqs, block[..., :skip, :], rest=None if rest is None else rest[..., :skip, :])
            block, rest = block[..., skip:, :], (None if rest is None else rest[..., skip:, :])
            centred = None if centred is None else centred[..., skip:, :]
            r0, rows = r0 + skip, rows - skip
        if rows <= 0:
            return
        if centred is not None:
            if rest is not None:
                raise ValueError("centred scores describe the whole row: not with rest")
            row_max = block.amax(dim=-1)
            row_h = softmax_plogp_rows(block, centred, row_max, self._work(block))  # (b, h, rows) float64
        else:
            work = self._work(block)
            plogp = plogp_(block, work[:block.numel()].view(block.shape))
            row_h = plogp.sum(dim=-1)  # (b, h, rows) float32: sum_j p log p
            row_max = block.amax(dim=-1) if block.shape[-1] else torch.zeros_like(row_h)
        if rest is not None and rest.shape[-1]:  # keys right of k that are not all zero
            row_h += plogp_(rest, torch.empty_like(rest)).sum(dim=-1)
            row_max = torch.maximum(row_max, rest.amax(dim=-1))
        elif block.shape[-1] < self.t:
            row_max = row_max.clamp_min(0)
        ent = (row_h.double() / self.log_n[r0:r0 + rows]).sum(dim=-1)  # (b, h)
        self.entropy[seqs, heads] -= ent
        self.row_max_sum[seqs, heads] += row_max.sum(dim=-1, dtype=torch.float64)
        self.row_max_peak[seqs, heads] = torch.maximum(self.row_max_peak[seqs, heads], row_max.amax(dim=-1))
        self.check[seqs] += ent.sum(dim=-1)

    def add_head_rows(self, seqs: slice | int, rows: Tensor, rest: Tensor | None = None) -> None:
        """Rows without a defined entropy (``rows`` (..., r, k)): they only enter the finiteness check."""
        seqs = slice(seqs, seqs + 1) if isinstance(seqs, int) else seqs
        total = rows.reshape(rows.shape[0] if rows.dim() == 4 else 1, -1).sum(dim=-1, dtype=torch.float64)
        if rest is not None:
            total = total + rest.reshape(total.shape[0], -1).sum(dim=-1, dtype=torch.float64)
        self.check[seqs] += total

    def _work(self, block: Tensor) -> Tensor:
        """A float32 buffer for the entry-wise temporaries of ``block`` (..., k), reused: made for
        the block's rows at the full width T, so that the widening blocks of a causal capture
        (k = r1) take the same one (from the buffer pool while the monitor captures)."""
        numel = block.numel()
        if self.work is None or self.work.numel() < numel or self.work.device != block.device:
            rows = numel // block.shape[-1] if block.shape[-1] else 0
            self.work = scratch((max(numel, rows * self.t),), torch.float32, block.device)
        return self.work

    def sums(self) -> StabilitySums:
        """What was added, as :class:`StabilitySums`."""
        return StabilitySums(self.entropy, self.row_max_sum, self.row_max_peak, self.sink, self.check,
                             causal=self.causal, seq_len=self.t)


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


@dataclass
class StabilityReport:
    """Stability signals of one layer over the snapshots seen.

    Per-head lists have one entry per head (None where undefined, e.g. no snapshot); layer
    values summarise the heads.

    Attributes:
        n_snapshots: sequences used (finite fields).
        n_heads: heads of the layer.
        causal: True / False when every update said so, None when mixed or unknown.
        max_logit: per head, max pre-softmax logit q.k * scale; None when no logits were given.
        entropy: per head, mean normalised row entropy in [0, 1] (rows with >= 2 visible keys).
        sink_mass: per head, mean of A[i, 0] over queries i >= 1.
        max_prob: per head, the largest probability (rows with >= 2 visible keys).
        mean_row_max: per head, the mean over those rows of max_j A[i, j].
        max_logit_layer: max over heads of ``max_logit`` (None without logits).
        entropy_mean: mean over heads of ``entropy``.
        entropy_min: min over heads of ``entropy``.
        sink_mass_mean: mean over heads of ``sink_mass``.
        sink_mass_max: max over heads of ``sink_mass``.
        max_prob_layer: max over heads of ``max_prob``.
        n_skipped_nonfinite: sequences skipped because their field held NaN or Inf (or, not
            probabilities, entries so large that p log p, a float32 row sum or the float32 copy
            of float64 fields overflows).
        status: "ok", or "empty" when no snapshot was usable.
        messages: what was excluded, and why.
    """

    n_snapshots: int
    n_heads: int
    causal: bool | None
    max_logit: list[float | None] | None
    entropy: list[float | None]
    sink_mass: list[float | None]
    max_prob: list[float | None]
    mean_row_max: list[float | None]
    max_logit_layer: float | None
    entropy_mean: float | None
    entropy_min: float | None
    sink_mass_mean: float | None
    sink_mass_max: float | None
    max_prob_layer: float | None
    n_skipped_nonfinite: int = 0
    status: str = "ok"
    messages: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, strict JSON (non-finite numbers become None)."""
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = _finite_or_none(value)
            elif isinstance(value, list) and key != "messages":
                out[key] = [_finite_or_none(v) if isinstance(v, float) else v for v in value]
        return out


class StabilityAccumulator:
    """Accumulates the stability signals of one layer, batch by batch (see the module docstring).

    Pure torch, no Lightning. Sums are float64 on the CPU: (H,) vectors, so the state is tiny,
    picklable (:meth:`state_dict`) and merges across processes (:meth:`merge`).

    Example:
        >>> acc = StabilityAccumulator()
        >>> for fields, lmax in batches:  # (B, H, T, T), (B, H)
        ...     acc.update(fields, lmax, causal=True)
        >>> report = acc.compute()
    """

    def __init__(self) -> None:
        self.n_heads: int | None = None
        self.n_snapshots = 0
        self.n_skipped_nonfinite = 0
        self.n_logit_snapshots = 0
        self.causal_seen: set[bool] = set()
        self._entropy_sum: Tensor | None = None  # (H,) sum over rows with >= 2 visible keys
        self._entropy_rows = 0  # rows per head entering _entropy_sum
        self._sink_sum: Tensor | None = None  # (H,) sum of A[i, 0], i >= 1
        self._sink_rows = 0
        self._row_max_sum: Tensor | None = None  # (H,)
        self._max_prob: Tensor | None = None  # (H,)
        self._max_logit: Tensor | None = None  # (H,)
        self._work_buffer: Tensor | None = None  # update's scratch space, not state

    def _init(self, n_heads: int) -> None:
        self.n_heads = n_heads
        zeros = torch.zeros(n_heads, dtype=torch.float64)
        self._entropy_sum, self._sink_sum, self._row_max_sum = zeros.clone(), zeros.clone(), zeros.clone()
        self._max_prob = torch.full((n_heads,), -math.inf, dtype=torch.float64)
        self._max_logit = torch.full((n_heads,), -math.inf, dtype=torch.float64)

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def update(self, fields: Tensor, logit_max: Tensor | None = None, causal: bool | None = None,
               zeros_above_diagonal: bool = False) -> None:
        """Add a batch of one layer's attention.

        Args:
            fields: (B, H, T, T) post-softmax probabilities, rows are queries.
            logit_max: (B, H) max pre-softmax logit of each sequence and head, or None.
            causal: whether the attention is causal (n_i = i + 1 visible keys); None infers it
                from the fields (causal when nothing lies above the diagonal).
            zeros_above_diagonal: with ``causal=True``, the caller's promise that every entry
                above the diagonal is +0 (a capture that wrote them so:
                ``CapturedAttention.zeros_above_diagonal``; rows with a non-finite visible entry
                excepted, whose sequence is skipped anyway); those entries are then not read.
                False (default): they are checked, and summed where they are not all +0.

        Raises:
            ValueError: ``fields`` is not (B, H, T, T), its head count differs from earlier
                batches, or ``logit_max`` is not (B, H).
            TypeError: ``fields`` is not a tensor.
        """
        if not isinstance(fields, Tensor):
            raise TypeError(f"fields must be a (B, H, T, T) tensor, got {type(fields).__name__}")
        if fields.dim() != 4 or fields.shape[-1] != fields.shape[-2]:
            raise ValueError(f"fields must be (B, H, T, T), got shape {tuple(fields.shape)}")
        b, h, t, _ = fields.shape
        self._check(b, h, logit_max)
        inferred = causal is None
        if inferred:  # causal when nothing lies above the diagonal (NaN there: not causal)
            causal = max_above_diagonal(fields.reshape(b * h, t, t)) == 0 if t > 1 else True
        causal = bool(causal)
        first = _first_row(t, causal)
        blocks = _row_blocks(first, t, causal)
        right_zero = causal and (inferred or zeros_above_diagonal or _right_of_blocks_zero(fields, blocks))
        rows = StabilityRows(b, h, t, causal, fields.device)
        if t > 1:
            rows.work = self._work(h * (blocks[0][1] - blocks[0][0]) * t, fields.device)
        # each sequence's sums first, then which sequences are finite (one transfer for the batch)
        for s in range(b):
            a = fields[s].float()  # (H, T, T)
            rows.add_head_rows(s, a[:, :first])
            for r0, r1, k in blocks:
                rest = None if right_zero or k == t else a[None, :, r0:r1, k:]
                rows.add(slice(s, s + 1), slice(None), r0, a[None, :, r0:r1, :k], rest)
        self.add_sums(rows.sums(), logit_max)

    def _check(self, b: int, h: int, logit_max: Tensor | None) -> None:
        """Take the head count from the first batch; refuse another one, or ``logit_max`` not (B, H)."""
        if self.n_heads is None:
            self._init(h)
        elif h != self.n_heads:
            raise ValueError(f"fields have {h} heads, earlier batches had {self.n_heads}")
        if logit_max is not None and tuple(logit_max.shape) != (b, h):
            raise ValueError(f"logit_max must be (B, H) = {(b, h)}, got shape {tuple(logit_max.shape)}")

    def add_sums(self, sums: StabilitySums, logit_max: Tensor | None = None) -> None:
        """Add one layer's per-sequence sums (from :class:`StabilityRows`: a capture that reduces
        its row blocks as it forms them, or :meth:`update`); sequences with a non-finite entry are
        counted as skipped.

        Args:
            sums: the batch's :class:`StabilitySums` (B sequences of H heads).
            logit_max: (B, H) max pre-softmax logit of each sequence and head, or None.

        Raises:
            ValueError: the head count differs from earlier batches, or ``logit_max`` is not (B, H).
        """
        b, h = sums.entropy.shape
        self._check(b, h, logit_max)
        t, causal = sums.seq_len, sums.causal
        n_rows = max(0, t - 1) if causal else (t if t > 1 else 0)
        assert self._entropy_sum is not None and self._sink_sum is not None and self._row_max_sum is not None
        assert self._max_prob is not None and self._max_logit is not None
        finite = torch.isfinite(sums.check).tolist()
        # the sums in the same order as one sequence at a time, on the sums' device (one transfer
        # back per batch; on the CPU these are the state's own tensors)
        device = sums.entropy.device
        ent, sink, row_max_total = (x.to(device) for x in (self._entropy_sum, self._sink_sum, self._row_max_sum))
        max_prob, max_logit = self._max_prob.to(device), self._max_logit.to(device)
        used = 0
        for s in range(b):
            if not finite[s]:
                self.n_skipped_nonfinite += 1
                continue
            used += 1
            if n_rows:
                ent += sums.entropy[s]
                row_max_total += sums.row_max_sum[s]
                max_prob = torch.maximum(max_prob, sums.row_max_peak[s].double())
            if t > 1:
                sink += sums.sink[s]
            if logit_max is not None:
                lm = logit_max[s].detach().double().to(device)
                max_logit = torch.maximum(max_logit, lm.nan_to_num(nan=-math.inf))
        self._entropy_sum, self._sink_sum, self._row_max_sum = ent.cpu(), sink.cpu(), row_max_total.cpu()
        self._max_prob, self._max_logit = max_prob.cpu(), max_logit.cpu()
        self._entropy_rows += used * n_rows
        self._sink_rows += used * (t - 1)
        self.n_snapshots += used
        if logit_max is not None:
            self.n_logit_snapshots += used
        if used:
            self.causal_seen.add(causal)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the scratch buffers."""
        return {**self.__dict__, "_work_buffer": None}

    def _work(self, numel: int, device: torch.device) -> Tensor:
        """A reused float32 buffer of at least ``numel`` elements (not part of the state)."""
        work = self._work_buffer
        if work is None or work.numel() < numel or work.device != device:
            work = torch.empty(numel, dtype=torch.float32, device=device)
            self._work_buffer = work
        return work


    # ------------------------------------------------------------------ merge / state
    def merge(self, other: StabilityAccumulator) -> StabilityAccumulator:
        """Add ``other``'s snapshots to this accumulator (another process's, for example); returns self.

        Raises:
            ValueError: the head counts differ.
        """
        if other.n_heads is None:
            return self
        if self.n_heads is None:
            self._init(other.n_heads)
        elif other.n_heads != self.n_heads:
            raise ValueError(f"cannot merge a {other.n_heads}-head accumulator into a {self.n_heads}-head one")
        assert self._entropy_sum is not None and other._entropy_sum is not None
        self._entropy_sum += other._entropy_sum
        self._sink_sum += other._sink_sum  # type: ignore[operator]
        self._row_max_sum += other._row_max_sum  # type: ignore[operator]
        self._max_prob = torch.maximum(self._max_prob, other._max_prob)  # type: ignore[arg-type]
        self._max_logit = torch.maximum(self._max_logit, other._max_logit)  # type: ignore[arg-type]
        self._entropy_rows += other._entropy_rows
        self._sink_rows += other._sink_rows
        self.n_snapshots += other.n_snapshots
        self.n_skipped_nonfinite += other.n_skipped_nonfinite
        self.n_logit_snapshots += other.n_logit_snapshots
        self.causal_seen |= other.causal_seen
        return self

    def state_dict(self) -> dict[str, Any]:
        """Plain Python numbers and lists (picklable, JSON-able apart from infinities)."""

        def vec(t: Tensor | None) -> list[float] | None:
            return None if t is None else [float(x) for x in t.tolist()]

        return {
            "version": _STATE_VERSION,
            "n_heads": self.n_heads,
            "n_snapshots": self.n_snapshots,
            "n_skipped_nonfinite": self.n_skipped_nonfinite,
            "n_logit_snapshots": self.n_logit_snapshots,
            "causal_seen": sorted(self.causal_seen),
            "entropy_sum": vec(self._entropy_sum),
            "entropy_rows": self._entropy_rows,
            "sink_sum": vec(self._sink_sum),
            "sink_rows": self._sink_rows,
            "row_max_sum": vec(self._row_max_sum),
            "max_prob": vec(self._max_prob),
            "max_logit": vec(self._max_logit),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace this accumulator's state by ``state`` (from :meth:`state_dict`).

        Raises:
            ValueError: unknown state version.
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unknown StabilityAccumulator state version {state.get('version')!r}")
        self.__init__()  # type: ignore[misc]
        if state["n_heads"] is None:
            return
        self._init(int(state["n_heads"]))

        def vec(x: list[float]) -> Tensor:
            return torch.tensor(x, dtype=torch.float64)

        self.n_snapshots = int(state["n_snapshots"])
        self.n_skipped_nonfinite = int(state["n_skipped_nonfinite"])
        self.n_logit_snapshots = int(state["n_logit_snapshots"])
        self.causal_seen = {bool(c) for c in state["causal_seen"]}
        self._entropy_sum, self._sink_sum = vec(state["entropy_sum"]), vec(state["sink_sum"])
        self._row_max_sum, self._max_prob = vec(state["row_max_sum"]), vec(state["max_prob"])
        self._max_logit = vec(state["max_logit"])
        self._entropy_rows, self._sink_rows = int(state["entropy_rows"]), int(state["sink_rows"])

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> StabilityAccumulator:
        acc = cls()
        acc.load_state_dict(state)
        return acc

    # ------------------------------------------------------------------ compute
    def compute(self) -> StabilityReport:
        """The signals of the snapshots seen so far (the state is kept: more updates may follow)."""
        h = self.n_heads or 0
        messages = []
        causal = next(iter(self.causal_seen)) if len(self.causal_seen) == 1 else None
        if self.n_skipped_nonfinite:
            messages.append(f"{self.n_skipped_nonfinite} sequence(s) with NaN/Inf attention skipped")
        if causal is not False:
            messages.append("entropy and probability maxima over rows with >= 2 visible keys: query 0 of causal "
                            "attention excluded (one visible key: log(1) = 0 and its probability is 1)")
        if self.n_snapshots == 0 or h == 0:
            none: list[float | None] = [None] * h
            return StabilityReport(
                n_snapshots=0, n_heads=h, causal=causal, max_logit=None, entropy=none, sink_mass=none,
                max_prob=none, mean_row_max=none, max_logit_layer=None, entropy_mean=None, entropy_min=None,
                sink_mass_mean=None, sink_mass_max=None, max_prob_layer=None,
                n_skipped_nonfinite=self.n_skipped_nonfinite, status="empty",
                messages=[*messages, "no usable snapshot"],
            )
        assert self._entropy_sum is not None and self._sink_sum is not None and self._row_max_sum is not None
        assert self._max_prob is not None and self._max_logit is not None

        def per_head(total: Tensor, count: int) -> list[float | None]:
            return [float(x) / count for x in total.tolist()] if count else [None] * h

        def stat(values: list[float | None], fn: Any) -> float | None:
            vals = [v for v in values if v is not None and math.isfinite(v)]
            return float(fn(vals)) if vals else None

        entropy = per_head(self._entropy_sum, self._entropy_rows)
        sink = per_head(self._sink_sum, self._sink_rows)
        row_max = per_head(self._row_max_sum, self._entropy_rows)
        max_prob = [_finite_or_none(float(x)) for x in self._max_prob.tolist()]
        max_logit = ([_finite_or_none(float(x)) for x in self._max_logit.tolist()]
                     if self.n_logit_snapshots else None)
        if max_logit is None:
            messages.append("no logits given (adapter sees probabilities only): max_logit unknown")
        elif self.n_logit_snapshots < self.n_snapshots:
            messages.append(f"max_logit over {self.n_logit_snapshots} of {self.n_snapshots} snapshots")
        return StabilityReport(
            n_snapshots=self.n_snapshots,
            n_heads=h,
            causal=causal,
            max_logit=max_logit,
            entropy=entropy,
            sink_mass=sink,
            max_prob=max_prob,
            mean_row_max=row_max,
            max_logit_layer=stat(max_logit or [], max),
            entropy_mean=stat(entropy, lambda v: sum(v) / len(v)),
            entropy_min=stat(entropy, min),
            sink_mass_mean=stat(sink, lambda v: sum(v) / len(v)),
            sink_mass_max=stat(sink, max),
            max_prob_layer=stat(max_prob, max),
            n_skipped_nonfinite=self.n_skipped_nonfinite,
            status="ok",
            messages=messages,
        )


__all__ = ["StabilityAccumulator", "StabilityReport", "StabilityRows", "StabilitySums"]
