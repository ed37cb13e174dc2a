"""A background worker for the monitors' outputs: the training loop does not wait for matplotlib or disk.

:class:`BackgroundWorker` runs submitted jobs one after the other on a daemon thread, in order.
The queue is bounded (``max_pending`` jobs): when the outputs fall that far behind, :meth:`submit`
waits, so memory stays bounded and nothing is dropped. :meth:`flush` waits until every job has
run (the monitors call it at the end of fitting, at teardown and on exceptions). A job's own
errors are its business (the publisher's jobs catch and warn per output); an exception that
escapes a job is kept and warned once, and the worker goes on. :attr:`BackgroundWorker.busy_s` and
:attr:`BackgroundWorker.cpu_s` add up what the jobs cost: the part of the monitor's work that no
timing inside the validation loop sees.

On Linux the worker thread lowers its own scheduling priority (``niceness``, default 19, the
lowest; the rest of the process keeps its own): where training keeps every core busy (a CPU run on
all cores), work at the normal priority takes a core from the training's threads. The pictures
themselves are drawn in a child process (:mod:`podmonitor.reporting.render_process`), because a
thread of the training process also competes for its interpreter lock, whatever its priority
(``benchmarks/bench_background.py`` measures both). When the training waits for the worker
(:meth:`flush`, or :meth:`submit` with a full queue) the worker has the CPU to itself.
"""

from __future__ import annotations

import os
import queue
import sys
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
        niceness: the worker thread's scheduling niceness on Linux (0 to 19: 19 runs it when the
            cores have nothing else to do; None or 0 keeps the caller's). It can only be raised
            above the process's own, which it never changes. Ignored on other systems.
    """

    def __init__(self, name: str = "podmonitor-outputs", max_pending: int = 2,
                 warning: type[Warning] = UserWarning, niceness: int | None = 19) -> None:
        if niceness is not None and not 0 <= int(niceness) <= 19:
            raise ValueError(f"niceness must be None or between 0 and 19, got {niceness!r}")
        self.name = name
        self.warning = warning
        self.niceness = None if niceness is None else int(niceness)
        #: the niceness the worker thread ran at (None until it started, or where not set)
        self.thread_niceness: int | None = None
        self._queue: queue.Queue[Callable[[], Any] | None] = queue.Queue(maxsize=max(1, int(max_pending)))
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []
        #: wall seconds spent running jobs, and the worker thread's CPU seconds in them
        self.busy_s = 0.0
        self.cpu_s = 0.0

    def _lower_priority(self) -> None:
        """Raise this (the worker) thread's niceness to :attr:`niceness`, on Linux; a failure
        leaves the priority as it was (the outputs are still written)."""
        if not self.niceness or not sys.platform.startswith("linux") or not hasattr(os, "setpriority"):
            return
        # on Linux, PRIO_PROCESS with a thread id sets that one thread's niceness
        tid = threading.get_native_id()
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < self.niceness:
                os.setpriority(os.PRIO_PROCESS, tid, self.niceness)
            self.thread_niceness = os.getpriority(os.PRIO_PROCESS, tid)
        except OSError:  # (a sandbox that forbids it): keep the priority
            self.thread_niceness = None

    def _run(self) -> None:
        self._lower_priority()
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
