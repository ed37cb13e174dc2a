"""Is the head allocation advice stable enough to act on? Drift of POD subspaces and of H* across runs.

Between two consecutive monitored validation runs, for every layer:

* subspace drift: the principal angles theta_1 <= ... <= theta_k between the spans of the top k
  POD modes (at the layer's top dominant scale) of the two runs, flattened to vectors of
  length L^2 (mode lag profiles, length T, when the report keeps no mode fields). The drift is
  the chordal distance ``sqrt(mean_i sin^2 theta_i)`` in [0, 1]: 0 for the same subspace, 1 for
  orthogonal ones. The largest angle (degrees) is reported too.
* H* drift: ``|H*_t - H*_{t-1}| / max(H*_{t-1}, 1)`` of H*(eps).

A run is "settled" when every layer with a result has subspace drift <= ``drift_tol`` and H*
drift <= ``h_tol``, and the advice (the recommended heads per layer and the first ``n_check``
heads of the drop order) is the same as in the previous run. The advice is "stable" once
``patience`` consecutive runs have settled; any unsettled run resets the count. The first run
(or the first after a resume: the previous modes are not checkpointed) cannot settle.

Example:
    >>> readiness = AdviceReadiness(patience=2)
    >>> state = readiness.update(step, reports, layer_names, advice)
    >>> state["stable"], state["reason"]
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..engine.report import PODReport
from .advisor import HeadAllocationAdvice, report_rank


def principal_angles(a: Tensor, b: Tensor) -> Tensor:
    """Principal angles between span(a) and span(b), radians, ascending.

    Args:
        a: (k1, D) vectors spanning the first subspace (need not be orthonormal).
        b: (k2, D) vectors spanning the second.

    Returns:
        (min(k1, k2),) angles in [0, pi/2].

    Raises:
        ValueError: shapes differ in D, or a set is empty.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1] or a.shape[0] == 0 or b.shape[0] == 0:
        raise ValueError(f"need (k1, D) and (k2, D) with k >= 1, got {tuple(a.shape)} and {tuple(b.shape)}")
    qa, _ = torch.linalg.qr(a.double().T)  # (D, k1) orthonormal basis
    qb, _ = torch.linalg.qr(b.double().T)  # (D, k2)
    cos = torch.linalg.svdvals(qa.T @ qb).clamp(0.0, 1.0)  # descending
    return torch.arccos(cos)


def subspace_drift(a: Tensor, b: Tensor) -> tuple[float, float]:
    """(chordal distance sqrt(mean sin^2 theta) in [0, 1], largest principal angle in degrees)."""
    theta = principal_angles(a, b)
    return float(torch.sqrt(torch.sin(theta).square().mean())), float(torch.rad2deg(theta.max()))


def top_modes(report: PODReport, k: int) -> Tensor | None:
    """(k', D) the report's first k modes at its top dominant scale, flattened; None if none.

    Mode fields (L*L) when kept, else mode lag profiles (T).
    """
    head = report.headline
    if head is None:
        return None
    if head.modes is not None and head.modes.numel():
        m = head.modes[:k]
        return m.reshape(m.shape[0], -1).double()
    if head.mode_lag_profiles is not None and head.mode_lag_profiles.numel():
        return head.mode_lag_profiles[:k].double()
    return None


class AdviceReadiness:
    """Tracks, across validation runs, the drift of the dominant POD subspaces, of H* and of the advice.

    Args:
        n_modes: k, modes of the dominant subspace compared between runs.
        drift_tol: largest subspace drift (chordal distance, [0, 1]) of a settled run.
        h_tol: largest relative H*(eps) change of a settled run.
        patience: consecutive settled runs before the advice is called stable.
        eps: the eps of H*(eps).
        n_check: heads at the head of the drop order that must not change (None: the heads the
            advice drops to reach its recommendation, at least 1).

    Raises:
        ValueError: invalid arguments.
    """

    def __init__(self, n_modes: int = 3, drift_tol: float = 0.3, h_tol: float = 0.25, patience: int = 2,
                 eps: float = 0.10, n_check: int | None = None) -> None:
        if n_modes < 1:
            raise ValueError(f"n_modes must be >= 1, got {n_modes}")
        if not 0.0 <= drift_tol <= 1.0:
            raise ValueError(f"drift_tol must lie in [0, 1], got {drift_tol}")
        if h_tol < 0:
            raise ValueError(f"h_tol must be >= 0, got {h_tol}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        if n_check is not None and n_check < 1:
            raise ValueError(f"n_check must be >= 1, got {n_check}")
        self.n_modes = n_modes
        self.drift_tol = drift_tol
        self.h_tol = h_tol
        self.patience = patience
        self.eps = eps
        self.n_check = n_check
        self.history: list[dict[str, Any]] = []
        self.settled_runs = 0
        self._prev_modes: dict[str, Tensor] = {}
        self._prev_rank: dict[str, int | None] = {}
        self._prev_advice: tuple[Any, ...] | None = None

    @property
    def stable(self) -> bool:
        return self.settled_runs >= self.patience

    def _advice_key(self, advice: HeadAllocationAdvice | None) -> tuple[Any, ...] | None:
        if advice is None:
            return None
        n = self.n_check
        if n is None:
            n = max(1, sum(max(0, r.heads_now - r.recommended) for r in advice.layers))
        return (tuple(r.recommended for r in advice.layers),
                tuple((d.layer, d.head) for d in advice.drop_order[:n]))

    def update(self, step: int, reports: Mapping[str, PODReport], layer_names: Sequence[str],
               advice: HeadAllocationAdvice | None = None) -> dict[str, Any]:
        """Compare this run with the previous one; returns this run's readiness record.

        Record: ``step``, ``layers`` ({layer: {subspace_drift, max_angle_deg, h_eps, h_drift,
        top_scale}}), ``max_subspace_drift``, ``max_h_drift``, ``advice_changed``, ``settled``,
        ``settled_runs``, ``stable``, ``reason``.
        """
        layers: dict[str, dict[str, Any]] = {}
        problems: list[str] = []
        first = not self._prev_modes and not self._prev_rank
        for name in layer_names:
            rep = reports.get(name)
            if rep is None:
                continue
            rank, _ = report_rank(rep, self.eps)
            modes = top_modes(rep, self.n_modes)
            drift = angle = h_drift = math.nan
            prev = self._prev_modes.get(name)
            if modes is not None and prev is not None and prev.shape[1] == modes.shape[1]:
                drift, angle = subspace_drift(prev, modes)
            prev_rank = self._prev_rank.get(name)
            if rank is not None and prev_rank is not None:
                h_drift = abs(rank - prev_rank) / max(prev_rank, 1)
            layers[name] = {"subspace_drift": drift, "max_angle_deg": angle, "h_eps": rank, "h_drift": h_drift,
                            "top_scale": rep.dominant_scales[0] if rep.dominant_scales else math.nan}
            if modes is not None:
                self._prev_modes[name] = modes
            self._prev_rank[name] = rank
            if not first:
                if math.isnan(drift) and modes is not None:
                    problems.append(f"{name}: no previous modes to compare")
                elif drift > self.drift_tol:
                    problems.append(f"{name}: subspace drift {drift:.2f} > {self.drift_tol:g}")
                if not math.isnan(h_drift) and h_drift > self.h_tol:
                    problems.append(f"{name}: H*({self.eps:g}) {prev_rank} -> {rank}")
        key = self._advice_key(advice)
        advice_changed = key is not None and self._prev_advice is not None and key != self._prev_advice
        if advice_changed:
            problems.append("the advice changed")
        if key is not None:
            self._prev_advice = key
        if first:
            problems.insert(0, "first monitored run: nothing to compare with")
        settled = not problems
        self.settled_runs = self.settled_runs + 1 if settled else 0
        drifts = [v["subspace_drift"] for v in layers.values() if not math.isnan(v["subspace_drift"])]
        hd = [v["h_drift"] for v in layers.values() if not math.isnan(v["h_drift"])]
        if self.stable:
            reason = f"stable: {self.settled_runs} consecutive settled runs (patience {self.patience})"
        elif settled:
            reason = f"settling: {self.settled_runs} of {self.patience} settled runs"
        else:
            reason = "not stable: " + "; ".join(problems)
        record = {
            "step": int(step),
            "layers": layers,
            "max_subspace_drift": max(drifts) if drifts else math.nan,
            "max_h_drift": max(hd) if hd else math.nan,
            "advice_changed": bool(advice_changed),
            "settled": settled,
            "settled_runs": self.settled_runs,
            "stable": self.stable,
            "reason": reason,
        }
        self.history.append(record)
        return record

    def state_dict(self) -> dict[str, Any]:
        """Counters and history (the previous modes are not kept: a resumed run needs one more run)."""
        return {"history": list(self.history), "settled_runs": self.settled_runs}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = list(state.get("history", []))
        self.settled_runs = 0  # nothing to compare the next run with: start counting again
        self._prev_modes, self._prev_rank, self._prev_advice = {}, {}, None


class RankingReadiness:
    """Is the measured ranking stable enough to act on? Its change between monitored runs.

    Between two consecutive measurements (of :class:`~podmonitor.pruning.HeadImportanceProbe`):

    * rank stability: the Spearman correlation of the heads' measured damage, over the heads
      measured in both runs;
    * whether the heads to drop first (the first ``n_drop`` of the drop order, as a set) changed.

    A run is "settled" when the correlation is at least ``min_spearman`` and the set did not
    change; the ranking is "stable" once ``patience`` consecutive runs have settled (any
    unsettled run resets the count; the first run cannot settle). The drift of each layer's
    dominant POD subspace (chordal distance of the top ``n_modes`` modes, as in
    :class:`AdviceReadiness`) is recorded beside it as evidence; it does not decide.

    Args:
        min_spearman: the least rank correlation with the previous run of a settled run.
        patience: consecutive settled runs before the ranking is called stable.
        n_modes: modes of the dominant POD subspace compared (evidence only).

    Raises:
        ValueError: invalid arguments.
    """

    def __init__(self, min_spearman: float = 0.8, patience: int = 2, n_modes: int = 3) -> None:
        if not -1.0 <= min_spearman <= 1.0:
            raise ValueError(f"min_spearman must lie in [-1, 1], got {min_spearman}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        if n_modes < 1:
            raise ValueError(f"n_modes must be >= 1, got {n_modes}")
        self.min_spearman = min_spearman
        self.patience = patience
        self.n_modes = n_modes
        self.history: list[dict[str, Any]] = []
        self.settled_runs = 0
        self._prev_damage: dict[str, float] | None = None
        self._prev_drop: list[str] | None = None
        self._prev_modes: dict[str, Tensor] = {}

    @property
    def stable(self) -> bool:
        return self.settled_runs >= self.patience

    def update(self, step: int, damage: Mapping[str, float], drop: Sequence[str],
               reports: Mapping[str, PODReport] | None = None,
               layer_names: Sequence[str] = ()) -> dict[str, Any]:
        """Compare this run's measurement with the previous one; returns this run's record.

        Args:
            step: the run's step.
            damage: ``{"<layer>/head_<hh>": measured damage}`` of the heads measured this run.
            drop: the keys of the heads to drop first, in order.
            reports: this run's POD reports (for the subspace drift evidence; optional).
            layer_names: the layers whose reports to compare.

        Record: ``step``, ``spearman_vs_previous``, ``n_compared``, ``drop_set_changed``,
        ``drop_added``, ``drop_removed``, ``settled``, ``settled_runs``, ``stable``, ``reason``,
        ``pod_subspace_drift`` ({layer: chordal distance}).
        """
        from .ablation import spearman

        rho, n = math.nan, 0
        first = self._prev_damage is None
        if not first:
            assert self._prev_damage is not None
            common = [k for k in damage if k in self._prev_damage]
            rho, n = spearman([self._prev_damage[k] for k in common], [damage[k] for k in common])
        prev_drop = set(self._prev_drop or [])
        added = [k for k in drop if k not in prev_drop]
        removed = [k for k in (self._prev_drop or []) if k not in set(drop)]
        changed = not first and bool(added or removed)
        drift: dict[str, float] = {}
        for name in layer_names:
            rep = (reports or {}).get(name)
            modes = top_modes(rep, self.n_modes) if rep is not None else None
            prev = self._prev_modes.get(name)
            if modes is not None and prev is not None and prev.shape[1] == modes.shape[1]:
                drift[name] = subspace_drift(prev, modes)[0]
            if modes is not None:
                self._prev_modes[name] = modes
        problems = []
        if first:
            problems.append("first measurement: nothing to compare with")
        else:
            if not (rho >= self.min_spearman):
                problems.append(f"rank correlation with the previous run {rho:.2f} < {self.min_spearman:g}"
                                if math.isfinite(rho) else "rank correlation with the previous run undefined")
            if changed:
                problems.append(f"the heads to drop changed (+{', '.join(added) or '-'}; -{', '.join(removed) or '-'})")
        settled = not problems
        self.settled_runs = self.settled_runs + 1 if settled else 0
        if self.stable:
            reason = f"stable: {self.settled_runs} consecutive settled runs (patience {self.patience})"
        elif settled:
            reason = f"settling: {self.settled_runs} of {self.patience} settled runs"
        else:
            reason = "not stable: " + "; ".join(problems)
        record = {
            "step": int(step),
            "spearman_vs_previous": rho,
            "n_compared": n,
            "drop_set_changed": changed,
            "drop_added": added,
            "drop_removed": removed,
            "settled": settled,
            "settled_runs": self.settled_runs,
            "stable": self.stable,
            "reason": reason,
            "pod_subspace_drift": drift,
        }
        self._prev_damage = {str(k): float(v) for k, v in damage.items()}
        self._prev_drop = [str(k) for k in drop]
        self.history.append(record)
        return record

    def state_dict(self) -> dict[str, Any]:
        """History, counter and the previous measurement (the POD modes are not kept)."""
        return {"history": list(self.history), "settled_runs": self.settled_runs,
                "prev_damage": dict(self._prev_damage) if self._prev_damage is not None else None,
                "prev_drop": list(self._prev_drop) if self._prev_drop is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = list(state.get("history", []))
        self.settled_runs = int(state.get("settled_runs", 0))
        prev = state.get("prev_damage")
        self._prev_damage = {str(k): float(v) for k, v in prev.items()} if prev is not None else None
        self._prev_drop = list(state["prev_drop"]) if state.get("prev_drop") is not None else None
        self._prev_modes = {}


__all__ = ["AdviceReadiness", "RankingReadiness", "principal_angles", "subspace_drift", "top_modes"]
