"""Run a multi-process (DDP) training scenario in its own process group, under a timeout.

A distributed hang must fail the one test that hit it, not the whole CI run. A scenario is a
module-level function ``scenario(tmp_dir: str, *args: str) -> dict`` (JSON-serialisable result;
named ``"module:function:arg1:arg2"``) that builds
and fits a Trainer (for example with ``strategy="ddp_spawn", accelerator="cpu", devices=2``).
:func:`run_scenario` runs it as ``python -m tests.distributed <module:function> <tmp_dir> <out>``
in a new session, waits at most ``timeout`` seconds, kills the whole process group (the spawned
ranks included) when the time is up, and fails the test with the tail of the output.

Each spawned process also arms :func:`faulthandler.dump_traceback_later`, so a hang prints the
stacks of the main process before it is killed.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_scenario(target: str, tmp_path: Path | str, timeout: float = 150.0) -> dict[str, Any]:
    """Run ``target`` ("package.module:function", optionally ":arg" strings after it) in a
    subprocess; return its result.

    Raises:
        pytest.fail: the scenario did not finish within ``timeout`` seconds (hang), or failed.
    """
    tmp = Path(tmp_path)
    out = tmp / "scenario_result.json"
    env = dict(os.environ)
    env.setdefault("WANDB_MODE", "offline")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["PODMONITOR_SCENARIO_TIMEOUT"] = str(max(5.0, timeout - 10.0))
    log = tmp / "scenario_output.txt"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.distributed", target, str(tmp), str(out)],
            cwd=str(ROOT), env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            pytest.fail(f"{target} did not finish within {timeout:.0f} s (hang?); output tail:\n{_tail(log)}")
    _kill_group(proc)  # leftovers (a rank that outlived the main process)
    if rc != 0 or not out.exists():
        pytest.fail(f"{target} failed with exit code {rc}; output tail:\n{_tail(log)}")
    return json.loads(out.read_text())


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass


def _tail(path: Path, n: int = 6000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-n:]


def main(argv: list[str]) -> int:
    target, tmp_dir, out = argv
    seconds = float(os.environ.get("PODMONITOR_SCENARIO_TIMEOUT", "0") or 0)
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, exit=False)
    module_name, func_name, *args = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(tmp_dir, *args)
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
