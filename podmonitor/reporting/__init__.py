"""Reporting: figures, dashboard scalars and sinks for :class:`~podmonitor.PODReport` objects.

Data flows one way: capture -> accumulate -> analyse -> report. This package takes finished
reports and writes them out; it holds no Lightning callback code.

- :mod:`.figures`: matplotlib figures (Agg canvas, no pyplot) and their RGB arrays.
- :mod:`.scalars`: per-layer metrics named ``"pod/<metric>/<layer>"`` and TensorBoard's
  custom-scalars layout.
- :mod:`.sinks`: TensorBoard, W&B, PNG and JSON-lines outputs; :func:`sinks_for_loggers`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:
    from .figures import (
        coherency_figure,
        figure_to_array,
        layer_images,
        modes_figure,
        scale_organisation_figure,
        scalogram_figure,
        spectrum_figure,
    )
    from .scalars import custom_scalars_layout, layer_scalars, metric_names, summary_markdown
    from .sinks import (
        JSONLinesWriter,
        PNGSink,
        ReportSink,
        TensorBoardSink,
        WandbSink,
        read_json_lines,
        sinks_for_loggers,
    )

#: Where each public name lives; a module is imported when one of its names is first asked for
#: (the picture process imports ``.figures`` alone, without torch).
_LAZY = {
    **dict.fromkeys(("coherency_figure", "figure_to_array", "layer_images", "modes_figure",
                     "scale_organisation_figure", "scalogram_figure", "spectrum_figure"), "figures"),
    **dict.fromkeys(("custom_scalars_layout", "layer_scalars", "metric_names", "summary_markdown"), "scalars"),
    **dict.fromkeys(("JSONLinesWriter", "PNGSink", "ReportSink", "TensorBoardSink", "WandbSink",
                     "read_json_lines", "sinks_for_loggers"), "sinks"),
}

__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())

__all__ = [
    "JSONLinesWriter",
    "PNGSink",
    "ReportSink",
    "TensorBoardSink",
    "WandbSink",
    "coherency_figure",
    "custom_scalars_layout",
    "figure_to_array",
    "layer_images",
    "layer_scalars",
    "metric_names",
    "modes_figure",
    "read_json_lines",
    "scale_organisation_figure",
    "scalogram_figure",
    "sinks_for_loggers",
    "spectrum_figure",
    "summary_markdown",
]
