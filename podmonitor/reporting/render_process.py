"""Pictures drawn in a child process: matplotlib never holds the training process's interpreter lock.

Drawing a figure is mostly Python (matplotlib's ticks, text layout). On a thread of the training
process it competes with the training loop for the interpreter lock: the loop releases the lock in
every tensor operation and then waits for the drawing thread to hand it back (up to Python's switch
interval, 5 ms, each time). ``benchmarks/bench_background.py`` measured it on 2 CPU cores with the
tiny reference GPT (medians of six alternating pairs of segments, training steps with / without a
picture run in the background): a thread at the normal priority 4.53x with both cores training and
1.79x with one core left free (as a GPU run leaves the CPU), a thread at the lowest priority 0.97x
and 1.82x, this child process 0.99x and 1.05x.

:class:`PictureProcess` runs :func:`~podmonitor.reporting.figures.draw_run_pictures` in a child
Python (``python -m podmonitor.reporting.render_process``) with its own interpreter lock, at the
lowest scheduling priority (niceness 19 where the system has ``os.nice``), one thread. The reports
go over a pipe (pickled, each tensor as the float64 numpy array the pictures read, so that the
child never imports torch) and the (H, W, 3) uint8 pictures come back; the pixels are those of
drawing in the process (``tests/reporting/test_render_process.py`` compares them). The child
starts on the first request, serves one request at a time and ends when the parent closes it or
exits (its input pipe closes). A child that cannot start, dies, answers with
something else or takes longer than ``timeout_s`` raises :class:`PictureProcessError` (the child is
killed); the publisher then warns once and draws in its own process from then on. A drawing error
inside the child (a bad report) is raised again in the parent as the same kind of exception.

:func:`shared_picture_process` gives one child per training process, shared by every monitor.
"""

from __future__ import annotations

import atexit
import dataclasses
import io
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.report import PODReport
from .figures import PICTURES, as_float_array

_HEADER = struct.Struct("<Q")  # the length of each pickled message, in bytes


def for_pictures(report: PODReport) -> PODReport:
    """A copy of ``report`` without the fields no picture reads: the (L, L) mean field and each
    scale's (k, L, L) mode fields and (N, k) coefficients (at L = 1024 these are most of a report's
    bytes). The arrays the pictures read are shared, not copied."""
    empty = report.mean_field.new_zeros(0) if hasattr(report.mean_field, "new_zeros") else report.mean_field
    return dataclasses.replace(
        report, mean_field=empty,
        per_scale=[dataclasses.replace(sr, modes=None, coefficients=None) for sr in report.per_scale])


class PictureProcessError(RuntimeError):
    """The picture process could not be started, died, timed out or broke the protocol."""


class _ArrayPickler(pickle.Pickler):
    """Pickles tensors as the float64 numpy arrays the pictures read (:func:`as_float_array`):
    the child never imports torch (about 2 s of CPU and 180 MiB of memory less per child, which
    matters most where the child runs at the lowest priority on busy cores) and never touches a
    GPU."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")  # (no tensor exists unless torch was imported)
        if torch is not None and isinstance(obj, torch.Tensor):
            return as_float_array(obj).__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _ArrayPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _write(stream: Any, payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)))
    stream.write(payload)
    stream.flush()


def _read_exact(stream: Any, n: int) -> bytes:
    chunks: list[bytes] = []
    left = n
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError(f"the pipe closed after {n - left} of {n} bytes")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read(stream: Any) -> bytes:
    (n,) = _HEADER.unpack(_read_exact(stream, _HEADER.size))
    return _read_exact(stream, n)


class PictureProcess:
    """A child Python that draws the pictures of monitored runs.

    Args:
        niceness: the child's niceness increment (``os.nice``; 19, the lowest priority, lets the
            training's threads have the cores first; 0 keeps the parent's). Ignored where the
            system has no ``os.nice``.
        timeout_s: longest wait for one answer (the child's start included) before the child is
            killed and :class:`PictureProcessError` raised.
    """

    def __init__(self, niceness: int = 19, timeout_s: float = 600.0) -> None:
        if not 0 <= int(niceness) <= 19:
            raise ValueError(f"niceness must be between 0 and 19, got {niceness!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.niceness = int(niceness)
        self.timeout_s = float(timeout_s)
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # one request at a time (monitors may share the child)

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _start(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        env = dict(os.environ)
        # the child imports the same podmonitor as this process, wherever that was found
        root = str(Path(__file__).resolve().parents[2])
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = "1"  # one thread: the child must not compete with the training's threads
        env["MPLBACKEND"] = "Agg"
        env["CUDA_VISIBLE_DEVICES"] = ""  # it draws; it never needs a GPU
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "podmonitor.reporting.render_process", str(self.niceness)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0, close_fds=True)
        except OSError as err:
            raise PictureProcessError(f"the picture process could not start ({type(err).__name__}: {err})") from err
        return self._proc

    def _ask(self, request: tuple[Any, ...]) -> Any:
        """Send one request and wait for its answer (at most ``timeout_s``)."""
        payload = _dumps(request)  # before the child starts: a pickling error is the caller's
        with self._lock:
            proc = self._start()
            timed_out = threading.Event()

            def expire() -> None:  # a killed child closes its pipe, which ends the read below
                timed_out.set()
                proc.kill()

            timer = threading.Timer(self.timeout_s, expire)
            timer.daemon = True
            timer.start()
            try:
                assert proc.stdin is not None and proc.stdout is not None
                _write(proc.stdin, payload)
                answer = pickle.loads(_read(proc.stdout))
            except (OSError, EOFError, pickle.UnpicklingError, struct.error) as err:
                self._kill()
                why = (f"took longer than {self.timeout_s:g} s and was stopped" if timed_out.is_set()
                       else f"stopped answering ({type(err).__name__}: {err})")
                raise PictureProcessError(f"the picture process {why}") from err
            finally:
                timer.cancel()
        if not isinstance(answer, tuple) or not answer or answer[0] not in ("ok", "error"):
            self._kill()
            raise PictureProcessError(f"the picture process answered {type(answer).__name__}")
        if answer[0] == "error":
            _, kind, message = answer
            exc_type = {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError}.get(kind, RuntimeError)
            raise exc_type(f"{message} (raised in the picture process as {kind})")
        return answer[1]

    def draw_run_pictures(self, prefix: str, reports: Mapping[str, PODReport], present: Sequence[str],
                          trend: Mapping[str, tuple[str, Mapping[str, Sequence[float]]]] | None = None,
                          steps: Sequence[int] = (), units: Mapping[str, str] | None = None,
                          which: Collection[str] = PICTURES,
                          timings: dict[str, float] | None = None) -> dict[str, np.ndarray]:
        """:func:`~podmonitor.reporting.figures.draw_run_pictures`, drawn in the child (the same
        arguments; the reports go without what no picture reads: :func:`for_pictures`).

        Args:
            timings: when given, ``timings["cpu_s"]`` grows by the child's CPU seconds for this
                request (the drawing, and the unpickling of the reports).

        Returns:
            tag -> (H, W, 3) uint8 array.
        """
        slim = {name: for_pictures(rep) for name, rep in reports.items()}
        answer = self._ask(("draw_run_pictures", (prefix, slim, list(present), trend, list(steps), units),
                            {"which": tuple(which)}))
        if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], Mapping)):
            raise PictureProcessError(f"the picture process returned {type(answer).__name__}")
        pictures, cpu_s = answer
        if timings is not None:
            timings["cpu_s"] = timings.get("cpu_s", 0.0) + float(cpu_s)
        return dict(pictures)

    def status(self) -> dict[str, Any]:
        """The child's process id and niceness, and whether it has imported torch, as it reports
        them (starts it if needed)."""
        return self._ask(("status", (), {}))

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()

    def close(self) -> None:
        """End the child (it exits when its input closes; killed after 5 s, or at once when a
        request is still running after 10 s)."""
        if not self._lock.acquire(timeout=10):
            self._kill()  # (a request hangs: its reader gets EOF and raises)
            return
        try:
            proc, self._proc = self._proc, None
            if proc is None:
                return
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        finally:
            self._lock.release()


_shared: PictureProcess | None = None
_shared_lock = threading.Lock()


def shared_picture_process() -> PictureProcess:
    """The training process's one :class:`PictureProcess` (started on its first request, closed
    at exit)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = PictureProcess()
            atexit.register(_shared.close)
        return _shared


def _serve(niceness: int) -> None:
    """The child's loop: read a request, answer it, until the input closes."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    requests = sys.stdin.buffer
    sys.stdout = sys.stderr  # prints and warnings of the drawing code never reach the answer pipe
    if niceness and hasattr(os, "nice"):
        try:
            os.nice(niceness)
        except OSError:
            pass
    from podmonitor.reporting.figures import draw_run_pictures
    from podmonitor.reporting.layouts import FigureCache

    kept = FigureCache()  # each kind's figure built once for the child's life

    while True:
        try:
            payload = _read(requests)
        except EOFError:
            return
        cpu = time.process_time()
        what, args, kwargs = pickle.loads(payload)
        try:
            if what == "draw_run_pictures":
                pictures = draw_run_pictures(*args, **kwargs, cache=kept)
                answer: tuple[Any, ...] = ("ok", (pictures, time.process_time() - cpu))
            elif what == "status":
                answer = ("ok", {"pid": os.getpid(), "niceness": os.nice(0) if hasattr(os, "nice") else None,
                                 "torch_imported": "torch" in sys.modules})
            else:
                answer = ("error", "ValueError", f"unknown request {what!r}")
        except Exception as err:  # noqa: BLE001 - the parent decides what a failed picture costs
            answer = ("error", type(err).__name__, str(err))
        _write(answers, _dumps(answer))


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else 19)
