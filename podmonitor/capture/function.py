"""Capture through a user function ``fn(module, batch)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from podmonitor.capture.base import CaptureAdapter, CapturedAttention


class FunctionAdapter(CaptureAdapter):
    """Calls ``fn(module, batch)`` after the validation step, without gradients.

    Args:
        fn: returns a list of (B, H, T, T) tensors (one per layer, named "layer_00", ...)
            or a :class:`CapturedAttention` (to set ``valid``, ``causal`` or names).
        causal: ``causal`` of the result when ``fn`` returns a plain list.

    Example:
        >>> adapter = FunctionAdapter(lambda module, batch: module.net.attention(batch[0]))  # doctest: +SKIP
    """

    name = "function"

    def __init__(self, fn: Callable[[torch.nn.Module, Any], Any], causal: bool | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"FunctionAdapter needs a callable fn(module, batch), got {type(fn).__name__}")
        self.fn = fn
        self.causal = causal

    @classmethod
    def applies(cls, module: torch.nn.Module) -> bool:
        """Any module: the function decides (but the adapter needs the function)."""
        return True

    def collect(self, module: torch.nn.Module, batch: Any, outputs: Any) -> CapturedAttention:
        with torch.no_grad():
            maps = self.fn(module, batch)
        if isinstance(maps, CapturedAttention):
            return maps
        fn_name = getattr(self.fn, "__qualname__", repr(self.fn))
        try:
            return CapturedAttention.from_maps(maps, causal=self.causal)
        except (TypeError, ValueError) as err:
            raise type(err)(f"capture function {fn_name}: {err}") from err

    def __repr__(self) -> str:
        return f"FunctionAdapter({getattr(self.fn, '__qualname__', self.fn)!r})"


__all__ = ["FunctionAdapter"]
