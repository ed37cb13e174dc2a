"""Scalar metrics of a :class:`~podmonitor.PODReport`, named for dashboards from the registry.

Every metric of a layer is ``"<prefix>/<group>/<key>/<layer_name>"`` (e.g.
``"pod/headline/t_spec/layer_00"``); names, groups, titles, units and descriptions come from
:mod:`podmonitor.reporting.metrics`. TensorBoard writes each layer as a run of its own with the
tag ``"<prefix>/<group>/<key>"`` (:class:`~podmonitor.reporting.sinks.TensorBoardSink`), so one
card shows all layers; :func:`custom_scalars_layout` puts the headline metrics on one page.

Missing values are NaN, never a made-up number: NaN stays NaN (TensorBoard and W&B accept it),
``None`` (e.g. H*(eps) of a report without POD) becomes NaN, a flat spectrum's T_spec stays inf.

Example:
    >>> scalars = layer_scalars(report, "layer_00", analysis_seconds=0.4)
    >>> scalars["pod/headline/t_spec/layer_00"], scalars["pod/headline/effective_rank_90pct/layer_00"]
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..engine.report import PODReport, eps_lookup
from .metrics import RUN_METRICS, by_key, layer_metrics, registry
from .metrics import as_float as _float

__all__ = ["custom_scalars_layout", "eps_label", "layer_scalars", "metric_names", "metric_tags",
           "summary_markdown", "summary_table"]

DEFAULT_EPS: tuple[float, ...] = (0.10, 0.05, 0.01)


def eps_label(eps: float) -> str:
    """0.1 -> "0.10", 0.05 -> "0.05", 0.001 -> "0.001" (two decimals unless more are needed)."""
    text = f"{eps:.2f}"
    return text if math.isclose(float(text), eps, rel_tol=1e-12, abs_tol=0.0) else f"{eps:g}"


def metric_names(eps: Sequence[float] = DEFAULT_EPS) -> list[str]:
    """The per-layer metric keys of the registry for these eps, in dashboard order."""
    return [m.key for m in registry(eps)]


def metric_tags(eps: Sequence[float] = DEFAULT_EPS, prefix: str = "pod") -> dict[str, Any]:
    """``{tag without layer: Metric}`` of every per-layer and run-level metric (for descriptions)."""
    return {m.tag(prefix): m for m in (*registry(eps), *RUN_METRICS)}


def layer_scalars(report: PODReport, layer_name: str, *, prefix: str = "pod",
                  analysis_seconds: float | None = None,
                  extra: Mapping[str, float] | None = None) -> dict[str, float]:
    """The per-layer metrics of one report as ``{"<prefix>/<group>/<key>/<layer_name>": value}``.

    The metrics are the registry's (:func:`podmonitor.reporting.metrics.registry`): headline values
    at the top dominant scale (METHOD.md section 5), fit quality, scales, cost and health counters;
    bounded-memory (sketch) reports add ``sketch/resolved_rank`` and ``sketch/error_bound``.
    A report without POD gives NaN for the fit values, H*(eps) and the saturation flags.

    Args:
        report: the analysis of one layer.
        layer_name: the last component of every key.
        prefix: the first component ("" for none).
        analysis_seconds: wall time of the analysis; None takes ``report.analysis_seconds``.
        extra: values of registry metrics computed elsewhere, by key (``{"max_logit": 12.0}``).

    Returns:
        tag -> float (NaN where the value is missing). Every value is there; which ones a sink
        writes (health counters only when non-zero) is the publisher's choice.
    """
    eps = tuple(float(e) for e in (report.config.get("eps") or DEFAULT_EPS))
    values = layer_metrics(report, eps=eps, extra=extra)
    if analysis_seconds is not None:
        values["analysis_seconds"] = _float(analysis_seconds)
    metrics = by_key(eps)
    return {metrics[k].tag(prefix, layer_name): _float(v) for k, v in values.items() if k in metrics}


def _lookup(d: dict, eps: float) -> Any:
    """d[eps] tolerant of float round-off in the key (0.1 vs 0.1000000001)."""
    return eps_lookup(d, eps)


def custom_scalars_layout(prefix: str = "pod", *, eps: Sequence[float] = DEFAULT_EPS,
                          extra_charts: Mapping[str, Sequence[str]] | None = None) -> dict[str, dict[str, list]]:
    """TensorBoard custom-scalars layout: one chart per metric, one line per layer (layers are runs).

    Format of ``SummaryWriter.add_custom_scalars``::

        {"podmonitor headline": {"T_spec (spectral concentration)": ["Multiline", ["^pod/headline/t_spec$"]], ...},
         "podmonitor stability": {...}, "podmonitor cost": {...}}

    The regular expressions match TensorBoard tags; each layer's run contributes its own line.
    Health counters (mostly 0) and sketch values are left to the Time Series tab.

    Args:
        prefix: the tag prefix.
        eps: the eps values of H*(eps).
        extra_charts: more charts of the headline category, ``{title: [tag regex, ...]}`` (e.g. the
            validation loss).
    """
    def chart(tag: str) -> list:
        return ["Multiline", [f"^{re.escape(tag)}$"]]

    metrics = [*registry(eps), *RUN_METRICS]
    layout: dict[str, dict[str, list]] = {}
    for group, title in (("headline", "podmonitor headline"), ("reference", "podmonitor at the reference scale"),
                         ("stability", "podmonitor stability"),
                         ("fit", "podmonitor fit and scales"), ("scales", "podmonitor fit and scales"),
                         ("cost", "podmonitor cost")):
        charts = layout.setdefault(title, {})
        for m in metrics:
            if m.group == group:
                charts[m.title] = chart(m.tag(prefix))
    for name, patterns in (extra_charts or {}).items():
        layout["podmonitor headline"][name] = ["Multiline", list(patterns)]
    return layout


def summary_table(reports: Sequence[PODReport], layer_names: Sequence[str] | None = None
                  ) -> tuple[list[str], list[list[str]]]:
    """``(columns, rows)`` of the headline values of every layer (a W&B table; the markdown summary).

    Columns: layer, status, top a* (tokens), centroid (tokens), T_spec, R^2, H*(eps) for every eps
    (modes), mean attention distance (tokens), entropy, N.

    Raises:
        ValueError: the number of names differs from the number of reports.
    """
    reports = list(reports)
    names = [f"layer {i}" for i in range(len(reports))] if layer_names is None else [str(n) for n in layer_names]
    if len(names) != len(reports):
        raise ValueError(f"got {len(reports)} reports but {len(names)} layer names")
    eps = tuple(float(e) for e in ((reports[0].config.get("eps") if reports else None) or DEFAULT_EPS))

    def fmt(x: Any, spec: str = ".3g") -> str:
        v = _float(x)
        return "n/a" if math.isnan(v) else ("inf" if math.isinf(v) else format(v, spec))

    header = ["layer", "status", "top a* [tokens]", "centroid [tokens]", "T_spec", "R²"]
    header += [f"H*({eps_label(e)}) [modes]" for e in eps] + ["attn dist [tokens]", "entropy", "N"]
    rows = []
    for name, rep in zip(names, reports, strict=True):
        dom = list(rep.dominant_scales or [])
        ranks = rep.headline.effective_rank if rep.headline is not None else {}
        sat = rep.headline.saturated if rep.headline is not None else {}
        beyond = (getattr(rep.headline, "beyond_resolved", None) or {}) if rep.headline is not None else {}
        resolved = getattr(rep.headline, "resolved_rank", None) if rep.headline is not None else None
        hs = []
        for e in eps:
            r = _lookup(ranks, e)
            if r is None and _lookup(beyond, e) and resolved is not None:
                hs.append(f"> {resolved} (sketch)")
            else:
                hs.append("n/a" if r is None else f"{r}{' (sat.)' if _lookup(sat, e) else ''}")
        rows.append([name, rep.status, fmt(dom[0] if dom else None), fmt(rep.scale_centroid), fmt(rep.t_spec),
                     fmt(rep.r2, ".3f"), *hs, fmt(rep.mean_attention_distance), fmt(rep.entropy),
                     str(rep.n_snapshots)])
    return header, rows


def summary_markdown(reports: Sequence[PODReport], layer_names: Sequence[str] | None = None, *,
                     step: int | None = None) -> str:
    """A markdown table of the headline values of every layer (for :meth:`ReportSink.log_text`).

    The columns of :func:`summary_table`; a legend follows the table, and flagged layers get their
    messages under it.
    """
    reports = list(reports)
    header, rows = summary_table(reports, layer_names)
    names = [r[0] for r in rows]
    eps = tuple(float(e) for e in ((reports[0].config.get("eps") if reports else None) or DEFAULT_EPS))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    notes = []
    for name, rep in zip(names, reports, strict=True):
        if rep.status != "ok":
            msgs = list(rep.messages)
            notes.append(f"- **{name}** ({rep.status}): " + ("; ".join(msgs) if msgs else "no message"))
    title = "### podmonitor" + (f" at step {step}" if step is not None else "")
    e0 = eps_label(eps[0]) if eps else "0.10"
    legend = (f"*Legend:* top a* = the lag scale with the most fluctuation energy, where T_spec and H* are measured; "
              f"T_spec = 1/beta of the POD eigenvalue power law (larger = more complex attention); "
              f"H*({e0}) = POD modes for {100 * (1 - float(e0)):g} % of the energy (sat. = needs every mode); "
              "attn dist = mean |i - j| under the attention; entropy = normalised row entropy (1 = uniform); "
              "N = snapshots. Full glossary: the `glossary` text of this run.")
    return "\n".join([title, "", *lines, "", legend] + (["", *notes] if notes else [])) + "\n"
