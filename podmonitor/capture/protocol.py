"""Capture through the model's own ``attention_maps(batch)`` method (the podmonitor protocol)."""

from __future__ import annotations

from typing import Any

import torch

from podmonitor.capture.base import CaptureAdapter, CapturedAttention


def _causal_flag(module: torch.nn.Module) -> bool | None:
    flag = getattr(module, "attention_is_causal", None)
    if callable(flag):
        flag = flag()
    return flag if isinstance(flag, bool) else None


class ProtocolAdapter(CaptureAdapter):
    """For modules that define ``attention_maps(batch) -> list[Tensor (B, H, T, T)]``.

    The method runs its own forward (in eval mode, without gradients) on the batch; it
    may also return a :class:`CapturedAttention` (to report ``valid`` or its own layer
    names). ``attention_is_causal`` (a bool attribute or property), when present, gives
    ``causal``. See :class:`podmonitor.models.lightning.GPTLightningModule` for an example.

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
        try:
            return CapturedAttention.from_maps(maps, causal=_causal_flag(module))
        except (TypeError, ValueError) as err:
            raise type(err)(f"{type(module).__name__}.attention_maps(batch): {err}") from err


__all__ = ["ProtocolAdapter"]
