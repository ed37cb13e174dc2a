"""Capture through the model's own ``attention_maps(batch)`` method (the podmonitor protocol)."""

from __future__ import annotations

from typing import Any

import torch

from podmonitor.capture.base import CaptureAdapter, CapturedAttention


def _flag(module: torch.nn.Module, name: str) -> bool | None:
    """The module's bool attribute or property ``name`` (called when it is a method); None when
    it is absent or not a bool."""
    flag = getattr(module, name, None)
    if callable(flag):
        flag = flag()
    return flag if isinstance(flag, bool) else None


class ProtocolAdapter(CaptureAdapter):
    """For modules that define ``attention_maps(batch) -> list[Tensor (B, H, T, T)]``.

    The method runs its own forward (in eval mode, without gradients) on the batch; it
    may also return a :class:`CapturedAttention` (to report ``valid`` or its own layer
    names). ``attention_is_causal`` (a bool attribute or property), when present, gives
    ``causal``; ``attention_zeros_above_diagonal`` (the same), when also True, promises that
    the maps hold +0 at every key after its query, as the method writes them, so that the
    stability signals skip their check of those entries (a wrong promise makes them ignore
    those entries; the POD's own check of the head-averaged fields still runs). See
    :class:`podmonitor.models.lightning.GPTLightningModule` for an example.

    Nothing is attached: :meth:`start` and :meth:`stop` do nothing.
    """

    name = "protocol"

    @classmethod
    def applies(cls, module: torch.nn.Module) -> bool:
        return callable(getattr(module, "attention_maps", None))

    def collect(self, module: torch.nn.Module, batch: Any, outputs: Any) -> CapturedAttention:
        with torch.no_grad():
            maps = module.attention_maps(batch)
        if isinstance(maps, CapturedAttention):
            return maps
        causal = _flag(module, "attention_is_causal")
        try:
            return CapturedAttention.from_maps(
                maps, causal=causal,
                zeros_above_diagonal=causal is True and _flag(module, "attention_zeros_above_diagonal") is True)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{type(module).__name__}.attention_maps(batch): {err}") from err


__all__ = ["ProtocolAdapter"]
