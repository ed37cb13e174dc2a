"""The exit handler that destroys a gloo process group (podmonitor.distributed.destroy_gloo_group_at_exit).

The DDP scenarios (tests/test_ddp_defaults.py) check in real ranks that the group is gone at exit.
Here, in one process, with torch.distributed's functions replaced: the handler acts on gloo only,
swallows errors, and does not keep the process from exiting when the destruction blocks (a
collective still waiting for a peer that went away can hold gloo's worker threads).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from podmonitor import distributed


@pytest.fixture()
def fake_dist(monkeypatch):
    """torch.distributed as an initialised group on ``state.backend``; destroy calls ``state.destroy``."""
    state = SimpleNamespace(backend="gloo", destroyed=0, destroy=None)

    def destroy() -> None:
        state.destroyed += 1
        if state.destroy is not None:
            state.destroy()

    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a, **k: state.backend)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", destroy)
    return state


def test_a_gloo_group_is_destroyed(fake_dist):
    distributed._destroy_gloo_group()
    assert fake_dist.destroyed == 1


def test_other_backends_are_left_alone(fake_dist):
    fake_dist.backend = "nccl"  # Lightning destroys NCCL groups itself
    distributed._destroy_gloo_group()
    assert fake_dist.destroyed == 0


def test_an_error_while_destroying_is_swallowed(fake_dist):
    def fail() -> None:
        raise RuntimeError("connection reset")

    fake_dist.destroy = fail
    distributed._destroy_gloo_group()  # no exception at exit
    assert fake_dist.destroyed == 1


def test_a_destruction_that_blocks_does_not_hold_the_exit(fake_dist, monkeypatch):
    release = threading.Event()
    entered = threading.Event()

    def block() -> None:
        entered.set()
        release.wait(60)

    fake_dist.destroy = block
    monkeypatch.setattr(distributed, "EXIT_DESTROY_TIMEOUT_S", 0.2)
    try:
        distributed._destroy_gloo_group()  # returns although the destruction has not finished
        assert entered.is_set() and not release.is_set()
        stuck = [t for t in threading.enumerate() if t.name == "podmonitor-destroy-gloo-group"]
        assert stuck and all(t.daemon for t in stuck)  # a daemon thread: it cannot keep the process alive
    finally:
        release.set()


def test_the_handler_is_registered_once_and_only_in_a_distributed_run(monkeypatch):
    registered = []
    monkeypatch.setattr(distributed.atexit, "register", lambda fn: registered.append(fn))
    monkeypatch.setattr(distributed, "_EXIT_HANDLER_REGISTERED", [])
    distributed.destroy_gloo_group_at_exit(SimpleNamespace(world_size=1))  # one process: nothing
    assert registered == []
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    trainer = SimpleNamespace(world_size=2)
    distributed.destroy_gloo_group_at_exit(trainer)
    distributed.destroy_gloo_group_at_exit(trainer)
    assert registered == [distributed._destroy_gloo_group]
