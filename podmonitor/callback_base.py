"""What podmonitor's callbacks share: run directory, warn-or-raise, history that survives ``ddp_spawn``.

:class:`MonitorCallback` is the common shell of :class:`~podmonitor.PODMonitor`,
:class:`~podmonitor.SmoothnessMonitor` and :class:`~podmonitor.pruning.HeadPruning`:

- the run directory is worked out in ``setup`` on every rank (``trainer.log_dir`` is a collective
  in Lightning, so it must never be reached from rank-zero-only code) and kept;
- ``history`` (a list of plain records, checkpointed) reaches the main process after
  ``strategy="ddp_spawn"`` (or ``ddp_fork``): there the callback object the user holds is not the
  one that ran, so rank zero hands its ``state_dict()`` over through a file in the temporary
  folder at teardown, as Lightning does for the model's weights, and the main process loads it on
  first access of ``history``;
- in a distributed run on gloo, the process group is destroyed at interpreter exit (see
  :func:`~podmonitor.distributed.destroy_gloo_group_at_exit`: otherwise a rank can abort after
  a finished fit);
- errors become one warning (or are re-raised with ``strict=True``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import tempfile
import uuid
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer

from .distributed import destroy_gloo_group_at_exit, global_rank, resolve_run_dir, world_size


class MonitorCallback(Callback):
    """Base of podmonitor's callbacks (see the module docstring).

    Subclasses set ``output_dir``, ``strict`` and ``warning_class`` and implement
    ``state_dict`` / ``load_state_dict``; they call :meth:`_setup_shell` first in ``setup``.
    """

    warning_class: type[Warning] = UserWarning
    output_dir: str | None = None
    strict: bool = False

    def _init_shell(self) -> None:
        self._history: list[dict[str, Any]] = []
        self._run_dir: str | None = None
        self._created_pid = os.getpid()
        self._handoff = os.path.join(tempfile.gettempdir(), f"podmonitor-{type(self).__name__}-{uuid.uuid4().hex}.pt")
        # a hand-over nobody read is removed when the main process exits (workers never run __init__)
        atexit.register(_remove_quietly, self._handoff)

    # ------------------------------------------------------------------ history
    @property
    def history(self) -> list[dict[str, Any]]:
        """One summary per monitored run (checkpointed; after ``ddp_spawn``, rank zero's)."""
        self._receive_handoff()
        return self._history

    @history.setter
    def history(self, value: list[dict[str, Any]]) -> None:
        self._history = list(value)

    def _hand_over(self, trainer: Trainer) -> None:
        """In a process started by ``ddp_spawn`` / ``ddp_fork`` (not the one that made this object),
        rank zero writes its state for the main process. Never raises."""
        if os.getpid() == self._created_pid or world_size(trainer) <= 1 or global_rank(trainer) != 0:
            return
        try:
            torch.save(self.state_dict(), self._handoff)
        except Exception as err:  # noqa: BLE001
            warnings.warn(f"{type(self).__name__}: could not hand the history to the main process: {err}",
                          self.warning_class, stacklevel=2)

    def _receive_handoff(self) -> None:
        if os.getpid() != self._created_pid or not os.path.exists(self._handoff):
            return
        try:
            state = torch.load(self._handoff, weights_only=True)
            os.remove(self._handoff)
        except Exception as err:  # noqa: BLE001
            warnings.warn(f"{type(self).__name__}: could not read the history of the worker processes: {err}",
                          self.warning_class, stacklevel=3)
            return
        self._load_handoff(state)

    def _load_handoff(self, state: dict[str, Any]) -> None:
        """Take the state rank zero handed over (default: ``load_state_dict``)."""
        self.load_state_dict(state)

    # ------------------------------------------------------------------ setup
    def _setup_shell(self, trainer: Trainer) -> None:
        """What every callback does first in ``setup``, on every rank: the run directory (a
        collective) and, in a distributed run on gloo, the process group's release at exit
        (:func:`~podmonitor.distributed.destroy_gloo_group_at_exit`)."""
        self._setup_run_dir(trainer)
        destroy_gloo_group_at_exit(trainer)

    # ------------------------------------------------------------------ run dir
    def _setup_run_dir(self, trainer: Trainer) -> None:
        """Work out the run directory; a collective: call from ``setup``, on every rank."""
        self._run_dir = resolve_run_dir(trainer, self.output_dir)

    def run_dir(self, trainer: Trainer | None = None) -> str:
        """The folder of this callback's JSON-lines file and PNG pictures.

        Known after ``setup``; before that it is worked out from ``trainer``, which is a
        collective in DDP (``trainer.log_dir``): then call it on every rank.
        """
        if self._run_dir is not None:
            return self._run_dir
        if trainer is None:
            if self.output_dir is not None:
                return str(self.output_dir)
            raise ValueError(f"{type(self).__name__}.run_dir() needs the trainer before setup")
        return resolve_run_dir(trainer, self.output_dir)

    # ------------------------------------------------------------------ errors
    def _warn_or_raise(self, msg: str, err: BaseException, stacklevel: int = 3) -> None:
        if self.strict:
            raise err
        warnings.warn(msg, self.warning_class, stacklevel=stacklevel)


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


__all__ = ["MonitorCallback"]
