"""Measured head importance during validation: :class:`HeadImportanceProbe` (METHOD.md section 7).

An extra of :class:`~podmonitor.PODMonitor` (:mod:`podmonitor.extras`). On the first
``probe_batches`` batches of every ``every_n_runs``-th monitored validation run it removes one
head at a time (:class:`~podmonitor.pruning.heads.HeadGates`) and measures how much the model's
output changes (:mod:`podmonitor.pruning.ablation`; label-free KL divergence by default). From
that it publishes, every run:

* the advice (:class:`MeasuredAdvice`): heads per layer now, the heads to drop first with their
  measured damage, and the POD statistics of each head beside them (per-head H*, T_spec,
  redundancy, attention distance, entropy, with ``PODMonitor(per_head=True)``), each with its
  Spearman correlation to the measured damage on this model: every run tests the hypothesis that
  a statistic predicts importance instead of assuming it. The H*-based layer allocation
  (:mod:`.advisor`) is shown as a labelled hypothesis with its measured correlation;
* the readiness (:class:`~podmonitor.pruning.readiness.RankingReadiness`): the rank correlation
  with the previous measurement and whether the heads to drop changed;
* the cost: forward (and backward) passes and seconds.

Options: ``first_order=True`` adds Michel et al.'s estimate (one backward per batch; needs a loss:
``loss_fn`` or the model's ``validation_step``); ``greedy=True`` refines the first ``n_drop``
drops greedily (re-measure every candidate after each drop, or each ``group`` of drops, on the
probe batches: about ``n_drop / group`` times the cost of the single-head pass).

DDP: every rank measures on its own probe batches; the monitor gathers the parts and rank zero
averages them (no collective in here). The greedy refinement runs on rank zero's probe batches
only (each drop must be decided before the next measurement).

Example:
    >>> monitor = PODMonitor(per_head=True, extras=[HeadImportanceProbe()])
    >>> trainer = Trainer(callbacks=[monitor, HeadPruning(n_heads=4, at_step=4000)])
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..extras import ExtraContext, ExtraResult, MonitorExtra
from ..reporting.sinks import strict_jsonable
from .ablation import (
    Cost,
    DamageFn,
    ForwardFn,
    GreedyStep,
    LossFn,
    Measurer,
    first_order_importance,
    greedy_drop_order,
    lowest_first,
    single_head_damage,
    spearman,
)
from .advisor import report_rank, report_rank_lower_bound
from .heads import HeadGates
from .readiness import RankingReadiness

Heads = dict[int, list[int]]

STATISTICS = {
    "h_star": ("per-head H*(eps)", "paper: low-rank heads can go (expects rho > 0)"),
    "t_spec": ("per-head T_spec", "advisor tie-break: low T_spec can go (expects rho > 0)"),
    "redundancy": ("largest field similarity with another head", "redundant heads can go (expects rho < 0)"),
    "distance": ("mean attention distance", "no stated hypothesis"),
    "entropy": ("normalised row entropy", "no stated hypothesis"),
    "first_order": ("Michel et al. |d loss / d xi| (per-layer l2-normalised)",
                    "an estimate of the same (expects rho > 0)"),
}


def head_key(layer: str, head: int) -> str:
    """The key of a head, as the monitor names per-head reports: ``"<layer>/head_<hh>"``."""
    return f"{layer}/head_{head:02d}"


@dataclass
class HeadToDrop:
    """One line of the measured drop order."""

    rank: int  # 1-based position
    layer: str
    layer_index: int
    head: int
    damage: float  # measured damage of removing this head alone
    set_damage: float = math.nan  # greedy: re-measured damage of the set dropped so far, this head included
    source: str = "single"  # "greedy" or "single" (ranked by its single-head damage)
    evidence: dict[str, float] = field(default_factory=dict)  # the head's POD statistics


@dataclass
class MeasuredAdvice:
    """What one measurement says: the ranking, the heads to drop first, the evidence beside them.

    Attributes:
        step: the trainer's step of the run.
        layer_names: the layers (the monitor's names when they match the gated layers).
        n_heads: heads per layer (pruned ones included).
        pruned: heads already pruned, ``{layer index: [heads]}`` (not measured, not dropped again).
        damage: (L, H) mean damage of removing each head alone (NaN: not measured).
        damage_kind: "kl", "cosine", "loss" or "function".
        n_sequences: sequences the damage was averaged over (all ranks).
        drop_order: every head that may go, best candidate first (the greedy drops first).
        n_drop: how many of them the advice names (the readiness compares these).
        first_order: (L, H) Michel et al.'s estimate, per-layer l2-normalised, or None.
        statistics: ``{statistic: {"spearman", "n", "meaning", "hypothesis"}}`` over the active heads.
        hypothesis: the H*-based layer allocation as a hypothesis (its rank correlation with the
            layers' measured damage, the heads it would drop first and their measured damage).
        readiness: the :class:`RankingReadiness` record of the run.
        cost: forward and backward passes and seconds of the measurement (all ranks).
        notes: what the reader should know (fallbacks, missing evidence, failures).
    """

    step: int
    layer_names: list[str]
    n_heads: list[int]
    pruned: Heads
    damage: list[list[float]]
    damage_kind: str
    n_sequences: int
    drop_order: list[HeadToDrop]
    n_drop: int
    first_order: list[list[float]] | None = None
    statistics: dict[str, dict[str, Any]] = field(default_factory=dict)
    hypothesis: dict[str, Any] = field(default_factory=dict)
    readiness: dict[str, Any] = field(default_factory=dict)
    cost: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def heads_to_prune(self, n: int) -> Heads:
        """The first ``n`` heads of the drop order, ``{layer index: [heads, sorted]}``.

        Raises:
            ValueError: ``n`` is negative or more than the drop order holds.
        """
        if n < 0 or n > len(self.drop_order):
            raise ValueError(f"the measured advice can drop 0..{len(self.drop_order)} heads, asked for {n}")
        out: Heads = {}
        for d in self.drop_order[:n]:
            out.setdefault(d.layer_index, []).append(d.head)
        return {k: sorted(v) for k, v in sorted(out.items())}

    def active_heads(self) -> list[int]:
        return [n - len(self.pruned.get(i, [])) for i, n in enumerate(self.n_heads)]

    def table(self) -> tuple[list[str], list[list[Any]]]:
        """(columns, rows): the drop order with the damage and the POD statistics of each head."""
        stats = [s for s in STATISTICS if s != "first_order" or self.first_order is not None]
        cols = ["rank", "layer", "head", f"damage ({self.damage_kind})", "set damage (greedy)", *stats]
        rows = [[d.rank, d.layer, d.head, _num(d.damage), _num(d.set_damage),
                 *[_num(d.evidence.get(s, math.nan)) for s in stats]] for d in self.drop_order]
        return cols, rows

    def layer_table(self) -> tuple[list[str], list[list[Any]]]:
        """(columns, rows): per layer, heads now, the advice's drops there, mean and largest damage."""
        first = self.drop_order[: self.n_drop]
        cols = ["layer", "heads now", "advice drops", "mean damage", "largest damage (head)"]
        rows = []
        for i, name in enumerate(self.layer_names):
            vals = [(v, h) for h, v in enumerate(self.damage[i]) if math.isfinite(v)]
            mean = sum(v for v, _ in vals) / len(vals) if vals else math.nan
            top = max(vals) if vals else (math.nan, -1)
            drops = [d.head for d in first if d.layer_index == i]
            rows.append([name, self.active_heads()[i], " ".join(f"h{h}" for h in drops) or "-", _num(mean),
                         f"{_fmt(top[0])} (h{top[1]})" if vals else "n/a"])
        return cols, rows

    def markdown(self) -> str:
        """The advice as markdown: per layer, heads to drop, evidence with correlations, readiness, cost."""
        kind = {"kl": "KL(p || p without the head), nats", "cosine": "1 - cos(output, output without the head)",
                "loss": "loss change", "function": "your damage function"}.get(self.damage_kind, self.damage_kind)
        lines = [f"### measured head importance (step {self.step})", "",
                 f"Damage = {kind}, averaged over {self.n_sequences} probe sequences.", "",
                 "| layer | heads now | advice drops | mean damage | largest damage |", "|---|---|---|---|---|"]
        lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in self.layer_table()[1]]
        lines += ["", f"**Heads to drop first** ({self.n_drop} named; greedy rows re-measured after each drop):", "",
                  "| # | layer | head | damage | set damage | H* | T_spec | redundancy | distance | entropy |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for d in self.drop_order[: self.n_drop]:
            e = d.evidence
            lines.append(f"| {d.rank} | {d.layer} | {d.head} | {_fmt(d.damage)} | {_fmt(d.set_damage)} | "
                         f"{_fmt(e.get('h_star'))} | {_fmt(e.get('t_spec'))} | {_fmt(e.get('redundancy'))} | "
                         f"{_fmt(e.get('distance'))} | {_fmt(e.get('entropy'))} |")
        if self.statistics:
            lines += ["", "**Does a POD statistic predict the measured damage here?** (Spearman rho over the "
                      "active heads)", "", "| statistic | rho | heads | hypothesis |", "|---|---|---|---|"]
            for s, v in self.statistics.items():
                lines.append(f"| {s} ({v['meaning']}) | {_fmt(v['spearman'], '.2f')} | {v['n']} | {v['hypothesis']} |")
            n = max((v["n"] for v in self.statistics.values()), default=0)
            if n > 3:
                lines.append(f"\n|rho| below about {1.96 / math.sqrt(n - 1):.2f} is within chance for {n} heads.")
        h = self.hypothesis
        if h:
            lines += ["", "**Hypothesis, not the advice: H*-based layer allocation** (METHOD.md section 7): "
                      f"rank correlation of layer H*({h.get('eps', 0.1):g}) with the layer's mean measured damage "
                      f"rho = {_fmt(h.get('spearman'), '.2f')} over {h.get('n', 0)} layers (it expects rho > 0). "
                      f"Its first {len(h.get('first_drops', []))} drops "
                      f"({', '.join(h.get('first_drops', [])) or '-'}) cost {_fmt(h.get('first_drops_damage'))} "
                      f"(sum of single-head damages) vs {_fmt(h.get('advice_damage'))} for the measured advice's."]
        r = self.readiness
        if r:
            lines += ["", f"**Readiness:** {r.get('reason', '')}."]
        c = self.cost
        if c:
            lines += ["", f"**Cost:** {int(c.get('forward_passes', 0))} forward and "
                      f"{int(c.get('backward_passes', 0))} backward passes, {c.get('seconds', 0.0):.2f} s."]
        if self.notes:
            lines += ["", *[f"- {m}" for m in self.notes]]
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable (non-finite floats become None)."""
        d = asdict(self)
        d["pruned"] = {str(k): v for k, v in self.pruned.items()}
        return strict_jsonable(d)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MeasuredAdvice:
        """Inverse of :meth:`to_dict` (None becomes NaN)."""
        def f(x: Any) -> float:
            return math.nan if x is None else float(x)

        order = [HeadToDrop(rank=int(o["rank"]), layer=o["layer"], layer_index=int(o["layer_index"]),
                            head=int(o["head"]), damage=f(o.get("damage")), set_damage=f(o.get("set_damage")),
                            source=o.get("source", "single"),
                            evidence={k: f(v) for k, v in (o.get("evidence") or {}).items()})
                 for o in d.get("drop_order", [])]
        fo = d.get("first_order")
        return cls(step=int(d.get("step", 0)), layer_names=list(d.get("layer_names", [])),
                   n_heads=[int(n) for n in d.get("n_heads", [])],
                   pruned={int(k): [int(h) for h in v] for k, v in (d.get("pruned") or {}).items()},
                   damage=[[f(v) for v in row] for row in d.get("damage", [])],
                   damage_kind=str(d.get("damage_kind", "kl")), n_sequences=int(d.get("n_sequences", 0)),
                   drop_order=order, n_drop=int(d.get("n_drop", 0)),
                   first_order=None if fo is None else [[f(v) for v in row] for row in fo],
                   statistics=dict(d.get("statistics") or {}), hypothesis=dict(d.get("hypothesis") or {}),
                   readiness=dict(d.get("readiness") or {}), cost=dict(d.get("cost") or {}),
                   notes=list(d.get("notes") or []))


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(float(x)) else None


def _fmt(x: Any, spec: str = ".4g") -> str:
    if x is None or not isinstance(x, (int, float)) or not math.isfinite(float(x)):
        return "n/a"
    return format(float(x), spec)


def _cell(x: Any) -> str:
    return _fmt(x) if isinstance(x, float) or x is None else str(x)


def head_statistics(reports: Mapping[str, Any], layer_names: Sequence[str], n_heads: Sequence[int],
                    redundancy: Mapping[str, Any] | None = None, eps: float = 0.10,
                    active: Mapping[int, Sequence[int]] | None = None) -> dict[str, list[list[float]]]:
    """Per-head POD statistics ``{statistic: (L, H) values}`` (NaN where unknown) from the
    monitor's per-head reports ``"<layer>/head_<hh>"`` and head redundancy.

    ``h_star``: H*(eps) (0 for a constant head; a sketch report's lower bound beyond its resolved
    rank); ``t_spec``; ``distance``: mean attention distance; ``entropy``; ``redundancy``: the
    largest field similarity with another head of the layer that is not pruned (``active`` maps a
    layer to its pruned heads).
    """
    h_max = max(n_heads) if n_heads else 0
    out = {s: [[math.nan] * h_max for _ in layer_names] for s in ("h_star", "t_spec", "redundancy", "distance",
                                                                  "entropy")}
    for i, name in enumerate(layer_names):
        for h in range(n_heads[i]):
            rep = reports.get(head_key(name, h))
            if rep is None:
                continue
            try:
                r, _ = report_rank(rep, eps)
                if r is None:
                    r, _ = report_rank_lower_bound(rep, eps)
            except ValueError:
                r = None
            out["h_star"][i][h] = math.nan if r is None else float(r)
            out["t_spec"][i][h] = float(rep.t_spec)
            out["distance"][i][h] = float(rep.mean_attention_distance)
            out["entropy"][i][h] = float(rep.entropy)
        red = (redundancy or {}).get(name)
        if red is not None and red.n_heads == n_heads[i]:
            gone = set((active or {}).get(i, []))
            others = [g for g in range(n_heads[i]) if g not in gone]
            for h in others:
                _, sim = red.most_similar(h, among=others)
                out["redundancy"][i][h] = float(sim)
    return out


class HeadImportanceProbe(MonitorExtra):
    """Measure head importance on the monitored validation batches (see the module docstring).

    Args:
        probe_batches: batches of each measured run used (the first ones of the monitored loader,
            on every rank).
        every_n_runs: measure on every k-th monitored validation run (the first one included).
        damage: "kl" (default, label-free), "cosine", "loss" (change of ``loss_fn``, by default the
            loss your ``validation_step`` returns) or ``fn(base_output, masked_output, batch) -> (B,)``.
        forward: ``fn(pl_module, batch) -> output`` (default: ``pl_module(batch[0])``,
            ``pl_module(**batch)`` for a dict, see :func:`~podmonitor.pruning.ablation.default_forward`).
        loss_fn: ``fn(pl_module, batch) -> loss`` for damage "loss" and the first-order estimate.
        first_order: also compute Michel et al.'s estimate (one backward per probe batch).
        greedy: refine the first ``n_drop`` drops greedily on the probe batches.
        group: heads dropped per greedy round.
        n_drop: heads the advice names (its readiness compares them): a count, or a fraction of all
            heads (default 0.25).
        min_heads: heads every layer keeps.
        readiness: the ranking readiness tracker (default ``RankingReadiness()``).
        gates: how heads are removed: "auto", one of :data:`~podmonitor.pruning.heads.KINDS`, or
            ``{output projection path: heads}`` (kind "projection").
        eps: the eps of the per-head H*(eps) shown as evidence (one of ``PODConfig.eps``).

    Raises:
        ValueError: invalid arguments.
    """

    name = "head_importance"

    def __init__(self, probe_batches: int = 2, every_n_runs: int = 1, *, damage: str | DamageFn = "kl",
                 forward: ForwardFn | None = None, loss_fn: LossFn | None = None, first_order: bool = False,
                 greedy: bool = False, group: int = 1, n_drop: int | float = 0.25, min_heads: int = 1,
                 readiness: RankingReadiness | None = None, gates: str | Mapping[str, int] = "auto",
                 eps: float = 0.10) -> None:
        if not isinstance(probe_batches, int) or probe_batches < 1:
            raise ValueError(f"probe_batches must be an int >= 1, got {probe_batches!r}")
        if not isinstance(every_n_runs, int) or every_n_runs < 1:
            raise ValueError(f"every_n_runs must be an int >= 1, got {every_n_runs!r}")
        if isinstance(damage, str) and damage not in ("kl", "cosine", "loss"):
            raise ValueError(f"damage must be 'kl', 'cosine', 'loss' or a function, got {damage!r}")
        if group < 1 or min_heads < 1:
            raise ValueError("group and min_heads must be >= 1")
        if isinstance(n_drop, float) and not 0.0 < n_drop < 1.0 or isinstance(n_drop, int) and n_drop < 1:
            raise ValueError(f"n_drop must be an int >= 1 or a fraction in (0, 1), got {n_drop!r}")
        self.probe_batches = probe_batches
        self.every_n_runs = every_n_runs
        self.damage = damage
        self.forward = forward
        self.loss_fn = loss_fn
        self.first_order = first_order
        self.greedy = greedy
        self.group = group
        self.n_drop = n_drop
        self.min_heads = min_heads
        self.readiness = readiness or RankingReadiness()
        self.gates_spec = gates
        self.eps = eps
        self.last_advice: MeasuredAdvice | None = None
        self.history: list[dict[str, Any]] = []
        self._monitor: Any = None
        self._gates: HeadGates | None = None
        self._gates_of: int | None = None
        self._reset()

    # ------------------------------------------------------------------ per run
    def _reset(self) -> None:
        self._active = False
        self._seen = 0
        self._failed: str | None = None
        self._sum: Tensor | None = None
        self._count: Tensor | None = None
        self._fo_sum: Tensor | None = None
        self._fo_count: Tensor | None = None
        self._stored: list[Any] = []
        self._greedy: list[GreedyStep] | None = None
        self._cost = Cost()
        self._notes: list[str] = []
        self._pruned: Heads = {}

    def n_drop_for(self, total_heads: int) -> int:
        """The count the advice names for a model of ``total_heads`` heads."""
        if isinstance(self.n_drop, float):
            return max(1, round(self.n_drop * total_heads))
        return int(self.n_drop)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        for cb in getattr(trainer, "callbacks", []):
            if any(e is self for e in getattr(cb, "extras", [])):
                self._monitor = cb

    def start_run(self, trainer: Any, pl_module: Any, monitored_index: int) -> None:
        self._reset()
        self._active = monitored_index % self.every_n_runs == 0
        self._rank = int(getattr(trainer, "global_rank", 0) or 0)

    def gates_for(self, module: Any) -> HeadGates:
        """The gates of ``module`` (built once per module)."""
        if self._gates is None or self._gates_of != id(module):
            spec = self.gates_spec
            self._gates = HeadGates(module, projections=spec) if isinstance(spec, Mapping) else \
                HeadGates(module, kind=spec)
            self._gates_of = id(module)
        return self._gates

    def _already_pruned(self, trainer: Any, gates: HeadGates) -> Heads:
        """Heads pruned now: silenced in the model (reference) or masked by a HeadPruning callback."""
        out = {k: set(v) for k, v in gates.inactive().items()}
        for cb in getattr(trainer, "callbacks", []):
            masker = getattr(cb, "masker", None)
            if masker is not None and type(cb).__name__ == "HeadPruning" and \
                    len(masker.n_heads) == len(gates.n_heads):
                for k, v in masker.pruned.items():
                    out.setdefault(int(k), set()).update(int(h) for h in v)
        return {k: sorted(v) for k, v in sorted(out.items()) if v}

    def _measurer(self, pl_module: Any, gates: HeadGates) -> Measurer:
        return Measurer(pl_module, gates, damage=self.damage, forward=self.forward, loss_fn=self.loss_fn,
                        base_pruned=self._pruned, cost=self._cost, notes=self._notes)

    def on_batch(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, outputs: Any) -> None:
        if not self._active or self._failed is not None or self._seen >= self.probe_batches:
            return
        self._seen += 1
        try:
            gates = self.gates_for(pl_module)
            if self._seen == 1:
                self._pruned = self._already_pruned(trainer, gates)
            with gates:
                measurer = self._measurer(pl_module, gates)
                with torch.inference_mode():
                    s, c = single_head_damage(measurer, [batch])
                self._sum = s if self._sum is None else self._sum + s
                self._count = c if self._count is None else self._count + c
                if self.first_order:
                    fs, fc = first_order_importance(measurer, [batch])
                    self._fo_sum = fs if self._fo_sum is None else self._fo_sum + fs
                    self._fo_count = fc if self._fo_count is None else self._fo_count + fc
            if self.greedy and self._rank == 0:
                self._stored.append(batch)
                if self._seen == self.probe_batches:
                    self._run_greedy(pl_module)
        except Exception as err:
            self._failed = f"{type(err).__name__}: {err}"
            self._stored = []
            raise

    def _run_greedy(self, pl_module: Any) -> None:
        if not self._stored or self._sum is None or self._count is None:
            return
        gates = self.gates_for(pl_module)
        n = self.n_drop_for(sum(gates.n_heads))
        first = self._sum / self._count.clamp_min(1.0)
        first[self._count == 0] = math.nan
        with gates, torch.inference_mode():
            self._greedy = greedy_drop_order(self._measurer(pl_module, gates), self._stored, n,
                                             min_heads=self.min_heads, group=self.group, first=first)
        self._stored = []

    def gather_state(self) -> Any:
        if not self._active:
            return None
        if self._stored and self._greedy is None and self._failed is None:  # the loader had fewer batches
            try:
                self._run_greedy(self._gates.module if self._gates is not None else None)
            except Exception as err:  # noqa: BLE001 - the single-head ranking stands
                self._notes.append(f"greedy refinement failed: {type(err).__name__}: {err}")
        gates = self._gates
        return {
            "sum": None if self._sum is None else self._sum.cpu(),
            "count": None if self._count is None else self._count.cpu(),
            "fo_sum": None if self._fo_sum is None else self._fo_sum.cpu(),
            "fo_count": None if self._fo_count is None else self._fo_count.cpu(),
            "greedy": None if self._greedy is None else [asdict(g) for g in self._greedy],
            "cost": self._cost.to_dict(),
            "notes": list(self._notes),
            "failed": self._failed,
            "pruned": {int(k): list(v) for k, v in self._pruned.items()},
            "n_heads": None if gates is None else list(gates.n_heads),
            "layer_names": None if gates is None else list(gates.layer_names),
            "kind": None if gates is None else gates.kind,
            "batches": self._seen,
        }

    # ------------------------------------------------------------------ rank zero
    def compute(self, parts: list[Any], context: ExtraContext) -> ExtraResult | None:
        parts = [p for p in parts if p]
        if not parts:
            return None
        failures = [p["failed"] for p in parts if p.get("failed")]
        usable = [p for p in parts if p.get("sum") is not None and p.get("n_heads")]
        if not usable:
            text = "measuring head importance failed: " + "; ".join(failures or ["no probe batch was measured"])
            return ExtraResult(texts={f"{context.prefix}/head_importance": text}, record={"error": text})
        n_heads = list(usable[0]["n_heads"])
        total = sum(p["sum"] for p in usable)
        count = sum(p["count"] for p in usable)
        damage = total / count.clamp_min(1.0)
        damage[count == 0] = math.nan
        fo = None
        fo_parts = [p for p in usable if p.get("fo_sum") is not None]
        if fo_parts:
            fs = sum(p["fo_sum"] for p in fo_parts)
            fc = sum(p["fo_count"] for p in fo_parts)
            fo = fs / fc.clamp_min(1.0)
            fo = fo / fo.nan_to_num(0.0).norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
            fo[fc == 0] = math.nan
        cost = Cost()
        for p in parts:
            cost.add(Cost(**{k: type(getattr(Cost(), k))(v) for k, v in p["cost"].items()}))
        notes = sorted({n for p in parts for n in p.get("notes", [])})
        notes += [f"a rank failed: {f}" for f in failures]
        gate_names = list(usable[0]["layer_names"])
        names = list(context.layer_names) if len(context.layer_names) == len(n_heads) else gate_names
        if names is gate_names and context.layer_names:
            notes.append(f"the monitor's {len(context.layer_names)} layers do not match the {len(n_heads)} gated "
                         "layers: no POD statistics beside the damage")
        pruned = {int(k): list(v) for k, v in usable[0]["pruned"].items()}
        can_go = sum(max(0, n - len(pruned.get(i, [])) - self.min_heads) for i, n in enumerate(n_heads))
        n_drop = min(self.n_drop_for(sum(n_heads)), can_go)

        # drop order: the greedy drops (rank zero's), then the rest by single-head damage
        order_pairs: list[tuple[tuple[int, int], str, float]] = []
        greedy = next((p["greedy"] for p in usable if p.get("greedy")), None)  # rank zero's
        if greedy:
            order_pairs = [((g["layer"], g["head"]), "greedy", g["set_damage"]) for g in greedy]
        chosen = {pair for pair, _, _ in order_pairs}
        rest_pruned = {k: list(v) for k, v in pruned.items()}
        for (i, h) in chosen:
            rest_pruned.setdefault(i, []).append(h)
        rest = lowest_first(damage, n_heads, rest_pruned, sum(n_heads), self.min_heads)
        order_pairs += [(pair, "single", math.nan) for pair in rest]

        stats = head_statistics(context.reports, names, n_heads,
                                getattr(self._monitor, "last_redundancy", None), self.eps, pruned)
        if fo is not None:
            stats["first_order"] = fo.tolist()
        order = [HeadToDrop(rank=r + 1, layer=names[i], layer_index=i, head=h, damage=float(damage[i, h]),
                            set_damage=float(sd), source=src,
                            evidence={s: float(v[i][h]) for s, v in stats.items()})
                 for r, ((i, h), src, sd) in enumerate(order_pairs)]

        active = [(i, h) for i, n in enumerate(n_heads) for h in range(n)
                  if h not in pruned.get(i, []) and math.isfinite(float(damage[i, h]))]
        measured = [float(damage[i, h]) for i, h in active]
        statistics: dict[str, dict[str, Any]] = {}
        for s, values in stats.items():
            rho, n = spearman([values[i][h] for i, h in active], measured)
            if n:
                statistics[s] = {"spearman": rho, "n": n, "meaning": STATISTICS[s][0], "hypothesis": STATISTICS[s][1]}
        if not any(v["n"] for k, v in statistics.items() if k != "first_order"):
            notes.append("no POD statistics per head: run PODMonitor(per_head=True) to see them beside the damage")
        hypothesis = self._hypothesis(context, names, n_heads, damage, pruned, n_drop, order)
        key = {(i, h): head_key(names[i], h) for i, h in active}
        record = self.readiness.update(context.step, {key[c]: float(damage[c]) for c in active},
                                       [head_key(d.layer, d.head) for d in order[:n_drop]], context.reports, names)
        kind = self.damage if isinstance(self.damage, str) else "function"
        if kind == "kl" and "no logits: compared by 1 - cosine" in notes:
            kind = "cosine"
        advice = MeasuredAdvice(step=context.step, layer_names=names, n_heads=n_heads, pruned=pruned,
                                damage=damage.tolist(), damage_kind=kind,
                                n_sequences=int(count.max()) if count.numel() else 0, drop_order=order,
                                n_drop=n_drop, first_order=None if fo is None else fo.tolist(),
                                statistics=statistics, hypothesis=hypothesis, readiness=record,
                                cost=cost.to_dict(), notes=notes)
        self.last_advice = advice
        entry = advice.to_dict()
        self.history.append({"step": context.step, "readiness": entry["readiness"], "cost": entry["cost"]})
        return self._result(advice, entry, context.prefix)

    def _hypothesis(self, context: ExtraContext, names: Sequence[str], n_heads: Sequence[int], damage: Tensor,
                    pruned: Heads, n_drop: int, order: Sequence[HeadToDrop]) -> dict[str, Any]:
        """The H*-based allocation as a hypothesis: its correlation and what its first drops cost here."""
        ranks, means = [], []
        for i, name in enumerate(names):
            rep = context.reports.get(name)
            vals = [float(v) for v in damage[i] if math.isfinite(float(v))]
            if rep is None or not vals:
                continue
            try:
                r, _ = report_rank(rep, self.eps)
            except ValueError:
                r = None
            if r is None:
                continue
            ranks.append(float(r))
            means.append(sum(vals) / len(vals))
        if not ranks:
            return {}
        rho, n = spearman(ranks, means)
        out: dict[str, Any] = {"eps": self.eps, "spearman": rho, "n": n}
        if any("/head_" in k for k in context.reports):
            try:
                from .advisor import AdviceSettings, advise_from_reports

                active = {name: [h not in pruned.get(i, []) for h in range(n_heads[i])] for i, name in enumerate(names)}
                adv = advise_from_reports(context.reports, list(names),
                                          getattr(self._monitor, "last_redundancy", None) or {},
                                          AdviceSettings(eps=self.eps, min_heads=self.min_heads), active=active)
                first = adv.drop_order[:n_drop]
                out["first_drops"] = [f"{d.layer} h{d.head}" for d in first]
                out["first_drops_damage"] = sum(float(damage[d.layer_index, d.head]) for d in first)
                out["advice_damage"] = sum(d.damage for d in order[:n_drop])
            except Exception as err:  # noqa: BLE001 - evidence only
                out["error"] = f"{type(err).__name__}: {err}"
        return out

    def _result(self, advice: MeasuredAdvice, entry: dict[str, Any], prefix: str) -> ExtraResult:
        p = f"{prefix}/importance"
        scalars: dict[str, float] = {}
        for i, name in enumerate(advice.layer_names):
            for h, v in enumerate(advice.damage[i]):
                if math.isfinite(v):
                    scalars[f"{p}/{name}/head_{h:02d}"] = float(v)
        r = advice.readiness
        if r.get("spearman_vs_previous") is not None and math.isfinite(r["spearman_vs_previous"]):
            scalars[f"{p}/spearman_vs_previous"] = float(r["spearman_vs_previous"])
        scalars[f"{p}/stable"] = float(bool(r.get("stable")))
        scalars[f"{p}/drop_set_changed"] = float(bool(r.get("drop_set_changed")))
        for s, v in advice.statistics.items():
            if math.isfinite(v["spearman"]):
                scalars[f"{p}/spearman/{s}"] = float(v["spearman"])
        first = advice.drop_order[: advice.n_drop]
        if first:
            greedy = [d.set_damage for d in first if d.source == "greedy" and math.isfinite(d.set_damage)]
            scalars[f"{p}/drop_damage"] = greedy[-1] if len(greedy) == len(first) else sum(d.damage for d in first)
        scalars[f"{p}/cost_forward_passes"] = float(advice.cost.get("forward_passes", 0))
        scalars[f"{p}/cost_seconds"] = float(advice.cost.get("seconds", 0.0))
        evidence_rows = [[s, v["meaning"], _num(v["spearman"]), v["n"], v["hypothesis"]]
                         for s, v in advice.statistics.items()]
        return ExtraResult(
            scalars=scalars,
            texts={f"{prefix}/head_importance": advice.markdown()},
            tables={f"{prefix}/head_importance_table": advice.table(),
                    f"{prefix}/head_importance_layers": advice.layer_table(),
                    f"{prefix}/head_importance_evidence": (["statistic", "meaning", "spearman", "heads", "hypothesis"],
                                                          evidence_rows)},
            record=entry,
        )

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"readiness": self.readiness.state_dict(), "history": list(self.history),
                "last_advice": None if self.last_advice is None else self.last_advice.to_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("readiness"):
            self.readiness.load_state_dict(state["readiness"])
        self.history = list(state.get("history", []))
        last = state.get("last_advice")
        self.last_advice = MeasuredAdvice.from_dict(last) if last else None


def find_probe(monitor: Any) -> HeadImportanceProbe | None:
    """The monitor's :class:`HeadImportanceProbe`, or None."""
    for extra in getattr(monitor, "extras", []) or []:
        if isinstance(extra, HeadImportanceProbe):
            return extra
    return None


__all__ = ["STATISTICS", "HeadImportanceProbe", "HeadToDrop", "MeasuredAdvice", "find_probe", "head_key",
           "head_statistics"]
