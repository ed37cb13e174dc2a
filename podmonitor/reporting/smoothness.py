"""Scalars, figures and text of the smoothness metrics (:class:`~podmonitor.smoothness.LayerSmoothness`).

Scalars are named ``"<prefix>/<metric>/<layer>"`` like the POD metrics (default prefix
``"smooth"``), so one metric over all layers is grouped together on the dashboards:

- ``sigma_n<n>``: sigma(n), mean over the measured sequences, for every prefix length n;
- ``alpha``, ``alpha_r2``: growth exponent of sigma(n) ~ c n^alpha and its R^2;
- ``monotone``: 1 when every sequence's sigma(n) is non-decreasing (causal layers), else 0;
- ``power_iters``: power-iteration steps over all prefix lengths;
- ``entropy``, ``p_norm``, ``p_norm_max``: the companions (every run).

Figures (Agg canvas, no pyplot): :func:`sigma_figure` (one layer: sigma(n) on log-log axes, every
sequence, the mean, the fitted power law and the reference slopes 1/4 and 1/2) and
:func:`sigma_layers_figure` (the mean curves of all layers on one chart).

Example:
    >>> scalars = smoothness_scalars(result, "layer_00")
    >>> image = figure_to_array(sigma_figure(result))
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator

from .figures import _message, _new_figure, _rect, figure_to_array

__all__ = [
    "smoothness_images",
    "smoothness_layout",
    "smoothness_markdown",
    "smoothness_scalars",
    "sigma_figure",
    "sigma_layers_figure",
]

#: Metric -> chart title (TensorBoard custom-scalars layout).
SMOOTHNESS_TITLES: dict[str, str] = {
    "alpha": "alpha (growth exponent of sigma(n))",
    "alpha_r2": "R^2 of the alpha fit",
    "entropy": "row entropy (normalised)",
    "p_norm": "||P||_2 (mean over heads)",
    "p_norm_max": "||P||_2 (max over heads)",
    "monotone": "sigma(n) non-decreasing (1) / not (0)",
    "power_iters": "power-iteration steps",
}


def _f(x: Any) -> float:
    try:
        return float(x) if x is not None else math.nan
    except (TypeError, ValueError):
        return math.nan


def smoothness_scalars(result: Any, layer_name: str, *, prefix: str = "smooth") -> dict[str, float]:
    """``{"<prefix>/<metric>/<layer_name>": value}`` for one layer (NaN where missing).

    Args:
        result: a :class:`~podmonitor.smoothness.LayerSmoothness`.
        layer_name: the last component of every key.
        prefix: the first component ("" for none).
    """
    values: dict[str, float] = {}
    for n, s in zip(result.lengths, result.sigma_mean, strict=True):
        values[f"sigma_n{n}"] = _f(s)
    if result.fit is not None:
        values["alpha"] = _f(result.fit.alpha)
        values["alpha_r2"] = _f(result.fit.r2)
        values["power_iters"] = float(sum(result.n_iter))
    if result.monotone is not None:
        values["monotone"] = 1.0 if result.monotone else 0.0
    if result.companions is not None:
        values["entropy"] = _f(result.companions.entropy)
        values["p_norm"] = _f(result.companions.p_norm)
        values["p_norm_max"] = _f(result.companions.p_norm_max)
    head = f"{prefix}/" if prefix else ""
    return {f"{head}{m}/{layer_name}": v for m, v in values.items()}


def smoothness_layout(lengths: Sequence[int], prefix: str = "smooth") -> dict[str, dict[str, list]]:
    """TensorBoard custom-scalars layout: one multi-line chart (all layers) per metric.

    Category "podmonitor smoothness"; one chart per sigma(n) and one per metric of
    :data:`SMOOTHNESS_TITLES`. A TensorBoard run keeps a single layout, so the callback writes this
    one only when no other podmonitor callback writes its own.
    """
    head = f"{re.escape(prefix)}/" if prefix else ""
    charts: dict[str, list] = {f"sigma(n = {n})": ["Multiline", [f"{head}sigma_n{n}/.*"]] for n in lengths}
    charts.update({title: ["Multiline", [f"{head}{re.escape(m)}/.*"]] for m, title in SMOOTHNESS_TITLES.items()})
    return {"podmonitor smoothness": charts}


def _loglog_axes(fig: Figure) -> Any:
    ax = fig.add_axes(_rect(fig, 0.8, 0.6, 0.2, 0.45))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix length n (tokens)")
    ax.set_ylabel("sigma(n) = ||Df(X[:n])||_2")
    ax.grid(True, which="major", alpha=0.3)
    ax.yaxis.set_major_locator(LogLocator(base=10.0, subs=(1.0, 2.0, 5.0)))  # labelled 1-2-5 ticks
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    return ax


def sigma_figure(result: Any, *, title: str | None = None) -> Figure:
    """sigma(n) of one layer on log-log axes.

    Thin grey lines: every sequence; dots and black line: the mean; red dashes: the fitted power
    law c n^alpha; dotted: slopes 1/4 (real text in the paper) and 1/2 (worst case) through the
    first mean point. A layer without sigma values gives a figure that says so.
    """
    fig = _new_figure((6.0, 4.2))
    name = title or result.name
    fig.suptitle(f"{name}: local Lipschitz constant vs prefix length", fontsize=11)
    ax = _loglog_axes(fig)
    n = np.asarray(result.lengths, dtype=np.float64)
    mean = np.asarray(result.sigma_mean, dtype=np.float64)
    if n.size == 0 or not np.all(np.isfinite(mean)) or np.any(mean <= 0):
        _message(ax, ["no sigma(n) in this run" if n.size == 0 else "sigma(n) is not finite and positive"])
        return fig
    per_seq = np.asarray(result.sigma, dtype=np.float64)  # (n_lengths, b)
    for s in range(per_seq.shape[1]):
        ax.plot(n, per_seq[:, s], color="0.6", lw=0.8, alpha=0.8)
    ax.plot(n, mean, "o-", color="black", lw=1.6, label="mean over sequences")
    for slope, style in ((0.25, ":"), (0.5, "-.")):
        ax.plot(n, mean[0] * (n / n[0]) ** slope, style, color="tab:blue", lw=1.0, label=f"slope {slope:g}")
    fit = result.fit
    if fit is not None and math.isfinite(fit.alpha) and math.isfinite(fit.log_c):
        r2 = "n/a" if not math.isfinite(fit.r2) else f"{fit.r2:.3f}"
        ax.plot(n, np.exp(fit.log_c) * n ** fit.alpha, "--", color="tab:red", lw=1.2,
                label=f"fit: alpha = {fit.alpha:.3f}, R² = {r2}")
    ax.set_xticks(n)
    ax.set_xticklabels([str(int(v)) for v in n])
    ax.legend(fontsize=8, loc="upper left")
    return fig


def sigma_layers_figure(results: Sequence[Any], layer_names: Sequence[str] | None = None) -> Figure:
    """The mean sigma(n) curves of all layers on one log-log chart (alpha in the legend)."""
    fig = _new_figure((6.5, 4.4))
    fig.suptitle("sigma(n) per layer", fontsize=11)
    ax = _loglog_axes(fig)
    names = list(layer_names) if layer_names is not None else [r.name for r in results]
    drawn = False
    ticks: set[int] = set()
    for name, r in zip(names, results, strict=True):
        n = np.asarray(r.lengths, dtype=np.float64)
        mean = np.asarray(r.sigma_mean, dtype=np.float64)
        if n.size == 0 or not np.all(np.isfinite(mean)) or np.any(mean <= 0):
            continue
        alpha = r.fit.alpha if r.fit is not None else math.nan
        ax.plot(n, mean, "o-", lw=1.3, label=f"{name} (alpha {alpha:.2f})")
        ticks.update(int(v) for v in n)
        drawn = True
    if not drawn:
        _message(ax, ["no sigma(n) in this run"])
        return fig
    ax.set_xticks(sorted(ticks))
    ax.set_xticklabels([str(v) for v in sorted(ticks)])
    ax.legend(fontsize=7, loc="upper left")
    return fig


def smoothness_images(results: Mapping[str, Any], *, prefix: str = "smooth") -> dict[str, np.ndarray]:
    """Rendered figures: ``"<prefix>/sigma_vs_n/<layer>"`` per layer and ``"<prefix>/sigma_vs_n_layers"``.

    Layers without sigma values in this run are left out.
    """
    head = f"{prefix}/" if prefix else ""
    with_sigma = {k: r for k, r in results.items() if r.lengths}
    out: dict[str, np.ndarray] = {}
    if not with_sigma:
        return out
    out[f"{head}sigma_vs_n_layers"] = figure_to_array(sigma_layers_figure(list(with_sigma.values()),
                                                                          list(with_sigma)))
    for name, r in with_sigma.items():
        out[f"{head}sigma_vs_n/{name}"] = figure_to_array(sigma_figure(r, title=name))
    return out


def _fmt(x: Any, spec: str = ".3g") -> str:
    v = _f(x)
    return "n/a" if math.isnan(v) else format(v, spec)


def smoothness_markdown(results: Mapping[str, Any], *, step: int | None = None) -> str:
    """A Markdown table per layer: sigma(n) for every n, alpha, R^2, entropy, ||P||_2, monotone."""
    lengths: list[int] = sorted({n for r in results.values() for n in r.lengths})
    header = ["layer"] + [f"σ({n})" for n in lengths] + ["alpha", "R²", "entropy", "‖P‖₂", "monotone"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, r in results.items():
        by_n = dict(zip(r.lengths, r.sigma_mean, strict=True))
        comp = r.companions
        mono = "n/a" if r.monotone is None else ("yes" if r.monotone else "**no**")
        row = [name] + [_fmt(by_n.get(n)) for n in lengths]
        row += [_fmt(r.alpha, ".3f"), _fmt(r.r2, ".3f"), _fmt(comp.entropy if comp else None),
                _fmt(comp.p_norm if comp else None), mono]
        lines.append("| " + " | ".join(row) + " |")
    title = "### podmonitor smoothness" + (f" at step {step}" if step is not None else "")
    return "\n".join([title, "", *lines]) + "\n"
