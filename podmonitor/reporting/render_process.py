"""Pictures drawn in a separate, low-priority process: matplotlib never holds the training's GIL.

Drawing a run's pictures costs about 0.3 s of pure-Python matplotlib work per layer. On the
publisher's background thread that work still holds the interpreter lock of the training
process, so the training loop waits for it in small slices. :class:`PictureProcess` instead
sends the reports to a child interpreter (``python -m podmonitor.reporting._render_child``,
started on first use, ``nice 19``, one thread) that runs
:func:`~podmonitor.reporting.figures.draw_run_pictures` and sends the pixel arrays back; the
waiting thread releases the lock. The child is a plain subprocess speaking length-prefixed
pickles over its stdin and stdout, not ``multiprocessing``: spawn and forkserver re-import the
user's ``__main__``, which re-runs a training script that lacks a ``__name__`` guard.

When the child cannot draw, :meth:`PictureProcess.draw` raises :class:`RenderProcessError` and
the caller draws in its own thread instead (nothing is lost). A child that cannot be started,
dies or stops answering is given up for good (``broken``); a drawing error leaves it running.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

#: Seconds to wait for one run's pictures before the child is given up.
DRAW_TIMEOUT_S = 600.0

_HEADER = struct.Struct("<Q")


class RenderProcessError(RuntimeError):
    """The picture process could not draw (not started, died, timed out or raised)."""


def _write_message(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _read_exact(stream: IO[bytes], n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError("the stream closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_message(stream: IO[bytes]) -> Any:
    (size,) = _HEADER.unpack(_read_exact(stream, _HEADER.size))
    return pickle.loads(_read_exact(stream, size))  # noqa: S301 - our own child, over a private pipe


class PictureProcess:
    """A child interpreter that draws run pictures; one request at a time.

    Args:
        nice: niceness added to the child (POSIX): it draws on otherwise idle cores and yields
            them to the training.
    """

    def __init__(self, nice: int = 19) -> None:
        self.nice = nice
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self.broken: str | None = None  # why the child was given up (then draw always raises)

    def _start(self) -> subprocess.Popen[bytes]:
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([package_root, *[p for p in sys.path if p], env.get("PYTHONPATH", "")])
        env.update(MPLBACKEND="Agg", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                   PODMONITOR_RENDER_NICE=str(self.nice))
        return subprocess.Popen([sys.executable, "-m", "podmonitor.reporting._render_child"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def draw(self, prefix: str, reports: Mapping[str, Any], present: Sequence[str],
             trend: Mapping[str, Any] | None, steps: Sequence[int],
             units: Mapping[str, str] | None = None) -> dict[str, np.ndarray]:
        """:func:`~podmonitor.reporting.figures.draw_run_pictures` in the child.

        Returns:
            tag -> (H, W, 3) uint8 array.

        Raises:
            RenderProcessError: the child could not draw; the caller should draw itself.
        """
        with self._lock:
            if self.broken is not None:
                raise RenderProcessError(self.broken)
            try:
                if self._proc is not None and self._proc.poll() is not None:
                    # died between requests: given up like one that dies while drawing
                    raise RenderProcessError(f"the picture process ended (exit code {self._proc.returncode})")
                if self._proc is None:
                    self._proc = self._start()
                proc = self._proc
                assert proc.stdin is not None and proc.stdout is not None
                request = {"prefix": prefix, "reports": {n: reports[n] for n in present}, "present": list(present),
                           "trend": dict(trend or {}), "steps": list(steps), "units": dict(units or {})}
                _write_message(proc.stdin, request)
                answer = self._answer(proc)
            except RenderProcessError as err:
                self._give_up(str(err))
                raise
            except Exception as err:  # noqa: BLE001 - pipe, pickling or start-up failures alike
                self._give_up(f"{type(err).__name__}: {err}")
                raise RenderProcessError(self.broken) from err
            if answer.get("error"):
                raise RenderProcessError(answer["error"])  # a drawing error: the child itself is fine
            return answer["pictures"]

    def _answer(self, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
        """Read one answer, or raise if the child does not give one within :data:`DRAW_TIMEOUT_S`."""
        box: dict[str, Any] = {}

        def read() -> None:
            try:
                box["answer"] = _read_message(proc.stdout)  # type: ignore[arg-type]
            except Exception as err:  # noqa: BLE001 - reported below
                box["error"] = err

        reader = threading.Thread(target=read, name="podmonitor-render-read", daemon=True)
        reader.start()
        reader.join(DRAW_TIMEOUT_S)
        if reader.is_alive():
            raise RenderProcessError(f"no pictures after {DRAW_TIMEOUT_S:.0f} s")
        if "error" in box:
            code = proc.poll()
            raise RenderProcessError(f"the picture process ended (exit code {code}): {box['error']}")
        return box["answer"]

    def _give_up(self, why: str) -> None:
        self.broken = why
        self._stop(kill=True)

    def _stop(self, kill: bool = False) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if not kill and proc.poll() is None and proc.stdin is not None:
                proc.stdin.close()  # end of input: the child exits
                proc.wait(timeout=10)
        except Exception:  # noqa: BLE001, S110 - killed below
            pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except Exception:  # noqa: BLE001, S110 - closing a dead pipe
                pass

    def close(self) -> None:
        """Stop the child (it is started again on the next :meth:`draw`)."""
        with self._lock:
            self._stop()


def serve() -> None:
    """The child's loop: read requests from stdin, answer on the original stdout until EOF."""
    nice = int(os.environ.get("PODMONITOR_RENDER_NICE", "0") or 0)
    if nice and hasattr(os, "nice"):
        try:
            os.nice(nice)
        except OSError:
            pass
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints of libraries go to stderr, not into the answers
    requests = os.fdopen(os.dup(0), "rb")
    import torch

    torch.set_num_threads(1)
    from .figures import draw_run_pictures

    while True:
        try:
            request = _read_message(requests)
        except EOFError:
            return
        try:
            pictures = draw_run_pictures(request["prefix"], request["reports"], request["present"],
                                         request["trend"], request["steps"], request["units"])
            _write_message(answers, {"pictures": pictures})
        except Exception as err:  # noqa: BLE001 - reported to the parent, which draws itself
            _write_message(answers, {"error": f"{type(err).__name__}: {err}"})

