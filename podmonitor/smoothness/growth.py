"""Growth exponent alpha of sigma(n) ~ c n^alpha (METHOD.md section 8) and the prefix grid.

alpha is the ordinary least-squares slope of ln sigma on ln n. The reading of Castin, Ablin &
Peyre (ICML 2024): about 0.25 on real text for trained BERT / GPT-2, 0.5 in the worst case
(sigma ~ sqrt(n)), about 0 when attention is uniform or saturated (mean-field regime).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["GrowthFit", "growth_exponent", "prefix_grid"]


@dataclass(frozen=True)
class GrowthFit:
    """OLS fit ln sigma(n) = ln c + alpha ln n.

    Attributes:
        alpha: the slope (NaN unless ``status`` is "ok" or "constant").
        log_c: the intercept ln c.
        r2: coefficient of determination of the fit in log-log space (NaN when sigma is constant:
            nothing to explain).
        n_points: number of (n, sigma) pairs used.
        status: "ok"; "constant" (all sigma equal: alpha = 0, r2 NaN); "degenerate" (fewer than 3
            usable points, or all n equal: alpha, log_c and r2 NaN). Points with a non-finite or
            non-positive sigma are not usable.
    """

    alpha: float
    log_c: float
    r2: float
    n_points: int
    status: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def growth_exponent(lengths: Sequence[int], sigmas: Sequence[float], min_points: int = 3) -> GrowthFit:
    """The growth exponent alpha of sigma(n), with R^2, the number of points and a status.

    Args:
        lengths: prefix lengths n (> 0).
        sigmas: sigma(n), same length.
        min_points: fewer usable points give status "degenerate" (3 by default, as for T_spec).

    Returns:
        :class:`GrowthFit`.

    Raises:
        ValueError: ``lengths`` and ``sigmas`` differ in length.
    """
    if len(lengths) != len(sigmas):
        raise ValueError(f"{len(lengths)} lengths but {len(sigmas)} sigmas")
    pts = [(math.log(float(n)), math.log(float(s))) for n, s in zip(lengths, sigmas, strict=True)
           if n > 0 and math.isfinite(float(s)) and float(s) > 0.0]
    k = len(pts)
    nan = math.nan
    if k < min_points:
        return GrowthFit(nan, nan, nan, k, "degenerate")
    mx = sum(p[0] for p in pts) / k
    my = sum(p[1] for p in pts) / k
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx <= 0.0:
        return GrowthFit(nan, nan, nan, k, "degenerate")
    sxy = sum((p[0] - mx) * (p[1] - my) for p in pts)
    alpha = sxy / sxx
    log_c = my - alpha * mx
    ss_tot = sum((p[1] - my) ** 2 for p in pts)
    ss_res = sum((p[1] - log_c - alpha * p[0]) ** 2 for p in pts)
    scale = max(1.0, max(abs(p[1]) for p in pts))
    if ss_tot <= (1e-12 * scale) ** 2 * k:
        return GrowthFit(alpha, log_c, nan, k, "constant")
    return GrowthFit(alpha, log_c, 1.0 - ss_res / ss_tot, k, "ok")


def prefix_grid(seq_len: int, min_length: int = 16) -> list[int]:
    """n = min_length, 2 min_length, 4 min_length, ... < seq_len, then seq_len itself.

    ``prefix_grid(128) == [16, 32, 64, 128]``; ``prefix_grid(100) == [16, 32, 64, 100]``;
    a sequence shorter than ``min_length`` gives ``[seq_len]``.

    Raises:
        ValueError: ``seq_len`` or ``min_length`` < 1.
    """
    if seq_len < 1 or min_length < 1:
        raise ValueError(f"seq_len and min_length must be >= 1, got {seq_len}, {min_length}")
    out = []
    n = min_length
    while n < seq_len:
        out.append(n)
        n *= 2
    out.append(seq_len)
    return out
