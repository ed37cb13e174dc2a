"""What every capture in podmonitor attaches and takes off again: hook handles, the MHA fast-path switch.

A capture (an adapter of :mod:`podmonitor.capture`, the smoothness sub-layer capture
:class:`~podmonitor.smoothness.sublayers.InputCapture`, the head gates of :mod:`podmonitor.pruning`)
changes a model only between its ``start()`` and ``stop()``. Two things are undone at ``stop()``:

- the forward (pre-)hooks it registered: kept in one :class:`HookHandles`, removed together;
- PyTorch's ``nn.MultiheadAttention`` fast path, switched off so that the module's Python forward
  (and its hooks, and its attention weights) run: :class:`MHAFastPathOff`. The previous setting is
  put back only if nobody changed it in between, so two captures that toggle it (another callback,
  or two of ours) never override each other, in whatever order they stop.

Example (an adapter's ``start`` / ``stop``)::

    def start(self, module):
        self.stop()
        self._fastpath.switch_off()
        for sub in modules_to_hook(module):
            self._hooks.add(sub.register_forward_hook(self._hook))

    def stop(self):  # idempotent, also after a start that failed halfway
        self._hooks.remove()
        self._fastpath.restore()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils.hooks import RemovableHandle


class HookHandles:
    """The removable hooks one capture attached; :meth:`remove` takes every one of them off."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def add(self, handle: RemovableHandle) -> RemovableHandle:
        """Keep ``handle`` (the return value of ``register_forward_hook`` and the like); returns it."""
        self._handles.append(handle)
        return handle

    def remove(self) -> None:
        """Remove every hook kept so far (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __len__(self) -> int:
        return len(self._handles)

    def __bool__(self) -> bool:
        return bool(self._handles)


class MHAFastPathOff:
    """``torch.backends.mha`` fast path off between :meth:`switch_off` and :meth:`restore`.

    The fast path of ``nn.MultiheadAttention`` (inference, batch-first, ...) skips the module's
    Python forward and returns no attention weights: a capture must switch it off. ``restore``
    puts the value seen at ``switch_off`` back only when the setting is still off (nobody restored
    it in between). Also a context manager (see :func:`mha_fastpath_off`).
    """

    def __init__(self) -> None:
        self._previous: bool | None = None

    @property
    def active(self) -> bool:
        """Whether this switch holds the fast path off now."""
        return self._previous is not None

    def switch_off(self) -> None:
        """Switch the fast path off, remembering the setting (a second call while active does nothing)."""
        if self._previous is not None:
            return
        self._previous = bool(torch.backends.mha.get_fastpath_enabled())
        torch.backends.mha.set_fastpath_enabled(False)

    def restore(self) -> None:
        """Put the remembered setting back if the fast path is still off (idempotent)."""
        if self._previous is None:
            return
        previous, self._previous = self._previous, None
        if not torch.backends.mha.get_fastpath_enabled():
            torch.backends.mha.set_fastpath_enabled(previous)

    def __enter__(self) -> MHAFastPathOff:
        self.switch_off()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


@contextlib.contextmanager
def mha_fastpath_off() -> Iterator[None]:
    """The ``nn.MultiheadAttention`` fast path off within the block (see :class:`MHAFastPathOff`)."""
    with MHAFastPathOff():
        yield


__all__ = ["HookHandles", "MHAFastPathOff", "mha_fastpath_off"]
