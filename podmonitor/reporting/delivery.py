"""Deliver one callback's outputs so that each sink fails on its own.

A monitor writes to several places: its JSON-lines file and one sink per logger (TensorBoard,
W&B, PNG files). :class:`Outputs` writes to each of them in turn and catches what one of them
raises (a read-only folder, a full disk, a W&B run that went away): that sink's failure becomes
one warning naming the sink and the cause (once per sink and kind of error, not at every
validation run), the message is kept in :attr:`Outputs.failures` for the run's record, and the
other sinks still get everything. A sink that could not be created is tried again at the next
delivery.

Example:
    >>> out = Outputs("PODMonitor", PODMonitorWarning, jsonl_path="logs/podmonitor/podmonitor.jsonl",
    ...               fallback_dir="logs/podmonitor/images")
    >>> out.record({"step": 100, ...})
    >>> out.send(trainer.loggers, lambda sink: sink.log_scalars(scalars, 100))
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .sinks import JSONLinesWriter, ReportSink, sink_factories


class Outputs:
    """The JSON-lines file and the logger sinks of one callback, each failing alone.

    Args:
        owner: the callback's name, first word of every warning ("PODMonitor").
        warning: the warning class to warn with.
        jsonl_path: the JSON-lines file (None: no file).
        fallback_dir: folder of the PNG sink (used when no logger takes images).
        prefix, layer_names, layout: passed to the TensorBoard sink (its custom-scalars layout).
        descriptions: ``{tag: (title, description)}`` for the TensorBoard sink's tag metadata.
        strict: re-raise a sink's error instead of warning.
    """

    def __init__(self, owner: str, warning: type[Warning], *, jsonl_path: str | os.PathLike | None,
                 fallback_dir: str | os.PathLike, prefix: str = "pod", layer_names: Sequence[str] | None = None,
                 layout: dict | None = None, strict: bool = False,
                 descriptions: Mapping[str, tuple[str, str]] | None = None) -> None:
        self.owner = owner
        self.warning = warning
        self.jsonl_path = None if jsonl_path is None else str(jsonl_path)
        self.fallback_dir = str(fallback_dir)
        self.prefix = prefix
        self.layer_names = None if layer_names is None else list(layer_names)
        self.layout = layout
        self.descriptions = dict(descriptions or {})
        self.strict = strict
        self.failures: list[str] = []  # messages since the last clear_failures()
        self._jsonl: JSONLinesWriter | None = None
        self._sinks: dict[str, ReportSink | None] | None = None
        self._makers: dict[str, Callable[[], ReportSink]] = {}
        self._warned: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------ failures
    def clear_failures(self) -> None:
        self.failures = []

    def _failed(self, label: str, what: str, err: BaseException, failures: list[str] | None = None) -> None:
        msg = (f"{self.owner}: {what} to {label} failed ({type(err).__name__}: {err}); "
               "the other outputs are unaffected")
        (self.failures if failures is None else failures).append(msg)
        if self.strict:
            raise err
        key = (label, type(err).__name__)
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, self.warning, stacklevel=3)

    # ------------------------------------------------------------------ writing
    def record(self, record: Mapping[str, Any], failures: list[str] | None = None) -> bool:
        """Append ``record`` to the JSON-lines file; False (and a warning) when that fails.
        A failure's message goes to ``failures`` (default :attr:`failures`)."""
        if self.jsonl_path is None:
            return False
        label = f"JSON lines ({self.jsonl_path})"
        try:
            if self._jsonl is None or self._jsonl.closed:
                self._jsonl = JSONLinesWriter(self.jsonl_path)
            self._jsonl.append(record)
            return True
        except Exception as err:  # noqa: BLE001 - one sink's failure must not stop the others
            self._jsonl = None
            self._failed(label, "writing the record", err, failures)
            return False

    def sinks(self, loggers: Any, failures: list[str] | None = None) -> dict[str, ReportSink]:
        """The sinks made so far (made now when missing; one that fails to be made is left out)."""
        if self._sinks is None:
            self._makers = dict(sink_factories(loggers, self.fallback_dir, prefix=self.prefix,
                                               layer_names=self.layer_names, layout=self.layout,
                                               descriptions=self.descriptions))
            self._sinks = dict.fromkeys(self._makers)
        for label, sink in list(self._sinks.items()):
            if sink is None:
                try:
                    self._sinks[label] = self._makers[label]()
                except Exception as err:  # noqa: BLE001
                    self._failed(label, "opening the sink", err, failures)
        return {label: s for label, s in self._sinks.items() if s is not None}

    def send(self, loggers: Any, write: Callable[[ReportSink], None], failures: list[str] | None = None) -> int:
        """Call ``write(sink)`` then ``sink.flush()`` for every sink, each on its own; failures'
        messages go to ``failures`` (default :attr:`failures`).

        Returns:
            The number of sinks that took everything.
        """
        ok = 0
        for label, sink in self.sinks(loggers, failures).items():
            try:
                write(sink)
                sink.flush()
                ok += 1
            except Exception as err:  # noqa: BLE001
                self._failed(label, "writing", err, failures)
        return ok

    def close(self) -> None:
        """Close the JSON-lines file and flush every sink (never raises)."""
        if self._jsonl is not None:
            try:
                self._jsonl.close()
            except Exception:  # noqa: BLE001
                pass
            self._jsonl = None
        for sink in (self._sinks or {}).values():
            if sink is None:
                continue
            try:
                sink.flush()
            except Exception:  # noqa: BLE001 - a closed logger
                pass
        self._sinks = None


__all__ = ["Outputs"]
