"""Publish one validation run's reports: scalars, pictures, text and the JSON-lines record.

:class:`Publisher` is what :class:`~podmonitor.PODMonitor` calls on rank zero at the end of a
monitored validation run. It turns the per-layer :class:`~podmonitor.PODReport` objects into
scalars (:mod:`.scalars`), pictures (:mod:`.figures`) and one JSON-lines record, and writes them
to the sinks of the trainer's loggers (:mod:`.sinks`).
"""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..engine.report import PODReport
from .figures import figure_to_array, layer_images, scale_organisation_figure
from .scalars import layer_scalars, summary_markdown
from .sinks import JSONLinesWriter, ReportSink, sinks_for_loggers

JSONL_NAME = "podmonitor.jsonl"


def headline(report: PODReport) -> dict[str, Any]:
    """The few numbers of a layer kept in the callback's history (checkpointed)."""
    return {
        "status": report.status,
        "n_snapshots": report.n_snapshots,
        "dominant_scales": list(report.dominant_scales),
        "scale_centroid": report.scale_centroid,
        "t_spec": report.t_spec,
        "beta": report.beta,
        "r2": report.r2,
        "effective_rank": {str(k): v for k, v in report.effective_rank.items()},
        "mean_attention_distance": report.mean_attention_distance,
        "entropy": report.entropy,
    }


class Publisher:
    """Writes reports to the trainer's loggers and to ``<out_dir>/podmonitor.jsonl``.

    Args:
        out_dir: the monitor's run directory (JSON-lines file; PNG pictures when no logger
            takes images).
        prefix: scalar and image tag prefix.
    """

    def __init__(self, out_dir: str, prefix: str = "pod") -> None:
        self.out_dir = out_dir
        self.prefix = prefix
        self.jsonl = JSONLinesWriter(os.path.join(out_dir, JSONL_NAME))
        self._sinks: list[ReportSink] | None = None

    def sinks(self, loggers: Any, layer_names: Sequence[str]) -> list[ReportSink]:
        if self._sinks is None:
            self._sinks = sinks_for_loggers(loggers, os.path.join(self.out_dir, "images"),
                                            prefix=self.prefix, layer_names=list(layer_names))
        return self._sinks

    def publish(self, *, loggers: Any, reports: Mapping[str, PODReport], layer_names: Sequence[str], step: int,
                epoch: int, images: bool, skipped: Mapping[str, int], errors: Sequence[str],
                timings: Mapping[str, float]) -> dict[str, Any]:
        """Write everything for one monitored validation run; returns the history entry."""
        p = self.prefix
        record: dict[str, Any] = {
            "step": step,
            "epoch": epoch,
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "skipped": dict(skipped),
            "errors": list(errors),
            "timings": dict(timings),
            "layers": {name: rep.to_dict() for name, rep in reports.items()},
        }
        # the record is on disk before anything else can fail
        self.jsonl.append(record)

        scalars: dict[str, float] = {}
        for name, rep in reports.items():
            scalars.update(layer_scalars(rep, name, prefix=p, analysis_seconds=rep.analysis_seconds))
        scalars[f"{p}/run/n_layers"] = float(len(layer_names))
        for k, v in skipped.items():
            scalars[f"{p}/run/skipped_{k}"] = float(v)
        for k, v in timings.items():
            scalars[f"{p}/run/{k}"] = float(v)
        scalars[f"{p}/run/errors"] = float(len(errors))

        layer_reports = [reports[n] for n in layer_names if n in reports]
        present = [n for n in layer_names if n in reports]
        pictures: dict[str, Any] = {}
        if images and layer_reports:
            pictures[f"{p}/scale_organisation"] = figure_to_array(scale_organisation_figure(layer_reports, present))
            for name in present:
                pictures.update(layer_images(reports[name], name, prefix=p))
        text = summary_markdown(layer_reports, present, step=step) if layer_reports else ""
        if errors:
            text += "\n\n**Problems in this run:**\n\n" + "\n".join(f"- {e}" for e in errors)

        for sink in self.sinks(loggers, layer_names):
            sink.log_scalars(scalars, step)
            if pictures:
                sink.log_images(pictures, step)
            if text:
                sink.log_text(f"{p}/summary", text, step)
            sink.flush()
        return {
            "step": step,
            "epoch": epoch,
            "skipped": dict(skipped),
            "errors": list(errors),
            "layers": {name: headline(rep) for name, rep in reports.items()},
        }

