"""The pictures of one monitored run, drawn in parts that two drawers share.

A picture run is split into parts: the scale organisation over depth, then each layer's pictures,
then the layers x validation-steps heatmaps (:func:`picture_parts`). The worker thread draws the
parts one after the other, through the picture process (:mod:`.render_process`). At the end of a
fit the training process waits for them (:meth:`~podmonitor.reporting.publish.Publisher.close`);
while it waits, its own thread takes the parts that nobody has started and draws them in this
process (:func:`draw_here`, the same pixels), so that the wait is shared by two cores instead of
one. Whoever drew them, the pictures are put together in the order of the parts and written by the
worker alone, after every part is drawn, so what the loggers receive is what one call of
:func:`~podmonitor.reporting.figures.draw_run_pictures` gives.

Where this matters: after the last validation run of a fit, whose pictures are always drawn, and
on a CPU run that keeps every core busy, where the picture process (at the lowest priority) gets
little time during training and its pictures wait for the end of the fit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from ..engine.report import PODReport
from .figures import LAYER_PICTURES, draw_run_pictures
from .layouts import FigureCache

#: one part: (the layers it draws, the picture names it draws)
Part = tuple[list[str], tuple[str, ...]]

#: draws one part: (reports, layers, picture names) -> tag -> (H, W, 3) uint8 array
PartDrawer = Callable[[Mapping[str, PODReport], Sequence[str], tuple[str, ...]], dict[str, np.ndarray]]

_HERE = threading.Lock()  # matplotlib in this process: one drawing at a time


def picture_parts(present: Sequence[str], which: Collection[str]) -> list[Part]:
    """The parts of a picture run, in the order :func:`draw_run_pictures` draws its pictures.

    Args:
        present: the layers drawn, in depth order.
        which: the picture names asked for (from :data:`~podmonitor.reporting.figures.PICTURES`).

    Returns:
        ``[(all layers, ("scale_organisation",)), ([layer], per-layer names) for each layer,
        (all layers, ("trend",))]``, without the parts that draw nothing.
    """
    present = list(present)
    if not present:
        return []
    per_layer = tuple(k for k in LAYER_PICTURES if k in which)
    parts: list[Part] = []
    if "scale_organisation" in which:
        parts.append((present, ("scale_organisation",)))
    parts.extend(([name], per_layer) for name in present if per_layer)
    if "trend" in which:
        parts.append((present, ("trend",)))
    return parts


class PictureRun:
    """The pictures of one run, drawn part by part by the worker and, at the end, by a helper.

    Args:
        prefix: tag prefix ("pod").
        reports: layer name -> report.
        present: the layers to draw, in depth order.
        trend, steps, units: the headline series, their validation steps and the metrics' units,
            as :func:`~podmonitor.reporting.figures.draw_run_pictures` takes them.
        which: the picture names asked for.
        on_error: called with the exception when a part fails; that part's pictures are left out
            and the other parts are still drawn.
    """

    def __init__(self, prefix: str, reports: Mapping[str, PODReport], present: Sequence[str],
                 trend: Mapping[str, Any] | None, steps: Sequence[int], units: Mapping[str, str] | None,
                 which: Collection[str], on_error: Callable[[Exception], None]) -> None:
        self.prefix, self.reports, self.trend, self.steps, self.units = prefix, reports, trend, list(steps), units
        self.parts = picture_parts(present, which)
        self.on_error = on_error
        self._cond = threading.Condition()
        self._next = 0  # the first part nobody has taken
        self._results: list[dict[str, np.ndarray] | None] = [None] * len(self.parts)
        self._n_done = 0
        self._kept: FigureCache | None = None  # figures kept between the parts one help() draws

    def _take(self) -> int | None:
        with self._cond:
            if self._next >= len(self.parts):
                return None
            self._next += 1
            return self._next - 1

    def _draw(self, index: int, drawer: PartDrawer) -> None:
        layers, names = self.parts[index]
        result: dict[str, np.ndarray] = {}
        try:
            result = drawer({n: self.reports[n] for n in layers}, layers, names)
        except Exception as err:  # noqa: BLE001 - a part never costs the others
            self.on_error(err)
        finally:  # also when it raises (strict, an interrupt): :meth:`draw` never waits for it in vain
            with self._cond:
                self._results[index] = result
                self._n_done += 1
                self._cond.notify_all()

    def draw(self, drawer: PartDrawer) -> dict[str, np.ndarray]:
        """Draw the parts nobody has taken with ``drawer``, wait for those a helper is drawing,
        and return every picture, in the order of the parts."""
        while (index := self._take()) is not None:
            self._draw(index, drawer)
        with self._cond:
            self._cond.wait_for(lambda: self._n_done == len(self.parts))
        pictures: dict[str, np.ndarray] = {}
        for result in self._results:
            pictures.update(result or {})
        return pictures

    def help(self) -> int:
        """Draw the parts nobody has started, in this process (:func:`draw_here`), from a thread
        that would otherwise only wait for them; returns how many it drew."""
        drawn = 0
        self._kept = FigureCache()  # the kinds drawn for one layer are drawn again for the next
        try:
            while (index := self._take()) is not None:
                self._draw(index, self.draw_here)
                drawn += 1
        finally:
            self._kept = None
        return drawn

    def draw_here(self, reports: Mapping[str, PODReport], layers: Sequence[str],
                  names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """One part drawn in this process (a :data:`PartDrawer`)."""
        return draw_here(self.prefix, reports, layers, self.trend, self.steps, self.units, names, cache=self._kept)


def draw_here(prefix: str, reports: Mapping[str, PODReport], present: Sequence[str],
              trend: Mapping[str, Any] | None, steps: Sequence[int], units: Mapping[str, str] | None,
              which: Collection[str], cache: FigureCache | None = None) -> dict[str, np.ndarray]:
    """:func:`~podmonitor.reporting.figures.draw_run_pictures` in this process, one drawing at a
    time (matplotlib's global state is not meant for two threads at once); ``cache``: figures kept
    from the last call (:class:`~podmonitor.reporting.layouts.FigureCache`)."""
    with _HERE:
        return draw_run_pictures(prefix, reports, present, trend, steps, units, which=which, cache=cache)


__all__ = ["PictureRun", "draw_here", "picture_parts"]
