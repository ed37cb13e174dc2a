"""The harness of the multi-process tests (tests/distributed.py): a hang fails one test, in time,
and leaves no process behind; the scenarios run in processes of their own."""

from __future__ import annotations

import os
import time

import pytest
from _pytest.outcomes import Failed

from tests.distributed import run_scenario


def sleeper(tmp: str, seconds: str) -> dict:
    """A scenario that hangs: it writes its process id and group, starts a child in its group, sleeps."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(tmp, "pids.txt"), "w") as fh:
        fh.write(f"{os.getpid()} {os.getpgid(0)} {child.pid}")
    time.sleep(float(seconds))
    return {}


def identity(tmp: str, text: str) -> dict:
    """A scenario that finishes: its argument and its process id."""
    return {"text": text, "pid": os.getpid()}


def failing(tmp: str) -> dict:
    raise ValueError("this scenario fails on purpose")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_hanging_scenario_fails_in_time_and_its_whole_group_is_killed(tmp_path):
    start = time.monotonic()
    with pytest.raises(Failed, match="did not finish within 15 s"):
        run_scenario("tests.test_distributed_harness:sleeper:600", tmp_path, timeout=15)
    assert time.monotonic() - start < 60  # not the 600 s the scenario sleeps
    pid, group, child = map(int, (tmp_path / "pids.txt").read_text().split())
    assert group == pid != os.getpgid(0)  # a session of its own, not pytest's
    deadline = time.monotonic() + 10
    while (_alive(pid) or _alive(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid) and not _alive(child)
    # the next scenario runs as usual
    res = run_scenario("tests.test_distributed_harness:identity:after", tmp_path / "next", timeout=60)
    assert res["text"] == "after"


def test_each_scenario_runs_in_a_process_of_its_own_and_a_failure_shows_its_output(tmp_path):
    a = run_scenario("tests.test_distributed_harness:identity:a", tmp_path / "a", timeout=60)
    b = run_scenario("tests.test_distributed_harness:identity:b", tmp_path / "b", timeout=60)
    assert (a["text"], b["text"]) == ("a", "b")
    assert a["pid"] != b["pid"] and os.getpid() not in (a["pid"], b["pid"])
    with pytest.raises(Failed, match="this scenario fails on purpose"):
        run_scenario("tests.test_distributed_harness:failing", tmp_path / "c", timeout=60)
