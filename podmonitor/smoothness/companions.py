"""Cheap companions of sigma (METHOD.md section 8), from the attention matrix P alone.

- Row entropy, normalised by the log of the number of keys the row may see: 0 for a one-hot
  (saturated) row, 1 for a uniform row. Rows with a single key (the first row of causal
  attention) have no entropy to normalise and are left out.
- Spectral norm ||P||_2 of each head's row-stochastic matrix: between 1 and sqrt(n); 1 for
  uniform attention (bidirectional) or the identity, sqrt(n) when every query attends to one key.
  For causal uniform attention (the Cesaro matrix) it tends to about 1.7 (see
  :func:`cesaro_norm`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from podmonitor.engine.lags import row_entropy as _engine_row_entropy

__all__ = ["AttentionCompanions", "attention_companions", "cesaro_matrix", "cesaro_norm", "row_entropy",
           "spectral_norm_p"]


def row_entropy(p: torch.Tensor, causal: bool) -> torch.Tensor:
    """Normalised entropy of every row of attention matrices.

    The per-row values of :func:`podmonitor.engine.lags.row_entropy` (the same normalisation),
    computed in float64, with the rows it leaves out (a single key) marked NaN instead of 0.

    Args:
        p: (..., T, T) row-stochastic matrices (rows are queries).
        causal: row i may see i + 1 keys (True) or all T keys (False).

    Returns:
        (..., T) entropy of row i divided by log(number of keys of row i); NaN where a row has a
        single key.
    """
    p = p.detach().to(torch.float64)
    # the engine sums over its leading snapshot axis: a leading axis of one keeps every row
    h, valid = _engine_row_entropy(p.unsqueeze(0), causal)  # (..., T), (T,)
    return h.masked_fill(~valid, float("nan"))


def spectral_norm_p(p: torch.Tensor) -> torch.Tensor:
    """||P||_2 of every matrix: (..., T, T) -> (...,), float64."""
    return torch.linalg.matrix_norm(p.detach().to(torch.float64), ord=2)


def cesaro_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """C_n with C_ij = 1 / i for j <= i (1-based), else 0: causal uniform attention, (n, n)."""
    i = torch.arange(1, n + 1, dtype=dtype)
    return torch.ones(n, n, dtype=dtype).tril() / i.unsqueeze(1)


def cesaro_norm(n: int) -> float:
    """||C_n||_2 (1.4677, 1.5393, 1.5979, 1.6462, 1.6864 for n = 16, 32, 64, 128, 256)."""
    return float(torch.linalg.matrix_norm(cesaro_matrix(n), ord=2))


@dataclass(frozen=True)
class AttentionCompanions:
    """Companions of one layer on a batch of sequences.

    Attributes:
        entropy: mean normalised row entropy over sequences, heads and rows with > 1 key.
        p_norm: mean ||P||_2 over sequences and heads.
        p_norm_max: largest ||P||_2 over sequences and heads.
        n_heads: H.
        n_sequences: b.
        seq_len: T.
    """

    entropy: float
    p_norm: float
    p_norm_max: float
    n_heads: int
    n_sequences: int
    seq_len: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def attention_companions(p: torch.Tensor, causal: bool) -> AttentionCompanions:
    """Entropy and spectral norm of a layer's attention.

    Args:
        p: (b, H, T, T) post-softmax attention (rows sum to 1).
        causal: whether rows see only keys j <= i.

    Raises:
        ValueError: ``p`` is not (b, H, T, T).
    """
    if p.dim() != 4 or p.shape[-1] != p.shape[-2]:
        raise ValueError(f"attention must be (b, H, T, T), got shape {tuple(p.shape)}")
    ent = row_entropy(p, causal)  # (b, H, T)
    ent = ent[~torch.isnan(ent)]
    norms = spectral_norm_p(p)  # (b, H)
    return AttentionCompanions(
        entropy=float(ent.mean()) if ent.numel() else float("nan"),
        p_norm=float(norms.mean()),
        p_norm_max=float(norms.max()),
        n_heads=int(p.shape[1]),
        n_sequences=int(p.shape[0]),
        seq_len=int(p.shape[-1]),
    )
