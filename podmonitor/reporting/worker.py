"""A background worker for the monitors' outputs: the training loop does not wait for matplotlib or disk.

:class:`BackgroundWorker` runs submitted jobs one after the other on a daemon thread, in order.
The queue is bounded (``max_pending`` jobs): when the outputs fall that far behind, :meth:`submit`
waits, so memory stays bounded and nothing is dropped. :meth:`flush` waits until every job has
run (the monitors call it at the end of fitting, at teardown and on exceptions). A job's own
errors are its business (the publisher's jobs catch and warn per output); an exception that
escapes a job is kept and warned once, and the worker goes on. :attr:`BackgroundWorker.busy_s` and
:attr:`BackgroundWorker.cpu_s` add up what the jobs cost: the part of the monitor's work that no
timing inside the validation loop sees.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any


class BackgroundWorker:
    """Runs jobs on one daemon thread, in submission order.

    Args:
        name: thread name (shows in stack dumps).
        max_pending: jobs waiting at most; :meth:`submit` blocks beyond that.
        warning: the warning class of escaped errors.
    """

    def __init__(self, name: str = "podmonitor-outputs", max_pending: int = 2,
                 warning: type[Warning] = UserWarning) -> None:
        self.name = name
        self.warning = warning
        self._queue: queue.Queue[Callable[[], Any] | None] = queue.Queue(maxsize=max(1, int(max_pending)))
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []
        #: wall seconds spent running jobs, and the worker thread's CPU seconds in them
        self.busy_s = 0.0
        self.cpu_s = 0.0

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                if job is None:
                    return
                job()
            except Exception as err:  # noqa: BLE001 - the worker outlives a bad job
                msg = f"{self.name}: an output job failed ({type(err).__name__}: {err})"
                self.errors.append(msg)
                warnings.warn(msg, self.warning, stacklevel=2)
            finally:
                self.busy_s += time.perf_counter() - wall
                self.cpu_s += time.thread_time() - cpu
                self._queue.task_done()

    def submit(self, job: Callable[[], Any]) -> None:
        """Queue ``job``; waits while ``max_pending`` jobs are already queued."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._queue.put(job)

    def flush(self) -> None:
        """Wait until every submitted job has run."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._thread = None


__all__ = ["BackgroundWorker"]
