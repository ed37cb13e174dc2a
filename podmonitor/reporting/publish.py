"""Publish one validation run's reports: scalars, pictures, text and the JSON-lines record.

:class:`Publisher` is what :class:`~podmonitor.PODMonitor` calls on rank zero at the end of a
monitored validation run. It turns the per-layer :class:`~podmonitor.PODReport` objects into
scalars (:mod:`.scalars`), pictures (:mod:`.figures`) and one JSON-lines record, and writes them
to the sinks of the trainer's loggers (:mod:`.sinks`).
"""

from __future__ import annotations

import datetime as _dt
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..engine.report import PODReport
from .delivery import Outputs
from .figures import figure_to_array, head_allocation_figure, layer_images, scale_organisation_figure
from .scalars import layer_scalars, summary_markdown
from .sinks import read_json_lines, strict_jsonable

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

    Every record of the JSON-lines file has a ``kind``: ``"report"`` (one monitored validation
    run, with its ``stage``, "fit" or "validate", and the ``run_id`` of the monitor that wrote it)
    or ``"resume"`` (a marker: training resumed from a checkpoint; it names the steps of earlier
    records that the resumed run will measure again). A report whose step and stage are already in
    the file says so in ``repeats`` (the run id of the earlier record), so a reader never meets two
    records of one step without being told.

    Each output fails on its own (:class:`~podmonitor.reporting.delivery.Outputs`): a read-only
    folder or a failing logger costs that output only, with one warning naming it.

    Args:
        out_dir: the monitor's run directory (JSON-lines file; PNG pictures when no logger
            takes images).
        prefix: scalar and image tag prefix.
        run_id: written into every record (default: none).
        warning: the warning class of sink failures.
        strict: re-raise a sink's failure instead of warning.
    """

    def __init__(self, out_dir: str, prefix: str = "pod", *, run_id: str | None = None,
                 warning: type[Warning] = UserWarning, strict: bool = False) -> None:
        self.out_dir = out_dir
        self.prefix = prefix
        self.run_id = run_id
        self.outputs = Outputs("PODMonitor", warning, jsonl_path=os.path.join(out_dir, JSONL_NAME),
                               fallback_dir=os.path.join(out_dir, "images"), prefix=prefix, strict=strict)
        self._seen = _records_in(os.path.join(out_dir, JSONL_NAME))  # (step, stage) -> run id

    def mark_resume(self, *, step: int, previous_run_id: str | None, stage: str = "fit") -> dict[str, Any]:
        """Write the resume marker: training goes on from ``step``; records of ``stage`` beyond it
        already in the file (from the run that was resumed) will be measured again."""
        superseded = sorted(s for (s, st) in self._seen if st == stage and s > step)
        marker = {"kind": "resume", "run_id": self.run_id, "previous_run_id": previous_run_id, "stage": stage,
                  "step": int(step), "superseded_steps": superseded,
                  "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
        self.outputs.record(marker)
        return marker

    def publish(self, *, loggers: Any, reports: Mapping[str, PODReport], layer_names: Sequence[str], step: int,
                epoch: int, images: bool, skipped: Mapping[str, int], errors: Sequence[str],
                timings: Mapping[str, float], head_allocation: Any = None,
                head_redundancy: Mapping[str, Any] | None = None,
                readiness: Mapping[str, Any] | None = None, stage: str = "fit",
                extra_record: Mapping[str, Any] | None = None,
                extra_scalars: Mapping[str, float] | None = None,
                extras: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Write everything for one monitored validation run; returns the history entry.

        ``head_allocation`` (a :class:`~podmonitor.pruning.HeadAllocationAdvice`), ``head_redundancy``
        (``{layer: HeadRedundancy}``) and ``readiness`` (the record of
        :meth:`~podmonitor.pruning.AdviceReadiness.update`) come with the per-head analysis; each
        adds its part to the record, the scalars, the text, the pictures and a table
        (:func:`pruning_outputs`). ``extra_record`` adds keys to the JSON-lines record,
        ``extra_scalars`` scalars to every logger; ``extras`` (``{name: ExtraResult}``, see
        :mod:`podmonitor.extras`) add their scalars, texts, tables, pictures and a record entry
        under their name. The failures of single outputs are in the
        returned entry's ``output_failures``.
        """
        self.outputs.clear_failures()
        p = self.prefix
        record: dict[str, Any] = {
            "kind": "report",
            "run_id": self.run_id,
            "stage": stage,
            "step": step,
            "epoch": epoch,
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "skipped": dict(skipped),
            "errors": list(errors),
            "timings": dict(timings),
            "layers": {name: rep.to_dict() for name, rep in reports.items()},
        }
        if head_allocation is not None:
            record["head_allocation"] = head_allocation.to_dict()
        if head_redundancy:
            record["head_redundancy"] = {name: red.to_dict() for name, red in head_redundancy.items()}
        if readiness is not None:
            record["readiness"] = strict_jsonable(dict(readiness))
        if extra_record:
            record.update(strict_jsonable(dict(extra_record)))
        extras = dict(extras or {})
        for name, res in extras.items():
            record[name] = strict_jsonable(dict(res.record))
        previous = self._seen.get((step, stage))
        if previous is not None:
            record["repeats"] = previous
        # the record is on disk before anything else can fail
        self.outputs.record(record)
        self._seen[(step, stage)] = self.run_id or ""

        scalars: dict[str, float] = {}
        for name, rep in reports.items():
            scalars.update(layer_scalars(rep, name, prefix=p, analysis_seconds=rep.analysis_seconds))
        scalars[f"{p}/run/n_layers"] = float(len(layer_names))
        for k, v in skipped.items():
            scalars[f"{p}/run/skipped_{k}"] = float(v)
        for k, v in timings.items():
            scalars[f"{p}/run/{k}"] = float(v)
        scalars[f"{p}/run/errors"] = float(len(errors))
        scalars.update(extra_scalars or {})

        layer_reports = [reports[n] for n in layer_names if n in reports]
        present = [n for n in layer_names if n in reports]
        pictures: dict[str, Any] = {}
        if images and layer_reports:
            try:
                pictures[f"{p}/scale_organisation"] = figure_to_array(scale_organisation_figure(layer_reports, present))
                for name in present:
                    pictures.update(layer_images(reports[name], name, prefix=p))
            except Exception as err:  # noqa: BLE001 - a picture never costs the numbers
                self.outputs._failed("the pictures", "drawing", err)
                pictures = {}
        text = summary_markdown(layer_reports, present, step=step) if layer_reports else ""
        if errors:
            text += "\n\n**Problems in this run:**\n\n" + "\n".join(f"- {e}" for e in errors)
        extra = pruning_outputs(head_allocation, head_redundancy, readiness, prefix=p, images=images)
        scalars.update(extra["scalars"])
        pictures.update(extra["images"])
        texts: dict[str, str] = {}
        tables: dict[str, Any] = {}
        for res in extras.values():
            scalars.update(res.scalars)
            texts.update(res.texts)
            tables.update(res.tables)
            if images:
                pictures.update(res.images)

        self.outputs.layer_names = list(layer_names)

        def write(sink: Any) -> None:
            sink.log_scalars(scalars, step)
            if pictures:
                sink.log_images(pictures, step)
            if text:
                sink.log_text(f"{p}/summary", text, step)
            if extra["text"]:
                sink.log_text(f"{p}/head_allocation", extra["text"], step)
            if extra["table"] is not None:
                sink.log_table(f"{p}/head_allocation_table", *extra["table"], step)
            for tag, markdown in texts.items():
                sink.log_text(tag, markdown, step)
            for tag, (columns, rows) in tables.items():
                sink.log_table(tag, columns, rows, step)

        self.outputs.send(loggers, write)
        entry: dict[str, Any] = {
            "step": step,
            "epoch": epoch,
            "stage": stage,
            "skipped": dict(skipped),
            "errors": list(errors),
            "layers": {name: headline(rep) for name, rep in reports.items()},
        }
        for key in ("head_allocation", "readiness", *extras):
            if key in record:
                entry[key] = record[key]
        entry["output_failures"] = list(self.outputs.failures)
        return entry

    def close(self) -> None:
        """Close the JSON-lines file, flush the sinks."""
        self.outputs.close()


def _records_in(path: str) -> dict[tuple[int, str], str]:
    """``{(step, stage): run_id}`` of the reports already in a JSON-lines file (empty when there is
    no readable file; records of older versions without a stage count as "fit")."""
    try:
        records = read_json_lines(path) if os.path.exists(path) else []
    except Exception:  # noqa: BLE001 - an unreadable or truncated file: nothing to compare with
        return {}
    out: dict[tuple[int, str], str] = {}
    for r in records:
        if r.get("kind", "report") != "report" or not isinstance(r.get("step"), int):
            continue
        out[(int(r["step"]), str(r.get("stage") or "fit"))] = str(r.get("run_id") or "")
    return out


def pruning_outputs(head_allocation: Any, head_redundancy: Mapping[str, Any] | None,
                    readiness: Mapping[str, Any] | None, *, prefix: str = "pod", images: bool = True
                    ) -> dict[str, Any]:
    """Scalars, text, pictures and table of the head allocation advice, redundancy and readiness.

    Scalars: ``<p>/heads_now/<layer>``, ``<p>/heads_recommended/<layer>``,
    ``<p>/head_redundancy/<layer>/head_<h>`` (largest field similarity with another head),
    ``<p>/subspace_drift/<layer>``, ``<p>/h_eps_drift/<layer>``, ``<p>/run/advice_stable`` (1 / 0),
    ``<p>/run/settled_runs``. Text: the advice's markdown and the readiness line. Picture:
    ``<p>/head_allocation`` (:func:`~podmonitor.reporting.figures.head_allocation_figure`).

    Returns:
        ``{"scalars": {...}, "text": str, "images": {...}, "table": (columns, rows) or None}``.
    """
    scalars: dict[str, float] = {}
    text = ""
    pictures: dict[str, Any] = {}
    table = None
    if head_allocation is not None:
        for row in head_allocation.layers:
            scalars[f"{prefix}/heads_now/{row.layer}"] = float(row.heads_now)
            scalars[f"{prefix}/heads_recommended/{row.layer}"] = float(row.recommended)
        text = head_allocation.markdown()
        table = head_allocation.table()
        if images:
            pictures[f"{prefix}/head_allocation"] = figure_to_array(head_allocation_figure(head_allocation))
    for layer, red in (head_redundancy or {}).items():
        for h in range(red.n_heads):
            _, sim = red.most_similar(h)
            scalars[f"{prefix}/head_redundancy/{layer}/head_{h:02d}"] = float(sim)
    if readiness is not None:
        for layer, v in readiness.get("layers", {}).items():
            scalars[f"{prefix}/subspace_drift/{layer}"] = _float(v.get("subspace_drift"))
            scalars[f"{prefix}/h_eps_drift/{layer}"] = _float(v.get("h_drift"))
        scalars[f"{prefix}/run/advice_stable"] = 1.0 if readiness.get("stable") else 0.0
        scalars[f"{prefix}/run/settled_runs"] = float(readiness.get("settled_runs", 0))
        line = f"**readiness:** {readiness.get('reason', '')}"
        text = f"{text}\n{line}\n" if text else line + "\n"
    return {"scalars": scalars, "text": text, "images": pictures, "table": table}


def _float(x: Any) -> float:
    try:
        return math.nan if x is None else float(x)
    except (TypeError, ValueError):
        return math.nan

