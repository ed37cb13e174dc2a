"""Figure layouts: built fresh, or kept from the last figure of the same kind and refilled.

Building a matplotlib figure (its axes, every axis' tick objects, a colour bar) is a large part of
what a picture costs, besides drawing it (``benchmarks/bench_pictures.py --compare`` times a
picture run with and without this module's reuse). A picture run draws the same few kinds of
figure for every layer, and the picture process draws a run at every picture run of a fit, so
:func:`~podmonitor.reporting.figures.draw_run_pictures` draws inside :func:`reusing`:

- a figure function asks :func:`layout` for its figure and axes; the first time they are built,
  later it gets the axes of the last figure of that kind and size with their data removed (lines,
  images, meshes, texts, legends) and their scales, labels and limits back to a fresh axes' own;
- :func:`colorbar` updates the kept colour bar (``Colorbar.update_normal``) instead of building
  another;
- :func:`release` (called by :func:`~podmonitor.reporting.figures.figure_to_array` once the
  pixels are copied) puts the figure back for the next one;
- a figure that took another path (:func:`spoil`, e.g. a centred message instead of data) or whose
  function raised is never handed out again.

The pixels are those of a fresh figure: ``tests/reporting/test_layouts.py`` compares them for
every kind of picture, after another report and after a flagged one. Outside :func:`reusing`
(the public figure functions, whose figures the caller keeps) every figure is fresh.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colorbar import Colorbar
from matplotlib.figure import Figure

#: margins of one axes in inches to the figure edges: (left, bottom, right, top)
Margins = tuple[float, float, float, float]

_SLOT = "_podmonitor_layout"  # the attribute of a handed-out figure that names its slot
_local = threading.local()


def new_figure(figsize: tuple[float, float] = (7.0, 4.5), dpi: float = 100.0) -> Figure:
    """A Figure with its own Agg canvas (never registered with pyplot).

    Layouts are fixed margins in inches (:func:`rect`), not constrained layout: the layout solver
    took three quarters of the rendering time, which matters when every layer is drawn at every
    analysis of a training run.
    """
    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def rect(fig: Figure, left: float, bottom: float, right: float, top: float) -> list[float]:
    """Axes rectangle (figure fractions) from margins in inches to the figure edges."""
    w, h = fig.get_size_inches()
    return [left / w, bottom / h, max(0.05, (w - left - right) / w), max(0.05, (h - bottom - top) / h)]


@dataclass
class _Slot:
    """One kept figure: its axes in the order :func:`layout` built them, and its colour bars by
    the index of their axes."""

    key: Hashable
    figure: Figure
    axes: list[Axes]
    cache: FigureCache
    colorbars: dict[int, Colorbar] = field(default_factory=dict)
    reusable: bool = True


class FigureCache:
    """The figures kept for reuse, one per kind and layout (a few MiB each: the Agg buffer)."""

    def __init__(self) -> None:
        self._slots: dict[Hashable, _Slot] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def clear(self) -> None:
        """Drop every kept figure."""
        self._slots.clear()


@contextmanager
def reusing(cache: FigureCache | None = None) -> Iterator[FigureCache]:
    """Within: the figures this thread builds through :func:`layout` come from ``cache`` (a new,
    empty one by default) and go back to it on :func:`release`.

    A figure handed out here must not outlive its use: the next figure of its kind redraws it.
    """
    cache = FigureCache() if cache is None else cache
    previous = getattr(_local, "cache", None)
    _local.cache = cache
    try:
        yield cache
    finally:
        _local.cache = previous


def layout(kind: str, figsize: tuple[float, float], margins: Sequence[Margins],
           sharey: dict[int, int] | None = None) -> tuple[Figure, list[Axes]]:
    """A figure of ``figsize`` inches with one axes per entry of ``margins``.

    Args:
        kind: the figure's kind (figures of one kind and the same size and margins share a slot).
        figsize: (width, height) in inches.
        margins: per axes, (left, bottom, right, top) margins in inches.
        sharey: axes index -> index of an earlier axes whose y axis it shares.

    Returns:
        (figure, axes). Inside :func:`reusing` possibly a kept figure, cleared of data; outside,
        always a fresh one.
    """
    sharey = sharey or {}
    key = (kind, tuple(figsize), tuple(tuple(m) for m in margins), tuple(sorted(sharey.items())))
    cache: FigureCache | None = getattr(_local, "cache", None)
    slot = cache._slots.pop(key, None) if cache is not None else None  # out of the cache while in use
    if slot is not None:
        _clear(slot)
    else:
        fig = new_figure(figsize)
        axes: list[Axes] = []
        for i, m in enumerate(margins):
            axes.append(fig.add_axes(rect(fig, *m), sharey=axes[sharey[i]] if i in sharey else None))
        if cache is None:
            return fig, axes
        slot = _Slot(key, fig, axes, cache)
    setattr(slot.figure, _SLOT, slot)
    return slot.figure, slot.axes


def _clear(slot: _Slot) -> None:
    """Remove a kept figure's data and reset its axes to what a fresh axes has (colour bar axes
    are redrawn by their :class:`Colorbar`)."""
    for i, ax in enumerate(slot.axes):
        if i in slot.colorbars:
            continue
        for artist in [*ax.lines, *ax.collections, *ax.images, *ax.texts, *ax.patches, *ax.artists]:
            artist.remove()
        legend = ax.get_legend()
        if legend is not None:
            legend.remove()
        for loc in ("center", "left", "right"):
            ax.set_title("", loc=loc)
        ax.set_prop_cycle(None)  # the next line takes the first colour again
        ax.set_xlabel("")
        ax.set_ylabel("")
        ax.set_xscale("linear")  # also the default tick locators and formatters
        ax.set_yscale("linear")
        ax.relim()
        ax.set_autoscale_on(True)


def colorbar(fig: Figure, mappable: object, cax: Axes, label: str) -> Colorbar:
    """``fig.colorbar(mappable, cax=cax, label=label)``, or the kept colour bar of ``cax`` updated
    to ``mappable`` (its norm, colour map and label)."""
    slot: _Slot | None = getattr(fig, _SLOT, None)
    index = next((i for i, ax in enumerate(slot.axes) if ax is cax), None) if slot is not None else None
    kept = slot.colorbars.get(index) if slot is not None and index is not None else None
    if kept is None:
        bar = fig.colorbar(mappable, cax=cax, label=label)
        if slot is not None and index is not None:
            slot.colorbars[index] = bar
        return bar
    kept.update_normal(mappable)
    kept.set_label(label)
    mappable.colorbar = kept  # type: ignore[attr-defined]
    return kept


def spoil(fig: Figure) -> None:
    """Never hand ``fig`` out again (it took a path the clearing does not undo, e.g. axes off)."""
    slot: _Slot | None = getattr(fig, _SLOT, None)
    if slot is not None:
        slot.reusable = False


def release(fig: Figure) -> None:
    """Put a figure from :func:`layout` back for the next figure of its kind (its pixels are
    copied: it will be redrawn); other figures are left alone."""
    slot: _Slot | None = fig.__dict__.pop(_SLOT, None)
    if slot is not None and slot.reusable:
        slot.cache._slots[slot.key] = slot


__all__ = ["FigureCache", "Margins", "colorbar", "layout", "new_figure", "rect", "release", "reusing", "spoil"]
