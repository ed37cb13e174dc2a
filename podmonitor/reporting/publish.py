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
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from ..engine.report import PODReport
from ..extras import ExtraResult
from .delivery import Outputs
from .figures import PICTURES, check_pictures
from .metrics import RUN_METRICS, LogPolicy, glossary_markdown, glossary_rows, registry
from .picture_run import PictureRun
from .render_process import PictureProcess, PictureProcessError, shared_picture_process
from .scalars import layer_scalars, metric_tags, summary_markdown, summary_table
from .sinks import read_json_lines, strict_jsonable
from .worker import BackgroundWorker

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
        strict: re-raise a sink's failure instead of warning (outputs then run inline).
        background: write pictures and sinks on a background worker, so the validation loop does
            not wait for matplotlib or disk (:meth:`flush` waits for them).
        pictures: the pictures a picture run draws, names from
            :data:`~podmonitor.reporting.figures.PICTURES` (default all); the extras' own pictures
            (e.g. the head allocation of ``per_head=True``) are drawn on every picture run.
        picture_process: with the background worker, draw the pictures in a child process
            (:mod:`podmonitor.reporting.render_process`: its own interpreter lock, the lowest
            priority), by default the one shared by the monitors of this process; False draws
            them on the worker thread. A child that fails is warned once and the pictures are
            drawn in this process from then on.
    """

    def __init__(self, out_dir: str, prefix: str = "pod", *, run_id: str | None = None,
                 warning: type[Warning] = UserWarning, strict: bool = False, background: bool = True,
                 pictures: Sequence[str] = PICTURES,
                 picture_process: bool | PictureProcess = True) -> None:
        self.out_dir = out_dir
        self.pictures = check_pictures(pictures)
        self.prefix = prefix
        self.run_id = run_id
        # pictures and sinks run on a worker thread (the JSON-lines record is written at once);
        # in strict mode they run inline so that an error can be raised
        self.worker = BackgroundWorker(warning=warning) if background and not strict else None
        self.warning = warning
        self.painter: PictureProcess | None = None
        self._painter_timings: dict[str, float] = {"cpu_s": 0.0}  # the child's CPU for this publisher
        self._open_runs: list[PictureRun] = []  # picture runs queued or being drawn in the background
        self._help_cpu_s = 0.0  # what the waiting thread spent drawing them (see flush and close)
        self._units: dict[str, str] | None = None  # metric key -> unit, for the heatmaps' colour bars
        if self.worker is not None and picture_process is not False:
            self.painter = shared_picture_process() if picture_process is True else picture_process
        self._policy = LogPolicy()
        self._last_top: dict[str, float] = {}
        self._glossary_sent = False
        self._steps: list[int] = []
        self._series: dict[str, dict[str, list[float]]] = {}
        self._pictured_last = True
        self._last_args: tuple[Any, ...] | None = None
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
                timings: Mapping[str, float], stage: str = "fit",
                stability: Mapping[str, Mapping[str, float]] | None = None,
                extra_record: Mapping[str, Any] | None = None,
                extra_scalars: Mapping[str, float] | None = None,
                extras: Mapping[str, ExtraResult] | None = None) -> dict[str, Any]:
        """Write everything for one monitored validation run; returns the history entry.

        ``extra_record`` adds keys to the JSON-lines record, ``extra_scalars`` scalars to every
        logger; ``extras`` (``{name: ExtraResult}``, see :mod:`podmonitor.extras`; the head
        analysis of ``per_head=True`` is one) add their scalars, texts, tables, pictures (drawn
        here, on picture runs, when given as functions), a record entry under their name and
        their ``record_top`` keys (the ``history_keys`` among them also in the history entry).
        An extra with an empty ``record`` has no entry under its name.
        The failures of single outputs are in the returned entry's ``output_failures``.
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
        extras = dict(extras or {})
        reserved = {*record, *(extra_record or {}), *extras}
        history_keys: list[str] = []
        for name, res in extras.items():
            for key, value in res.record_top.items():
                if key in reserved or key in history_keys:
                    record["errors"].append(f"extra {name!r}: record key {key!r} is taken; left out")
                    continue
                record[key] = strict_jsonable(value)
                if key in res.history_keys:
                    history_keys.append(key)
        if extra_record:
            record.update(strict_jsonable(dict(extra_record)))
        for name, res in extras.items():
            if res.record:
                record[name] = strict_jsonable(dict(res.record))
        previous = self._seen.get((step, stage))
        if previous is not None:
            record["repeats"] = previous
        # the record is on disk before anything else can fail
        self.outputs.record(record)
        self._seen[(step, stage)] = self.run_id or ""

        eps = tuple(float(e) for e in (next(iter(reports.values())).config.get("eps") if reports else None)
                    or (0.10, 0.05, 0.01))
        metrics = metric_tags(eps, p)
        if not self.outputs.descriptions:
            self.outputs.descriptions = {tag: (m.title, m.description) for tag, m in metrics.items()}
        # per layer: {layer: {tag without layer: value}}, after each metric's log rule
        per_layer: dict[str, dict[str, float]] = {}
        for name, rep in reports.items():
            extra_values = dict((stability or {}).get(name, {}))
            top = rep.dominant_scales[0] if rep.dominant_scales else None
            last = self._last_top.get(name)
            if top is not None and "/" not in name:
                extra_values["top_scale_changed"] = float(last is not None and max(top, last) / min(top, last) > 1.5)
                self._last_top[name] = float(top)
            flat = layer_scalars(rep, name, prefix=p, analysis_seconds=rep.analysis_seconds, extra=extra_values)
            suffix = f"/{name}"
            values = {tag[: -len(suffix)]: v for tag, v in flat.items()}
            chosen = self._policy.select({f"{t}{suffix}": v for t, v in values.items()},
                                         {f"{t}{suffix}": metrics[t] for t in values if t in metrics})
            per_layer[name] = {tag[: -len(suffix)]: v for tag, v in chosen.items()}
        run_values = {f"{p}/cost/{k}": float(v) for k, v in timings.items()}
        run_values.update({f"{p}/health/skipped_{k}": float(v) for k, v in skipped.items()})
        run_values[f"{p}/health/errors"] = float(len(errors))
        scalars = self._policy.select(run_values, metrics)
        scalars.update(extra_scalars or {})

        layer_reports = [reports[n] for n in layer_names if n in reports]
        present = [n for n in layer_names if n in reports]
        text = summary_markdown(layer_reports, present, step=step) if layer_reports else ""
        table = summary_table(layer_reports, present) if layer_reports else None
        if errors:
            text += "\n\n**Problems in this run:**\n\n" + "\n".join(f"- {e}" for e in errors)
        texts: dict[str, str] = {}
        tables: dict[str, Any] = {}
        for res in extras.values():
            scalars.update(res.scalars)
            texts.update(res.texts)
            tables.update(res.tables)
        glossary = None
        if not self._glossary_sent:
            glossary = (glossary_markdown(eps, p), glossary_rows([*registry(eps), *RUN_METRICS]))
            self._glossary_sent = True
        trend = self._trend(step, per_layer, layer_names)
        steps = list(self._steps)  # copies: the job may run after the next publish
        self.outputs.layer_names = list(layer_names)
        failures: list[str] = []

        picture_run = self._picture_run(reports, present, failures, trend, steps) if images and layer_reports else None

        def job() -> None:
            pictures: dict[str, Any] = {}
            if picture_run is not None:
                pictures = self._draw_pictures(picture_run)
                for res in extras.values():
                    pictures.update(self._extra_pictures(res, failures))

            def write(sink: Any) -> None:
                if glossary is not None:
                    if sink.prefers_tables:
                        sink.log_table(f"{p}/glossary", ["group", "metric", "title", "unit", "meaning"],
                                       glossary[1], step)
                    else:
                        sink.log_text(f"{p}/glossary", glossary[0], step)
                sink.log_layer_scalars(per_layer, step)
                sink.log_scalars(scalars, step)
                for key, (title, series) in trend.items():
                    sink.log_line_series(f"{p}/charts/{key}", steps, series, title, step)
                if pictures:
                    sink.log_images(pictures, step)
                if sink.prefers_tables and table is not None:
                    sink.log_table(f"{p}/summary", *table, step)
                    if errors:
                        sink.log_table(f"{p}/problems", ["problem"], [[e] for e in errors], step)
                elif text:
                    sink.log_text(f"{p}/summary", text, step)
                for tag, markdown in texts.items():
                    sink.log_text(tag, markdown, step)
                for tag, (columns, rows) in tables.items():
                    sink.log_table(tag, columns, rows, step)

            self.outputs.send(loggers, write, failures)

        if self.worker is not None:
            self.worker.submit(job)
        else:
            job()
        self._pictured_last = bool(images)
        self._last_args = (loggers, reports, list(layer_names), step, trend, steps)
        entry: dict[str, Any] = {
            "step": step,
            "epoch": epoch,
            "stage": stage,
            "skipped": dict(skipped),
            "errors": list(errors),
            "layers": {name: headline(rep) for name, rep in reports.items()},
        }
        for key in (*history_keys, *extras):
            if key in record:
                entry[key] = record[key]
        entry["output_failures"] = failures  # filled by the outputs job (in the background)
        return entry

    def _picture_run(self, reports: Mapping[str, PODReport], present: Sequence[str], failures: list[str],
                     trend: Mapping[str, Any] | None = None, steps: Sequence[int] = ()) -> PictureRun:
        """Every picture of a run, to be drawn (:class:`~podmonitor.reporting.picture_run.PictureRun`;
        :func:`~podmonitor.reporting.figures.draw_run_pictures` in parts); ``trend`` (copies of the
        headline series, see :meth:`_trend`) adds the layers x steps heatmaps. A part that fails
        costs its pictures only. Runs drawn in the background are open to :meth:`flush`'s help."""
        if self._units is None:
            self._units = {m.key: m.unit for m in registry()}
        run = PictureRun(self.prefix, reports, present, trend, steps, self._units, self.pictures,
                         lambda err: self.outputs._failed("the pictures", "drawing", err, failures))
        if self.worker is not None:
            self._open_runs.append(run)
        return run

    def _draw_pictures(self, run: PictureRun) -> dict[str, Any]:
        """Draw ``run`` (in the picture process when there is one, else in this process)."""

        def part(reports: Mapping[str, PODReport], layers: Sequence[str], names: tuple[str, ...]) -> dict[str, Any]:
            if self.painter is not None:
                try:
                    return self.painter.draw_run_pictures(run.prefix, reports, layers, run.trend, run.steps,
                                                          run.units, which=names, timings=self._painter_timings)
                except PictureProcessError as err:
                    self.painter = None
                    warnings.warn(f"PODMonitor: {err}; the pictures are drawn in the training process from now on",
                                  self.warning, stacklevel=2)
            return run.draw_here(reports, layers, names)

        try:
            return run.draw(part)
        finally:
            if run in self._open_runs:
                self._open_runs.remove(run)

    def _help(self) -> None:
        """From a thread that is about to wait for the background outputs: draw, in this process,
        the parts of the queued picture runs that nobody has started (the worker writes them)."""
        cpu = time.thread_time()
        for run in list(self._open_runs):
            run.help()
        self._help_cpu_s += time.thread_time() - cpu

    def _extra_pictures(self, result: ExtraResult, failures: list[str]) -> dict[str, Any]:
        """An extra's pictures, those given as functions drawn now (one failing costs that picture)."""
        out: dict[str, Any] = {}
        for tag, image in result.images.items():
            try:
                out[tag] = image() if callable(image) else image
            except Exception as err:  # noqa: BLE001 - a picture never costs the numbers
                self.outputs._failed(f"the picture {tag}", "drawing", err, failures)
        return out

    def publish_last_pictures(self) -> bool:
        """Draw the pictures of the last published run if it had none (the end of a fit always gets
        pictures). Returns whether pictures were queued."""
        if self._last_args is None or self._pictured_last:
            return False
        loggers, reports, layer_names, step, trend, steps = self._last_args
        present = [n for n in layer_names if n in reports]
        layer_reports = [reports[n] for n in present]
        if not layer_reports:
            return False
        failures: list[str] = []

        picture_run = self._picture_run(reports, present, failures, trend, steps)

        def job() -> None:
            pictures = self._draw_pictures(picture_run)
            if pictures:
                self.outputs.send(loggers, lambda sink: sink.log_images(pictures, step), failures)

        if self.worker is not None:
            self.worker.submit(job)
        else:
            job()
        self._pictured_last = True
        return True

    def _trend(self, step: int, per_layer: Mapping[str, Mapping[str, float]],
               layer_names: Sequence[str]) -> dict[str, tuple[str, dict[str, list[float]]]]:
        """Headline metrics over the runs so far, one line per layer (for grouped line charts)."""
        if not self._steps or self._steps[-1] != step:
            self._steps.append(step)
        n = len(self._steps)
        out: dict[str, tuple[str, dict[str, list[float]]]] = {}
        for m in registry():
            if m.group != "headline":
                continue
            tag = m.tag(self.prefix)
            series = self._series.setdefault(m.key, {})
            for name in layer_names:
                line = series.setdefault(name, [])
                line.extend([math.nan] * (n - 1 - len(line)))
                value = per_layer.get(name, {}).get(tag, math.nan)
                if len(line) == n:
                    line[-1] = value
                else:
                    line.append(value)
            out[m.key] = (m.title, {k: list(v) for k, v in series.items()})
        return out

    def flush(self) -> None:
        """Wait for the outputs queued in the background, drawing the pictures' parts that nobody
        has started meanwhile (see :mod:`~podmonitor.reporting.picture_run`)."""
        if self.worker is not None:
            self._help()
            self.worker.flush()

    def close(self) -> None:
        """Run the queued outputs (helping with their pictures as :meth:`flush` does), close the
        JSON-lines file, flush the sinks."""
        if self.worker is not None:
            self._help()
            self.worker.close()
        self.outputs.close()

    def background_seconds(self) -> dict[str, float]:
        """What the outputs run in the background have cost so far: ``{"wall_s", "cpu_s",
        "picture_cpu_s", "help_cpu_s"}`` (the worker's busy time, its thread's CPU time, the picture
        process's CPU time for this publisher's pictures, and the CPU time the thread waiting in
        :meth:`flush` or :meth:`close` spent drawing parts of them; zeros when outputs run in the
        loop)."""
        if self.worker is None:
            return {"wall_s": 0.0, "cpu_s": 0.0, "picture_cpu_s": 0.0, "help_cpu_s": 0.0}
        return {"wall_s": self.worker.busy_s, "cpu_s": self.worker.cpu_s,
                "picture_cpu_s": self._painter_timings["cpu_s"], "help_cpu_s": self._help_cpu_s}


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
