"""Small helpers shared by the adapters: call-argument access for hooks, mask reading."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

MISSING: Any = object()

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _positional_index(sig: inspect.Signature, name: str) -> int | None:
    """Index of ``name`` among the positional parameters of ``sig`` (None if keyword-only or absent)."""
    for i, p in enumerate(sig.parameters.values()):
        if p.kind not in _POSITIONAL:
            return None
        if p.name == name:
            return i
    return None


def accepts(sig: inspect.Signature, name: str) -> bool:
    """Whether a call with keyword ``name`` binds to ``sig`` (a named parameter or ``**kwargs``)."""
    params = sig.parameters
    if name in params and params[name].kind != inspect.Parameter.POSITIONAL_ONLY:
        return True
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())


def get_arg(sig: inspect.Signature, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    """The value the call ``f(*args, **kwargs)`` passes for parameter ``name``.

    Falls back to the parameter's default in ``sig``, then to ``default``.
    """
    i = _positional_index(sig, name)
    if i is not None and i < len(args):
        return args[i]
    if name in kwargs:
        return kwargs[name]
    p = sig.parameters.get(name)
    if p is not None and p.default is not inspect.Parameter.empty:
        return p.default
    return default


def set_arg(sig: inspect.Signature, args: tuple, kwargs: dict, name: str, value: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of the same call with parameter ``name`` set to ``value``.

    Raises:
        TypeError: ``sig`` has no such parameter and no ``**kwargs``.
    """
    i = _positional_index(sig, name)
    if i is not None and i < len(args):
        return args[:i] + (value,) + args[i + 1 :], kwargs
    if not accepts(sig, name):
        raise TypeError(f"the call accepts no argument {name!r}")
    return args, {**kwargs, name: value}


def blocked(mask: torch.Tensor) -> torch.Tensor:
    """Boolean tensor, True where an attention mask blocks a key.

    PyTorch convention: a boolean mask blocks where True; a float mask is added to the
    scores and blocks where it is ``-inf`` (or a huge negative number standing in for it).
    """
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        return torch.isneginf(mask) | (mask <= torch.finfo(mask.dtype).min / 2)
    return mask != 0


def is_causal_mask(mask: torch.Tensor) -> bool:
    """Whether an additive/boolean attention mask (..., T, T) blocks exactly the keys j > i."""
    if mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    t = mask.shape[-1]
    upper = torch.ones(t, t, dtype=torch.bool, device=mask.device).triu(1)
    return bool((blocked(mask) == upper).all())


def strictly_upper_is_zero(fields: list[torch.Tensor]) -> bool:
    """Whether every field (B, H, T, T) is exactly zero above the diagonal (causal structure)."""
    for f in fields:
        t = f.shape[-1]
        upper = torch.ones(t, t, dtype=torch.bool, device=f.device).triu(1)
        if bool((f[..., upper] != 0).any()):
            return False
    return True


def layer_names(n: int) -> list[str]:
    """``["layer_00", "layer_01", ...]`` (wider numbers past 100 layers)."""
    width = max(2, len(str(max(n - 1, 0))))
    return [f"layer_{i:0{width}d}" for i in range(n)]


def common_causal(flags: Iterable[bool]) -> bool | None:
    """The capture's ``causal`` from its layers' own: True or False when every layer agrees, None
    when they differ (an encoder-decoder model), so that each layer's accumulators and stability
    signals infer it from that layer's own field; None for no layers."""
    seen = {bool(f) for f in flags}
    return seen.pop() if len(seen) == 1 else None
