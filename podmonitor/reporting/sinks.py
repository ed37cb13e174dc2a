"""Where reports go: TensorBoard, Weights & Biases, PNG files, JSON lines.

A :class:`ReportSink` takes scalars (``{"pod/headline/t_spec/layer_00": 0.8, ...}``, see
:func:`~podmonitor.reporting.scalars.layer_scalars`), images (``{tag: (H, W, 3) uint8}``, see
:func:`~podmonitor.reporting.figures.layer_images`) and markdown text, each with an explicit step.
:func:`sinks_for_loggers` picks the sinks that match a Lightning trainer's loggers.
:class:`JSONLinesWriter` is the durable record of every analysis (one strict-JSON line each).

Sinks do not own the writer / run they are given unless told so (``owns_writer`` /
``owns_run``): :meth:`ReportSink.close` then only flushes, and the logger that created the
writer closes it.

Example:
    >>> from lightning.pytorch.loggers import TensorBoardLogger
    >>> logger = TensorBoardLogger("logs")
    >>> (sink,) = sinks_for_loggers([logger], fallback_dir="logs/podmonitor")
    >>> sink.log_scalars(layer_scalars(report, "layer_00"), step=100)
    >>> sink.log_images(layer_images(report, "layer_00"), step=100)
"""

from __future__ import annotations

import csv
import html
import json
import math
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .scalars import custom_scalars_layout

__all__ = [
    "JSONLinesWriter",
    "PNGSink",
    "ReportSink",
    "TensorBoardSink",
    "WandbSink",
    "read_json_lines",
    "safe_filename",
    "sink_factories",
    "sinks_for_loggers",
    "strict_jsonable",
]


def _check_images(images: Mapping[str, np.ndarray]) -> None:
    for tag, img in images.items():
        if not isinstance(img, np.ndarray) or img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
            shape = getattr(img, "shape", None)
            dtype = getattr(img, "dtype", type(img).__name__)
            raise ValueError(f"image {tag!r} must be an (H, W, 3) uint8 numpy array, got shape {shape}, "
                             f"dtype {dtype}")


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    return int(step)


class ReportSink(ABC):
    """Destination of podmonitor's scalars, images and text, each logged at an explicit step."""

    @abstractmethod
    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        """Log ``{tag: value}`` at ``step`` (NaN and inf are passed through)."""

    def log_layer_scalars(self, per_layer: Mapping[str, Mapping[str, float]], step: int) -> None:
        """Log ``{layer: {tag: value}}`` at ``step``. Default: the flat tags ``<tag>/<layer>`` through
        :meth:`log_scalars`; TensorBoard writes each layer as a run of its own instead."""
        flat = {f"{tag}/{layer}": v for layer, values in per_layer.items() for tag, v in values.items()}
        if flat:
            self.log_scalars(flat, step)

    @abstractmethod
    def log_images(self, images: Mapping[str, np.ndarray], step: int) -> None:
        """Log ``{tag: (H, W, 3) uint8 RGB array}`` at ``step``.

        Raises:
            ValueError: an image is not an (H, W, 3) uint8 array.
        """

    @abstractmethod
    def log_text(self, tag: str, markdown: str, step: int) -> None:
        """Log a markdown text under ``tag`` at ``step``."""

    #: whether the sink shows tables better than markdown (W&B): the publisher then sends the
    #: summary as a table instead of text
    prefers_tables: bool = False

    def log_table(self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:  # noqa: B027
        """Log a table (e.g. the head allocation advice). Default: nothing (the same content is
        logged as markdown text); W&B logs a ``wandb.Table``, the PNG sink a CSV file."""

    def log_line_series(self, tag: str, steps: Sequence[int], series: Mapping[str, Sequence[float]],  # noqa: B027
                        title: str, step: int) -> None:
        """Log one chart of several lines (``{line name: values at steps}``), e.g. one metric over
        all layers. Default: nothing (TensorBoard has its layers-as-runs cards); W&B logs a
        ``wandb.plot.line_series``."""

    def flush(self) -> None:  # noqa: B027 - optional hook
        """Push buffered data to disk / the service."""

    def close(self) -> None:
        """Flush; release what the sink owns (nothing it was merely given)."""
        self.flush()


# --------------------------------------------------------------------------------------------
# TensorBoard


class TensorBoardSink(ReportSink):
    """Writes to a TensorBoard ``SummaryWriter`` (``TensorBoardLogger.experiment``).

    Per-layer scalars (:meth:`log_layer_scalars`) go to one writer per layer, in
    ``<log_dir>/podmonitor_layers/<layer>``: TensorBoard shows each layer as a run of its own, with
    its own colour and a legend entry, so one card of ``pod/headline/t_spec`` holds every layer.
    The first value of each tag carries the metric's title and description as summary metadata
    (shown by TensorBoard under the card; ``descriptions``). On the first write it adds a
    custom-scalars layout (:func:`~podmonitor.reporting.scalars.custom_scalars_layout`).

    Args:
        writer: ``torch.utils.tensorboard.SummaryWriter`` (any object with ``add_scalar``,
            ``add_image``, ``add_text``, ``add_custom_scalars``, ``flush``; one without ``log_dir``
            gets the per-layer scalars as flat ``<tag>/<layer>`` tags instead).
        prefix: the prefix of the scalar tags (for the layout).
        layer_names: unused, kept for compatibility.
        layout: a custom-scalars layout to write instead of the default one; ``{}`` writes none.
        owns_writer: close the writer in :meth:`close` (default False: the logger owns it).
        descriptions: ``{tag: (title, description)}`` written once per tag and writer.
        layer_dir: folder of the per-layer writers under the writer's ``log_dir``.
    """

    def __init__(self, writer: Any, *, prefix: str = "pod", layer_names: Sequence[str] | None = None,
                 layout: dict | None = None, owns_writer: bool = False,
                 descriptions: Mapping[str, tuple[str, str]] | None = None,
                 layer_dir: str = "podmonitor_layers") -> None:
        self.writer = writer
        self.prefix = prefix
        self.layer_names = list(layer_names) if layer_names is not None else None
        self._layout = layout
        self._layout_written = False
        self.owns_writer = owns_writer
        self.descriptions = dict(descriptions or {})
        self.layer_dir = layer_dir
        self._layer_writers: dict[str, Any] = {}
        self._described: set[tuple[int, str]] = set()

    def _write_layout(self) -> None:
        self._layout_written = True
        layout = self._layout
        if layout is None:
            layout = custom_scalars_layout(self.prefix, extra_charts={"validation loss": ["^val_loss$"]})
        if layout:
            self.writer.add_custom_scalars(layout)

    def _scalar(self, writer: Any, tag: str, value: float, step: int) -> None:
        """One scalar event. A tag with a description is written as a "new style" scalar summary (a
        tensor with the scalars plugin's metadata): TensorBoard's default (fast) loader reads a tag's
        title and description only from such events; the first event of each tag and writer carries
        them. Other tags are plain scalars."""
        file_writer = getattr(writer, "_get_file_writer", None)
        described = self.descriptions.get(tag)
        if file_writer is None or described is None:
            writer.add_scalar(tag, float(value), global_step=step)
            return
        from torch.utils.tensorboard.summary import scalar

        summary = scalar(tag, float(value), new_style=True)
        key = (id(writer), tag)
        if key not in self._described:
            summary.value[0].metadata.display_name = described[0]
            summary.value[0].metadata.summary_description = described[1]
            self._described.add(key)
        file_writer().add_summary(summary, step)

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        step = _check_step(step)
        if not self._layout_written:
            self._write_layout()
        for tag, value in scalars.items():
            self._scalar(self.writer, tag, value, step)

    def _writer_for(self, layer: str) -> Any:
        if layer not in self._layer_writers:
            from torch.utils.tensorboard import SummaryWriter

            self._layer_writers[layer] = SummaryWriter(os.path.join(self.writer.log_dir, self.layer_dir, layer))
        return self._layer_writers[layer]

    def log_layer_scalars(self, per_layer: Mapping[str, Mapping[str, float]], step: int) -> None:
        step = _check_step(step)
        if not getattr(self.writer, "log_dir", None):
            super().log_layer_scalars(per_layer, step)
            return
        if not self._layout_written:
            self._write_layout()
        for layer, values in per_layer.items():
            w = self._writer_for(layer)
            for tag, value in values.items():
                self._scalar(w, tag, value, step)

    def log_images(self, images: Mapping[str, np.ndarray], step: int) -> None:
        step = _check_step(step)
        _check_images(images)
        for tag, img in images.items():
            self.writer.add_image(tag, img, global_step=step, dataformats="HWC")

    def log_text(self, tag: str, markdown: str, step: int) -> None:
        self.writer.add_text(tag, markdown, global_step=_check_step(step))

    def flush(self) -> None:
        self.writer.flush()
        for w in self._layer_writers.values():
            w.flush()

    def close(self) -> None:
        self.flush()
        for w in self._layer_writers.values():
            w.close()
        self._layer_writers = {}
        if self.owns_writer:
            self.writer.close()


# --------------------------------------------------------------------------------------------
# Weights & Biases


class WandbSink(ReportSink):
    """Writes to a W&B run (``WandbLogger.experiment`` or the result of ``wandb.init``).

    Steps: W&B keeps one internal step per run that only moves forward; ``run.log(..., step=s)``
    with ``s`` below it is dropped with a warning. Lightning's ``WandbLogger`` logs without
    ``step=`` (every call advances the internal step) and puts the trainer step in a metric
    ``trainer/global_step``, so passing ``step=trainer.global_step`` here would fight it:
    one side's rows would be dropped. Logging with ``commit=False`` instead attaches our values to
    Lightning's next row, which may carry another step or never come. The robust option, used
    here: never pass ``step=`` and never ``commit=False``; every call is its own row carrying a
    step metric ``pod/step`` (``step_metric``), and each of our keys is declared once with
    ``run.define_metric(key, step_metric="pod/step")``. Explicitly defined keys take precedence
    over a glob such as Lightning's ``define_metric("*", step_metric="trainer/global_step")``, so
    W&B plots podmonitor's values against ``pod/step`` (the trainer step the callback passes),
    whatever else logs to the run, in any order, and steps may repeat or go back (a resumed run).

    Text is logged as ``wandb.Html`` (preformatted), W&B having no markdown media type.

    Args:
        run: a ``wandb`` run (``wandb.sdk.wandb_run.Run``; Lightning's rank-zero dummy also works).
        step_metric: the key that carries the step.
        owns_run: call ``run.finish()`` in :meth:`close` (default False: the logger owns it).
    """

    prefers_tables = True

    def __init__(self, run: Any, *, step_metric: str = "pod/step", owns_run: bool = False) -> None:
        self.run = run
        self.step_metric = step_metric
        self.owns_run = owns_run
        self._defined: set[str] = set()

    def _define(self, keys: Iterable[str], summary: str | None = None) -> None:
        define = getattr(self.run, "define_metric", None)
        if define is None:
            return
        if self.step_metric not in self._defined:
            define(self.step_metric)
            self._defined.add(self.step_metric)
        for key in keys:
            if key not in self._defined:
                if summary is None:
                    define(key, step_metric=self.step_metric)
                else:
                    define(key, step_metric=self.step_metric, summary=summary)
                self._defined.add(key)

    def _log(self, payload: dict[str, Any], step: int, summary: str | None = None) -> None:
        if not payload:
            return
        if self.step_metric in payload:
            raise ValueError(f"{self.step_metric!r} is the step metric of this sink, not a loggable key")
        self._define(payload.keys(), summary)
        self.run.log({self.step_metric: step, **payload})

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        # the run summary of each scalar is its last value (the latest state of the layer)
        self._log({k: float(v) for k, v in scalars.items()}, _check_step(step), summary="last")

    def log_images(self, images: Mapping[str, np.ndarray], step: int) -> None:
        step = _check_step(step)
        _check_images(images)
        import wandb  # optional dependency: imported only when a W&B sink is used

        self._log({tag: wandb.Image(img) for tag, img in images.items()}, step)

    def log_text(self, tag: str, markdown: str, step: int) -> None:
        import wandb

        self._log({tag: wandb.Html(f"<pre>{html.escape(markdown)}</pre>")}, _check_step(step))

    def log_table(self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        import wandb

        data = [[_table_cell(v) for v in row] for row in rows]
        self._log({tag: wandb.Table(columns=list(columns), data=data)}, _check_step(step))

    def log_line_series(self, tag: str, steps: Sequence[int], series: Mapping[str, Sequence[float]], title: str,
                        step: int) -> None:
        import wandb

        keys = list(series)
        ys = [[_table_cell(float(v)) if v is not None else None for v in series[k]] for k in keys]
        chart = wandb.plot.line_series(xs=[int(s) for s in steps], ys=ys, keys=keys, title=title, xname="step")
        self._log({tag: chart}, _check_step(step))

    def close(self) -> None:
        if self.owns_run:
            self.run.finish()


def _table_cell(v: Any) -> Any:
    """A table cell W&B accepts: numbers, strings, bools; None for missing / non-finite values."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    return str(v)


# --------------------------------------------------------------------------------------------
# PNG files


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_filename(tag: str, max_len: int = 200) -> str:
    """A tag as a file name: runs of characters outside ``[A-Za-z0-9._-]`` become "_".

    ``"pod/scalogram/layer_00"`` -> ``"pod_scalogram_layer_00"``. Leading dots are removed (no
    hidden files, no ``..``); an empty result becomes ``"untitled"``. Distinct tags can map to
    one name (``"a/b"`` and ``"a_b"``).
    """
    name = _UNSAFE.sub("_", str(tag)).lstrip(".")[:max_len]
    return name or "untitled"


class PNGSink(ReportSink):
    """Plain files, for runs without TensorBoard or W&B.

    Layout::

        <directory>/scalars.csv            step,tag,value (appended; header written once)
        <directory>/<step>/<tag>.png       one image per tag and step (tag via safe_filename)
        <directory>/<step>/<tag>.md        text
        <directory>/<step>/<tag>.csv       tables (:meth:`log_table`)

    Every write is flushed and fsynced at once: nothing is lost if training dies later.

    Args:
        directory: created if missing, at the first write.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)

    @property
    def scalars_path(self) -> Path:
        return self.directory / "scalars.csv"

    def _step_dir(self, step: int) -> Path:
        d = self.directory / str(step)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        step = _check_step(step)
        path = self.scalars_path
        self.directory.mkdir(parents=True, exist_ok=True)
        new = not path.exists() or path.stat().st_size == 0
        with open(path, "a", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["step", "tag", "value"])
            for tag, value in scalars.items():
                w.writerow([step, tag, repr(float(value))])
            f.flush()
            os.fsync(f.fileno())

    def log_images(self, images: Mapping[str, np.ndarray], step: int) -> None:
        step = _check_step(step)
        _check_images(images)
        from matplotlib.image import imsave  # no pyplot, no backend change

        d = self._step_dir(step) if images else None
        for tag, img in images.items():
            imsave(d / f"{safe_filename(tag)}.png", img, format="png")

    def log_table(self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        path = self._step_dir(_check_step(step)) / f"{safe_filename(tag)}.csv"
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(list(columns))
            w.writerows([["" if v is None else v for v in row] for row in rows])
            f.flush()
            os.fsync(f.fileno())

    def log_text(self, tag: str, markdown: str, step: int) -> None:
        path = self._step_dir(_check_step(step)) / f"{safe_filename(tag)}.md"
        with open(path, "w", encoding="utf-8") as f:
            f.write(markdown)
            f.flush()
            os.fsync(f.fileno())


# --------------------------------------------------------------------------------------------
# JSON lines


def strict_jsonable(x: Any) -> Any:
    """``x`` with every non-finite float as None, numpy / torch values as Python ones.

    Objects with a ``to_dict()`` method (a :class:`~podmonitor.PODReport`) are converted with it.
    Other objects are left for ``json.dumps`` to reject.
    """
    if x is None or isinstance(x, (str, bool, int)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, np.generic):
        return strict_jsonable(x.item())
    if isinstance(x, np.ndarray):
        return strict_jsonable(x.tolist())
    if hasattr(x, "detach") and hasattr(x, "tolist"):  # torch.Tensor
        return strict_jsonable(x.detach().cpu().tolist())
    if isinstance(x, Mapping):
        return {str(k): strict_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        if all(type(v) is float for v in x):  # a row of numbers (e.g. a report's arrays): no call per entry
            return [v if math.isfinite(v) else None for v in x]
        return [strict_jsonable(v) for v in x]
    if callable(getattr(x, "to_dict", None)):
        return strict_jsonable(x.to_dict())
    return x


class JSONLinesWriter:
    """Appends one strict-JSON object per line (RFC 8259: no NaN / Infinity) to ``path``.

    Each :meth:`append` writes a complete line, flushes and ``os.fsync``s it before returning, so
    the file holds every record appended so far even if the process dies later. Non-finite floats
    become ``null`` (as in ``PODReport.to_dict()``).

    Example:
        >>> with JSONLinesWriter("logs/pod.jsonl") as out:
        ...     out.append({"step": 100, "layer": "layer_00", "report": report.to_dict()})

    Args:
        path: the file (parent folders are created; an existing file is appended to).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def append(self, record: Mapping[str, Any]) -> None:
        """Write ``record`` as one line, then flush and fsync.

        Raises:
            TypeError: the record holds a value JSON cannot represent.
            ValueError: the writer is closed.
        """
        if self._file.closed:
            raise ValueError(f"JSONLinesWriter({str(self.path)!r}) is closed")
        line = json.dumps(strict_jsonable(record), allow_nan=False, separators=(",", ":"))
        self._file.write(line + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> JSONLinesWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name}")


def read_json_lines(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a file written by :class:`JSONLinesWriter`, rejecting NaN / Infinity (strict JSON)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line, parse_constant=_reject_constant))
    return out


# --------------------------------------------------------------------------------------------
# choosing sinks


def _is_lightning_logger(logger: Any, class_name: str) -> bool:
    """Whether ``logger`` is (a subclass of) Lightning's ``class_name`` logger.

    Checked by class name and module over the MRO, so neither ``lightning`` nor
    ``pytorch_lightning`` (nor wandb) is imported here; covers ``lightning.pytorch``,
    ``lightning.fabric`` and ``pytorch_lightning``.
    """
    for cls in type(logger).__mro__:
        module = getattr(cls, "__module__", "") or ""
        if cls.__name__ == class_name and module.split(".")[0] in ("lightning", "pytorch_lightning",
                                                                   "lightning_fabric"):
            return True
    return False


def sink_factories(loggers: Any, fallback_dir: str | os.PathLike, *, prefix: str = "pod",
                   layer_names: Sequence[str] | None = None, layout: dict | None = None,
                   descriptions: Mapping[str, tuple[str, str]] | None = None
                   ) -> list[tuple[str, Callable[[], ReportSink]]]:
    """``[(label, make_sink), ...]`` for a trainer's loggers, nothing created yet.

    ``TensorBoardLogger`` -> :class:`TensorBoardSink` of its ``experiment`` (label "TensorBoard");
    ``WandbLogger`` -> :class:`WandbSink` of its ``experiment`` ("W&B"); any other logger
    (CSVLogger, MLflow, ...) or no logger at all -> one :class:`PNGSink` in ``fallback_dir`` ("PNG
    files (<dir>)", at most one, however many such loggers). Calling ``make_sink`` accesses the
    logger's ``experiment``, which creates the writer / run if the logger has not yet done so; it
    may raise (a read-only folder), which is why each sink is made on its own
    (:class:`~podmonitor.reporting.delivery.Outputs`).

    Args:
        loggers: a list of loggers, a single logger, or None.
        fallback_dir: folder of the PNG sink.
        prefix, layer_names, layout, descriptions: passed to :class:`TensorBoardSink` (its custom-scalars
            layout and tag descriptions).
    """
    if loggers is None:
        loggers = []
    elif not isinstance(loggers, (list, tuple)):
        loggers = [loggers]
    out: list[tuple[str, Callable[[], ReportSink]]] = []
    step_metric = f"{prefix}/step" if prefix else "pod/step"
    need_png = not loggers
    for i, logger in enumerate(loggers):
        label = "TensorBoard" if i == 0 else f"TensorBoard ({i})"
        if _is_lightning_logger(logger, "TensorBoardLogger"):
            out.append((label, lambda lg=logger: TensorBoardSink(lg.experiment, prefix=prefix, layer_names=layer_names,
                                                                 layout=layout, descriptions=descriptions)))
        elif _is_lightning_logger(logger, "WandbLogger"):
            out.append(("W&B" if i == 0 else f"W&B ({i})",
                        lambda lg=logger: WandbSink(lg.experiment, step_metric=step_metric)))
        else:
            need_png = True
    if need_png:
        out.append((f"PNG files ({fallback_dir})", lambda: PNGSink(fallback_dir)))
    return out


def sinks_for_loggers(loggers: Any, fallback_dir: str | os.PathLike, *, prefix: str = "pod",
                      layer_names: Sequence[str] | None = None) -> list[ReportSink]:
    """The sinks for a trainer's loggers (``trainer.loggers``), all created now.

    See :func:`sink_factories` for which logger gives which sink.

    Raises:
        Exception: whatever creating a sink raises (a read-only ``fallback_dir``, ...).
    """
    return [make() for _, make in sink_factories(loggers, fallback_dir, prefix=prefix, layer_names=layer_names)]
