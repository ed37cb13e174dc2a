"""Results of the analysis of one layer: :class:`PODReport` and its per-scale :class:`ScaleReport`."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (no torch at run time: the picture process draws reports without it)
    from torch import Tensor


#: Report statuses. "ok" is the only one whose headline numbers are meaningful.
STATUSES = {
    "ok": "analysis complete",
    "empty": "no finite snapshot was given",
    "no_scales": "the sequence is too short for every scale of the grid",
    "too_few_snapshots": "fewer snapshots than PODConfig.min_snapshots: no POD",
    "zero_variance": "all snapshots are identical: the fluctuation is zero",
    "degenerate": "fewer than 3 eigenvalues above the floor: no power-law fit",
    "flat": "flat spectrum (beta <= 0): T_spec is infinite",
    "not_normalised": "rows of some snapshots do not sum to 1: not attention probabilities",
}


def eps_lookup(d: Any, eps: float) -> Any:
    """``d[eps]`` for a dict keyed by eps (H*(eps), saturation flags, bounds), tolerant of float
    round-off and of string keys ("0.1" after a JSON round trip); None when absent."""
    if not d:
        return None
    if eps in d:
        return d[eps]
    for k, v in d.items():
        try:
            if math.isclose(float(k), eps, rel_tol=1e-9):
                return v
        except (TypeError, ValueError):
            continue
    return None


def _jsonable(x: Any) -> Any:
    """Tensors and numpy arrays -> lists, non-finite floats -> None (strict JSON has no NaN/inf)."""
    torch = sys.modules.get("torch")  # (no tensor exists unless torch was imported)
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if not x.is_complex() and (not x.is_floating_point() or bool(torch.isfinite(x).all())):
            return x.tolist()  # nothing to replace: no walk over every entry
        return _jsonable(x.tolist())
    if type(x).__module__ == "numpy":  # arrays and numpy scalars (reports as the picture process holds them)
        np = sys.modules["numpy"]
        kind = x.dtype.kind if isinstance(x, np.ndarray) else ""
        if kind and (kind in "biu" or (kind == "f" and bool(np.isfinite(x).all()))):
            return x.tolist()
        return _jsonable(x.tolist())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


@dataclass
class ScaleReport:
    """POD of the filtered fluctuation ensemble at one dominant scale.

    Attributes:
        scale: the dominant scale a* (tokens).
        window: "lowpass" or "band".
        n_lags: lags that carry window weight (>= PODConfig.window_tol).
        eigenvalues: (K,) float64, descending, >= 0 (K = N snapshots; at most N - 1 non-zero).
        energy_fractions: (K,) eigenvalues / their sum.
        total_energy: sum of the eigenvalues (mean squared norm of the filtered fluctuation).
        t_spec, beta, r2, n_fit, status: the power-law fit (see :func:`spectral_fit`).
        effective_rank: eps -> H*(eps).
        saturated: eps -> whether H*(eps) needs every non-zero mode.
        n_nonzero: eigenvalues above the relative floor.
        lags: (T,) lag of each entry of the mode lag profiles (``i - j``; negative = forward).
        mode_lag_profiles: (n_modes, T) ``phi_k(tau) = mean_i phi_k(i, i - tau)`` over the rows
            where the entry exists; sign fixed so that the largest-magnitude entry is positive.
        modes: (n_modes, L, L) unit-norm POD modes (None unless PODConfig.keep_mode_fields).
        coefficients: (N, n_modes) temporal coefficients ``a_k(s) = <u_s, phi_k>`` (None in
            sketch mode: the snapshots are not kept).
        mode: "exact" (POD of every snapshot) or "sketch" (Frequent Directions sketch).
        error_bound: e, a guaranteed bound ``|lambda_k - eigenvalues_k| <= e`` for every k
            (0.0 in exact mode). In sketch mode the true eigenvalue lies in
            ``[eigenvalues_lower_k, eigenvalues_lower_k + e]``.
        eigenvalues_lower: (K,) guaranteed lower bounds of the eigenvalues (raw sketch); None in
            exact mode.
        resolved_rank: R, the eigenvalues that are at least ``sketch_resolve_factor * e`` (relative
            error at most its inverse); in exact mode the number of non-zero eigenvalues.
            ``energy_fractions`` are exact fractions of the exact ``total_energy`` in both modes.
        effective_rank_bounds: eps -> [lower, upper] guaranteed bounds of H*(eps) (upper None
            when the sketch cannot bound it); [H, H] in exact mode.
        beyond_resolved: eps -> True when H*(eps) lies beyond the resolved rank R: then
            ``effective_rank[eps]`` is None, read "more than R" (at least the lower bound).
    """

    scale: float
    window: str
    n_lags: int
    eigenvalues: Tensor
    energy_fractions: Tensor
    total_energy: float
    t_spec: float
    beta: float
    r2: float
    n_fit: int
    status: str
    effective_rank: dict[float, int | None]
    saturated: dict[float, bool]
    n_nonzero: int
    lags: Tensor
    mode_lag_profiles: Tensor
    modes: Tensor | None = None
    coefficients: Tensor | None = None
    mode: str = "exact"
    error_bound: float = 0.0
    eigenvalues_lower: Tensor | None = None
    resolved_rank: int | None = None
    effective_rank_bounds: dict[float, list[int | None]] = field(default_factory=dict)
    beyond_resolved: dict[float, bool] = field(default_factory=dict)

    def to_dict(self, *, include_modes: bool = False) -> dict[str, Any]:
        """JSON-serialisable dict (mode fields and coefficients only on request)."""
        out = {
            "scale": self.scale,
            "window": self.window,
            "n_lags": self.n_lags,
            "eigenvalues": self.eigenvalues,
            "energy_fractions": self.energy_fractions,
            "total_energy": self.total_energy,
            "t_spec": self.t_spec,
            "beta": self.beta,
            "r2": self.r2,
            "n_fit": self.n_fit,
            "status": self.status,
            "effective_rank": self.effective_rank,
            "saturated": self.saturated,
            "n_nonzero": self.n_nonzero,
            "lags": self.lags,
            "mode_lag_profiles": self.mode_lag_profiles,
            "mode": self.mode,
            "error_bound": self.error_bound,
            "eigenvalues_lower": self.eigenvalues_lower,
            "resolved_rank": self.resolved_rank,
            "effective_rank_bounds": self.effective_rank_bounds,
            "beyond_resolved": self.beyond_resolved,
        }
        if include_modes:
            out["modes"] = self.modes
            out["coefficients"] = self.coefficients
        return _jsonable(out)


@dataclass
class PODReport:
    """Scale-selective POD of one layer's attention ensemble (METHOD.md sections 1 to 6).

    Attributes:
        status: "ok" or a flag (see :data:`STATUSES`); ``messages`` says why.
        n_snapshots: finite snapshots analysed (N).
        n_skipped_nonfinite: snapshots skipped because they held NaN or Inf.
        seq_len: L.
        causal: whether the field was treated as causal (backward lags only).
        scales: (S,) the scales of the grid this L supports.
        scalogram: (S, L) mean over snapshots and rows of |W|^2 of the fluctuation lag signals
            (forward + backward energies for bidirectional fields).
        mean_scalogram: (S, L) the same for the rows of the mean field.
        scale_energy, mean_scale_energy: (S,) sums over the lag of the two scalograms.
        dominant_scales: a*_1.. a*_M, strongest first.
        scale_centroid: ``exp(sum E log a / sum E)`` of the fluctuation scale energy.
        per_scale: one :class:`ScaleReport` per dominant scale, same order.
        t_spec, beta, r2, effective_rank, saturated: headline values (top dominant scale).
        mean_attention_distance: ``sum_j A[i, j] |i - j|`` averaged over rows and snapshots.
        entropy: row entropy normalised by log(number of keys), averaged over rows and snapshots.
        entropy_profile: (L,) the same per query position (NaN for rows with one key).
        running: the per-layer metrics of the running state (:data:`~podmonitor.engine.running.RESULTS`),
            by key (empty without snapshots).
        coherency: (L, L) cross-coherency at ``coherency_scale`` (None when disabled).
        coherency_scale: the scale of the coherency map.
        mean_field: (L, L) the mean attention field Abar.
        config: the PODConfig as a dict.
        messages: human-readable notes (flags, skipped input, approximations).
        analysis_seconds: wall time of the analysis (``compute``).
        mode: "exact" or "sketch" (how the POD was computed; the scalograms, mean field,
            entropy and attention distance are exact in both).
        sketch: in sketch mode, the sketch's facts: ``rank`` (l), ``rows`` held, ``delta_total``
            (the Frequent Directions shrinkage Delta, in squared-norm units of the centred
            un-windowed snapshots), ``n_shrinks``, ``state_bytes``; None in exact mode.
        error_bound, resolved_rank, beyond_resolved: headline values (top dominant scale).
        n_not_normalised: snapshots with a row whose sum over its keys (j <= i for causal fields)
            is not 1 within tolerance; when non-zero, a report that is otherwise "ok" has the
            status "not_normalised" (its numbers are computed, but are not those of attention
            probabilities).
        max_row_sum_error: the largest ``|row sum - 1|`` over every row of every snapshot.
    """

    status: str
    n_snapshots: int
    n_skipped_nonfinite: int
    seq_len: int
    causal: bool
    scales: Tensor
    scalogram: Tensor
    mean_scalogram: Tensor
    scale_energy: Tensor
    mean_scale_energy: Tensor
    dominant_scales: list[float]
    scale_centroid: float
    per_scale: list[ScaleReport]
    mean_attention_distance: float
    entropy: float
    entropy_profile: Tensor
    coherency: Tensor | None
    coherency_scale: float | None
    mean_field: Tensor
    config: dict[str, Any]
    messages: list[str] = field(default_factory=list)
    analysis_seconds: float = math.nan
    mode: str = "exact"
    sketch: dict[str, Any] | None = None
    n_not_normalised: int = 0
    max_row_sum_error: float = 0.0
    running: dict[str, float] = field(default_factory=dict)

    @property
    def headline(self) -> ScaleReport | None:
        """The analysis at the top dominant scale, if any."""
        return self.per_scale[0] if self.per_scale else None

    @property
    def t_spec(self) -> float:
        return self.headline.t_spec if self.headline else math.nan

    @property
    def beta(self) -> float:
        return self.headline.beta if self.headline else math.nan

    @property
    def r2(self) -> float:
        return self.headline.r2 if self.headline else math.nan

    @property
    def effective_rank(self) -> dict[float, int | None]:
        eps = self.config.get("eps", ())
        return self.headline.effective_rank if self.headline else {float(e): None for e in eps}

    @property
    def saturated(self) -> dict[float, bool]:
        eps = self.config.get("eps", ())
        return self.headline.saturated if self.headline else {float(e): False for e in eps}

    @property
    def error_bound(self) -> float:
        return self.headline.error_bound if self.headline else math.nan

    @property
    def resolved_rank(self) -> int | None:
        return self.headline.resolved_rank if self.headline else None

    @property
    def beyond_resolved(self) -> dict[float, bool]:
        eps = self.config.get("eps", ())
        return self.headline.beyond_resolved if self.headline else {float(e): False for e in eps}

    def to_dict(self, *, include_fields: bool = False, include_modes: bool = False) -> dict[str, Any]:
        """JSON-serialisable dict.

        Args:
            include_fields: also include the (L, L) mean field and coherency map.
            include_modes: also include the full mode fields and coefficients.
        """
        out: dict[str, Any] = {
            "status": self.status,
            "messages": list(self.messages),
            "analysis_seconds": self.analysis_seconds,
            "n_snapshots": self.n_snapshots,
            "n_skipped_nonfinite": self.n_skipped_nonfinite,
            "n_not_normalised": self.n_not_normalised,
            "max_row_sum_error": self.max_row_sum_error,
            "seq_len": self.seq_len,
            "causal": self.causal,
            "scales": self.scales,
            "scalogram": self.scalogram,
            "mean_scalogram": self.mean_scalogram,
            "scale_energy": self.scale_energy,
            "mean_scale_energy": self.mean_scale_energy,
            "dominant_scales": self.dominant_scales,
            "scale_centroid": self.scale_centroid,
            "t_spec": self.t_spec,
            "beta": self.beta,
            "r2": self.r2,
            "effective_rank": self.effective_rank,
            "saturated": self.saturated,
            "mode": self.mode,
            "error_bound": self.error_bound,
            "resolved_rank": self.resolved_rank,
            "beyond_resolved": self.beyond_resolved,
            "sketch": self.sketch,
            "mean_attention_distance": self.mean_attention_distance,
            "entropy": self.entropy,
            "entropy_profile": self.entropy_profile,
            **self.running,
            "coherency_scale": self.coherency_scale,
            "config": self.config,
            "per_scale": [s.to_dict(include_modes=include_modes) for s in self.per_scale],
        }
        if include_fields:
            out["mean_field"] = self.mean_field
            out["coherency"] = self.coherency
        return _jsonable(out)
