"""Redundancy between the heads of one layer: similarity of their attention fields over the ensemble.

For heads h, g of a layer and snapshots s = 1..N (METHOD.md section 1 notation):

* field similarity (cosine in the ensemble inner product)::

      S[h, g] = E_s <A_s^h, A_s^g>_F / sqrt(E_s |A_s^h|_F^2  E_s |A_s^g|_F^2)

  1 for exact copies; it counts the mean pattern too (two heads that both look at the previous
  token are similar even if their fluctuations differ).
* fluctuation correlation (Pearson over the ensemble of the fluctuations u = A - Abar)::

      R[h, g] = E_s <u_s^h, u_s^g>_F / sqrt(E_s |u_s^h|_F^2  E_s |u_s^g|_F^2)

  NaN where a head's fluctuation is zero (a constant head).

State: the (H, H) Gram matrix ``sum_s <A_s^h, A_s^g>`` and the (H, L, L) field sums, so the
accumulator is exact at any N, mergeable across processes and cheap to checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class HeadRedundancy:
    """Redundancy of the heads of one layer.

    Attributes:
        similarity: (H, H) field similarity S (diagonal 1; NaN for an all-zero head).
        fluctuation_correlation: (H, H) R (NaN rows / columns for constant heads).
        n_snapshots: N, sequences used.
        n_skipped_nonfinite: sequences skipped because a head held NaN or Inf.
    """

    similarity: Tensor
    fluctuation_correlation: Tensor
    n_snapshots: int
    n_skipped_nonfinite: int = 0

    @property
    def n_heads(self) -> int:
        return int(self.similarity.shape[0])

    def most_similar(self, head: int, among: list[int] | None = None) -> tuple[int | None, float]:
        """(g, S[head, g]) for the most similar other head g (restricted to ``among``); (None, NaN) if none."""
        others = [g for g in (range(self.n_heads) if among is None else among) if g != head]
        best, value = None, -math.inf
        for g in others:
            v = float(self.similarity[head, g])
            if math.isfinite(v) and v > value:
                best, value = g, v
        return (best, value) if best is not None else (None, math.nan)

    def to_dict(self) -> dict[str, Any]:
        def rows(t: Tensor) -> list[list[float | None]]:
            return [[float(v) if math.isfinite(float(v)) else None for v in row] for row in t.tolist()]

        return {
            "similarity": rows(self.similarity),
            "fluctuation_correlation": rows(self.fluctuation_correlation),
            "n_snapshots": self.n_snapshots,
            "n_skipped_nonfinite": self.n_skipped_nonfinite,
        }


class HeadRedundancyAccumulator:
    """Incremental head-redundancy statistics of one layer: ``update`` / ``compute`` / ``merge``.

    Example:
        >>> acc = HeadRedundancyAccumulator()
        >>> acc.update(fields)          # (B, H, L, L) per-head attention of one batch
        >>> red = acc.compute()         # HeadRedundancy, red.similarity (H, H)
    """

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        self.dtype = dtype
        self.reset()

    def reset(self) -> None:
        self.n = 0
        self.n_skipped_nonfinite = 0
        self.gram: Tensor | None = None  # (H, H) sum_s <A_s^h, A_s^g>
        self.field_sum: Tensor | None = None  # (H, L, L) sum_s A_s^h

    def update(self, fields: Tensor) -> int:
        """Add a batch of per-head fields.

        Args:
            fields: (B, H, L, L) attention probabilities of the heads of one layer.

        Returns:
            the number of sequences used (non-finite ones are skipped and counted).

        Raises:
            ValueError: wrong rank, or H / L different from earlier batches.
        """
        if not isinstance(fields, Tensor) or fields.dim() != 4 or fields.shape[-1] != fields.shape[-2]:
            raise ValueError(f"fields must be a (B, H, L, L) tensor, got {getattr(fields, 'shape', type(fields))}")
        x = fields.detach().to(self.dtype)
        finite = torch.isfinite(x).flatten(1).all(dim=1)  # (B,)
        self.n_skipped_nonfinite += int((~finite).sum())
        x = x[finite]
        if x.shape[0] == 0:
            return 0
        if self.gram is None:
            h, L = x.shape[1], x.shape[-1]
            self.gram = torch.zeros(h, h, dtype=self.dtype, device=x.device)
            self.field_sum = torch.zeros(h, L, L, dtype=self.dtype, device=x.device)
        elif self.field_sum is not None and x.shape[1:] != self.field_sum.shape:
            raise ValueError(f"fields of shape {tuple(x.shape[1:])} after {tuple(self.field_sum.shape)}")
        assert self.field_sum is not None
        flat = x.flatten(2)  # (B, H, L*L)
        self.gram += torch.einsum("bhp,bgp->hg", flat, flat)
        self.field_sum += x.sum(dim=0)
        self.n += int(x.shape[0])
        return int(x.shape[0])

    def merge(self, other: HeadRedundancyAccumulator) -> HeadRedundancyAccumulator:
        """Add another accumulator's sums into this one (another process's snapshots); returns self."""
        if other.gram is None:
            return self
        if self.gram is None:
            self.gram, self.field_sum = other.gram.clone(), other.field_sum.clone()  # type: ignore[union-attr]
        else:
            if other.gram.shape != self.gram.shape or other.field_sum.shape != self.field_sum.shape:  # type: ignore[union-attr]
                raise ValueError("cannot merge redundancy accumulators of different shapes")
            self.gram += other.gram.to(self.gram.device)
            self.field_sum += other.field_sum.to(self.gram.device)  # type: ignore[operator,union-attr]
        self.n += other.n
        self.n_skipped_nonfinite += other.n_skipped_nonfinite
        return self

    def state_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "n_skipped_nonfinite": self.n_skipped_nonfinite,
            "gram": None if self.gram is None else self.gram.cpu(),
            "field_sum": None if self.field_sum is None else self.field_sum.cpu(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])
        self.n_skipped_nonfinite = int(state["n_skipped_nonfinite"])
        self.gram = None if state["gram"] is None else state["gram"].to(self.dtype).clone()
        self.field_sum = None if state["field_sum"] is None else state["field_sum"].to(self.dtype).clone()

    def compute(self) -> HeadRedundancy:
        """The similarity and fluctuation-correlation matrices (see the module docstring).

        Raises:
            ValueError: no finite snapshot was given.
        """
        if self.gram is None or self.field_sum is None or self.n == 0:
            raise ValueError("no finite snapshot: nothing to compare")
        n = float(self.n)
        second = self.gram / n  # (H, H) E<A^h, A^g>
        mean = (self.field_sum / n).flatten(1)  # (H, L*L)
        cov = second - mean @ mean.T  # (H, H) E<u^h, u^g>
        return HeadRedundancy(
            similarity=_normalise(second, second),
            fluctuation_correlation=_normalise(cov, second),
            n_snapshots=self.n,
            n_skipped_nonfinite=self.n_skipped_nonfinite,
        )


def _normalise(m: Tensor, ref: Tensor) -> Tensor:
    """m[h, g] / sqrt(m[h, h] m[g, g]), NaN where a diagonal entry is at the rounding floor
    (1e-12 of the largest diagonal entry of ``ref``, the second moments)."""
    d = m.diagonal().clamp_min(0.0)  # (H,)
    floor = 1e-12 * float(ref.diagonal().abs().max()) if ref.numel() else 0.0
    ok = d > floor
    scale = torch.sqrt(d)
    out = m / (scale[:, None] * scale[None, :]).clamp_min(torch.finfo(m.dtype).tiny)
    out = out.clamp(-1.0, 1.0)
    bad = ~(ok[:, None] & ok[None, :])
    out[bad] = math.nan
    return out


__all__ = ["HeadRedundancy", "HeadRedundancyAccumulator"]
