"""The metric registry: every number podmonitor logs per layer, named, titled, with unit and meaning.

One entry per metric. The scalars of every logger (:func:`layer_metrics`), the TensorBoard
layout and tag descriptions, the W&B metric definitions, the glossary (:func:`glossary_markdown`,
logged once per run), the CLI table and the README's metric list all come from :data:`METRICS`,
so a new metric is one entry here plus its computation.

Tags: ``<prefix>/<group>/<key>/<layer>`` in flat sinks (W&B, CSV), ``<prefix>/<group>/<key>`` in
TensorBoard, where each layer is its own run (one colour per layer, all layers on one card).

Groups, in dashboard order:

- ``headline``: the few numbers to watch (T_spec, effective rank, top scale, distance, entropy);
- ``reference``: the headline spectrum numbers at a fixed scale per layer (the layer's top
  dominant scale at its first monitored run, kept for the whole training), so that the trend
  compares like with like when the dominant scales move;
- ``fit``: quality of the power-law fit behind T_spec;
- ``scales``: where the attention's fluctuations live;
- ``stability``: cheap early warnings of logit growth and entropy collapse (METHOD.md section 10);
- ``sketch``: bounded-memory mode only;
- ``cost``: seconds spent;
- ``health``: counters that are 0 (or constant) in a healthy run, logged only when they are not
  (``log="nonzero"``) or when they change (``log="changes"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine.report import PODReport, eps_lookup

GROUPS: tuple[str, ...] = ("headline", "reference", "fit", "scales", "stability", "sketch", "cost", "health")


@dataclass(frozen=True)
class Metric:
    """One logged metric.

    Attributes:
        key: short name, the tag's metric component and the JSON key ("t_spec").
        title: chart title, with the unit in brackets where there is one.
        unit: "tokens", "modes", "s", "nats" or "" (dimensionless).
        description: one line: what it is and how to read it.
        group: one of :data:`GROUPS`.
        value: the value from a layer's report (NaN where missing); None for metrics that come
            from elsewhere (the stability signals, run-level counters).
        log: "always", "nonzero" (only when not 0) or "changes" (the first time and when it changes).
    """

    key: str
    title: str
    unit: str
    description: str
    group: str
    value: Callable[[PODReport], float] | None = None
    log: str = "always"

    def tag(self, prefix: str = "pod", layer: str | None = None) -> str:
        parts = [p for p in (prefix, self.group, self.key, layer) if p]
        return "/".join(parts)


def as_float(x: Any) -> float:
    """Number / bool / None -> float (None and non-numbers -> NaN)."""
    if x is None:
        return math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def running_value(key: str) -> Callable[[PODReport], float]:
    """The value of a running metric of the report (``PODReport.running[key]``; NaN where missing)."""
    def get(r: PODReport) -> float:
        return as_float(getattr(r, "running", {}).get(key))
    return get


def _rank(eps: float) -> Callable[[PODReport], float]:
    def get(r: PODReport) -> float:
        return as_float(eps_lookup(r.effective_rank, eps)) if r.headline is not None else math.nan
    return get


def _saturated(eps: float) -> Callable[[PODReport], float]:
    def get(r: PODReport) -> float:
        if r.headline is None:
            return math.nan
        flag = eps_lookup(r.saturated, eps)
        return math.nan if flag is None else float(bool(flag))
    return get


def _top_scale(r: PODReport) -> float:
    dom = list(r.dominant_scales or [])
    return as_float(dom[0]) if dom else math.nan


def _sketch(attr: str) -> Callable[[PODReport], float]:
    def get(r: PODReport) -> float:
        h = r.headline
        if h is None or getattr(h, "mode", "exact") != "sketch":
            return math.nan
        return as_float(getattr(h, attr, None))
    return get


def _beyond(eps: float) -> Callable[[PODReport], float]:
    def get(r: PODReport) -> float:
        h = r.headline
        if h is None or getattr(h, "mode", "exact") != "sketch":
            return math.nan
        return float(bool(eps_lookup(getattr(h, "beyond_resolved", None) or {}, eps)))
    return get


def _pct(eps: float) -> str:
    return f"{100 * (1 - eps):g}"


def effective_rank_key(eps: float) -> str:
    """0.10 -> "effective_rank_90pct": H*(eps), the modes for 1 - eps of the energy."""
    return f"effective_rank_{_pct(eps)}pct"


def _eps_metrics(eps: Sequence[float]) -> list[Metric]:
    out = []
    for i, e in enumerate(eps):
        out.append(Metric(
            effective_rank_key(e), f"effective rank H*({e:.2f}) [modes for {_pct(e)} % of the energy]", "modes",
            f"H*({e:.2f}): the fewest POD modes whose energy is {_pct(e)} % of the layer's fluctuation energy at its "
            "top dominant scale; small = few recurring attention patterns.",
            "headline" if i == 0 else "fit", _rank(e)))
    for e in eps:
        out.append(Metric(
            f"saturated_{_pct(e)}pct", f"H*({e:.2f}) needs every mode (1 = yes)", "",
            f"1 when H*({e:.2f}) reaches the number of non-zero eigenvalues: the ensemble is too small to resolve "
            "the rank (use more snapshots).", "health", _saturated(e), log="nonzero"))
    return out


def registry(eps: Sequence[float] = (0.10, 0.05, 0.01)) -> list[Metric]:
    """Every per-layer metric for these eps, in dashboard order."""
    eps = [float(e) for e in eps]
    ranks = _eps_metrics(eps)
    return [
        Metric("t_spec", "T_spec (spectral concentration)", "",
               "1/beta of the power law lambda_k ~ k^-beta fitted to the POD eigenvalues at the top dominant "
               "scale; larger = flatter spectrum = a more complex attention field.", "headline",
               lambda r: as_float(r.t_spec)),
        ranks[0],
        Metric("top_scale", "top dominant scale [tokens]", "tokens",
               "The lag scale (Morlet scalogram) carrying the most fluctuation energy; headline values are "
               "measured there, so a jump of it changes what T_spec and H* describe.", "headline", _top_scale),
        Metric("mean_attention_distance", "mean attention distance [tokens]", "tokens",
               "sum_j A[i, j] |i - j|, averaged over queries and snapshots: how far back a layer looks.",
               "headline", lambda r: as_float(r.mean_attention_distance)),
        Metric("entropy", "attention entropy [0 to 1]", "",
               "Row entropy of the attention divided by log of the visible keys, averaged: 1 = uniform, "
               "0 = one key per query.", "headline", lambda r: as_float(r.entropy)),
        Metric("reference_scale", "reference scale [tokens]", "tokens",
               "The fixed lag scale of the reference metrics: the layer's top dominant scale at its first "
               "monitored run; logged when it changes.", "reference", None, log="changes"),
        Metric("t_spec_at_ref", "T_spec at the reference scale", "",
               "T_spec measured at the layer's fixed reference scale at every run: a trend that never joins "
               "values from different scales.", "reference"),
        Metric(effective_rank_key(eps[0]) + "_at_ref", f"H*({eps[0]:.2f}) at the reference scale [modes]", "modes",
               f"H*({eps[0]:.2f}) measured at the layer's fixed reference scale at every run.", "reference"),
        Metric("r2", "R^2 of the T_spec power-law fit", "",
               "Fit quality of ln lambda_k on ln k; below about 0.9 T_spec is a rough summary.", "fit",
               lambda r: as_float(r.r2)),
        *[m for m in ranks[1:] if m.group == "fit"],
        Metric("n_fit", "eigenvalues in the T_spec fit", "",
               "How many eigenvalues the power law was fitted to (at most k_fit); logged when it changes.", "fit",
               lambda r: as_float(r.headline.n_fit) if r.headline is not None else math.nan, log="changes"),
        Metric("scale_centroid", "energy-weighted scale centroid [tokens]", "tokens",
               "exp(sum E(a) log a / sum E(a)) over the scale grid: one number for where the fluctuation "
               "energy sits.", "scales", lambda r: as_float(r.scale_centroid)),
        Metric("resolved_rank", "resolved rank R (sketch mode)", "modes",
               "Bounded-memory mode: eigenvalues resolved by the sketch; H* beyond it is reported as bounds.",
               "sketch", _sketch("resolved_rank")),
        Metric("error_bound", "eigenvalue error bound (sketch mode)", "",
               "Bounded-memory mode: guaranteed bound on every eigenvalue's error.", "sketch",
               _sketch("error_bound")),
        *[Metric(f"beyond_resolved_{_pct(e)}pct", f"H*({e:.2f}) beyond the resolved rank (1 = yes, sketch mode)", "",
                 f"Bounded-memory mode: 1 when H*({e:.2f}) is more than the resolved rank R (its effective-rank value "
                 "is then NaN and the record gives bounds).", "sketch", _beyond(e)) for e in eps],
        Metric("analysis_seconds", "analysis time per layer [s]", "s",
               "Wall time of the layer's analysis at the end of the validation run.", "cost",
               lambda r: as_float(getattr(r, "analysis_seconds", None))),
        Metric("n_snapshots", "snapshots analysed", "",
               "Sequences in the layer's ensemble (summed over processes); logged when it changes.", "health",
               lambda r: as_float(r.n_snapshots), log="changes"),
        Metric("n_skipped_nonfinite", "snapshots skipped (NaN/Inf)", "",
               "Sequences whose attention had NaN or Inf entries, left out.", "health",
               lambda r: as_float(r.n_skipped_nonfinite), log="nonzero"),
        Metric("n_not_normalised", "snapshots whose rows do not sum to 1", "",
               "Sequences whose attention rows do not sum to 1 over the visible keys (raw scores, heads summed):"
               " the layer is flagged.", "health", lambda r: as_float(getattr(r, "n_not_normalised", 0)),
               log="nonzero"),
        Metric("status_flagged", "layer flagged (1) / ok (0)", "",
               "1 when the layer's report is not 'ok' (too few snapshots, degenerate spectrum, not normalised, "
               "...); the summary text says why.", "health", lambda r: 0.0 if r.status == "ok" else 1.0,
               log="nonzero"),
        Metric("top_scale_changed", "top scale jumped since the last run (1 = yes)", "",
               "1 when the top dominant scale moved by more than a factor 1.5 since the previous monitored run: "
               "the headline trend joins values measured at different scales there.", "health", None,
               log="nonzero"),
        *[m for m in ranks if m.group == "health"],
        *STABILITY,
    ]


#: The stability signals (METHOD.md section 10), per layer; values come from the capture.
STABILITY: tuple[Metric, ...] = (
    Metric("max_logit", "max attention logit", "",
           "Largest pre-softmax score q.k * scale over queries, visible keys and heads (needs the scores: "
           "fused-attention capture); steady growth warns of logit blow-up.", "stability"),
    Metric("entropy_min_head", "lowest head entropy [0 to 1]", "",
           "The smallest head's mean normalised row entropy; a sharp drop is entropy collapse.", "stability"),
    Metric("sink_mass", "attention-sink mass on the first key", "",
           "Mean attention on key 0 over queries i >= 1 (1 = every query looks at the first token).",
           "stability"),
    Metric("max_prob", "largest attention probability", "",
           "Largest attention probability of the batch; near 1 everywhere means one-hot attention.",
           "stability"),
)

#: Run-level scalars (no layer): the monitor's own cost and what it skipped.
RUN_METRICS: tuple[Metric, ...] = (
    Metric("capture_s", "capture time [s]", "s", "Seconds spent capturing attention in this validation run.",
           "cost"),
    Metric("accumulate_s", "accumulate time [s]", "s", "Seconds spent feeding the accumulators.", "cost"),
    Metric("compute_s", "compute time [s]", "s", "Seconds spent in the analysis (all layers).", "cost"),
    Metric("logging_s", "logging time [s]", "s", "Seconds the validation loop waited for the outputs.", "cost"),
    Metric("skipped_padding", "sequences skipped: padding", "", "Sequences with padding tokens (never analysed).",
           "health", log="nonzero"),
    Metric("skipped_length", "sequences skipped: other length", "",
           "Sequences whose length differs from the run's first batch.", "health", log="nonzero"),
    Metric("skipped_budget", "sequences skipped: memory budget", "", "Sequences that did not fit the budget.",
           "health", log="nonzero"),
    Metric("errors", "problems in this run", "", "Errors and warnings of the run (the summary text lists them).",
           "health", log="nonzero"),
)


def by_key(eps: Sequence[float] = (0.10, 0.05, 0.01)) -> dict[str, Metric]:
    """``{key: Metric}`` of :func:`registry` and :data:`RUN_METRICS`."""
    return {m.key: m for m in (*registry(eps), *RUN_METRICS)}


def layer_metrics(report: PODReport, *, eps: Sequence[float] | None = None,
                  extra: Mapping[str, float] | None = None) -> dict[str, float]:
    """``{key: value}`` of one layer's report for every registry metric with a value function;
    ``extra`` adds values computed elsewhere (stability signals, ``top_scale_changed``)."""
    eps = tuple(float(e) for e in (eps or report.config.get("eps") or (0.10, 0.05, 0.01)))
    out = {m.key: m.value(report) for m in registry(eps) if m.value is not None}
    if not (report.headline is not None and getattr(report.headline, "mode", "exact") == "sketch"):
        for m in registry(eps):
            if m.group == "sketch":
                out.pop(m.key, None)
    out.update(extra or {})
    return out


class LogPolicy:
    """Applies each metric's ``log`` rule over the runs of one monitor: "nonzero" metrics only when not
    0, "changes" metrics the first time and when they change. Keeps the last logged values."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def select(self, values: Mapping[str, float], metrics: Mapping[str, Metric]) -> dict[str, float]:
        """The subset of ``{tag: value}`` to log; ``metrics`` maps each tag to its metric."""
        out = {}
        for tag, v in values.items():
            m = metrics.get(tag)
            rule = m.log if m is not None else "always"
            if rule == "nonzero" and (v == 0 or (isinstance(v, float) and math.isnan(v))):
                continue
            if rule == "changes" and tag in self._last and (self._last[tag] == v or (
                    math.isnan(self._last[tag]) and math.isnan(v))):
                continue
            out[tag] = v
            self._last[tag] = v
        return out


def glossary_rows(metrics: Iterable[Metric]) -> list[list[str]]:
    """``[[group, key, title, unit, description], ...]`` for a table."""
    return [[m.group, m.key, m.title, m.unit or "-", m.description] for m in metrics]


def glossary_markdown(eps: Sequence[float] = (0.10, 0.05, 0.01), prefix: str = "pod") -> str:
    """The glossary logged once per run: every metric's tag, title, unit and meaning, by group."""
    metrics = [*registry(eps), *RUN_METRICS]
    lines = ["### podmonitor glossary", "",
             f"Tags are `{prefix}/<group>/<metric>`; in TensorBoard each layer is a run of its own "
             "(`.../podmonitor_layers/<layer>`), so every card shows all layers. Headline values are measured at "
             "each layer's top dominant scale.", ""]
    for group in GROUPS:
        rows = [m for m in metrics if m.group == group]
        if not rows:
            continue
        lines += [f"**{group}**", "", "| tag | title | unit | meaning |", "|---|---|---|---|"]
        lines += [f"| `{m.tag(prefix)}` | {m.title} | {m.unit or '-'} | {m.description} |" for m in rows]
        lines.append("")
    return "\n".join(lines)


def readme_table(eps: Sequence[float] = (0.10, 0.05, 0.01), prefix: str = "pod") -> str:
    """The README's metric list (tests/reporting/test_scalars.py checks that the README holds it)."""
    lines = ["| tag | title | meaning |", "|---|---|---|"]
    per_layer = {m.key for m in registry(eps)}
    for m in [*registry(eps), *RUN_METRICS]:
        where = " (per layer)" if m.key in per_layer else ""
        rule = {"nonzero": " Logged only when not 0.", "changes": " Logged when it changes."}.get(m.log, "")
        lines.append(f"| `{m.tag(prefix)}`{where} | {m.title} | {m.description}{rule} |")
    return "\n".join(lines)


__all__ = ["GROUPS", "RUN_METRICS", "STABILITY", "LogPolicy", "Metric", "as_float", "by_key", "effective_rank_key",
           "glossary_markdown", "glossary_rows", "layer_metrics", "readme_table", "registry"]
