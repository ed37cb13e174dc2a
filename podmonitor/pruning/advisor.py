"""Head allocation advice from H*_l(eps) and the per-head analysis (METHOD.md section 7).

A layer l whose effective rank H*_l(eps) (the POD modes its filtered attention fluctuation needs
at its top dominant scale) is small for its n_l heads carries low-rank, consistent attention: a
pruning candidate. A saturated layer may want more heads. The advice makes that concrete.

Load of a layer: ``H*_l / n_l``, POD modes per head.

* Recommended heads r_l under the same total budget ``B = sum_l n_l``: every layer keeps at least
  ``min_heads``; the remaining heads go one at a time to the layer of largest load
  ``H*_l / r_l`` (ties: fewer heads first, then layer order). This greedy allocation minimises
  the largest load ``max_l H*_l / r_l``; for demands proportional to a divisor of B it is the
  proportional allocation.
* Drop order (the heads to drop first, globally): repeatedly take the layer whose load after
  losing one head, ``H*_l / (n_l - 1)``, is smallest (ties: larger surplus ``n_l - r_l``, more
  heads, layer order), never below ``min_heads``; inside it drop

  1. one head of the most similar pair of its remaining heads, when their field similarity
     (:mod:`.redundancy`) is at least ``redundancy_threshold`` (reason "redundant"): the one
     with the lower per-head H*_h(eps), then lower T_spec;
  2. otherwise the remaining head of lowest per-head H*_h(eps), then lowest T_spec (reason
     "low_rank"): the simplest, most input-independent attention. A head whose fluctuation is
     zero (status "zero_variance") counts as rank 0; a head without a result counts as
     infinitely complex (dropped last).

Layers without a usable H* (a flagged report) keep their heads and are never dropped from; the
advice says so.

Bounded-memory ("sketch") reports resolve only the first R modes: when H*(eps) lies beyond R
(``beyond_resolved[eps]``), ``effective_rank[eps]`` is None, read "more than R". Such a layer (or
head) is the most complex one, not an unknown one: its demand is the guaranteed lower bound
``max(effective_rank_bounds[eps][0], R + 1)`` and the evidence says so.

Example:
    >>> advice = advise_from_reports(monitor.last_reports, monitor_layer_names, redundancy)
    >>> print(advice.markdown())
    >>> advice.heads_to_prune(4)   # {layer index: [head, ...]}
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..engine.report import PODReport, eps_lookup
from ..reporting.sinks import strict_jsonable
from .redundancy import HeadRedundancy

_HEAD_KEY = re.compile(r"^(?P<layer>.+)/head_(?P<head>\d+)$")


@dataclass(frozen=True)
class AdviceSettings:
    """Settings of the head allocation advisor.

    Args:
        eps: the eps of H*(eps) used as demand (one of ``PODConfig.eps``).
        redundancy_threshold: field similarity from which two heads count as redundant.
        min_heads: heads every layer keeps.
    """

    eps: float = 0.10
    redundancy_threshold: float = 0.9
    min_heads: int = 1

    def __post_init__(self) -> None:
        if not 0.0 < self.eps < 1.0:
            raise ValueError(f"eps must lie in (0, 1), got {self.eps}")
        if not 0.0 < self.redundancy_threshold <= 1.0:
            raise ValueError(f"redundancy_threshold must lie in (0, 1], got {self.redundancy_threshold}")
        if not isinstance(self.min_heads, int) or self.min_heads < 1:
            raise ValueError(f"min_heads must be an int >= 1, got {self.min_heads!r}")


@dataclass
class LayerEvidence:
    """What the advisor knows about one layer.

    Attributes:
        name: layer name (e.g. "layer_00").
        n_heads: heads of the layer (masked ones included).
        effective_rank: H*_l(eps) of the head-averaged field, None when unknown; 0 for a layer
            whose fluctuation is zero.
        saturated: H*_l(eps) needed every non-zero mode.
        t_spec: T_spec of the layer (NaN when unknown).
        status: the layer report's status.
        head_ranks: (H,) per-head H*_h(eps) (NaN unknown, 0 for a constant head, the sketch lower
            bound when H*_h lies beyond the head report's resolved rank), or None.
        head_t_spec: (H,) per-head T_spec (NaN unknown), or None.
        redundancy: the layer's :class:`HeadRedundancy`, or None.
        active: (H,) False for heads already pruned (they are neither counted nor dropped again).
        rank_lower_bound: for a sketch-mode report whose H*_l(eps) lies beyond its resolved rank R
            (``effective_rank`` None): the guaranteed lower bound ``max(lower bound, R + 1)``, used
            as the layer's demand; None otherwise.
        resolved_rank: R of such a report (None otherwise).
    """

    name: str
    n_heads: int
    effective_rank: int | None
    saturated: bool = False
    t_spec: float = math.nan
    status: str = "ok"
    head_ranks: list[float] | None = None
    head_t_spec: list[float] | None = None
    redundancy: HeadRedundancy | None = None
    active: list[bool] | None = None
    rank_lower_bound: int | None = None
    resolved_rank: int | None = None

    @property
    def demand(self) -> int | None:
        """H*_l(eps), else the sketch lower bound, else None (no usable H*)."""
        return self.effective_rank if self.effective_rank is not None else self.rank_lower_bound

    def active_heads(self) -> list[int]:
        return [h for h in range(self.n_heads) if self.active is None or self.active[h]]


@dataclass
class HeadDrop:
    """One line of the drop order."""

    rank: int  # position in the global drop order, 1-based
    layer: str
    layer_index: int
    head: int
    reason: str  # "redundant" | "low_rank" | "no_head_evidence"
    evidence: str
    head_effective_rank: float = math.nan
    head_t_spec: float = math.nan
    similarity: float = math.nan
    partner: int | None = None
    layer_load_after: float = math.nan  # H*_l / (heads left)


@dataclass
class LayerAdvice:
    """One row of the allocation table."""

    layer: str
    index: int
    heads_now: int
    recommended: int
    effective_rank: int | None
    saturated: bool
    t_spec: float
    status: str
    drop: list[int]  # heads this layer drops to reach min(now, recommended), in order
    evidence: str
    rank_lower_bound: int | None = None  # sketch mode, H* beyond the resolved rank: the demand used

    @property
    def change(self) -> int:
        return self.recommended - self.heads_now


@dataclass
class HeadAllocationAdvice:
    """Heads per layer now, recommended under the same budget, and the heads to drop first.

    Attributes:
        eps: the eps of H*(eps) used.
        total_budget: heads of the layers with evidence (the budget that is reallocated).
        layers: one :class:`LayerAdvice` per layer, in model order.
        drop_order: every head that may be dropped, best candidate first.
        messages: notes (layers without evidence, missing per-head analysis).
    """

    eps: float
    total_budget: int
    layers: list[LayerAdvice]
    drop_order: list[HeadDrop]
    messages: list[str] = field(default_factory=list)

    def heads_to_prune(self, n: int) -> dict[int, list[int]]:
        """The first ``n`` heads of the drop order as ``{layer index: [heads, sorted]}``.

        Raises:
            ValueError: ``n`` is negative or more than the drop order holds.
        """
        if n < 0 or n > len(self.drop_order):
            raise ValueError(f"can advise dropping 0..{len(self.drop_order)} heads, asked for {n}")
        out: dict[int, list[int]] = {}
        for d in self.drop_order[:n]:
            out.setdefault(d.layer_index, []).append(d.head)
        return {k: sorted(v) for k, v in sorted(out.items())}

    def recommended(self) -> dict[str, int]:
        return {row.layer: row.recommended for row in self.layers}

    def table(self) -> tuple[list[str], list[list[Any]]]:
        """(columns, rows) of the allocation table (for a W&B table or a CSV)."""
        cols = ["layer", "heads_now", f"H*({self.eps:g})", "saturated", "T_spec", "recommended", "change",
                "drop_first", "evidence"]
        rows = [[r.layer, r.heads_now, r.effective_rank, r.saturated, _num(r.t_spec), r.recommended, r.change,
                 " ".join(str(h) for h in r.drop), r.evidence] for r in self.layers]
        return cols, rows

    def markdown(self, n_order: int | None = None) -> str:
        """The table and the drop order (first ``n_order`` lines; all by default) as markdown."""
        lines = [f"### head allocation (H*({self.eps:g}), budget {self.total_budget} heads)", "",
                 f"| layer | heads now | H*({self.eps:g}) | T_spec | recommended | drop first | evidence |",
                 "|---|---|---|---|---|---|---|"]
        for r in self.layers:
            if r.effective_rank is not None:
                hstar = f"{r.effective_rank}{' (sat.)' if r.saturated else ''}"
            elif r.rank_lower_bound is not None:
                hstar = f">= {r.rank_lower_bound} (sketch)"
            else:
                hstar = "n/a"
            drop = ", ".join(f"h{h}" for h in r.drop) or "-"
            lines.append(f"| {r.layer} | {r.heads_now} | {hstar} | {_fmt(r.t_spec)} | {r.recommended} | {drop} | "
                         f"{r.evidence} |")
        order = self.drop_order if n_order is None else self.drop_order[:n_order]
        if order:
            lines += ["", "**Drop order:**", ""]
            lines += [f"{d.rank}. {d.layer} head {d.head} ({d.reason}): {d.evidence}" for d in order]
        if self.messages:
            lines += ["", *[f"- {m}" for m in self.messages]]
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable (non-finite floats become None)."""
        return strict_jsonable({
            "eps": self.eps,
            "total_budget": self.total_budget,
            "layers": [asdict(r) for r in self.layers],
            "drop_order": [asdict(d) for d in self.drop_order],
            "messages": list(self.messages),
        })


def _num(x: float) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def _fmt(x: float | None, spec: str = ".3g") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(x, spec)


def report_rank(report: PODReport, eps: float) -> tuple[int | None, bool]:
    """(H*(eps), saturated) of a report's headline; (0, False) for a zero fluctuation; (None, False)
    when unknown.

    Raises:
        ValueError: the report's config has no such eps.
    """
    if report.status == "zero_variance":
        return 0, False
    if not any(math.isclose(float(e), eps, rel_tol=1e-9) for e in report.config.get("eps", ())):
        raise ValueError(f"eps={eps} is not among the report's PODConfig.eps {report.config.get('eps')}")
    head = report.headline
    if head is None:
        return None, False
    rank = eps_lookup(head.effective_rank, eps)
    return (None if rank is None else int(rank)), bool(eps_lookup(head.saturated, eps))


def report_rank_lower_bound(report: PODReport, eps: float) -> tuple[int | None, int | None]:
    """(lower bound, R) when the report is a sketch whose H*(eps) lies beyond its resolved rank R
    (``effective_rank[eps]`` None, read "more than R"): the lower bound is
    ``max(effective_rank_bounds[eps][0], R + 1)``. (None, None) otherwise (H* known, or unknown for
    another reason).
    """
    head = report.headline
    if report.status == "zero_variance" or head is None:
        return None, None
    if not eps_lookup(getattr(head, "beyond_resolved", None) or {}, eps):
        return None, None
    resolved = getattr(head, "resolved_rank", None)
    bounds = eps_lookup(getattr(head, "effective_rank_bounds", None) or {}, eps)
    lower = bounds[0] if bounds else None
    return max(int(lower or 0), (int(resolved) if resolved is not None else 0) + 1), \
        (None if resolved is None else int(resolved))


def evidence_from_reports(reports: Mapping[str, PODReport], layer_names: Sequence[str],
                          redundancy: Mapping[str, HeadRedundancy] | None = None, *, eps: float = 0.10,
                          active: Mapping[str, Sequence[bool]] | None = None) -> list[LayerEvidence]:
    """:class:`LayerEvidence` of every layer from the monitor's reports.

    Args:
        reports: ``{layer: PODReport}`` and, for the per-head analysis, ``{"<layer>/head_<h>": PODReport}``.
        layer_names: the layers, in model order.
        redundancy: ``{layer: HeadRedundancy}`` (optional).
        eps: the eps of H*(eps).
        active: ``{layer: (H,) bool}`` for heads already pruned (optional).
    """
    heads: dict[str, dict[int, PODReport]] = {}
    for key, rep in reports.items():
        m = _HEAD_KEY.match(key)
        if m:
            heads.setdefault(m.group("layer"), {})[int(m.group("head"))] = rep
    out = []
    for name in layer_names:
        rep = reports.get(name)
        red = (redundancy or {}).get(name)
        per_head = heads.get(name, {})
        n_heads = max([len(per_head)] + ([red.n_heads] if red is not None else []) +
                      ([len(active[name])] if active and name in active else []))
        rank, sat = report_rank(rep, eps) if rep is not None else (None, False)
        lower, resolved = report_rank_lower_bound(rep, eps) if rep is not None and rank is None else (None, None)
        head_ranks = head_ts = None
        if per_head:
            head_ranks, head_ts = [], []
            for h in range(n_heads):
                hr = per_head.get(h)
                r, _ = report_rank(hr, eps) if hr is not None else (None, False)
                if r is None and hr is not None:
                    r, _ = report_rank_lower_bound(hr, eps)  # sketch, H*_h beyond R: its lower bound
                head_ranks.append(math.nan if r is None else float(r))
                head_ts.append(float(hr.t_spec) if hr is not None else math.nan)
        out.append(LayerEvidence(
            name=name, n_heads=n_heads, effective_rank=rank, saturated=sat,
            t_spec=float(rep.t_spec) if rep is not None else math.nan,
            status=rep.status if rep is not None else "missing",
            head_ranks=head_ranks, head_t_spec=head_ts, redundancy=red,
            active=list(active[name]) if active and name in active else None,
            rank_lower_bound=lower, resolved_rank=resolved,
        ))
    return out


def advise_from_reports(reports: Mapping[str, PODReport], layer_names: Sequence[str],
                        redundancy: Mapping[str, HeadRedundancy] | None = None,
                        settings: AdviceSettings | None = None,
                        active: Mapping[str, Sequence[bool]] | None = None) -> HeadAllocationAdvice:
    """:func:`advise_head_allocation` of :func:`evidence_from_reports`."""
    settings = settings or AdviceSettings()
    return advise_head_allocation(evidence_from_reports(reports, layer_names, redundancy, eps=settings.eps,
                                                        active=active), settings)


def _complexity(ev: LayerEvidence, h: int) -> tuple[float, float, int]:
    """Sort key of a head: (H*_h, T_spec_h, h); unknown values sort last."""
    r = ev.head_ranks[h] if ev.head_ranks is not None else math.nan
    t = ev.head_t_spec[h] if ev.head_t_spec is not None else math.nan
    return (r if math.isfinite(r) else math.inf, t if math.isfinite(t) else math.inf, h)


def _pick_head(ev: LayerEvidence, remaining: list[int], settings: AdviceSettings
               ) -> tuple[int, str, str, float, int | None]:
    """(head, reason, evidence, similarity, partner) of the next head to drop in this layer."""
    eps = settings.eps
    if ev.redundancy is not None and len(remaining) >= 2:
        best: tuple[float, int, int] | None = None
        for i, h in enumerate(remaining):
            for g in remaining[i + 1:]:
                s = float(ev.redundancy.similarity[h, g])
                if math.isfinite(s) and (best is None or s > best[0]):
                    best = (s, h, g)
        if best is not None and best[0] >= settings.redundancy_threshold:
            s, h, g = best
            drop, keep = sorted((h, g), key=lambda k: _complexity(ev, k))
            text = (f"field similarity {s:.3f} with head {keep} (>= {settings.redundancy_threshold:g}); "
                    f"H*_h({eps:g}) {_fmt(_complexity(ev, drop)[0])} vs {_fmt(_complexity(ev, keep)[0])} "
                    f"of head {keep}")
            return drop, "redundant", text, s, keep
    if ev.head_ranks is None:
        h = remaining[-1]
        return h, "no_head_evidence", "no per-head analysis (PODMonitor(per_head=True)): last active head", \
            math.nan, None
    ordered = sorted(remaining, key=lambda k: _complexity(ev, k))
    h = ordered[0]
    others = ", ".join(f"h{k}: {_fmt(_complexity(ev, k)[0])}" for k in ordered[1:])
    sim_partner, sim = (ev.redundancy.most_similar(h, remaining) if ev.redundancy is not None else (None, math.nan))
    text = (f"lowest per-head H*_h({eps:g}) among active heads: {_fmt(_complexity(ev, h)[0])} "
            f"(others {others or 'none'}), T_spec {_fmt(_complexity(ev, h)[1])}")
    if sim_partner is not None:
        text += f"; most similar: head {sim_partner} ({sim:.2f})"
    return h, "low_rank", text, sim, sim_partner


def advise_head_allocation(layers: Sequence[LayerEvidence], settings: AdviceSettings | None = None
                           ) -> HeadAllocationAdvice:
    """The allocation table and drop order (rules in the module docstring).

    Args:
        layers: evidence of every layer, in model order.
        settings: eps, redundancy threshold, minimum heads per layer.

    Returns:
        the advice; layers without a usable H* keep their heads (noted in ``messages``).
    """
    settings = settings or AdviceSettings()
    messages: list[str] = []
    now = [len(ev.active_heads()) for ev in layers]
    usable = [i for i, ev in enumerate(layers) if ev.demand is not None]
    for i, ev in enumerate(layers):
        if i not in usable:
            messages.append(f"{ev.name}: no usable H*({settings.eps:g}) (status {ev.status}); keeps its {now[i]} heads")
        else:
            if ev.effective_rank is None:
                messages.append(f"{ev.name}: H*({settings.eps:g}) > {ev.resolved_rank} (sketch), using lower bound "
                                f"{ev.rank_lower_bound} as its demand")
            if ev.head_ranks is None:
                messages.append(f"{ev.name}: no per-head analysis; which head to drop is not evidenced")
    demand = {i: float(layers[i].demand) for i in usable}  # type: ignore[arg-type]
    budget = sum(now[i] for i in usable)

    # recommended heads: min_heads each, then one at a time to the largest load H*/r
    rec = {i: now[i] for i in range(len(layers))}
    if usable and budget >= settings.min_heads * len(usable):
        alloc = {i: settings.min_heads for i in usable}
        for _ in range(budget - settings.min_heads * len(usable)):
            i = max(usable, key=lambda k: (demand[k] / alloc[k], -alloc[k], -k))
            alloc[i] += 1
        rec.update(alloc)
    elif usable:
        messages.append(f"budget {budget} is below min_heads x layers: no reallocation")

    # drop order
    left = {i: list(layers[i].active_heads()) for i in range(len(layers))}
    order: list[HeadDrop] = []
    while True:
        cand = [i for i in usable if len(left[i]) - 1 >= settings.min_heads]
        if not cand:
            break
        i = min(cand, key=lambda k: (demand[k] / (len(left[k]) - 1), -(len(left[k]) - rec[k]), -len(left[k]), k))
        ev = layers[i]
        h, reason, text, sim, partner = _pick_head(ev, left[i], settings)
        left[i].remove(h)
        load = demand[i] / len(left[i])
        cr = _complexity(ev, h)
        order.append(HeadDrop(rank=len(order) + 1, layer=ev.name, layer_index=i, head=h, reason=reason,
                              evidence=f"{text}; layer load H*/heads {demand[i] / (len(left[i]) + 1):.3g} -> "
                                       f"{load:.3g}",
                              head_effective_rank=cr[0] if math.isfinite(cr[0]) else math.nan,
                              head_t_spec=cr[1] if math.isfinite(cr[1]) else math.nan,
                              similarity=sim, partner=partner, layer_load_after=load))

    rows = []
    for i, ev in enumerate(layers):
        n_drop = max(0, now[i] - rec[i])
        drop = [d.head for d in order if d.layer_index == i][:n_drop]
        if i not in usable:
            text = f"no usable H*({settings.eps:g}) (status {ev.status}): kept as is"
        elif ev.effective_rank is None:
            r_text = "?" if ev.resolved_rank is None else str(ev.resolved_rank)
            text = f"H*({settings.eps:g}) > {r_text} (sketch), using lower bound {ev.rank_lower_bound} for " \
                   f"{now[i]} heads ({demand[i] / max(now[i], 1):.3g} modes/head at least)"
        else:
            text = f"H*({settings.eps:g}) = {ev.effective_rank} for {now[i]} heads ({demand[i] / max(now[i], 1):.3g} " \
                   f"modes/head)"
            if ev.saturated:
                text += "; saturated (needs every mode): may want more heads"
            if ev.redundancy is not None and len(left_pairs := ev.active_heads()) >= 2:
                s, a, b = max(((float(ev.redundancy.similarity[h, g]), h, g) for j, h in enumerate(left_pairs)
                               for g in left_pairs[j + 1:]), key=lambda t: t[0] if math.isfinite(t[0]) else -1.0)
                text += f"; most similar heads {a}, {b} ({_fmt(s, '.2f')})"
        rows.append(LayerAdvice(layer=ev.name, index=i, heads_now=now[i], recommended=rec[i],
                                effective_rank=ev.effective_rank, saturated=ev.saturated, t_spec=ev.t_spec,
                                status=ev.status, drop=drop, evidence=text,
                                rank_lower_bound=ev.rank_lower_bound if ev.effective_rank is None else None))
    return HeadAllocationAdvice(eps=settings.eps, total_budget=budget, layers=rows, drop_order=order,
                                messages=messages)


__all__ = [
    "AdviceSettings",
    "HeadAllocationAdvice",
    "HeadDrop",
    "LayerAdvice",
    "LayerEvidence",
    "advise_from_reports",
    "advise_head_allocation",
    "evidence_from_reports",
    "report_rank",
    "report_rank_lower_bound",
]
