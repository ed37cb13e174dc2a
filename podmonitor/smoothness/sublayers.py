"""Attention sub-layers as functions of their input: find them, capture their input, call them.

The smoothness metrics need the attention sub-layer f (all heads and the output projection,
no residual) as a function X -> f(X) of its actual input. The input is captured by a forward
pre-hook during the model's own validation forward (:class:`InputCapture`); afterwards the
sub-layer is called again on that input (or on perturbations of it) by :class:`BoundSublayer`,
always through the explicit-softmax (math) path, in fp32 and eval mode.

Supported sub-layers (:func:`find_attention_sublayers`, first kind found wins):

- "gpt": :class:`podmonitor.models.gpt.CausalSelfAttention` (softmax and EGA), called as
  ``attn(x, return_attention=True)``;
- "huggingface": the outermost modules of a ``transformers`` model whose class name ends with
  "Attention" and whose forward takes ``hidden_states`` first (GPT-2, Llama, ...: modules that end
  with their output projection); called with the captured arguments, caching off,
  ``output_attentions=True``, eager attention (switched on only around these calls) and the
  captured attention mask converted to the eager path's additive form;
- "torch_mha": ``torch.nn.MultiheadAttention`` self-attention calls (query is key is value),
  called as ``mha(x, x, x, attn_mask=..., key_padding_mask=..., need_weights=True,
  average_attn_weights=False)``.

Prefixes (sigma(n) for n < T): "prefix" mode calls f on the first n rows alone (the reference
GPT; MultiheadAttention, whose masks are sliced to n); "block" mode (causal Hugging Face
modules, whose extra arguments such as masks and rotary tables are model-specific) perturbs
only the first n rows of the full-length input and reads the first n output rows -- for causal
attention the same Jacobian, since outputs i < n do not depend on inputs j >= n; "full" (a
non-causal Hugging Face module): only n = T.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from podmonitor.capture._util import blocked, get_arg, is_causal_mask, set_arg
from podmonitor.capture.hooks import HookHandles, MHAFastPathOff, mha_fastpath_off

PrefixMode = Literal["prefix", "block", "full"]
SublayerKind = Literal["gpt", "huggingface", "torch_mha"]

__all__ = [
    "AttentionSublayer",
    "BoundSublayer",
    "CapturedCall",
    "InputCapture",
    "find_attention_sublayers",
]

_CACHE_ARGS = ("past_key_values", "past_key_value", "layer_past")


# --------------------------------------------------------------------------------------------
# small helpers


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor inside tuples / lists / dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A detached normal (non-inference) copy; floating tensors in fp32."""
    t = t.detach().clone()
    return t.float() if t.is_floating_point() else t


@contextlib.contextmanager
def _modes_kept(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Put ``modules`` (and their children) in eval mode; restore every ``training`` flag after."""
    saved = [(m, m.training) for root in modules for m in root.modules()]
    try:
        for root in modules:
            root.eval()
        yield
    finally:
        for m, mode in saved:
            m.training = mode


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` by name (shared ones once)."""
    return list(module.named_parameters()) + list(module.named_buffers())


def _refresh_from(target: nn.Module, live: nn.Module) -> bool:
    """Copy every parameter and buffer of ``live`` into ``target`` (its fp32 copy), in place.

    Returns:
        False, with nothing copied, when the two do not have the same tensor names, shapes and
        devices (or a floating tensor of ``target`` is not fp32, or a non-floating one changed
        dtype): the copy must then be made again.
    """
    dst, src = _tensors(target), _tensors(live)
    if [n for n, _ in dst] != [n for n, _ in src]:
        return False
    for (_, d), (_, s) in zip(dst, src, strict=True):
        if d.shape != s.shape or d.device != s.device:
            return False
        if d.dtype != (torch.float32 if s.is_floating_point() else s.dtype):
            return False
    with torch.no_grad():
        for (_, d), (_, s) in zip(dst, src, strict=True):
            d.copy_(s)
    return True


def _additive_mask(mask: Any, causal: bool, batch: int, T: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor | None:
    """An attention mask as the eager path of transformers expects it: additive float (b, 1, T, T).

    Masks built for other attention implementations are converted: None (sdpa / flash skip the
    mask of plain causal attention) -> the causal mask; boolean (True = attend) -> 0 / min;
    2-D padding masks (b, T) (1 = token) -> combined with the causal mask. Float masks are kept.
    """
    neg = torch.finfo(dtype).min
    allowed = torch.ones(T, T, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed.tril()
    if mask is None:
        if not causal:
            return None
        return torch.zeros(T, T, dtype=dtype, device=device).masked_fill(~allowed, neg).expand(batch, 1, T, T)
    if not isinstance(mask, torch.Tensor):
        return mask
    if mask.is_floating_point() and mask.dim() == 4:
        return mask.to(dtype)
    if mask.dim() == 2:  # (b, T) padding mask
        keys = mask.to(device) != 0
        full = allowed.unsqueeze(0) & keys[:, None, :]  # (b, T, T)
        return torch.zeros(full.shape, dtype=dtype, device=device).masked_fill(~full, neg).unsqueeze(1)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask.to(device), neg)
    return mask.to(dtype)


@contextlib.contextmanager
def _hf_eager(model: nn.Module | None) -> Iterator[None]:
    """A Hugging Face model (and its sub-configs) on eager attention; every ``_attn*`` attribute restored."""
    if model is None:
        yield
        return
    from podmonitor.capture.huggingface import HuggingFaceAdapter, _configs

    configs = _configs(model)
    cfg = getattr(model, "config", None)
    if cfg is not None and all(cfg is not c for c in configs):
        configs.append(cfg)
    saved = [(c, {k: v for k, v in vars(c).items() if k.startswith("_attn")}) for c in configs]
    try:
        if cfg is not None:
            HuggingFaceAdapter._switch_to_eager(model)  # a PreTrainedModel, or a sub-layer with a config
        yield
    finally:
        for c, attrs in reversed(saved):
            current = vars(c)
            for key in [k for k in current if k.startswith("_attn") and k not in attrs]:
                del current[key]
            current.update(attrs)


# --------------------------------------------------------------------------------------------
# sub-layers


@dataclass
class CapturedCall:
    """The arguments of one call of a sub-layer, as its forward pre-hook saw them."""

    args: tuple
    kwargs: dict


@dataclass
class AttentionSublayer:
    """One attention sub-layer of a model.

    Attributes:
        name: module path in the model (unique).
        module: the attention module (hooked for its input, called as a function of it).
        kind: "gpt", "huggingface" or "torch_mha".
        hf_model: the ``transformers.PreTrainedModel`` the module belongs to ("huggingface" only).
    """

    name: str
    module: nn.Module
    kind: SublayerKind
    hf_model: nn.Module | None = None
    _sig: inspect.Signature | None = field(default=None, repr=False)
    _fp32: nn.Module | None = field(default=None, repr=False)

    def signature(self) -> inspect.Signature:
        if self._sig is None:
            self._sig = inspect.signature(self.module.forward)
        return self._sig

    def fp32_module(self) -> nn.Module:
        """The module itself when its floating parameters are fp32, else an fp32 copy of it.

        The copy is made once (``copy.deepcopy(module).float()``) and kept; every later call
        copies the live module's current parameters and buffers into it (``copy_``) instead of
        copying the whole module again. It is made afresh when the module's parameters or
        buffers no longer match it (names, shapes or devices changed).
        """
        module = self.module
        if all(p.dtype == torch.float32 for p in module.parameters() if p.is_floating_point()):
            return module
        cached = self._fp32
        if cached is not None and _refresh_from(cached, module):
            return cached
        self._fp32 = copy.deepcopy(module).float()  # fp32 copy of a half / bf16 sub-layer
        return self._fp32

    # --------------------------------------------------------------------- input
    def input_of(self, call: CapturedCall) -> torch.Tensor | None:
        """The (B, T, C) input of a call, or None when the call is not self-attention."""
        sig = self.signature()
        if self.kind == "gpt":
            x = get_arg(sig, call.args, call.kwargs, "x")
            return x if isinstance(x, torch.Tensor) and x.dim() == 3 else None
        if self.kind == "huggingface":
            if get_arg(sig, call.args, call.kwargs, "encoder_hidden_states") is not None:
                return None
            x = get_arg(sig, call.args, call.kwargs, "hidden_states")
            return x if isinstance(x, torch.Tensor) and x.dim() == 3 else None
        q = get_arg(sig, call.args, call.kwargs, "query")
        k = get_arg(sig, call.args, call.kwargs, "key")
        v = get_arg(sig, call.args, call.kwargs, "value")
        if not (isinstance(q, torch.Tensor) and q is k and k is v and q.dim() == 3):
            return None  # cross-attention or unbatched input: not measured
        return q if getattr(self.module, "batch_first", False) else q.transpose(0, 1)

    def bind(self, call: CapturedCall, max_sequences: int, keep: torch.Tensor | None = None) -> BoundSublayer:
        """The sub-layer as a function of the captured input, on at most ``max_sequences`` sequences.

        Call inside ``torch.inference_mode(False)`` so that the copies are normal tensors.

        Args:
            call: a captured self-attention call (``input_of(call)`` is not None).
            max_sequences: b, the number of sequences kept (the first usable ones).
            keep: (B,) bool, sequences allowed (e.g. without padding); default all.

        Raises:
            ValueError: the call is not self-attention, or no sequence is left.
        """
        x = self.input_of(call)
        if x is None:
            raise ValueError(f"{self.name}: the captured call is not a self-attention call")
        B = x.shape[0]
        ok = torch.ones(B, dtype=torch.bool) if keep is None else keep.detach().to("cpu", torch.bool).clone()
        if self.kind == "torch_mha":
            kpm = get_arg(self.signature(), call.args, call.kwargs, "key_padding_mask")
            if isinstance(kpm, torch.Tensor) and kpm.dim() == 2:
                ok &= ~blocked(kpm).any(dim=-1).cpu()
        index = torch.nonzero(ok).flatten()[:max_sequences]
        if index.numel() == 0:
            raise ValueError(f"{self.name}: no sequence without padding in the captured batch")
        return BoundSublayer(self, call, index, B)


def find_attention_sublayers(module: nn.Module, paths: Sequence[str] | None = None) -> list[AttentionSublayer]:
    """The attention sub-layers of ``module`` that can be measured.

    Without ``paths``: every reference-GPT ``CausalSelfAttention``; if there is none, the
    outermost "...Attention" modules of a Hugging Face model; if none, every
    ``nn.MultiheadAttention``. With ``paths``: exactly those submodules (each of a supported kind).

    Raises:
        ValueError: a path names no submodule or a module of no supported kind.
    """
    from podmonitor.capture.huggingface import pretrained_model_class
    from podmonitor.models.gpt import CausalSelfAttention

    ptm = pretrained_model_class()

    def hf_owner(path: str) -> nn.Module | None:
        if ptm is None:
            return None
        owner = None
        parts = path.split(".") if path else []
        for i in range(len(parts) + 1):
            sub = module.get_submodule(".".join(parts[:i]))
            if isinstance(sub, ptm):
                owner = sub
        return owner

    def is_hf_attention(path: str, m: nn.Module) -> bool:
        if not type(m).__name__.endswith("Attention") or getattr(m, "is_cross_attention", False):
            return False
        params = list(inspect.signature(m.forward).parameters)
        return bool(params) and params[0] == "hidden_states" and hf_owner(path) is not None

    def kind_of(path: str, m: nn.Module) -> SublayerKind | None:
        if isinstance(m, CausalSelfAttention):
            return "gpt"
        if isinstance(m, nn.MultiheadAttention):
            return "torch_mha"
        if is_hf_attention(path, m):
            return "huggingface"
        return None

    if paths is not None:
        out = []
        for p in paths:
            m = module.get_submodule(p)
            kind = kind_of(p, m)
            if kind is None:
                raise ValueError(f"{p!r} ({type(m).__name__}) is not a supported attention sub-layer")
            out.append(AttentionSublayer(p, m, kind, hf_owner(p) if kind == "huggingface" else None))
        return out
    named = list(module.named_modules())
    gpt = [AttentionSublayer(p or "self", m, "gpt") for p, m in named if isinstance(m, CausalSelfAttention)]
    if gpt:
        return gpt
    hf: list[AttentionSublayer] = []
    for p, m in named:
        if is_hf_attention(p, m) and not any(p.startswith(s.name + ".") for s in hf):
            hf.append(AttentionSublayer(p, m, "huggingface", hf_owner(p)))
    if hf:
        return hf
    return [AttentionSublayer(p or "self", m, "torch_mha") for p, m in named if isinstance(m, nn.MultiheadAttention)]


# --------------------------------------------------------------------------------------------
# bound sub-layer


class BoundSublayer:
    """An attention sub-layer with its captured input: f(X) and its attention P, in fp32 / eval.

    Attributes:
        x: (b, T, C) fp32 input of the b kept sequences.
        causal: whether no information flows from later tokens to earlier outputs (then sigma(n)
            is non-decreasing in n); False for the reference GPT's EGA "window" gate, whose
            attention matrix is lower-triangular but whose gate statistics see the whole window.
        mask_causal: whether query i attends to keys j <= i only (the entropy normalisation).
        prefix_mode: "prefix", "block" or "full" (see the module docstring).
    """

    def __init__(self, sub: AttentionSublayer, call: CapturedCall, index: torch.Tensor, batch: int) -> None:
        self.sub = sub
        self.index = index
        sig = sub.signature()
        x_full = sub.input_of(call)
        assert x_full is not None
        dev = x_full.device
        idx = index.to(dev)

        def select(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, idx.to(t.device)) if t.dim() >= 2 and t.shape[0] == batch else t

        self.x = _plain(x_full.index_select(0, idx))  # (b, T, C)
        module = sub.fp32_module()  # the module, or its cached fp32 copy with the live weights
        self.module = module
        self._hf_model = sub.hf_model if module is sub.module else module
        self.prefix_mode: PrefixMode = "prefix"
        self._args: tuple = ()
        self._kwargs: dict = {}
        self._attn_mask: torch.Tensor | None = None
        self._kpm: torch.Tensor | None = None
        self.mask_causal = True  # query i sees keys j <= i only (for the entropy normalisation)
        if sub.kind == "gpt":
            gate = getattr(module, "gate", None)
            self.causal = gate is None or getattr(gate, "mode", "causal") == "causal"
        elif sub.kind == "torch_mha":
            attn_mask = get_arg(sig, call.args, call.kwargs, "attn_mask")
            kpm = get_arg(sig, call.args, call.kwargs, "key_padding_mask")
            is_causal = bool(get_arg(sig, call.args, call.kwargs, "is_causal", False))
            T = self.x.shape[1]
            if attn_mask is None and is_causal:
                attn_mask = torch.ones(T, T, dtype=torch.bool, device=dev).triu(1)
            if isinstance(attn_mask, torch.Tensor) and attn_mask.dim() == 3:  # (B * H, T, T)
                H = attn_mask.shape[0] // batch
                attn_mask = attn_mask.view(batch, H, T, T).index_select(0, idx.to(attn_mask.device))
                attn_mask = attn_mask.reshape(-1, T, T)
            self._attn_mask = _plain(attn_mask) if isinstance(attn_mask, torch.Tensor) else None
            self._kpm = _plain(select(kpm)) if isinstance(kpm, torch.Tensor) else None
            self.causal = self._attn_mask is not None and is_causal_mask(self._attn_mask)
            self.mask_causal = self.causal
        else:  # huggingface
            args, kwargs = call.args, dict(call.kwargs)
            for name in _CACHE_ARGS:
                if get_arg(sig, args, kwargs, name) is not None:
                    args, kwargs = set_arg(sig, args, kwargs, name, None)
            for name, value in (("use_cache", False), ("output_attentions", True)):
                if name in sig.parameters or get_arg(sig, args, kwargs, name) is not None:
                    args, kwargs = set_arg(sig, args, kwargs, name, value)
            args, kwargs = set_arg(sig, args, kwargs, "hidden_states", None)
            self._args = _map_tensors(args, lambda t: _plain(select(t)))
            self._kwargs = _map_tensors(kwargs, lambda t: _plain(select(t)))
            flag = getattr(module, "is_causal", None)
            if isinstance(flag, bool):
                self.causal = flag
            else:
                from podmonitor.capture.huggingface import config_causal

                self.causal = bool(config_causal(sub.hf_model)) if sub.hf_model is not None else False
            if "attention_mask" in sig.parameters:
                mask = get_arg(sig, self._args, self._kwargs, "attention_mask")
                mask = _additive_mask(mask, self.causal, self.n_sequences, self.seq_len, torch.float32, dev)
                self._args, self._kwargs = set_arg(sig, self._args, self._kwargs, "attention_mask", mask)
            self.mask_causal = self.causal
            self.prefix_mode = "block" if self.causal else "full"

    @property
    def seq_len(self) -> int:
        return int(self.x.shape[1])

    @property
    def n_sequences(self) -> int:
        return int(self.x.shape[0])

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """Eval mode, no autocast, math attention path; everything restored on exit."""
        stack = contextlib.ExitStack()
        with stack:
            stack.enter_context(_modes_kept([self.module]))
            stack.enter_context(torch.autocast(self.x.device.type, enabled=False))
            if self.sub.kind == "torch_mha":
                stack.enter_context(mha_fastpath_off())
            if self.sub.kind == "huggingface":
                stack.enter_context(_hf_eager(self._hf_model))
            yield

    def call(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """f(x) (b, n, C) and the attention (b, H, n, n) (or None) for x of length n.

        Must run inside :meth:`calling`. For a "block" sub-layer n must be T.
        """
        n = x.shape[1]
        kind = self.sub.kind
        if kind == "gpt":
            y, att = self.module(x, return_attention=True)
            return y, att
        if kind == "torch_mha":
            xx = x if self.module.batch_first else x.transpose(0, 1)
            mask = self._attn_mask[..., :n, :n] if self._attn_mask is not None else None
            kpm = self._kpm[:, :n] if self._kpm is not None else None
            y, att = self.module(xx, xx, xx, attn_mask=mask, key_padding_mask=kpm, need_weights=True,
                                 average_attn_weights=False)
            y = y if self.module.batch_first else y.transpose(0, 1)
            return y, att
        if n != self.seq_len:
            raise ValueError(f"{self.sub.name}: a Hugging Face sub-layer is called at full length only")
        sig = self.sub.signature()
        args, kwargs = set_arg(sig, self._args, self._kwargs, "hidden_states", x)
        out = self.module(*args, **kwargs)
        y = out[0] if isinstance(out, (tuple, list)) else out
        att = out[1] if isinstance(out, (tuple, list)) and len(out) > 1 else None
        if not (isinstance(att, torch.Tensor) and att.dim() == 4):
            att = None
        return y, att

    def lengths(self, grid: Sequence[int]) -> list[int]:
        """The prefix lengths of ``grid`` this sub-layer can be measured at (all for prefix / block)."""
        T = self.seq_len
        if self.prefix_mode == "full":
            return [T]
        return sorted({min(int(n), T) for n in grid if n >= 1})

    def function(self, n: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The sub-layer on prefixes of length n: (b, n, C) -> (b, n, C), evaluated at ``x[:, :n]``."""
        T = self.seq_len
        if not 1 <= n <= T:
            raise ValueError(f"prefix length {n} outside 1..{T}")
        if self.prefix_mode == "prefix" or n == T:
            return lambda xn: self.call(xn)[0]
        if self.prefix_mode == "full":
            raise ValueError(f"{self.sub.name}: non-causal Hugging Face sub-layer, only n = T = {T}")
        tail = self.x[:, n:]

        def block(xn: torch.Tensor) -> torch.Tensor:
            return self.call(torch.cat([xn, tail.to(xn.dtype)], dim=1))[0][:, :n]

        return block

    def attention(self) -> torch.Tensor | None:
        """(b, H, T, T) attention of the full input, fp32, or None when the module does not return it."""
        with torch.no_grad(), self.calling():
            _, att = self.call(self.x)
        return None if att is None else att.detach().float()


# --------------------------------------------------------------------------------------------
# capture


class InputCapture:
    """Forward pre-hooks that record the first self-attention call of every sub-layer.

    Example:
        >>> cap = InputCapture(find_attention_sublayers(model))
        >>> with cap.capturing(model):
        ...     model.validation_step(batch, 0)
        >>> cap.calls["model.transformer.h.0.attn"]  # CapturedCall

    While capturing, the ``torch.nn.MultiheadAttention`` fast path is off (it would bypass the
    module calls); it is restored by :meth:`stop`. Nothing else about the model's forward changes
    (Hugging Face models keep their attention implementation; their masks are converted when the
    sub-layer is called again, see :class:`BoundSublayer`).
    """

    def __init__(self, sublayers: Sequence[AttentionSublayer]) -> None:
        self.sublayers = list(sublayers)
        self.calls: dict[str, CapturedCall] = {}
        self._hooks = HookHandles()  # the shared capture mechanism (podmonitor.capture.hooks)
        self._fastpath = MHAFastPathOff()

    def start(self) -> None:
        self.stop()
        self.calls = {}
        try:
            if any(s.kind == "torch_mha" for s in self.sublayers):
                self._fastpath.switch_off()
            for s in self.sublayers:
                self._hooks.add(s.module.register_forward_pre_hook(self._hook_for(s), with_kwargs=True))
        except BaseException:
            self.stop()
            raise

    def _hook_for(self, sub: AttentionSublayer) -> Callable[[nn.Module, tuple, dict], None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if sub.name in self.calls:
                return
            call = CapturedCall(args=tuple(args), kwargs=dict(kwargs))
            if sub.input_of(call) is not None:
                for name in _CACHE_ARGS:  # never hold a KV cache
                    if name in call.kwargs:
                        call.kwargs[name] = None
                self.calls[sub.name] = call

        return hook

    def stop(self) -> None:
        """Remove the hooks and put the fast path back (idempotent)."""
        self._hooks.remove()
        self._fastpath.restore()

    @contextlib.contextmanager
    def capturing(self) -> Iterator[InputCapture]:
        try:
            self.start()
            yield self
        finally:
            self.stop()
