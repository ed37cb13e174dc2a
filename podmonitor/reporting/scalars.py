"""Scalar metrics of a :class:`~podmonitor.PODReport`, named for dashboards.

Every metric of a layer is logged as ``"<prefix>/<metric>/<layer_name>"`` (e.g.
``"pod/t_spec/layer_00"``): TensorBoard and W&B group keys by their leading components, so one
metric over all layers sits together, and :func:`custom_scalars_layout` puts all layers of one
metric on one TensorBoard chart.

Missing values are NaN, never a made-up number: NaN stays NaN (TensorBoard and W&B accept it),
``None`` (e.g. H*(eps) of a report without POD) becomes NaN, a flat spectrum's T_spec stays inf.

Example:
    >>> scalars = layer_scalars(report, "layer_00", analysis_seconds=0.4)
    >>> scalars["pod/t_spec/layer_00"], scalars["pod/h_eps_0.10/layer_00"]
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from ..engine.report import PODReport, eps_lookup

__all__ = ["METRIC_TITLES", "custom_scalars_layout", "eps_label", "layer_scalars", "metric_names",
           "summary_markdown"]

DEFAULT_EPS: tuple[float, ...] = (0.10, 0.05, 0.01)

#: Chart titles of the metrics that do not depend on eps (in dashboard order).
METRIC_TITLES: dict[str, str] = {
    "t_spec": "T_spec",
    "beta": "beta",
    "r2": "R^2 of the T_spec fit",
    "n_fit": "n_fit (eigenvalues in the fit)",
    "top_scale": "top dominant scale",
    "scale_centroid": "scale centroid",
    "mean_attention_distance": "mean attention distance",
    "entropy": "entropy (normalised)",
    "n_snapshots": "snapshots analysed",
    "n_skipped_nonfinite": "snapshots skipped (NaN/Inf)",
    "analysis_seconds": "analysis time (s)",
    "status_ok": "status ok (1) / flagged (0)",
}


def eps_label(eps: float) -> str:
    """0.1 -> "0.10", 0.05 -> "0.05", 0.001 -> "0.001" (two decimals unless more are needed)."""
    text = f"{eps:.2f}"
    return text if math.isclose(float(text), eps, rel_tol=1e-12, abs_tol=0.0) else f"{eps:g}"


def metric_names(eps: Sequence[float] = DEFAULT_EPS) -> list[str]:
    """The metric names :func:`layer_scalars` emits for these eps, in dashboard order."""
    names = ["t_spec", "beta", "r2", "n_fit"]
    names += [f"h_eps_{eps_label(e)}" for e in eps]
    names += [f"saturated_eps_{eps_label(e)}" for e in eps]
    names += ["top_scale", "scale_centroid", "mean_attention_distance", "entropy", "n_snapshots",
              "n_skipped_nonfinite", "analysis_seconds", "status_ok"]
    return names


def _title_of(metric: str) -> str:
    if metric in METRIC_TITLES:
        return METRIC_TITLES[metric]
    if metric.startswith("h_eps_"):
        return f"H*({metric[len('h_eps_'):]})"
    if metric.startswith("saturated_eps_"):
        return f"H*({metric[len('saturated_eps_'):]}) saturated"
    return metric


def _float(x: Any) -> float:
    """Number / bool / None -> float (None and non-numbers -> NaN)."""
    if x is None:
        return math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _key(prefix: str, metric: str, layer_name: str) -> str:
    return f"{prefix}/{metric}/{layer_name}" if prefix else f"{metric}/{layer_name}"


def layer_scalars(report: PODReport, layer_name: str, *, prefix: str = "pod",
                  analysis_seconds: float | None = None) -> dict[str, float]:
    """The per-layer metrics of one report as ``{"<prefix>/<metric>/<layer_name>": value}``.

    Metrics (headline values are those at the top dominant scale, METHOD.md section 5):
    ``t_spec``, ``beta``, ``r2``, ``n_fit``; ``h_eps_<eps>`` (H*(eps), e.g. ``h_eps_0.10``) and
    ``saturated_eps_<eps>`` (1.0 / 0.0) for every eps of the report's config; ``top_scale`` (first
    dominant scale), ``scale_centroid``, ``mean_attention_distance``, ``entropy``,
    ``n_snapshots``, ``n_skipped_nonfinite``, ``analysis_seconds`` and ``status_ok`` (1.0 when
    status is "ok", else 0.0). Reports of the bounded-memory (sketch) mode add ``resolved_rank``,
    ``error_bound`` and ``beyond_resolved_eps_<eps>`` (1.0 where H*(eps) is more than the resolved
    rank R; ``h_eps_<eps>`` is NaN there).

    A report without POD (empty ``per_scale``) gives NaN for the fit values, H*(eps) and the
    saturation flags (not "unsaturated": there is nothing to saturate); n_fit is NaN too.

    Args:
        report: the analysis of one layer.
        layer_name: the last component of every key.
        prefix: the first component ("" for none).
        analysis_seconds: wall time of the analysis; None takes ``report.analysis_seconds`` (NaN
            where the report has none).

    Returns:
        metric key -> float (NaN where the value is missing).
    """
    head = report.headline
    eps = tuple(float(e) for e in (report.config.get("eps") or DEFAULT_EPS))
    ranks = head.effective_rank if head is not None else {}
    saturated = head.saturated if head is not None else {}
    values: dict[str, float] = {
        "t_spec": _float(report.t_spec),
        "beta": _float(report.beta),
        "r2": _float(report.r2),
        "n_fit": _float(head.n_fit) if head is not None else math.nan,
    }
    beyond = getattr(head, "beyond_resolved", None) or {}
    for e in eps:
        values[f"h_eps_{eps_label(e)}"] = _float(_lookup(ranks, e))
    if head is not None and getattr(head, "mode", "exact") == "sketch":
        # bounded-memory mode: H*(eps) is NaN where it lies beyond the resolved rank R
        values["resolved_rank"] = _float(head.resolved_rank)
        values["error_bound"] = _float(head.error_bound)
        for e in eps:
            values[f"beyond_resolved_eps_{eps_label(e)}"] = float(bool(_lookup(beyond, e)))
    for e in eps:
        flag = _lookup(saturated, e)
        values[f"saturated_eps_{eps_label(e)}"] = math.nan if flag is None else float(bool(flag))
    dominant = list(report.dominant_scales or [])
    values.update({
        "top_scale": _float(dominant[0]) if dominant else math.nan,
        "scale_centroid": _float(report.scale_centroid),
        "mean_attention_distance": _float(report.mean_attention_distance),
        "entropy": _float(report.entropy),
        "n_snapshots": _float(report.n_snapshots),
        "n_skipped_nonfinite": _float(report.n_skipped_nonfinite),
        "analysis_seconds": _float(analysis_seconds if analysis_seconds is not None
                                   else getattr(report, "analysis_seconds", None)),
        "status_ok": 1.0 if report.status == "ok" else 0.0,
    })
    return {_key(prefix, m, layer_name): v for m, v in values.items()}


def _lookup(d: dict, eps: float) -> Any:
    """d[eps] tolerant of float round-off in the key (0.1 vs 0.1000000001)."""
    return eps_lookup(d, eps)


def custom_scalars_layout(layer_names: Sequence[str] | None = None, prefix: str = "pod", *,
                          metrics: Sequence[str] | None = None,
                          eps: Sequence[float] = DEFAULT_EPS) -> dict[str, dict[str, list]]:
    """TensorBoard custom-scalars layout: one multi-line chart per metric, one line per layer.

    Format of ``SummaryWriter.add_custom_scalars``::

        {"podmonitor": {"T_spec": ["Multiline", ["pod/t_spec/.*"]], "H*(0.10)": [...], ...},
         "podmonitor per layer": {"H*(eps) layer_00": ["Multiline", ["pod/h_eps_[^/]*/layer_00$"]], ...}}

    The regular expressions follow TensorBoard's custom-scalars plugin (searched in each tag).
    The second category (only when ``layer_names`` is given) puts the H*(eps) of all eps of one
    layer on one chart.

    Args:
        layer_names: the layers (for the per-layer category); None or empty to skip it.
        prefix: the prefix given to :func:`layer_scalars`.
        metrics: metric names to chart (default :func:`metric_names` of ``eps``).
        eps: the eps values of H*(eps), when ``metrics`` is None.

    Returns:
        the layout dict.
    """
    metrics = list(metrics) if metrics is not None else metric_names(eps)
    head = f"{re.escape(prefix)}/" if prefix else ""
    per_metric = {_title_of(m): ["Multiline", [f"{head}{re.escape(m)}/.*"]] for m in metrics}
    layout: dict[str, dict[str, list]] = {"podmonitor": per_metric}
    if layer_names:
        layout["podmonitor per layer"] = {
            f"H*(eps) {name}": ["Multiline", [f"{head}h_eps_[^/]*/{re.escape(str(name))}$"]] for name in layer_names
        }
    return layout


def summary_markdown(reports: Sequence[PODReport], layer_names: Sequence[str] | None = None, *,
                     step: int | None = None) -> str:
    """A markdown table of the headline values of every layer (for :meth:`ReportSink.log_text`).

    Columns: layer, status, top a*, centroid, T_spec, beta, R^2, H*(eps) for every eps, mean
    attention distance, entropy, N; flagged layers get their messages under the table.
    """
    reports = list(reports)
    names = [f"layer {i}" for i in range(len(reports))] if layer_names is None else [str(n) for n in layer_names]
    if len(names) != len(reports):
        raise ValueError(f"got {len(reports)} reports but {len(names)} layer names")
    eps = tuple(float(e) for e in ((reports[0].config.get("eps") if reports else None) or DEFAULT_EPS))

    def fmt(x: Any, spec: str = ".3g") -> str:
        v = _float(x)
        return "n/a" if math.isnan(v) else ("inf" if math.isinf(v) else format(v, spec))

    header = ["layer", "status", "top a*", "centroid", "T_spec", "beta", "R²"]
    header += [f"H*({eps_label(e)})" for e in eps] + ["attn dist", "entropy", "N"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes = []
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
        row = [name, rep.status, fmt(dom[0] if dom else None), fmt(rep.scale_centroid), fmt(rep.t_spec),
               fmt(rep.beta), fmt(rep.r2, ".3f"), *hs, fmt(rep.mean_attention_distance),
               fmt(rep.entropy), str(rep.n_snapshots)]
        lines.append("| " + " | ".join(row) + " |")
        if rep.status != "ok":
            msgs = list(rep.messages)
            notes.append(f"- **{name}** ({rep.status}): " + ("; ".join(msgs) if msgs else "no message"))
    title = "### podmonitor" + (f" at step {step}" if step is not None else "")
    return "\n".join([title, "", *lines] + (["", *notes] if notes else [])) + "\n"
