"""Capture from ``torch.nn.MultiheadAttention`` self-attention (nn.Transformer* models and the like)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from podmonitor.capture._util import blocked, common_causal, get_arg, is_causal_mask, set_arg
from podmonitor.capture.base import CaptureAdapter, CapturedAttention
from podmonitor.capture.hooks import HookHandles, MHAFastPathOff


@dataclass
class _Call:
    """What one self-attention call asked for, and what it looked like."""

    need_weights: bool
    average_attn_weights: bool
    key_padding_mask: torch.Tensor | None
    causal: bool


@dataclass
class _Record:
    name: str
    weights: torch.Tensor  # (B, H, T, T)
    valid: torch.Tensor | None  # (B,) bool
    causal: bool


class TorchMHAAdapter(CaptureAdapter):
    """Per-head weights of every ``nn.MultiheadAttention`` self-attention call in the validation step.

    During capture, on each MHA module:

    - a forward pre-hook forces ``need_weights=True, average_attn_weights=False`` on
      self-attention calls (``query is key``); cross-attention calls are left alone;
    - a forward hook stores the (B, H, T, T) weights and gives the caller back what it
      asked for (``None`` when it asked ``need_weights=False``, the head average when it
      asked ``average_attn_weights=True``);
    - PyTorch's fast path is switched off (``torch.backends.mha.set_fastpath_enabled(False)``),
      because in eval mode without gradients ``nn.TransformerEncoderLayer`` would otherwise
      run a fused kernel that never calls ``self_attn``. The previous value is restored.

    The attention output is computed by the explicit (math) path while capturing: equal to
    the fast path up to float rounding.

    ``valid``: a sequence is valid iff no ``key_padding_mask`` passed to any captured call
    masks one of its keys. ``causal``: a call is causal when it passes ``is_causal=True`` or
    an ``attn_mask`` that blocks exactly the keys j > i; the result is True (all causal),
    False (none) or None (mixed). Layers are named by module path, in the order the calls
    ran; a module called again in the same step (weight sharing, a second forward) adds
    ``"<path>#1"``, ``"<path>#2"``, ...
    """

    name = "torch_mha"

    def __init__(self) -> None:
        self._hooks = HookHandles()
        self._fastpath = MHAFastPathOff()
        self._pending: dict[int, list[_Call | None]] = {}
        self._records: list[_Record] = []

    @classmethod
    def applies(cls, module: nn.Module) -> bool:
        return any(isinstance(m, nn.MultiheadAttention) for m in module.modules())

    # ----------------------------------------------------------------- start / stop
    def start(self, module: nn.Module) -> None:
        """Switch off the fast path and hook every ``nn.MultiheadAttention`` of ``module``.

        Raises:
            ValueError: ``module`` contains no ``nn.MultiheadAttention``.
        """
        self.stop()
        try:
            self._fastpath.switch_off()
            found = False
            for path, sub in module.named_modules():
                if not isinstance(sub, nn.MultiheadAttention):
                    continue
                found = True
                sig = inspect.signature(sub.forward)
                self._pending[id(sub)] = []
                self._hooks.add(sub.register_forward_pre_hook(partial(self._pre_hook, sig), with_kwargs=True))
                self._hooks.add(sub.register_forward_hook(partial(self._hook, path or "self")))
            if not found:
                raise ValueError(f"{type(module).__name__} contains no torch.nn.MultiheadAttention")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self._hooks.remove()
        self._fastpath.restore()  # only if nobody switched it back on in between (podmonitor.capture.hooks)
        self._pending.clear()
        self._records.clear()

    # ----------------------------------------------------------------- hooks
    def _pre_hook(self, sig: inspect.Signature, mha: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        query = get_arg(sig, args, kwargs, "query")
        key = get_arg(sig, args, kwargs, "key")
        if query is not key:  # cross-attention: not captured, not touched
            self._pending[id(mha)].append(None)
            return None
        attn_mask = get_arg(sig, args, kwargs, "attn_mask")
        causal = bool(get_arg(sig, args, kwargs, "is_causal", False)) or (
            attn_mask is not None and is_causal_mask(attn_mask)
        )
        self._pending[id(mha)].append(
            _Call(
                need_weights=bool(get_arg(sig, args, kwargs, "need_weights", True)),
                average_attn_weights=bool(get_arg(sig, args, kwargs, "average_attn_weights", True)),
                key_padding_mask=get_arg(sig, args, kwargs, "key_padding_mask"),
                causal=causal,
            )
        )
        args, kwargs = set_arg(sig, args, kwargs, "need_weights", True)
        return set_arg(sig, args, kwargs, "average_attn_weights", False)

    def _hook(self, path: str, mha: nn.Module, args: tuple, output: Any) -> Any:
        pending = self._pending.get(id(mha))
        call = pending.pop() if pending else None
        if call is None:
            return None
        attn_out, weights = output
        if weights is None:  # should not happen with need_weights=True; leave the output alone
            return None
        if weights.dim() == 3:  # unbatched input: (H, T, S)
            weights_b = weights.unsqueeze(0)
        else:
            weights_b = weights
        valid = None
        if call.key_padding_mask is not None:
            kpm = call.key_padding_mask
            kpm = kpm.unsqueeze(0) if kpm.dim() == 1 else kpm
            valid = ~blocked(kpm).any(dim=-1).to(weights_b.device)
        repeats = sum(1 for r in self._records if r.name == path or r.name.startswith(path + "#"))
        name = path if repeats == 0 else f"{path}#{repeats}"
        self._records.append(_Record(name, weights_b.detach(), valid, call.causal))
        if not call.need_weights:
            return attn_out, None
        if call.average_attn_weights:
            return attn_out, weights.mean(dim=-3)
        return None

    # ----------------------------------------------------------------- collect
    def collect(self, module: nn.Module, batch: Any, outputs: Any) -> CapturedAttention:
        """The self-attention weights recorded during the validation step.

        Raises:
            RuntimeError: no MultiheadAttention self-attention ran (or ``start`` was not called).
            ValueError: the weights are not square (B, H, T, T) with one B and T for all layers
                (e.g. ``add_zero_attn`` or ``bias_k`` add a key).
        """
        records, self._records = self._records, []
        if not records:
            started = bool(self._hooks)
            raise RuntimeError(
                "TorchMHAAdapter saw no nn.MultiheadAttention self-attention call during the validation step"
                + ("" if started else " (start(module) was not called before the step)")
                + ": does validation_step run the attention layers on the batch?"
            )
        valid = None
        for r in records:
            if r.valid is not None:
                valid = r.valid if valid is None else valid & r.valid
        return CapturedAttention(
            fields=[r.weights for r in records],
            layer_names=[r.name for r in records],
            valid=valid,
            causal=common_causal(r.causal for r in records),
        )


__all__ = ["TorchMHAAdapter"]
