"""Figures of a :class:`~podmonitor.PODReport` (matplotlib, Agg canvas, no pyplot).

Every function builds a fresh :class:`matplotlib.figure.Figure` attached to its own
:class:`~matplotlib.backends.backend_agg.FigureCanvasAgg`: nothing touches pyplot's global figure
registry or the global backend, so the functions are safe inside a training loop and in threads
that do not own a GUI. :func:`figure_to_array` renders a figure to an (H, W, 3) uint8 RGB array
for the image sinks.

Flagged reports never raise: a report whose status is not "ok", whose ``per_scale`` is empty, or
whose arrays are empty or non-finite gives a figure that says what is wrong (text in the axes),
or ``None`` where documented (:func:`coherency_figure` without a coherency map).

Example:
    >>> from podmonitor import analyze
    >>> from podmonitor.reporting.figures import scalogram_figure, figure_to_array
    >>> image = figure_to_array(scalogram_figure(analyze(fields), title="layer 0"))
    >>> image.shape, image.dtype  # (H, W, 3), uint8
"""

from __future__ import annotations

import math
import sys
import textwrap
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter, LogFormatterMathtext, LogLocator, NullFormatter, NullLocator

from ..engine.report import PODReport, ScaleReport
from . import layouts
from .layouts import new_figure as _new_figure
from .layouts import rect as _rect

__all__ = [
    "LAYER_PICTURES",
    "PICTURES",
    "check_pictures",
    "coherency_figure",
    "figure_to_array",
    "head_allocation_figure",
    "draw_run_pictures",
    "layer_images",
    "modes_figure",
    "scalogram_figure",
    "trend_heatmap_figure",
    "scale_organisation_figure",
    "spectrum_figure",
]

Which = Literal["fluctuation", "mean"]

#: Dynamic range of the logarithmic colour scale of the scalogram images.
SCALOGRAM_DYNAMIC_RANGE = 1e4

#: The pictures drawn for each layer (tags ``<prefix>/<picture>/<layer>``).
LAYER_PICTURES = ("scalogram", "mean_scalogram", "spectrum", "modes", "coherency")

#: Every picture of a monitored run: the scale organisation over depth, each layer's pictures, and
#: the layers x validation-steps heatmaps of the headline trends (tags ``<prefix>/trend/<metric>``).
PICTURES = ("scale_organisation", *LAYER_PICTURES, "trend")


def check_pictures(names: Iterable[object]) -> tuple[str, ...]:
    """``names`` as picture names (order kept, repeats dropped), each one checked against
    :data:`PICTURES`.

    Raises:
        ValueError: a name that is not in :data:`PICTURES` (or is not a string).
    """
    names = list(names)
    unknown = [n for n in names if not isinstance(n, str) or n not in PICTURES]
    if unknown:
        raise ValueError(f"unknown picture(s) {unknown}; choose from {list(PICTURES)}")
    return tuple(dict.fromkeys(n for n in names if isinstance(n, str)))  # (all of them, checked above)


# --------------------------------------------------------------------------------------------
# helpers


def as_float_array(x: Any) -> np.ndarray:
    """Tensor / array / list / None -> float64 numpy array (None -> empty): how every picture reads
    a report's numbers (complex tensors by their magnitude). The picture process receives the
    reports' tensors already converted by this function, so it draws the same values without
    torch."""
    if x is None:
        return np.zeros(0, dtype=np.float64)
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().cpu()
        if x.is_complex():
            x = x.abs()
        x = x.double().numpy()
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        return np.zeros(0, dtype=np.float64)


_np = as_float_array  # (the short name the figures use)


def _finite(x: Any) -> bool:
    try:
        return x is not None and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _fmt(x: Any, spec: str = ".3g") -> str:
    """Number -> text; None / NaN / inf spelled out."""
    if x is None:
        return "n/a"
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return format(v, spec)


def _status_lines(report: PODReport) -> list[str]:
    """What is wrong with a flagged report (empty for status "ok")."""
    if report.status == "ok":
        return []
    msgs = list(report.messages)
    return [f"status: {report.status}"] + msgs[:2]


def _wrap(lines: Sequence[str], width: int = 70) -> str:
    return "\n".join(textwrap.fill(line, width) for line in lines)


def _message(ax: Axes, lines: Sequence[str]) -> None:
    """Replace the content of ``ax`` by a centred message."""
    layouts.spoil(ax.figure)  # axes off: a kept figure is not handed out again
    ax.set_axis_off()
    ax.text(0.5, 0.5, _wrap(lines), ha="center", va="center", transform=ax.transAxes,
            fontsize=13, color="firebrick", wrap=True)


def _message_figure(figsize: tuple[float, float], title: str | None, what: str,
                    margins: tuple[float, float, float, float], lines: Sequence[str]) -> Figure:
    """A fresh figure whose one axes (``margins`` in inches) says ``lines`` instead of data."""
    fig = _new_figure(figsize)
    _title(fig, title, what)
    _message(fig.add_axes(_rect(fig, *margins)), lines)
    return fig


def _note(ax: Axes, lines: Sequence[str]) -> None:
    """A boxed note at the bottom of ``ax`` over the data (for flagged but drawable reports)."""
    if not lines:
        return
    ax.text(0.02, 0.02, _wrap(lines, 60), ha="left", va="bottom", transform=ax.transAxes,
            fontsize=11, color="firebrick", bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "firebrick"})


def _title(fig: Figure, title: str | None, what: str) -> None:
    fig.suptitle(f"{title}: {what}" if title else what, fontsize=14)


def _log_edges(scales: np.ndarray) -> np.ndarray:
    """Cell edges of a log-spaced grid (geometric midpoints)."""
    la = np.log(scales)
    if la.size == 1:
        return np.exp(np.array([la[0] - 0.5 * math.log(2), la[0] + 0.5 * math.log(2)]))
    mid = 0.5 * (la[1:] + la[:-1])
    return np.exp(np.concatenate([[2 * la[0] - mid[0]], mid, [2 * la[-1] - mid[-1]]]))


# --------------------------------------------------------------------------------------------
# scalogram


def scalogram_figure(report: PODReport, which: Which = "fluctuation", *, title: str | None = None) -> Figure:
    """Image of the scalogram S(a, tau) with the scale energy E(a) beside it.

    Left panel: S(a, tau) (``report.scalogram`` or ``report.mean_scalogram``) with the lag tau on
    x and the scale a on a logarithmic y axis, logarithmic colour scale over
    :data:`SCALOGRAM_DYNAMIC_RANGE`; dominant scales drawn as dashed lines (the top one red).
    Right panel: E(a) = sum_tau S(a, tau) against a, same y axis.

    Args:
        report: the analysis of one layer.
        which: "fluctuation" (default, the scalogram the dominant scales come from) or "mean"
            (the mean field's; the dominant scales drawn are still those of the fluctuation).
        title: e.g. the layer name; goes in front of the figure title.

    Returns:
        The figure; for a report without a drawable scalogram (no scales, zero or non-finite
        energy) a figure whose axes say why.

    Raises:
        ValueError: ``which`` is not "fluctuation" or "mean".
    """
    if which not in ("fluctuation", "mean"):
        raise ValueError(f"which must be 'fluctuation' or 'mean', got {which!r}")
    what = "fluctuation scalogram S(a, τ)" if which == "fluctuation" else "mean-field scalogram S(a, τ)"
    s = _np(report.scalogram if which == "fluctuation" else report.mean_scalogram)
    scales = _np(report.scales)
    problems = _status_lines(report)
    ok_shape = s.ndim == 2 and s.size > 0 and scales.ndim == 1 and scales.size == s.shape[0]
    ok_scales = ok_shape and bool(np.all(np.isfinite(scales) & (scales > 0)))
    vmax = float(np.nanmax(np.where(np.isfinite(s), s, np.nan))) if ok_shape and np.isfinite(s).any() else math.nan
    # the engine decided the fluctuation is zero: what is left is float round-off, not signal
    round_off = which == "fluctuation" and report.status == "zero_variance"
    if round_off or not (ok_shape and ok_scales and vmax > 0):
        fig = _new_figure((8.0, 4.5))
        _title(fig, title, what)
        ax = fig.add_subplot()
        if round_off:
            why = "the scalogram is zero everywhere (up to float round-off)"
        elif not ok_shape:
            why = f"no scalogram to draw (shape {tuple(s.shape)}, {scales.size} scale(s))"
        elif not ok_scales:
            why = "the scale grid holds non-positive or non-finite values"
        elif not np.isfinite(s).any():
            why = "the scalogram holds no finite value"
        else:
            why = "the scalogram is zero everywhere"
        _message(ax, [why] + problems)
        return fig

    fig, (ax, ax_e, cax) = layouts.layout(
        "scalogram", (8.0, 4.5), [(0.75, 0.55, 2.3, 0.45), (5.8, 0.55, 1.1, 0.45), (7.0, 0.55, 0.85, 0.45)],
        sharey={1: 0})
    _title(fig, title, what)
    ax_e.tick_params(axis="y", labelleft=False)
    n_lags = s.shape[1]
    lag_edges = np.arange(n_lags + 1, dtype=np.float64) - 0.5
    a_edges = _log_edges(scales)
    vmin = vmax / SCALOGRAM_DYNAMIC_RANGE
    data = np.ma.masked_invalid(np.clip(s, vmin, None))
    mesh = ax.pcolormesh(lag_edges, a_edges, data, norm=LogNorm(vmin=vmin, vmax=vmax), cmap="viridis",
                         shading="flat")
    ax.set_yscale("log")
    ticks = scales[:: max(1, scales.size // 6)]
    ax.set_yticks(ticks, [f"{a:.3g}" for a in ticks])
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("lag τ = i − j (tokens)")
    ax.set_ylabel("scale a (tokens)")
    layouts.colorbar(fig, mesh, cax, "⟨|W|²⟩")

    energy = np.nansum(np.where(np.isfinite(s), s, np.nan), axis=1)
    ax_e.plot(energy, scales, "k.-", lw=1, ms=3)
    ax_e.set_xlabel("E(a)")
    pos_e = energy[np.isfinite(energy) & (energy > 0)]
    if pos_e.size and pos_e.max() > 20 * pos_e.min():
        ax_e.set_xscale("log")
        ax_e.xaxis.set_major_locator(LogLocator(numticks=3))
        ax_e.xaxis.set_minor_formatter(NullFormatter())
    ax_e.tick_params(axis="x", labelsize=10)

    for rank, a in enumerate(report.dominant_scales or []):
        if not _finite(a) or a <= 0:
            continue
        style = {"color": "red" if rank == 0 else "white", "ls": "--", "lw": 1.2 if rank == 0 else 0.8}
        ax.axhline(a, **style)
        ax_e.axhline(a, **{**style, "color": "red" if rank == 0 else "gray"})
        ax.text(n_lags - 0.5, a, f" a*{rank + 1}={a:.3g}", color=style["color"], fontsize=10,
                ha="right", va="bottom")
    if _finite(report.scale_centroid) and which == "fluctuation":
        ax_e.axhline(report.scale_centroid, color="tab:orange", ls=":", lw=1.2)
        ax_e.text(0.98, report.scale_centroid, "centroid", transform=ax_e.get_yaxis_transform(),
                  color="tab:orange", fontsize=10, ha="right", va="bottom")
    extra = []
    if not np.all(np.isfinite(s)):
        extra.append(f"{int(np.sum(~np.isfinite(s)))} non-finite value(s) left blank")
    _note(ax, problems + extra)
    return fig


# --------------------------------------------------------------------------------------------
# scale organisation over depth


def _scale_union(reports: Sequence[PODReport]) -> np.ndarray:
    vals = []
    for r in reports:
        a = _np(r.scales)
        if a.ndim == 1:
            vals.extend(float(v) for v in a if math.isfinite(v) and v > 0)
    if not vals:
        return np.zeros(0)
    vals = np.sort(np.asarray(vals))
    keep = np.concatenate([[True], ~np.isclose(vals[1:], vals[:-1], rtol=1e-9, atol=0.0)])
    return vals[keep]


def _index_of(grid: np.ndarray, a: float) -> int:
    return int(np.argmin(np.abs(np.log(grid) - math.log(a))))


def scale_organisation_figure(reports: Sequence[PODReport], layer_names: Sequence[str] | None = None, *,
                              which: Which = "fluctuation", title: str | None = None) -> Figure:
    """Layers x scales heatmap of the scale energy E(a), each row normalised to sum 1.

    The picture of how the scale content organises with depth (early layers fine scales,
    late layers coarse ones). Row l is ``E_l(a) / sum_a E_l(a)`` on the union of the scale grids
    of all reports (a scale a layer's L does not support is blank); the top dominant scale is
    drawn as a red star, the other dominant scales as white circles, the scale centroid as an
    orange diamond (joined over depth). The heatmap is the first image of the axes
    (``fig.axes[0].images[0].get_array()``: masked (n_layers, n_scales) array).

    Args:
        reports: one report per layer, in depth order.
        layer_names: row labels (default "layer 0", "layer 1", ...).
        which: "fluctuation" (``scale_energy``, default) or "mean" (``mean_scale_energy``).
        title: goes in front of the figure title.

    Returns:
        The figure; rows whose energy is zero or non-finite stay blank and are listed in a note;
        with no report or no scale at all the axes say so.

    Raises:
        ValueError: ``layer_names`` does not have one name per report, or ``which`` is invalid.
    """
    if which not in ("fluctuation", "mean"):
        raise ValueError(f"which must be 'fluctuation' or 'mean', got {which!r}")
    reports = list(reports)
    names = [f"layer {i}" for i in range(len(reports))] if layer_names is None else [str(n) for n in layer_names]
    if len(names) != len(reports):
        raise ValueError(f"got {len(reports)} reports but {len(names)} layer names")
    figsize = (8.0, max(2.6, 1.5 + 0.45 * len(reports)))
    what = "scale energy E(a) per layer (rows sum to 1)"
    left = 0.75 + 0.075 * max([len(n) for n in names] + [4])
    grid = _scale_union(reports)
    if not reports or grid.size == 0:
        return _message_figure(figsize, title, what, (left, 1.0, 1.25, 0.45), [
            "no report to draw" if not reports else "no report has a scale grid (sequences too short?)"])
    fig, (ax, cax) = layouts.layout("scale_organisation", figsize, [(left, 1.0, 1.25, 0.45), (6.95, 1.0, 0.9, 0.45)])
    _title(fig, title, what)

    rows = np.full((len(reports), grid.size), np.nan)
    blank = []
    for r_i, rep in enumerate(reports):
        scales = _np(rep.scales)
        energy = _np(rep.scale_energy if which == "fluctuation" else rep.mean_scale_energy)
        if scales.ndim != 1 or energy.shape != scales.shape or scales.size == 0:
            blank.append(f"{names[r_i]}: no scale energy (status {rep.status})")
            continue
        good = np.isfinite(energy) & np.isfinite(scales) & (scales > 0)
        total = float(np.sum(energy[good]))
        if not total > 0 or (which == "fluctuation" and rep.status == "zero_variance"):
            blank.append(f"{names[r_i]}: zero scale energy (status {rep.status})")
            continue
        for a, e in zip(scales[good], energy[good], strict=True):
            rows[r_i, _index_of(grid, a)] = e / total

    data = np.ma.masked_invalid(rows)
    img = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0.0, interpolation="nearest")
    layouts.colorbar(fig, img, cax, "E(a) / Σ E")
    step = max(1, grid.size // 8)
    ticks = np.arange(0, grid.size, step)
    ax.set_xticks(ticks, [f"{grid[t]:.3g}" for t in ticks])
    ax.set_yticks(np.arange(len(names)), names)
    ax.set_xlabel("scale a (tokens, log-spaced grid)")
    ax.set_ylabel("layer (depth ↓)")

    top_x, top_y, other_x, other_y, cen_x, cen_y = [], [], [], [], [], []
    log_grid = np.log(grid)
    for r_i, rep in enumerate(reports):
        for rank, a in enumerate(rep.dominant_scales or []):
            if _finite(a) and a > 0:
                (top_x if rank == 0 else other_x).append(_index_of(grid, a))
                (top_y if rank == 0 else other_y).append(r_i)
        c = rep.scale_centroid if which == "fluctuation" and rep.status != "zero_variance" else None
        if _finite(c) and c > 0 and grid.size > 1:
            cen_x.append(float(np.interp(math.log(c), log_grid, np.arange(grid.size))))
            cen_y.append(r_i)
        elif _finite(c) and c > 0:
            cen_x.append(0.0)
            cen_y.append(r_i)
    if other_x:
        ax.scatter(other_x, other_y, marker="o", s=30, facecolors="none", edgecolors="white",
                   label="other dominant scales")
    if top_x:
        ax.scatter(top_x, top_y, marker="*", s=110, color="red", edgecolors="white", linewidths=0.5,
                   label="top dominant scale")
    if cen_x:
        ax.plot(cen_x, cen_y, "D-", color="tab:orange", ms=5, lw=1, label="scale centroid")
    if top_x or other_x or cen_x:
        ax.legend(loc="lower center", bbox_to_anchor=(0.5, 0.0), bbox_transform=fig.transFigure, ncol=3,
                  fontsize=11, frameon=False)
    ax.set_xlim(-0.5, grid.size - 0.5)
    ax.set_ylim(len(reports) - 0.5, -0.5)
    _note(ax, blank[:4] + ([f"... and {len(blank) - 4} more"] if len(blank) > 4 else []))
    return fig


# --------------------------------------------------------------------------------------------
# POD spectrum


def fitted_power_law(scale_report: ScaleReport, k_fit: int = 30, floor: float = 1e-12
                     ) -> tuple[np.ndarray, np.ndarray] | None:
    """The fitted line ``c k^-beta`` over the points the fit of T_spec used.

    ``beta`` is the report's; ``c`` is the OLS intercept of the same fit (``ln c = mean(ln lambda) +
    beta mean(ln k)`` over the first ``k_fit`` eigenvalues above ``floor * lambda_1``, as in
    :func:`podmonitor.engine.spectrum.spectral_fit`).

    Returns:
        (k, c k^-beta) arrays, or None when beta is not finite or fewer than 2 points remain.
    """
    beta = scale_report.beta
    if getattr(scale_report, "mode", "exact") == "sketch" and scale_report.n_fit:
        k_fit = min(int(k_fit), int(scale_report.n_fit))  # a sketch fits its resolved eigenvalues only
    lam = _np(scale_report.eigenvalues)[: max(0, int(k_fit))]
    if not _finite(beta) or lam.ndim != 1 or lam.size == 0 or not (np.isfinite(lam[0]) and lam[0] > 0):
        return None
    k = np.arange(1, lam.size + 1, dtype=np.float64)
    keep = np.isfinite(lam) & (lam > floor * lam[0])
    k, lam = k[keep], lam[keep]
    if k.size < 2:
        return None
    log_c = float(np.mean(np.log(lam)) + beta * np.mean(np.log(k)))
    return k, np.exp(log_c - beta * np.log(k))


def spectrum_figure(report: PODReport, *, title: str | None = None) -> Figure:
    """POD eigenvalues lambda_k against k (log-log) at every dominant scale, with the power-law fit.

    One marker series per dominant scale; its fitted line ``c k^-beta`` (dashed, same colour,
    ``gid`` ``"fit:<index>"``) spans the points the T_spec fit used. The legend gives a*, T_spec,
    R^2, the number of fitted points and the fit status ("ok", "degenerate", "flat").
    Zero eigenvalues cannot be shown on log axes and are left out.

    Returns:
        The figure; a report without POD (empty ``per_scale``) or without a positive eigenvalue
        gives axes that say why.
    """
    fig, (ax,) = layouts.layout("spectrum", (7.0, 4.5), [(0.8, 0.55, 0.2, 0.45)])
    _title(fig, title, "POD spectrum λ_k at the dominant scales")
    if not report.per_scale:
        _message(ax, ["no POD spectrum: the report has no dominant scale"] + _status_lines(report))
        return fig
    k_fit = int(report.config.get("k_fit", 30) or 30)
    floor = float(report.config.get("eig_floor", 1e-12) or 0.0)
    drawn = 0
    skipped = []
    for idx, sr in enumerate(report.per_scale):
        lam = _np(sr.eigenvalues)
        color = f"C{idx % 10}"
        label = (f"a*={_fmt(sr.scale)}: T_spec={_fmt(sr.t_spec)}, R²={_fmt(sr.r2, '.3f')}, "
                 f"n={sr.n_fit}, {sr.status}")
        pos = (np.isfinite(lam) & (lam > 0)) if lam.ndim == 1 else np.zeros(0, dtype=bool)
        if not pos.any():
            skipped.append(f"a*={_fmt(sr.scale)}: no positive eigenvalue ({sr.status})")
            continue
        k = np.arange(1, lam.size + 1, dtype=np.float64)
        ax.plot(k[pos], lam[pos], "o", ms=3, color=color, label=label)
        fit = fitted_power_law(sr, k_fit, floor)
        if fit is not None:
            (line,) = ax.plot(fit[0], fit[1], "--", color=color, lw=1.2)
            line.set_gid(f"fit:{idx}")
        drawn += 1
    if not drawn:
        _message(ax, skipped + _status_lines(report))
        return fig
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("mode k")
    ax.set_ylabel("eigenvalue λ_k")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=10, loc="lower left", title="dashed: fit c·k^−β", title_fontsize=10)
    _note(ax, skipped + _status_lines(report))
    return fig


# --------------------------------------------------------------------------------------------
# mode lag profiles


def modes_figure(report: PODReport, n_modes: int = 4, *, title: str | None = None) -> Figure:
    """Lag profiles phi_k(tau) of the leading POD modes at the layer's top dominant scale.

    One panel, one size, whatever the number of dominant scales: the pictures of a layer line up
    from step to step and stay legible as thumbnails (the modes at the other scales are in the
    JSON-lines record). The legend gives each mode's energy fraction (``lambda_k / sum lambda``).

    Args:
        report: the analysis of one layer.
        n_modes: at most this many modes (fewer when the report kept fewer).
        title: goes in front of the figure title.

    Returns:
        The figure; without dominant scales (or without kept profiles) the axes say why.
    """
    fig, (ax,) = layouts.layout("modes", (7.0, 4.5), [(0.9, 0.75, 0.25, 0.75)])
    _title(fig, title, "POD mode lag profiles φ_k(τ)")
    scales = list(report.per_scale)
    if not scales:
        _message(ax, ["no POD modes: the report has no dominant scale"] + _status_lines(report))
        return fig
    sr = scales[0]
    head = f"top dominant scale a* = {_fmt(sr.scale)} tokens"
    prof = _np(sr.mode_lag_profiles)
    lags = _np(sr.lags)
    frac = _np(sr.energy_fractions)
    n = min(max(0, int(n_modes)), prof.shape[0] if prof.ndim == 2 else 0)
    if n == 0 or prof.ndim != 2 or lags.ndim != 1 or prof.shape[1] != lags.size or lags.size == 0:
        _message(ax, [f"{head}: no mode lag profile to draw ({sr.status})"])
        return fig
    for k in range(n):
        ef = f"{100 * frac[k]:.1f}%" if k < frac.size and np.isfinite(frac[k]) else "n/a"
        y = np.where(np.isfinite(prof[k]), prof[k], np.nan)
        ax.plot(lags, y, lw=1.6, label=f"φ{k + 1} ({ef})")
    ax.axhline(0.0, color="gray", lw=0.6)
    ax.set_title(head + " (top)", fontsize=12)
    ax.set_xlabel("lag τ (tokens)", fontsize=12)
    ax.tick_params(labelsize=11)
    ax.legend(fontsize=11, title="mode (energy)", title_fontsize=11)
    notes = _status_lines(report) + ([f"fit status: {sr.status}"] if sr.status != "ok" else [])
    _note(ax, notes)
    return fig


# --------------------------------------------------------------------------------------------
# coherency


def coherency_figure(report: PODReport, *, title: str | None = None) -> Figure | None:
    """Cross-coherency map gamma_ij(a) at ``report.coherency_scale`` (query i on y, key j on x).

    Returns:
        None when the report carries no coherency map (``PODConfig(coherency=False)`` or a report
        flagged before the coherency was computed). A map that is empty or entirely non-finite
        gives a figure whose axes say so; NaN entries (beyond the stored lag band) stay blank.
    """
    if report.coherency is None:
        return None
    what = f"cross-coherency γ_ij at a = {_fmt(report.coherency_scale)}"
    gamma = _np(report.coherency).astype(float, copy=True)
    if gamma.ndim == 2 and gamma.shape[0] == gamma.shape[1] and report.causal:
        # METHOD.md section 6: a causal query sees keys j <= i only; above the diagonal gamma is undefined
        gamma[np.triu_indices(gamma.shape[0], 1)] = np.nan
    if gamma.ndim != 2 or gamma.size == 0 or not np.isfinite(gamma).any():
        return _message_figure((5.6, 4.8), title, what, (0.65, 0.55, 1.1, 0.45),
                               [f"no finite coherency value (shape {tuple(gamma.shape)})"] + _status_lines(report))
    fig, (ax, cax) = layouts.layout("coherency", (5.6, 4.8), [(0.65, 0.55, 1.1, 0.45), (4.65, 0.55, 0.8, 0.45)])
    _title(fig, title, what)
    # one colour scale for every layer and step: gamma lies in [0, 1]
    img = ax.imshow(np.ma.masked_invalid(gamma), vmin=0.0, vmax=1.0, cmap="magma", interpolation="nearest")
    layouts.colorbar(fig, img, cax, "γ")
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    n_bad = int(np.sum(~np.isfinite(gamma)))
    what = "j > i (not visible) or beyond the lag band" if report.causal else "beyond the lag band"
    _note(ax, _status_lines(report) + ([f"blank: {what}"] if n_bad else []))
    return fig


def trend_heatmap_figure(title: str, steps: Sequence[int], layer_names: Sequence[str],
                         values: np.ndarray, *, unit: str = "") -> Figure:
    """One headline metric over layers (rows) and validation steps (columns), as a heatmap.

    Args:
        title: the metric's title (from the registry).
        steps: the validation steps, (S,).
        layer_names: the layers, (Lyr,).
        values: (Lyr, S); NaN cells stay blank.
        unit: shown on the colour bar.
    """
    vals = np.asarray(values, dtype=float)
    what = f"{title}: layers x validation steps"
    if vals.ndim != 2 or vals.size == 0 or not np.isfinite(vals).any():
        return _message_figure((9.0, 4.5), None, what, (1.6, 0.8, 1.4, 0.7), ["no finite value yet"])
    fig, (ax, cax) = layouts.layout("trend", (9.0, 4.5), [(1.6, 0.8, 1.4, 0.7), (7.8, 0.8, 0.9, 0.7)])
    _title(fig, None, what)
    img = ax.imshow(np.ma.masked_invalid(vals), aspect="auto", cmap="viridis", interpolation="nearest")
    layouts.colorbar(fig, img, cax, unit)
    ax.set_yticks(range(len(layer_names)), [str(n) for n in layer_names], fontsize=11)
    n = len(steps)
    every = max(1, math.ceil(n / 8))
    ax.set_xticks(range(0, n, every), [str(s) for s in list(steps)[::every]], fontsize=11)
    ax.set_xlabel("step", fontsize=12)
    return fig


# --------------------------------------------------------------------------------------------
# rendering


# --------------------------------------------------------------------------------------------
# head allocation


def head_allocation_figure(advice: Any, *, title: str | None = None) -> Figure:
    """Bar chart of a head allocation advice: heads per layer now and recommended, H*(eps) on top.

    Args:
        advice: a :class:`~podmonitor.pruning.HeadAllocationAdvice` (or anything with ``eps`` and
            ``layers`` rows holding ``layer``, ``heads_now``, ``recommended``, ``effective_rank``,
            ``saturated``).

    Returns:
        The figure; an advice without layers gives axes that say so.
    """
    fig = _new_figure((7.0, 4.0))
    eps = getattr(advice, "eps", math.nan)
    _title(fig, title, f"heads per layer: now vs recommended (same budget, H*({_fmt(eps, 'g')}))")
    ax = fig.add_axes(_rect(fig, 0.7, 0.9, 0.2, 0.45))
    rows = list(getattr(advice, "layers", []) or [])
    if not rows:
        _message(ax, ["no layer in the advice"])
        return fig
    x = np.arange(len(rows), dtype=np.float64)
    now = [float(r.heads_now) for r in rows]
    rec = [float(r.recommended) for r in rows]
    ax.bar(x - 0.2, now, width=0.4, color="C0", label="heads now", gid="bars:now")
    ax.bar(x + 0.2, rec, width=0.4, color="C1", label="recommended", gid="bars:recommended")
    top = max(now + rec + [1.0])
    for i, r in enumerate(rows):
        hstar = "n/a" if r.effective_rank is None else f"{r.effective_rank}{'*' if r.saturated else ''}"
        ax.text(x[i], max(now[i], rec[i]) + 0.03 * top, f"H*={hstar}", ha="center", va="bottom", fontsize=11)
    ax.set_xticks(x)
    ax.set_xticklabels([str(r.layer) for r in rows], rotation=30, ha="right", fontsize=11)
    ax.set_ylabel("heads")
    ax.set_ylim(0, 1.2 * top)
    ax.legend(fontsize=11, loc="upper right", title="* saturated", title_fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def figure_to_array(fig: Figure) -> np.ndarray:
    """Render ``fig`` and return its pixels as an (H, W, 3) uint8 RGB array.

    Minor ticks are dropped and mathtext log labels replaced by plain ones before drawing (they
    take most of the drawing time). A figure that pyplot manages is closed with
    ``pyplot.close``; other figures are released when the caller drops them.
    """
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    # Minor ticks (log axes, log colour bars) cost most of the drawing time and add little to a
    # dashboard picture: drop them.
    # Labels like 10^2 are typeset by mathtext, which is slow: plain "100" / "1e-05" read as well.
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_minor_locator(NullLocator())
            if isinstance(axis.get_major_formatter(), LogFormatterMathtext):
                axis.set_major_formatter(LogFormatter())
    canvas.draw()
    rgb = np.asarray(canvas.buffer_rgba())[..., :3].copy()
    layouts.release(fig)  # a kept figure (inside layouts.reusing) goes back for the next one
    plt = sys.modules.get("matplotlib.pyplot")  # only if the caller already imported pyplot
    if plt is not None and getattr(fig, "number", None) is not None and plt.fignum_exists(fig.number):
        plt.close(fig)
    return np.ascontiguousarray(rgb, dtype=np.uint8)


def layer_images(report: PODReport, layer_name: str, *, prefix: str = "pod",
                 which: Sequence[str] = LAYER_PICTURES,
                 n_modes: int = 4) -> dict[str, np.ndarray]:
    """All figures of one layer rendered for :meth:`ReportSink.log_images`.

    Tags are ``"<prefix>/<figure>/<layer_name>"`` (figure in scalogram, mean_scalogram,
    spectrum, modes, coherency), so that an image dashboard groups one figure over all layers.
    The coherency image is left out when :func:`coherency_figure` returns None.

    Returns:
        tag -> (H, W, 3) uint8 array.
    """
    known = set(LAYER_PICTURES)
    unknown = set(which) - known
    if unknown:
        raise ValueError(f"unknown figure(s) {sorted(unknown)}; choose from {sorted(known)}")
    out: dict[str, np.ndarray] = {}
    for name in which:
        if name == "scalogram":
            fig = scalogram_figure(report, "fluctuation", title=layer_name)
        elif name == "mean_scalogram":
            fig = scalogram_figure(report, "mean", title=layer_name)
        elif name == "spectrum":
            fig = spectrum_figure(report, title=layer_name)
        elif name == "modes":
            fig = modes_figure(report, n_modes, title=layer_name)
        else:
            fig = coherency_figure(report, title=layer_name)
        if fig is not None:
            out[f"{prefix}/{name}/{layer_name}"] = figure_to_array(fig)
    return out


def draw_run_pictures(prefix: str, reports: Mapping[str, PODReport], present: Sequence[str],
                      trend: Mapping[str, tuple[str, Mapping[str, Sequence[float]]]] | None = None,
                      steps: Sequence[int] = (), units: Mapping[str, str] | None = None,
                      which: Collection[str] = PICTURES, cache: layouts.FigureCache | None = None
                      ) -> dict[str, np.ndarray]:
    """The pictures of one monitored run, rendered: the scale organisation over depth, each layer's
    :func:`layer_images`, and one layers x validation-steps heatmap per headline trend.

    The figures are drawn inside :func:`~podmonitor.reporting.layouts.reusing`: each kind's axes,
    ticks and colour bar are built once and refilled for the next layer (the same pixels).

    Args:
        prefix: tag prefix ("pod").
        reports: layer name -> report.
        present: the layers to draw, in depth order (names in ``reports``).
        trend: metric key -> (title, {layer: values at ``steps``}); sub-layer names (with "/") get
            no heatmap row.
        steps: the validation steps of the trend.
        units: metric key -> unit, for the heatmaps' colour bars.
        which: the pictures to draw, names from :data:`PICTURES` (default all).
        cache: the kept figures, to reuse them from one call to the next too (the picture process
            keeps one for its life); default a new one for this call.

    Returns:
        tag -> (H, W, 3) uint8 array.

    Raises:
        ValueError: an unknown name in ``which``.
    """
    which = check_pictures(which)
    with layouts.reusing(cache):
        return _draw_run_pictures(prefix, reports, present, trend, steps, units, which)


def _draw_run_pictures(prefix: str, reports: Mapping[str, PODReport], present: Sequence[str],
                       trend: Mapping[str, tuple[str, Mapping[str, Sequence[float]]]] | None,
                       steps: Sequence[int], units: Mapping[str, str] | None,
                       which: tuple[str, ...]) -> dict[str, np.ndarray]:
    layer_reports = [reports[n] for n in present]
    pictures: dict[str, np.ndarray] = {}
    if not layer_reports:
        return pictures
    if "scale_organisation" in which:
        pictures[f"{prefix}/scale_organisation"] = figure_to_array(scale_organisation_figure(layer_reports, present))
    per_layer = [k for k in LAYER_PICTURES if k in which]
    for name in present if per_layer else ():
        pictures.update(layer_images(reports[name], name, prefix=prefix, which=per_layer))
    layers = [n for n in present if "/" not in n]
    for key, (title, series) in (trend or {}).items() if "trend" in which else ():
        grid = np.array([list(series.get(n, [math.nan] * len(steps))) for n in layers], dtype=float)
        fig = trend_heatmap_figure(title, steps, layers, grid, unit=(units or {}).get(key, ""))
        pictures[f"{prefix}/trend/{key}"] = figure_to_array(fig)
    return pictures
