"""Run a multi-process (DDP) training scenario in its own process group, under a timeout.

A distributed hang must fail the one test that hit it, not the whole CI run. A scenario is a
module-level function ``scenario(tmp_dir: str, *args: str) -> dict`` (JSON-serialisable result;
named ``"module:function:arg1:arg2"``) that builds and fits a Trainer (for example with
``strategy="ddp_spawn", accelerator="cpu", devices=2``). :func:`run_scenario` runs it in a process
of its own, in a new session, waits at most ``timeout`` seconds, kills the whole process group
(the spawned ranks included) when the time is up, and fails the test with the tail of the output.

Where processes can fork (Linux, macOS), the scenario's process is forked from a scenario server:
one process per test session that has imported torch, Lightning and podmonitor once (importing
Lightning is most of a short scenario's main process here, because torchmetrics imports
transformers when it is installed). Each scenario still gets a process of its
own and the ranks that ``ddp_spawn`` starts from it are fresh interpreters, exactly as before. The
server holds no thread of its own and has run no tensor operation when it forks. Elsewhere, or
when the server cannot start, each scenario runs as ``python -m tests.distributed <target> <tmp>
<out>``.

Each scenario's process also arms :func:`faulthandler.dump_traceback_later`, so a hang prints
its stacks before it is killed.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: imported by the scenario server before it forks (what every scenario's main process needs)
PRELOAD = ("torch", "lightning.pytorch", "podmonitor.callback", "tests.ddp_scenarios")


def _env(timeout: float) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("WANDB_MODE", "offline")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["PODMONITOR_SCENARIO_TIMEOUT"] = str(max(5.0, timeout - 10.0))
    return env


def run_scenario(target: str, tmp_path: Path | str, timeout: float = 150.0) -> dict[str, Any]:
    """Run ``target`` ("package.module:function", optionally ":arg" strings after it) in a
    process of its own; return its result.

    Raises:
        pytest.fail: the scenario did not finish within ``timeout`` seconds (hang), or failed.
    """
    tmp = Path(tmp_path)
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / "scenario_result.json"
    log = tmp / "scenario_output.txt"
    server = _server()
    if server is not None:
        rc = server.run(target, tmp, out, log, timeout)
    else:
        rc = _run_fresh(target, tmp, out, log, timeout)
    if rc is None:
        pytest.fail(f"{target} did not finish within {timeout:.0f} s (hang?); output tail:\n{_tail(log)}")
    if rc != 0 or not out.exists():
        pytest.fail(f"{target} failed with exit code {rc}; output tail:\n{_tail(log)}")
    return json.loads(out.read_text())


def _run_fresh(target: str, tmp: Path, out: Path, log: Path, timeout: float) -> int | None:
    """The scenario in a new interpreter: its exit code, or None after a timeout (group killed)."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.distributed", target, str(tmp), str(out)],
            cwd=str(ROOT), env=_env(timeout), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
    _kill_group(proc.pid)  # leftovers (a rank that outlived the main process), or the hung group
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass
    return rc


class _Server:
    """The scenario server of this test session (see the module docstring).

    Protocol, one JSON line each way: the test sends ``{"target", "tmp", "out", "log", "timeout"}``;
    the server forks, answers ``{"pid"}`` at once (the scenario's process, leader of its own
    process group) and ``{"pid", "rc"}`` when it has exited.
    """

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.distributed", "--serve"], cwd=str(ROOT), env=_env(150.0),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
            text=True, bufsize=1,
        )
        ready = self._read(deadline=time.monotonic() + 300)
        if ready != {"ready": True}:
            raise RuntimeError(f"scenario server did not start: {ready}")

    def _read(self, deadline: float) -> dict[str, Any] | None:
        assert self.proc.stdout is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            readable, _, _ = select.select([self.proc.stdout], [], [], left)
            if readable:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError("scenario server exited")
                return json.loads(line)

    def run(self, target: str, tmp: Path, out: Path, log: Path, timeout: float) -> int | None:
        assert self.proc.stdin is not None
        request = {"target": target, "tmp": str(tmp), "out": str(out), "log": str(log), "timeout": timeout}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        started = self._read(deadline=time.monotonic() + 30)
        if started is None:
            raise RuntimeError("scenario server did not fork")
        pid = int(started["pid"])
        done = self._read(deadline=time.monotonic() + timeout)
        _kill_group(pid)  # leftovers, or the hung group
        if done is None:
            if self._read(deadline=time.monotonic() + 30) is None:  # the server reaps the killed process
                self.close()  # or it is stuck itself: the next scenario starts another
            return None
        return int(done["rc"])

    def close(self) -> None:
        _kill_group(self.proc.pid)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass


_SERVER: list[_Server | None] = []  # [] until the first scenario; [None] where there is none


def _server() -> _Server | None:
    if not _SERVER:
        server = None
        if hasattr(os, "fork") and os.environ.get("PODMONITOR_TESTS_FRESH_SCENARIOS") != "1":
            try:
                server = _Server()
                atexit.register(server.close)
            except (OSError, RuntimeError, ValueError):
                server = None
        _SERVER.append(server)
    server = _SERVER[0]
    if server is not None and server.proc.poll() is not None:  # it died: start another
        _SERVER.clear()
        return _server()
    return server


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, n: int = 6000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-n:]


def _scenario(target: str, tmp_dir: str, out: str) -> None:
    seconds = float(os.environ.get("PODMONITOR_SCENARIO_TIMEOUT", "0") or 0)
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, exit=False)
    module_name, func_name, *args = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(tmp_dir, *args)
    Path(out).write_text(json.dumps(result))


def _forked_scenario(request: dict[str, Any]) -> int:
    """In the forked child: a session of its own, output to the log, the scenario; the exit code."""
    os.setsid()
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)  # not the server's request pipe
    os.dup2(null, 0)
    os.close(null)
    os.environ["PODMONITOR_SCENARIO_TIMEOUT"] = str(max(5.0, float(request["timeout"]) - 10.0))
    try:
        _scenario(request["target"], request["tmp"], request["out"])
        return 0
    except BaseException:  # noqa: BLE001 - reported in the log, like an uncaught exception
        import traceback

        traceback.print_exc()
        return 1
    finally:
        atexit._run_exitfuncs()  # what a normal exit runs (e.g. closing the picture process)
        sys.stdout.flush()
        sys.stderr.flush()


def serve() -> int:
    """The scenario server's loop: fork one process per request line on stdin (see :class:`_Server`)."""
    for name in PRELOAD:
        importlib.import_module(name)
    reply = sys.stdout
    reply.write(json.dumps({"ready": True}) + "\n")
    reply.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the scenario's process: never returns to this loop
            code = 1
            try:
                code = _forked_scenario(request)
            finally:
                os._exit(code)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"pid": pid, "rc": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()
    return 0


def main(argv: list[str]) -> int:
    if argv == ["--serve"]:
        return serve()
    target, tmp_dir, out = argv
    _scenario(target, tmp_dir, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
