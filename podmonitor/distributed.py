"""Every collective podmonitor calls, in one place.

The rule (docs/reliability.md): no collective inside rank-zero-only code, and every collective is
called on every rank, in the same order, decided by state that is the same on every rank. The
callbacks call the functions of this module only from hooks that Lightning runs on every rank
(``setup``, ``on_validation_epoch_start``, ``on_validation_batch_end``, ``on_validation_epoch_end``,
``on_validation_end``, ``on_train_start``, ``on_train_batch_start``), never from a branch that
only some ranks take. Lightning's ``trainer.log_dir`` is itself a collective (a broadcast), so
the run directory is worked out once, in ``setup``, on every rank (:func:`resolve_run_dir`).

Where the collectives are:

- ``PODMonitor.setup``: :func:`resolve_run_dir` (one broadcast);
- ``PODMonitor.on_validation_epoch_start`` of a monitored run: :func:`all_gather_ints` of the
  number of validation batches (are the ranks' loaders of equal length?);
- ``PODMonitor.on_validation_batch_end`` while the snapshot quota is open: :func:`all_gather_ints`
  of each rank's usable sequences in the batch (the quota is then shared out identically on every
  rank);
- ``PODMonitor.on_validation_epoch_end`` of a monitored run: :func:`all_gather_object` of the
  accumulator states;
- ``SmoothnessMonitor.setup`` and ``HeadPruning.setup``: :func:`resolve_run_dir`;
- ``HeadPruning``: :func:`all_ranks_true` at fit start and at every validation end,
  :func:`broadcast_object` of the readiness and of the chosen heads.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch


def world_size(trainer: Any) -> int:
    """Number of processes of the run (1 without DDP)."""
    return int(getattr(trainer, "world_size", 1) or 1)


def global_rank(trainer: Any) -> int:
    """This process's rank (0 without DDP)."""
    return int(getattr(trainer, "global_rank", 0) or 0)


def is_distributed(trainer: Any) -> bool:
    """Whether collectives are live: several processes and an initialised process group."""
    return (world_size(trainer) > 1 and torch.distributed.is_available()
            and torch.distributed.is_initialized())


def resolve_run_dir(trainer: Any, output_dir: str | None) -> str:
    """``output_dir``, else ``<trainer.log_dir or default_root_dir>/podmonitor``.

    A collective when ``output_dir`` is None (``trainer.log_dir`` broadcasts rank zero's path):
    call it on every rank, for example in ``setup``.
    """
    if output_dir is not None:
        return str(output_dir)
    base = trainer.log_dir or trainer.default_root_dir
    return os.path.join(str(base), "podmonitor")


def all_gather_object(trainer: Any, obj: Any) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]``; ``[obj]`` in a single process. Collective."""
    if not is_distributed(trainer):
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def all_gather_ints(trainer: Any, values: Sequence[int], device: torch.device | str = "cpu") -> list[list[int]]:
    """Each rank's list of ``len(values)`` ints (same length on every rank). Collective.

    Uses a tensor collective on ``device`` (the module's device: NCCL needs CUDA tensors).
    """
    if not is_distributed(trainer):
        return [[int(v) for v in values]]
    local = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, local)
    return [[int(v) for v in g.tolist()] for g in gathered]


def broadcast_object(trainer: Any, obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (the strategy's broadcast). Collective."""
    if world_size(trainer) <= 1:
        return obj
    return trainer.strategy.broadcast(obj, src=src)


#: whether this process has registered :func:`_destroy_gloo_group` with ``atexit``
_EXIT_HANDLER_REGISTERED: list[bool] = []


def destroy_gloo_group_at_exit(trainer: Any) -> None:
    """In a distributed run, have this process destroy the default process group at interpreter
    exit when it runs on gloo (registered once per process; not a collective).

    Why: Lightning destroys the process group at exit for NCCL only. A gloo group left alive keeps
    its worker threads into interpreter finalisation, and a worker that drops the last reference to
    a finished collective whose tensors Python created (Lightning's ``reduce_boolean_decision``
    before a checkpoint, for example) then needs the GIL that finalisation no longer hands out:
    the thread exits inside a destructor and the process aborts ("terminate called without an
    active exception", SIGABRT) after a finished fit, and ``ddp_spawn`` raises
    ``ProcessExitedException`` in the main process. Destroying the group in an ``atexit`` handler,
    while Python is still whole, joins those threads first (torch releases the GIL while it does).
    """
    if _EXIT_HANDLER_REGISTERED or not is_distributed(trainer):
        return
    _EXIT_HANDLER_REGISTERED.append(True)
    atexit.register(_destroy_gloo_group)


#: the longest the exit handler waits for the process group's destruction (seconds): it joins
#: gloo's worker threads, which a collective still waiting for a peer that went away could hold
#: until gloo's own timeout; after this the process exits as it would have without the handler
EXIT_DESTROY_TIMEOUT_S = 10.0


def _destroy_gloo_group() -> None:
    """The exit handler of :func:`destroy_gloo_group_at_exit`; never raises, and waits at most
    :data:`EXIT_DESTROY_TIMEOUT_S` (the destruction runs in a daemon thread)."""
    dist = torch.distributed
    try:
        if not (dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"):
            return
    except Exception:  # noqa: BLE001 - at exit, nothing is worth an error
        return
    worker = threading.Thread(target=_destroy_quietly, name="podmonitor-destroy-gloo-group", daemon=True)
    worker.start()
    worker.join(EXIT_DESTROY_TIMEOUT_S)


def _destroy_quietly() -> None:
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()


def all_ranks_true(trainer: Any, flag: bool) -> bool:
    """True when ``flag`` holds on every rank. Collective."""
    if world_size(trainer) <= 1:
        return bool(flag)
    return bool(trainer.strategy.reduce_boolean_decision(bool(flag), all=True))


def share_quota(usable: Sequence[int], remaining: int) -> list[int]:
    """How many of its usable sequences each rank takes so that together they take
    ``min(remaining, sum(usable))``, one sequence at a time round-robin over the ranks.

    Round-robin keeps the ranks even, so with a ``DistributedSampler`` (which deals sequences to
    the ranks in turn) the sequences taken are the first ones of the dataset, as in one process.
    Every rank computes the same answer from the same gathered counts.

    Example:
        >>> share_quota([8, 8], 8)
        [4, 4]
        >>> share_quota([8, 0], 5)
        [5, 0]
    """
    take = [0] * len(usable)
    left = max(0, int(remaining))
    while left > 0:
        moved = False
        for r, u in enumerate(usable):
            if left == 0:
                break
            if take[r] < int(u):
                take[r] += 1
                left -= 1
                moved = True
        if not moved:
            break
    return take


__all__ = [
    "all_gather_ints",
    "all_gather_object",
    "all_ranks_true",
    "broadcast_object",
    "destroy_gloo_group_at_exit",
    "global_rank",
    "is_distributed",
    "resolve_run_dir",
    "share_quota",
    "world_size",
]
