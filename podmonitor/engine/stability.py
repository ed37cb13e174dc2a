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
        if self.n_heads is None:
            self._init(h)
        elif h != self.n_heads:
            raise ValueError(f"fields have {h} heads, earlier batches had {self.n_heads}")
        if logit_max is not None and tuple(logit_max.shape) != (b, h):
            raise ValueError(f"logit_max must be (B, H) = {(b, h)}, got shape {tuple(logit_max.shape)}")
        inferred = causal is None
        if inferred:  # causal when nothing lies above the diagonal (NaN there: not causal)
            causal = max_above_diagonal(fields.reshape(b * h, t, t)) == 0 if t > 1 else True
        causal = bool(causal)
        device = fields.device
        # rows whose normalised entropy is defined (n_i >= 2 visible keys) and their log(n_i)
        if causal:
            first, log_n = 1, torch.log(torch.arange(2, t + 1, device=device, dtype=torch.float64))
        else:
            first, log_n = (0 if t > 1 else t), torch.full((t,), math.log(max(t, 1)), device=device,
                                                           dtype=torch.float64)
        n_rows = max(0, t - 1) if causal else (t if t > 1 else 0)
        assert self._entropy_sum is not None and self._sink_sum is not None and self._row_max_sum is not None
        assert self._max_prob is not None and self._max_logit is not None
        blocks = _row_blocks(first, t, causal)
        right_zero = causal and (inferred or zeros_above_diagonal or _right_of_blocks_zero(fields, blocks))
        # each sequence's sums first, then which sequences are finite (one transfer for the batch)
        per_seq = [self._sequence_sums(fields[s].float(), blocks, log_n, first, right_zero, n_rows)
                   for s in range(b)]
        if n_rows:
            # every entry enters a block's sum of p log p (first..T-1 rows; right of a causal block
            # only when not all zero), where a NaN or Inf makes the sum non-finite; row 0 apart
            flags = [torch.isfinite(torch.stack((ent_sum.sum(), fields[s, :, :first].float().sum())))
                     for s, (ent_sum, _, _, _) in enumerate(per_seq)]
        else:  # no rows with a defined entropy (T = 1): look at every entry
            flags = [torch.isfinite(torch.stack(torch.aminmax(fields[s]))) for s in range(b)]
        finite = torch.stack(flags).all(dim=1).tolist() if b else []
        # the sums in the same order as one sequence at a time, on the fields' device (one
        # transfer back per batch; on the CPU these are the state's own tensors)
        ent, sink, row_max_total = (x.to(device) for x in (self._entropy_sum, self._sink_sum, self._row_max_sum))
        max_prob, max_logit = self._max_prob.to(device), self._max_logit.to(device)
        used = 0
        for s in range(b):
            if not finite[s]:
                self.n_skipped_nonfinite += 1
                continue
            used += 1
            ent_sum, row_max_sum, row_max_peak, sink_sum = per_seq[s]
            if n_rows:
                ent += ent_sum
                row_max_total += row_max_sum
                max_prob = torch.maximum(max_prob, row_max_peak.double())
            if t > 1:
                sink += sink_sum
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

    def _sequence_sums(self, a: Tensor, blocks: list[tuple[int, int, int]], log_n: Tensor, first: int,
                       right_zero: bool, n_rows: int) -> tuple[Tensor | None, Tensor | None, Tensor | None,
                                                               Tensor | None]:
        """One sequence's contributions: entropy, row-maximum sum and peak (None without rows
        whose entropy is defined), and the sink sum (None for T = 1); see
        :meth:`_entropy_and_row_max`. ``a`` is (H, T, T) float32."""
        sums: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None, None)
        if n_rows:
            sums = self._entropy_and_row_max(a, blocks, log_n, first, right_zero)
        sink = a[:, 1:, 0].sum(dim=-1, dtype=torch.float64) if a.shape[-1] > 1 else None
        return (*sums, sink)

    def _entropy_and_row_max(self, a: Tensor, blocks: list[tuple[int, int, int]], log_n: Tensor,
                             first: int, right_zero: bool) -> tuple[Tensor, Tensor, Tensor]:
        """One finite sequence's sums over its rows ``first..T-1``.

        Works in row blocks ``[r0, r1)`` whose keys ``[:k]`` hold everything a causal row can see
        (k = r1; all T keys for bidirectional attention). The keys right of a block, which causal
        attention leaves at zero, enter only if they are not all zero, so the sums are those over
        every key (0 log 0 = 0, and a zero does not raise a row maximum of probabilities);
        ``right_zero`` says they are all zero (checked once per batch by the caller).
        ``p log p`` is evaluated and summed over each row's keys in the field's float32 (torch's
        cascade sum: about 1e-7 relative for rows of a few thousand keys, whose terms all have one
        sign); the rows' normalised entropies are summed in float64.

        Args:
            a: (H, T, T) float32 probabilities.
            blocks: ``(r0, r1, k)`` row blocks covering rows ``first..T-1``.
            log_n: (T - first,) float64 log of each row's visible keys.
            first: the first row with a defined entropy.
            right_zero: every key right of the causal row blocks is zero.

        Returns:
            entropy: (H,) float64 sum over the rows of the normalised row entropy.
            row_max_sum: (H,) float64 sum over the rows of the row maximum.
            row_max_peak: (H,) float32 largest row maximum.
        """
        h, t = a.shape[0], a.shape[-1]
        work = self._work(h * (blocks[0][1] - blocks[0][0]) * t, a.device)
        ent = torch.zeros(h, dtype=torch.float64, device=a.device)
        row_max_sum = torch.zeros(h, dtype=torch.float64, device=a.device)
        peaks = []
        for r0, r1, k in blocks:
            rows = r1 - r0
            block = a[:, r0:r1, :k]  # (H, rows, k)
            plogp = plogp_(block, work[:h * rows * k].view(h, rows, k))
            row_h = plogp.sum(dim=-1)  # (H, rows) float32: sum_j p log p
            row_max = block.amax(dim=-1)  # (H, rows)
            if k < t:
                rest = a[:, r0:r1, k:]
                if not right_zero:  # not causal after all: the keys right count too
                    row_h += plogp_(rest, torch.empty_like(rest)).sum(dim=-1)
                    row_max = torch.maximum(row_max, rest.amax(dim=-1))
                else:
                    row_max = row_max.clamp_min(0)
            ent -= (row_h.double() / log_n[r0 - first:r1 - first]).sum(dim=-1)
            row_max_sum += row_max.sum(dim=-1, dtype=torch.float64)
            peaks.append(row_max.amax(dim=-1))
        return ent, row_max_sum, torch.stack(peaks).amax(dim=0)

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


__all__ = ["StabilityAccumulator", "StabilityReport"]
