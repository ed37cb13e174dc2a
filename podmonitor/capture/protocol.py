"""Capture through the model's own ``attention_maps(batch)`` method (the podmonitor protocol)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from podmonitor.capture._util import common_causal, layer_names
from podmonitor.capture.base import CaptureAdapter, CapturedAttention
from podmonitor.capture.reduce import ReducedAttention, reducing, reducing_in_step, stop_reducing_in_step


def _own_maps(module: torch.nn.Module) -> bool:
    """Whether ``module``'s ``attention_maps`` is the reference models' own (which can reduce)."""
    from podmonitor.models.lightning import GPTLightningModule

    return getattr(type(module), "attention_maps", None) is GPTLightningModule.attention_maps


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

    When the monitor sets :attr:`~podmonitor.capture.base.CaptureAdapter.reduction`, the method
    runs inside :func:`~podmonitor.capture.reduce.reducing`: a model that forms its attention
    in row blocks and supports it (the reference models) reduces each layer as it goes and
    returns no maps; the adapter then returns a :class:`~podmonitor.capture.reduce.ReducedAttention`
    (causal as ``attention_is_causal`` says). Other models return their maps as always.

    The reference models need no forward of their own when they reduce: :meth:`start` asks the
    validation step's forward to hand each layer to the reduction as it goes
    (:func:`~podmonitor.capture.reduce.reducing_in_step`; the layer outputs, and so the step's
    loss, stay those of the fused kernel), and :meth:`collect` takes those layers when the step
    gave exactly one per layer of the model. Otherwise (EGA, autocast, a step that ran the model
    twice or not at all) it runs ``attention_maps(batch)`` as above. Nothing is attached.
    """

    name = "protocol"

    def __init__(self) -> None:
        self._in_step: Any = None  # the token of reducing_in_step while the step's forward reduces

    @classmethod
    def applies(cls, module: torch.nn.Module) -> bool:
        return callable(getattr(module, "attention_maps", None))

    def start(self, module: torch.nn.Module) -> None:
        if self.reduction is not None and self._in_step is None and _own_maps(module):
            self.reduction.clear()
            self._in_step = reducing_in_step(self.reduction)

    def stop(self) -> None:
        if self._in_step is not None:
            token, self._in_step = self._in_step, None
            stop_reducing_in_step(token)

    def collect(self, module: torch.nn.Module, batch: Any, outputs: Any) -> CapturedAttention | ReducedAttention:
        # only the library's own attention_maps (the reference models) reduces: a user's method may
        # select, split or restack what the forward returns, which a reduction cannot follow
        own = _own_maps(module)
        reduction = self.reduction if own else None
        in_step = self._in_step is not None
        self.stop()
        if in_step and reduction is not None:
            n_layer = getattr(getattr(module, "config", None), "n_layer", None)
            if len(reduction.layers) and len(reduction.layers) == n_layer:  # the step's own forward reduced
                layers, reduction.layers = reduction.layers, []
                return ReducedAttention(layers=[layer.result() for layer in layers],
                                        layer_names=layer_names(len(layers)),
                                        causal=common_causal(layer.causal for layer in layers))
        if reduction is not None:
            reduction.clear()
        with torch.no_grad(), (reducing(reduction) if reduction is not None else contextlib.nullcontext()):
            maps = module.attention_maps(batch)
        causal = _flag(module, "attention_is_causal")
        if reduction is not None and reduction.layers:  # the model reduced its attention as it formed it
            layers, reduction.layers = reduction.layers, []
            if isinstance(maps, CapturedAttention) or len(maps):
                raise ValueError(f"{type(module).__name__}.attention_maps(batch) returned maps for some layers "
                                 f"and reduced {len(layers)} others")
            return ReducedAttention(layers=[layer.result() for layer in layers],
                                    layer_names=layer_names(len(layers)),
                                    causal=common_causal(layer.causal for layer in layers))
        if isinstance(maps, CapturedAttention):
            return maps
        try:
            return CapturedAttention.from_maps(
                maps, causal=causal,
                zeros_above_diagonal=causal is True and _flag(module, "attention_zeros_above_diagonal") is True)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{type(module).__name__}.attention_maps(batch): {err}") from err


__all__ = ["ProtocolAdapter"]
