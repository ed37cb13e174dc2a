"""The background worker that keeps pictures and sinks off the training loop."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from podmonitor.reporting.worker import BackgroundWorker


def test_jobs_run_in_order_off_the_calling_thread_and_flush_waits_for_them():
    worker = BackgroundWorker(max_pending=2)
    seen: list[tuple[int, str]] = []
    for i in range(5):  # more than max_pending: submit waits, nothing is dropped
        worker.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
    worker.flush()
    assert [i for i, _ in seen] == list(range(5))
    assert {name for _, name in seen} == {"podmonitor-outputs"}
    worker.close()


def test_an_escaped_error_is_warned_and_kept_and_the_next_jobs_still_run():
    worker = BackgroundWorker()
    done: list[int] = []

    def bad() -> None:
        raise OSError("disk full")

    with pytest.warns(UserWarning, match="an output job failed \\(OSError: disk full\\)"):
        worker.submit(bad)
        worker.submit(lambda: done.append(1))
        worker.close()
    assert done == [1] and len(worker.errors) == 1


def test_busy_and_cpu_seconds_add_up_what_the_jobs_cost():
    worker = BackgroundWorker()
    assert worker.busy_s == worker.cpu_s == 0.0

    def spin(cpu: float) -> None:  # burns at least `cpu` seconds of this thread's CPU time
        start = time.thread_time()
        while time.thread_time() - start < cpu:
            pass

    worker.submit(lambda: time.sleep(0.2))  # waits, uses (almost) no CPU
    worker.flush()
    assert worker.busy_s >= 0.2
    sleeping_cpu = worker.cpu_s
    assert sleeping_cpu < worker.busy_s
    worker.submit(lambda: spin(0.05))
    worker.close()
    assert worker.cpu_s - sleeping_cpu >= 0.05


def _nice_from_proc(tid: int) -> int:
    """A thread's niceness as the kernel reports it (/proc/<pid>/task/<tid>/stat, field 19)."""
    stat = open(f"/proc/{os.getpid()}/task/{tid}/stat").read()
    return int(stat[stat.rindex(")") + 2:].split()[16])  # fields after "(comm)" start at field 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_the_worker_thread_runs_at_the_lowest_priority_and_leaves_the_process_alone():
    main_before = _nice_from_proc(threading.get_native_id())
    worker = BackgroundWorker()  # defaults, as the publisher builds it
    seen: list[int] = []
    worker.submit(lambda: seen.append(_nice_from_proc(threading.get_native_id())))
    worker.close()
    assert seen == [19] and worker.thread_niceness == 19
    assert _nice_from_proc(threading.get_native_id()) == main_before  # the training's threads keep theirs
    kept = BackgroundWorker(niceness=None)
    kept.submit(lambda: seen.append(_nice_from_proc(threading.get_native_id())))
    kept.close()
    assert seen[-1] == main_before and kept.thread_niceness is None
    with pytest.raises(ValueError, match="niceness"):
        BackgroundWorker(niceness=40)
