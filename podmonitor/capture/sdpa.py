"""Capture from models that call ``torch.nn.functional.scaled_dot_product_attention`` (METHOD.md section 11).

Fused attention never forms the probabilities A. While capturing, every SDPA call of the
validation step is intercepted (a :class:`torch.overrides.TorchFunctionMode`), passed through
unchanged, and A = softmax(Q K^T * scale + mask) is recomputed from the call's own arguments
with the function's semantics. A self-check (A V against the function's output) guards every
recomputed layer. The same interception, inside chosen modules only, scales heads' outputs:
:class:`SDPAHeadMask` (head masking for any SDPA model).

Layers are named by the module path of the module whose forward made the call
(``transformer.h.3.attn``), found with a stack of module paths kept by forward pre/post hooks
attached only while capturing; a module making several self-attention calls in one validation
step adds ``"<path>#1"``, ``"<path>#2"``, ...
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from podmonitor import hugepages
from podmonitor.capture._util import common_causal
from podmonitor.capture.base import NOTHING_FITS, CaptureAdapter, CapturedAttention
from podmonitor.capture.hooks import HookHandles
from podmonitor.capture.reduce import LayerReduction, ReducedAttention, Reduction

#: the function intercepted (the builtin itself, also when a library wrapped ``F.scaled_dot_product_attention``)
SDPA = torch._C._nn.scaled_dot_product_attention

_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                             "enable_gqa": False}

#: self-check tolerance by query dtype: max |A V - out| relative to the largest |V| of each (sequence, head)
SELF_CHECK_TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 3e-2,
}

#: a float mask entry at or below this blocks its key (-inf, ``finfo.min``, the -10000 of older models)
FLOAT_MASK_BLOCKS = -1e4

#: working memory of one chunk of query rows during the recomputation (bytes)
DEFAULT_CHUNK_BYTES = 32 * 2**20

#: query rows per block when a causal call is recomputed in row blocks (:func:`_recompute_causal`)
CAUSAL_BLOCK_ROWS = 128

_FOREIGN = ("torch", "transformers")  # packages whose classes have their own adapters (or never call SDPA)


# ----------------------------------------------------------------------------- the call
@dataclass
class SDPACall:
    """The arguments of one ``scaled_dot_product_attention`` call, defaults filled in."""

    query: Tensor
    key: Tensor
    value: Tensor
    attn_mask: Tensor | None
    dropout_p: float
    is_causal: bool
    scale: float | None
    enable_gqa: bool

    @classmethod
    def bind(cls, args: tuple, kwargs: Mapping[str, Any]) -> SDPACall:
        """The call ``scaled_dot_product_attention(*args, **kwargs)``.

        Raises:
            TypeError: more positional arguments than the function takes, or an unknown keyword.
        """
        if len(args) > len(_PARAMS):
            raise TypeError(f"scaled_dot_product_attention takes {len(_PARAMS)} arguments, got {len(args)}")
        unknown = set(kwargs) - set(_PARAMS)
        if unknown:
            raise TypeError(f"scaled_dot_product_attention got unknown arguments {sorted(unknown)}")
        values = dict(_DEFAULTS)
        values.update(zip(_PARAMS, args, strict=False))
        values.update(kwargs)
        return cls(
            query=values["query"], key=values["key"], value=values["value"], attn_mask=values["attn_mask"],
            dropout_p=float(values["dropout_p"]), is_causal=bool(values["is_causal"]),
            scale=None if values["scale"] is None else float(values["scale"]), enable_gqa=bool(values["enable_gqa"]),
        )

    def without_dropout(self) -> dict[str, Any]:
        """Keyword arguments of the same call with ``dropout_p=0``."""
        return {"query": self.query, "key": self.key, "value": self.value, "attn_mask": self.attn_mask,
                "dropout_p": 0.0, "is_causal": self.is_causal, "scale": self.scale, "enable_gqa": self.enable_gqa}


def mask_blocks(mask: Tensor) -> Tensor:
    """Boolean tensor, True where an SDPA ``attn_mask`` blocks a key.

    SDPA convention (the opposite of ``nn.MultiheadAttention``'s): a boolean mask is True where
    the query MAY attend; a float mask is added to the scores and blocks where it is at or below
    :data:`FLOAT_MASK_BLOCKS` (``-inf``, ``torch.finfo(dtype).min``, -10000).
    """
    if mask.dtype == torch.bool:
        return ~mask
    return mask <= FLOAT_MASK_BLOCKS


@dataclass
class Recomputed:
    """What the recomputation of one self-attention call found.

    Attributes:
        probs: (B, H, T, T) float32: A = softmax(Q K^T * scale + mask); rows whose keys are all
            blocked are zero (as SDPA's output for them). None when the recomputation handed A
            to a :class:`~podmonitor.capture.reduce.LayerReduction` instead (``reduced``).
        logit_max: (B, H) float32: max of q.k * scale over the queries and visible keys (-inf
            when nothing is visible).
        error: max over (sequence, head) of max |A V - out| / max |V|, over finite entries.
        padded: (B,) bool, True for sequences with a key that the mask blocks for every query
            and head (a padded key); None without a mask.
        causal: every key j > i is blocked (is_causal, or a lower-triangular mask).
        zeros_above_diagonal: the probabilities were written +0 at every key j > i (the
            ``is_causal`` call without a mask, :func:`_recompute_causal`; rows with a non-finite
            score excepted, whose visible entries are then not finite either).
    """

    probs: Tensor | None
    logit_max: Tensor
    error: float
    padded: Tensor | None
    causal: bool
    zeros_above_diagonal: bool = False
    reduced: LayerReduction | None = None


def _rows(t: Tensor | None, r0: int, r1: int) -> Tensor | None:
    """Rows r0:r1 of a mask (..., L or 1, S) (a size-1 query dimension broadcasts)."""
    if t is None or t.dim() < 2 or t.shape[-2] == 1:
        return t
    return t[..., r0:r1, :]


def _chunks(b: int, h: int, t: int, heads_per: int, rows_per: int) -> Iterator[tuple[int, int, int, int, int]]:
    """``(sequence, h0, h1, r0, r1)`` of every chunk of the recomputation: heads [h0, h1) and query
    rows [r0, r1) of one sequence."""
    for bi in range(b):
        for h0 in range(0, h, heads_per):
            for r0 in range(0, t, rows_per):
                yield bi, h0, min(h, h0 + heads_per), r0, min(t, r0 + rows_per)


def _worst(errors: Tensor, diff: Tensor) -> Tensor:
    """The running self-check error raised by a chunk's ``|A V - out| / max |V|`` (non-finite
    entries, e.g. of rows whose output is itself not finite, ignored)."""
    diff.masked_fill_(~torch.isfinite(diff), 0.0)
    return torch.maximum(errors, diff.amax()) if diff.numel() else errors


def recompute(call: SDPACall, output: Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
              reduction: Reduction | None = None, position: int = 0) -> Recomputed:
    """Recompute A of a 4-d self-attention call and self-check it against the call's ``output``.

    Exactly SDPA's semantics: scale defaults to 1/sqrt(E); a bool mask is True where a key may
    be attended, a float mask is added to the scores; ``is_causal`` blocks j > i; ``enable_gqa``
    repeats K and V over the query heads (``repeat_interleave``); no dropout. The scores are
    computed in float32 (float64 for float64 inputs), ``chunk_bytes`` of query rows at a time,
    so the working memory beyond A itself stays bounded. An ``is_causal`` call without a mask goes
    in row blocks that read only the keys they can see (:func:`_recompute_causal`). A is written
    into fresh memory advised as huge pages (:mod:`podmonitor.hugepages`).

    Args:
        call: the call's arguments; query (B, H, T, E), key (B, H or H_kv, T, E), value
            (B, H or H_kv, T, Ev), attn_mask broadcastable to (B, H, T, T).
        output: what the call returned, (B, H, T, Ev).
        chunk_bytes: working memory per chunk of queries.
        reduction: when given, A is not kept: a new layer of it (not yet added to its layers;
            ``position`` says which heads it averages) takes A row block by row block (the
            ``is_causal`` call without a mask) or whole (``Recomputed.reduced``).
        position: the layer's position among the capture's layers (for ``reduction``).

    Returns:
        :class:`Recomputed`.
    """
    q, k, v, mask = call.query.detach(), call.key.detach(), call.value.detach(), call.attn_mask
    mask = None if mask is None else mask.detach()
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, h, t, e = q.shape
    if call.enable_gqa and k.shape[-3] != h:
        k = k.repeat_interleave(h // k.shape[-3], dim=-3)
        v = v.repeat_interleave(h // v.shape[-3], dim=-3)
    scale = call.scale if call.scale is not None else 1.0 / math.sqrt(e)
    qs = q.to(work) * scale  # (B, H, T, E): q * scale, so that the scores are q.k * scale
    kt = k.to(work).transpose(-1, -2).expand(b, h, -1, t)  # (B, H, E, T), views where K broadcasts
    vw = v.to(work).expand(b, h, t, -1)  # (B, H, T, Ev)
    out = output.detach().expand(b, h, t, -1)
    v_scale = vw.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(work).tiny)  # (B, H, 1, 1)
    mask4 = None
    causal = call.is_causal
    padded = None
    if mask is not None:
        mask4 = mask
        while mask4.dim() < 4:  # broadcasting aligns on the right: (S,), (L, S), (H, L, S)
            mask4 = mask4.unsqueeze(0)
        blocked = mask_blocks(mask4)
        if not causal:
            upper = torch.ones(t, t, dtype=torch.bool, device=blocked.device).triu(1)
            causal = bool((blocked | ~upper).all())
        column = blocked.all(dim=-2).all(dim=1)  # (B | 1, S): blocked for every query of every head
        padded = column.any(dim=-1).expand(b).to(q.device)
        mask4 = mask4.expand(b, h, t, t)
    logit_max = torch.full((b, h), -math.inf, dtype=torch.float32, device=q.device)
    if call.is_causal and mask is None:  # the usual causal call: only the keys each row block can see
        if reduction is not None:
            layer = reduction.make_layer(b, h, t, True, q.device, position)
            error = _recompute_causal(qs, kt, vw, out, v_scale, None, logit_max, chunk_bytes, layer)
            return Recomputed(probs=None, logit_max=logit_max, error=error, padded=None, causal=True,
                              zeros_above_diagonal=True, reduced=layer)
        probs = hugepages.empty((b, h, t, t), torch.float32, q.device)  # fresh memory: faulted in by huge pages
        error = _recompute_causal(qs, kt, vw, out, v_scale, probs, logit_max, chunk_bytes)
        return Recomputed(probs=probs, logit_max=logit_max, error=error, padded=None, causal=True,
                          zeros_above_diagonal=True)
    probs = hugepages.empty((b, h, t, t), torch.float32, q.device)  # fresh memory: faulted in by huge pages
    # chunks write contiguous blocks of ``probs``: several heads of one sequence (all rows), or, when one
    # head's T x T scores exceed chunk_bytes, rows of one head
    elsize = torch.finfo(work).bits // 8
    head_bytes = t * t * elsize
    if head_bytes <= chunk_bytes:
        heads_per, rows_per = max(1, min(h, chunk_bytes // head_bytes)), t
    else:
        heads_per, rows_per = 1, max(1, chunk_bytes // (t * elsize))
    buffer = torch.empty(heads_per * rows_per * t, dtype=work, device=q.device)  # one chunk's scores, reused
    cols = torch.arange(t, device=q.device)
    errors = torch.zeros((), dtype=work, device=q.device)
    for bi, h0, h1, r0, r1 in _chunks(b, h, t, heads_per, rows_per):
        scores = buffer[: (h1 - h0) * (r1 - r0) * t].view(h1 - h0, r1 - r0, t)
        torch.matmul(qs[bi, h0:h1, r0:r1], kt[bi, h0:h1], out=scores)  # (h, c, T): q.k * scale
        hidden: Tensor | None = None  # keys a query may not attend, broadcastable to (h, c, T)
        if call.is_causal:
            hidden = cols[None, :] > torch.arange(r0, r1, device=q.device)[:, None]
        rows_mask = None if mask4 is None else mask4[bi, h0:h1, r0:r1]
        if rows_mask is not None:
            blocked_rows = ~rows_mask if rows_mask.dtype == torch.bool else rows_mask <= FLOAT_MASK_BLOCKS
            hidden = blocked_rows if hidden is None else hidden | blocked_rows
        if hidden is not None:
            scores.masked_fill_(hidden, -math.inf)
        lm = scores.amax(dim=(-2, -1)).float()  # (h,): over visible keys, before the mask's values
        logit_max[bi, h0:h1] = torch.maximum(logit_max[bi, h0:h1], lm)
        if rows_mask is not None and rows_mask.dtype != torch.bool:
            scores.add_(rows_mask.to(work))
        target = probs[bi, h0:h1, r0:r1]  # contiguous
        if work == torch.float32:
            a = torch.softmax(scores, dim=-1, out=target)
        else:
            a = torch.softmax(scores, dim=-1)
            target.copy_(a)
        dead = None if hidden is None else hidden.all(dim=-1, keepdim=True)  # rows with no visible key
        if dead is not None and bool(dead.any()):
            target.masked_fill_(dead, 0.0)  # as SDPA's output for them: zero
            a = a.masked_fill(dead, 0.0)
        diff = (a @ vw[bi, h0:h1]).sub_(out[bi, h0:h1, r0:r1].to(work)).abs_().div_(v_scale[bi, h0:h1])
        if dead is not None:
            diff.masked_fill_(dead, 0.0)
        errors = _worst(errors, diff)
    error = float(errors)
    if reduction is not None:  # A of a masked or bidirectional call, reduced whole
        layer = reduction.make_layer(b, h, t, causal, q.device, position)
        layer.add_maps(probs)
        return Recomputed(probs=None, logit_max=logit_max, error=error, padded=padded, causal=causal, reduced=layer)
    return Recomputed(probs=probs, logit_max=logit_max, error=error, padded=padded, causal=causal)


def _recompute_causal(qs: Tensor, kt: Tensor, vw: Tensor, out: Tensor, v_scale: Tensor, probs: Tensor | None,
                      logit_max: Tensor, chunk_bytes: int, layer: LayerReduction | None = None) -> float:
    """:func:`recompute` of an ``is_causal`` call without a mask, in row blocks that read only the
    keys they can see: rows [r0, r1) take the scores, softmax and self-check of keys [0, r1), and
    only the block's diagonal square is masked. About half the work and memory traffic of full
    rows at long contexts; the keys right of a block are written as zeros.

    Args:
        qs: (B, H, T, E) queries times the scale, in the working dtype.
        kt: (B, H, E, T) keys, transposed (views where they broadcast).
        vw: (B, H, T, Ev) values; out: (B, H, T, Ev) the call's output; v_scale: (B, H, 1, 1).
        probs: (B, H, T, T) float32, filled here; logit_max: (B, H) float32, raised here.
        chunk_bytes: working memory of one block's scores.
        layer: instead of ``probs`` (None), takes each block's A (all heads of a sequence in
            one block).

    Returns:
        The self-check error: max over (sequence, head) of max |A V - out| / max |V|.
    """
    b, h, t, _ = qs.shape
    work = qs.dtype
    elsize = torch.finfo(work).bits // 8
    if layer is None:
        rows_per = max(1, min(t, CAUSAL_BLOCK_ROWS, chunk_bytes // (t * elsize)))
        heads_per = max(1, min(h, chunk_bytes // (rows_per * t * elsize)))
    else:  # a reduction averages the heads of each block: all of them at once
        rows_per = max(1, min(t, CAUSAL_BLOCK_ROWS, chunk_bytes // (h * t * elsize)))
        heads_per = h
    buffer = torch.empty(heads_per * rows_per * t, dtype=work, device=qs.device)  # one block's scores, reused
    # a reduction reads the probabilities and the centred scores they came from (its entropy
    # needs no logarithm per entry, LayerReduction.add): the probabilities go to a second buffer,
    # and the masked keys hold a finite score (their probability is +0 all the same)
    prob_buffer = None if layer is None else torch.empty_like(buffer)
    masked = -math.inf if layer is None else torch.finfo(work).min / 2
    upper = torch.ones(rows_per, rows_per, dtype=torch.bool, device=qs.device).triu(1)  # j > i in a square
    errors = torch.zeros((), dtype=work, device=qs.device)
    for bi, h0, h1, r0, r1 in _chunks(b, h, t, heads_per, rows_per):
        scores = buffer[: (h1 - h0) * (r1 - r0) * r1].view(h1 - h0, r1 - r0, r1)
        torch.matmul(qs[bi, h0:h1, r0:r1], kt[bi, h0:h1, :, :r1], out=scores)  # (h, c, r1)
        scores[..., r0:r1].masked_fill_(upper[: r1 - r0, : r1 - r0], masked)
        if layer is not None:
            row_max = scores.amax(dim=-1, keepdim=True)  # (h, c, 1): over visible keys
            lm = row_max.amax(dim=(-2, -1)).float()
            # less the row maximum first: softmax subtracts the same value, so the same bits
            centred = scores.sub_(row_max)
            a = torch.softmax(centred, dim=-1, out=prob_buffer[: centred.numel()].view(centred.shape))
            layer.add(slice(bi, bi + 1), r0, a[None], centred=centred[None])
        else:
            lm = scores.amax(dim=(-2, -1)).float()  # (h,): over visible keys
            a = torch.softmax(scores, dim=-1, out=scores)
        logit_max[bi, h0:h1] = torch.maximum(logit_max[bi, h0:h1], lm)
        if layer is None:
            assert probs is not None
            probs[bi, h0:h1, r0:r1, :r1].copy_(a)
            probs[bi, h0:h1, r0:r1, r1:].zero_()
        diff = (a @ vw[bi, h0:h1, :r1]).sub_(out[bi, h0:h1, r0:r1].to(work)).abs_().div_(v_scale[bi, h0:h1])
        errors = _worst(errors, diff)
    return float(errors)


# ----------------------------------------------------------------------------- static probe
def _own_classes(cls: type) -> list[type]:
    """The classes of ``cls``'s MRO that are not torch's, transformers' or builtins."""
    return [c for c in cls.__mro__
            if c is not object and c.__module__.split(".")[0] not in (*_FOREIGN, "builtins", "lightning",
                                                                     "pytorch_lightning", "abc", "typing")]


@functools.lru_cache(maxsize=1024)
def class_calls_sdpa(cls: type) -> bool:
    """Whether the source of ``cls`` (or of a base class of its own) mentions ``scaled_dot_product_attention``.

    torch's and transformers' classes are not looked at (their own adapters cover them); a class
    whose source cannot be read (built in a REPL, compiled) counts as not mentioning it.
    """
    for c in _own_classes(cls):
        try:
            source = inspect.getsource(c)
        except (OSError, TypeError):
            continue
        if "scaled_dot_product_attention" in source:
            return True
    return False


def _clean(path: str) -> str:
    """A module path without the ``_orig_mod`` of ``torch.compile`` wrappers; ``"self"`` for the root."""
    parts = [p for p in path.split(".") if p and p != "_orig_mod"]
    return ".".join(parts) or "self"


def sdpa_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, submodule)`` of the modules whose class mentions SDPA (innermost ones), in module order."""
    found = [(_clean(p), m) for p, m in module.named_modules() if class_calls_sdpa(type(m))]
    inner = [(p, m) for p, m in found
             if not any(q != p and (p == "self" or q.startswith(p + ".")) for q, _ in found)]
    return inner


def head_count(module: nn.Module) -> int | None:
    """Heads of an attention module from its usual attributes (n_head, num_heads, ...), None if none."""
    for owner in (module, getattr(module, "config", None)):
        for attr in ("n_head", "num_heads", "n_heads", "num_attention_heads", "nhead", "heads"):
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


# ----------------------------------------------------------------------------- module stack
class _ModuleStack:
    """The path of the module whose forward is running, kept by forward pre/post hooks."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self._handles = HookHandles()

    def attach(self, module: nn.Module) -> None:
        for path, sub in module.named_modules():
            name = _clean(path)
            self._handles.add(sub.register_forward_pre_hook(partial(self._push, name)))
            self._handles.add(sub.register_forward_hook(partial(self._pop, name), always_call=True))

    def detach(self) -> None:
        self._handles.remove()
        self.paths.clear()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    @property
    def current(self) -> str:
        return self.paths[-1] if self.paths else "self"

    def _push(self, name: str, _module: nn.Module, _args: tuple) -> None:
        self.paths.append(name)

    def _pop(self, name: str, _module: nn.Module, _args: tuple, _output: Any) -> None:
        while self.paths:  # LIFO; also unwinds a forward that raised
            if self.paths.pop() == name:
                break


def _exit_mode(mode: TorchFunctionMode) -> None:
    """Leave ``mode``, also when other modes were entered above it and not left yet."""
    stack = torch.overrides._get_current_function_mode_stack()
    if mode not in stack:
        return
    if stack[-1] is mode:
        mode.__exit__(None, None, None)
        return
    above = []
    while torch._C._len_torch_function_stack() > 0:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


class _Interceptor(TorchFunctionMode):
    """Calls ``handler(func, args, kwargs)`` for SDPA calls; every other function runs as is."""

    def __init__(self, handler: Any) -> None:
        super().__init__()
        self.handler = handler

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is SDPA:
            return self.handler(func, args, kwargs)
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------- adapter
@dataclass
class _Record:
    name: str
    probs: Tensor | None  # (B, H, T, T) float32, or None when reduced
    reduced: LayerReduction | None
    logit_max: Tensor  # (B, H) float32
    padded: Tensor | None  # (B,) bool
    causal: bool
    zeros_above_diagonal: bool  # (see Recomputed)


class SDPAAdapter(CaptureAdapter):
    """Attention of every ``scaled_dot_product_attention`` self-attention call in the validation step.

    While capturing (``start()`` to ``stop()``, the monitored batches only):

    - a :class:`torch.overrides.TorchFunctionMode` intercepts SDPA calls; each call runs
      unchanged (the model's output is the same), then A is recomputed from its arguments
      (:func:`recompute`, METHOD.md section 11) and self-checked: where A V differs from the
      function's output by more than :data:`SELF_CHECK_TOLERANCE` (by dtype; soft-capping or a
      score modification below the interception, another function mode, a patched kernel), the
      layer is flagged (``CapturedAttention.flagged``, with the reason) and not reported, for
      the rest of this adapter's life (so the layers stay the same from batch to batch);
    - calls with fewer or more keys than queries (cross-attention, key/value caches) are
      skipped and counted (``counters["cross_attention_calls"]``); calls with ``dropout_p > 0``
      are self-checked against a dropout-free call and counted (``"dropout_calls"``);
    - forward pre/post hooks on every submodule keep the path of the module running, which
      names the layer (``transformer.h.3.attn``; ``_orig_mod`` of torch.compile wrappers left
      out, so names are the same with and without compilation);
    - ``torch.compile``'d code runs eagerly (``torch.compiler.set_stance("force_eager")``, set
      only when torch._dynamo is loaded, restored by ``stop()``): compiled graphs call no Python
      function that could be intercepted.

    ``valid``: False for a sequence whose mask, in any captured call, blocks some key for every
    query and head (a padded key). ``causal``: True when every reported call was causal
    (``is_causal`` or a mask blocking every j > i), False when none was, None when they differ
    (an encoder-decoder model: each layer's analysis then reads it from the layer's own map).
    ``logit_max``: the (B, H) max of q.k * scale over visible keys. A layer's (B, H, T, T) map is kept only until
    :meth:`collect` hands it over; the recomputation goes ``chunk_bytes`` of queries at a time.
    With :attr:`reduction` set (by the monitor, when it needs no per-head maps), no map is
    kept: each call's A goes to a :class:`~podmonitor.capture.reduce.LayerReduction` (an
    ``is_causal`` call block by block, as it is formed; other calls once recomputed) and
    :meth:`collect` returns a :class:`~podmonitor.capture.reduce.ReducedAttention`, whose
    stability sums take each layer's own ``causal``.

    Args:
        chunk_bytes: working memory of the recomputation per chunk of query rows.

    Example:
        >>> adapter = SDPAAdapter()
        >>> with adapter.capturing(model):  # doctest: +SKIP
        ...     out = model.validation_step(batch, 0)
        ...     captured = adapter.collect(model, batch, out)
    """

    name = "sdpa"
    any_module_when_named = True

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        self.chunk_bytes = chunk_bytes
        self._stack = _ModuleStack()
        self._mode: _Interceptor | None = None
        self._stance: Any = None
        self._module_name = ""
        self._sticky: dict[str, str] = {}  # layer -> reason, kept across batches
        self._clear()

    def _clear(self) -> None:
        self._records: list[_Record] = []
        self._name: str | None = None  # the layer of the call being recorded
        self._flags: dict[str, str] = {}
        self._calls: dict[str, int] = {}
        self._counters = {"sdpa_calls": 0, "cross_attention_calls": 0, "captured_calls": 0, "flagged_calls": 0,
                          "dropout_calls": 0}

    @classmethod
    def applies(cls, module: nn.Module) -> bool:
        """Whether the source of a submodule's class (not torch's, not transformers') mentions SDPA."""
        return bool(sdpa_modules(module))

    @classmethod
    def may_apply(cls, module: nn.Module) -> bool:
        """Whether any class in ``module`` is the user's own (its code might call SDPA through a helper)."""
        return any(_own_classes(type(m)) for m in module.modules())

    @property
    def flagged(self) -> dict[str, str]:
        """Layers excluded for the rest of this adapter's life: ``{layer: reason}``."""
        return dict(self._sticky)

    # ----------------------------------------------------------------- start / stop
    def start(self, module: nn.Module) -> None:
        """Attach the module-path hooks, enter the interception mode (and force compiled code eager)."""
        self.stop()
        try:
            self._module_name = type(module).__name__
            self._stack.attach(module)
            if "torch._dynamo" in sys.modules:
                self._stance = torch.compiler.set_stance("force_eager")
            self._mode = _Interceptor(self._on_call)
            self._mode.__enter__()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Leave the mode, remove every hook, restore the compiler stance, drop the batch's maps; idempotent."""
        try:
            if self._mode is not None:
                mode, self._mode = self._mode, None
                _exit_mode(mode)
        finally:
            self._stack.detach()
            if self._stance is not None:
                stance, self._stance = self._stance, None
                stance.__exit__(None, None, None)
            self._clear()

    @property
    def active(self) -> bool:
        """Whether the interception is on."""
        return self._mode is not None

    # ----------------------------------------------------------------- interception
    def _on_call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)  # the model's call, unchanged (errors reach the model as they would)
        self._name = None
        try:
            self._record(func, SDPACall.bind(args, kwargs), out)
        except Exception as err:  # noqa: BLE001 - capturing must never break the model's forward
            name = self._name or f"{self._stack.current} (call {self._counters['sdpa_calls']})"
            self._flag(name, f"capture failed: {type(err).__name__}: {err}", sticky=self._name is not None)
        return out

    def _record(self, func: Any, call: SDPACall, out: Tensor) -> None:
        self._counters["sdpa_calls"] += 1
        q, k = call.query, call.key
        if q.dim() >= 2 and k.dim() >= 2 and q.shape[-2] != k.shape[-2]:
            self._counters["cross_attention_calls"] += 1
            return
        path = self._stack.current
        index = self._calls.get(path, 0)
        self._calls[path] = index + 1
        name = self._name = path if index == 0 else f"{path}#{index}"
        reason = self._sticky.get(name) or self._unsupported(call, out)
        if reason is not None:
            self._flag(name, reason, sticky=True)
            return
        with torch.no_grad():
            reference = out
            if call.dropout_p > 0:
                self._counters["dropout_calls"] += 1
                reference = func(**call.without_dropout())
            result = recompute(call, reference, self.chunk_bytes, self.reduction, len(self._records))
        tol = SELF_CHECK_TOLERANCE.get(q.dtype, 1e-4)
        if not result.error <= tol:
            self._flag(name, f"self-check failed: A V differs from scaled_dot_product_attention's output by "
                             f"{result.error:.3g} (relative to max |V|; tolerance {tol:g} for {q.dtype}): the "
                             "attention is modified below the interception (soft-capping, another function "
                             "mode, a patched kernel)", sticky=True)
            return
        self._counters["captured_calls"] += 1
        self._records.append(_Record(name, result.probs, result.reduced, result.logit_max, result.padded,
                                     result.causal, result.zeros_above_diagonal))

    @staticmethod
    def _unsupported(call: SDPACall, out: Tensor) -> str | None:
        q, k, v = call.query, call.key, call.value
        if any(getattr(x, "is_nested", False) for x in (q, k, v)):
            return "nested (jagged) tensors are not captured"
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            return f"query/key/value are {q.dim()}-d/{k.dim()}-d/{v.dim()}-d; only 4-d (B, H, T, E) calls are captured"
        if not isinstance(out, Tensor) or out.dim() != 4:
            return "the call's output is not a 4-d tensor"
        if not (q.is_floating_point() and k.is_floating_point() and v.is_floating_point()):
            return f"query/key/value of dtype {q.dtype} are not captured"
        if call.enable_gqa and q.shape[-3] % k.shape[-3]:
            return f"enable_gqa with {q.shape[-3]} query heads and {k.shape[-3]} key heads"
        return None

    def _flag(self, name: str, reason: str, sticky: bool) -> None:
        self._counters["flagged_calls"] += 1
        self._flags[name] = reason
        if sticky:
            self._sticky[name] = reason

    # ----------------------------------------------------------------- collect
    def collect(self, module: nn.Module, batch: Any, outputs: Any) -> CapturedAttention | ReducedAttention:
        """The attention of the self-attention calls intercepted during the validation step.

        Layers of a (B, T) other than the most common one are flagged for this batch.

        Raises:
            RuntimeError: no call could be reported: none was intercepted (the message names
                the ways out; for the ``"auto"`` last resort it lists every adapter), only
                cross-attention calls ran, or every layer was flagged (with the reasons).
        """
        records, flags, counters = self._records, dict(self._flags), dict(self._counters)
        started = self.active
        self._clear()
        if not records:
            raise RuntimeError(self._nothing(counters, flags, started))
        shapes = [(r.logit_max.shape[0], (r.probs if r.reduced is None else r.reduced.average).shape[-1])
                  for r in records]
        common = max(set(shapes), key=shapes.count)
        kept = []
        for r, shape in zip(records, shapes, strict=True):
            if shape == common:
                kept.append(r)
            else:
                flags[r.name] = f"(B, T) = {shape} differs from the other layers' {common}: skipped this batch"
        valid = None
        for r in kept:
            if r.padded is not None:
                v = ~r.padded
                valid = v if valid is None else valid & v
        common = dict(layer_names=[r.name for r in kept], valid=valid, causal=common_causal(r.causal for r in kept),
                      logit_max=[r.logit_max for r in kept], flagged=flags, counters=counters)
        if self.reduction is not None:  # every record was reduced (see _record)
            return ReducedAttention(layers=[r.reduced.result() for r in kept], **common)  # type: ignore[union-attr]
        return CapturedAttention(fields=[r.probs for r in kept],
                                 zeros_above_diagonal=all(r.zeros_above_diagonal for r in kept), **common)

    def _nothing(self, counters: dict[str, int], flags: dict[str, str], started: bool) -> str:
        name = self._module_name or "the module"
        if flags:
            listed = "; ".join(f"{k}: {v}" for k, v in flags.items())
            return f"every scaled_dot_product_attention layer of {name} was flagged and is not reported ({listed})"
        if counters["cross_attention_calls"]:
            return (f"{name}.validation_step made {counters['cross_attention_calls']} scaled_dot_product_attention "
                    "call(s), all with a different number of queries and keys (cross-attention or a key/value "
                    "cache); only self-attention (as many queries as keys) is captured")
        msg = (f"no torch.nn.functional.scaled_dot_product_attention call was intercepted during {name}"
               ".validation_step" + ("" if started else " (start(module) was not called before the step)")
               + ": the model's attention does not call it, or calls it from code the interception does not see "
               "(another thread, a custom kernel such as flash_attn or xformers)")
        if self.last_resort:
            msg += ".\n" + NOTHING_FITS.format(module=name)
        return msg + "; use capture=fn(module, batch) or an attention_maps(batch) method there"

    def __repr__(self) -> str:
        return f"SDPAAdapter(chunk_bytes={self.chunk_bytes})"


# ----------------------------------------------------------------------------- head masking
class _HeadMaskMode(TorchFunctionMode):
    """Inside one module's forward: scales the output of its k-th self-attention call by its head mask."""

    def __init__(self, owner: SDPAHeadMask, path: str) -> None:
        super().__init__()
        self.owner = owner
        self.path = path
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not SDPA:
            return out
        call = SDPACall.bind(args, kwargs)
        if call.query.shape[-2] != call.key.shape[-2]:
            return out
        name = self.path if self.calls == 0 else f"{self.path}#{self.calls}"
        self.calls += 1
        mask = self.owner.masks.get(name)
        return out if mask is None else self.owner.scale(name, out, mask)


class SDPAHeadMask:
    """Scale each head's ``scaled_dot_product_attention`` output by a per-layer head mask.

    The output (B, H, T, E) of a layer's SDPA call is multiplied by its mask before the model
    merges the heads (``y.transpose(1, 2).reshape(B, T, H * E)``), which is the same as zeroing
    (scaling) that head's slice of the output projection's input. Layers are named as by
    :class:`SDPAAdapter` (the module path, ``"<path>#k"`` for the k-th self-attention call of one
    forward). While attached, a forward pre-hook on each masked module enters an interception
    mode for the duration of that module's forward (a forward hook, always called, leaves it), so
    training, validation and gradients all see the mask; nothing else of the model is touched.
    A mask that requires gradients gets them (Michel et al. importance: d loss / d mask).

    A module run twice in one step (weight sharing) gets the same mask each time (the calls are
    counted per forward, where :class:`SDPAAdapter` counts them per validation step).

    Args:
        module: the model (any module containing the layers).
        masks: ``{layer name: (H,) or (B, H) mask}``; more with :meth:`set`.

    Raises:
        ValueError: a layer name is not a module path of ``module``.

    Example:
        >>> masker = SDPAHeadMask(model, {"transformer.h.0.attn": torch.tensor([1.0, 0.0, 1.0, 1.0])})
        >>> with masker:  # doctest: +SKIP
        ...     logits = model(x)  # head 1 of layer 0 silenced
    """

    def __init__(self, module: nn.Module, masks: Mapping[str, Tensor | Sequence[float]] | None = None) -> None:
        self.module = module
        self.masks: dict[str, Tensor] = {}
        self._paths = {_clean(p): m for p, m in module.named_modules()}
        self._handles = HookHandles()
        self._modes: dict[int, list[_HeadMaskMode]] = {}
        for name, mask in (masks or {}).items():
            self.set(name, mask)

    def _module_of(self, name: str) -> nn.Module:
        path = name.split("#", 1)[0]
        if path not in self._paths:
            examples = [p for p in self._paths if p != "self"][:3]
            raise ValueError(f"{name!r} is no module path of {type(self.module).__name__} (e.g. {examples})")
        return self._paths[path]

    def set(self, name: str, mask: Tensor | Sequence[float]) -> None:
        """Set (replace) the mask of layer ``name``; (H,) or (B, H), 1 keeps a head, 0 silences it."""
        self._module_of(name)
        t = mask if isinstance(mask, Tensor) else torch.tensor(list(mask), dtype=torch.float32)
        if t.dim() not in (1, 2):
            raise ValueError(f"the head mask of {name!r} must be (H,) or (B, H), got shape {tuple(t.shape)}")
        self.masks[name] = t
        if self.attached:
            self.attach()

    def clear(self, name: str | None = None) -> None:
        """Drop the mask of ``name`` (every mask when None)."""
        if name is None:
            self.masks.clear()
        else:
            self.masks.pop(name, None)
        if self.attached:
            self.attach()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> None:
        """Hook the masked modules (again, after a change of masks)."""
        self.detach()
        paths = sorted({name.split("#", 1)[0] for name in self.masks})
        for path in paths:
            sub = self._paths[path]
            self._handles.add(sub.register_forward_pre_hook(partial(self._enter, path)))
            self._handles.add(sub.register_forward_hook(partial(self._leave, path), always_call=True))
            _ATTACHED[sub] = (self, path)

    def detach(self) -> None:
        """Remove every hook (the model is as before); idempotent."""
        self._handles.remove()
        for sub in [m for m, (owner, _) in list(_ATTACHED.items()) if owner is self]:
            _ATTACHED.pop(sub, None)
        for modes in self._modes.values():
            for mode in modes:
                _exit_mode(mode)
        self._modes.clear()

    def __enter__(self) -> SDPAHeadMask:
        self.attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _enter(self, path: str, module: nn.Module, _args: tuple) -> None:
        mode = _HeadMaskMode(self, path)
        mode.__enter__()
        self._modes.setdefault(id(module), []).append(mode)

    def _leave(self, path: str, module: nn.Module, _args: tuple, _output: Any) -> None:
        modes = self._modes.get(id(module))
        if modes:
            _exit_mode(modes.pop())

    @staticmethod
    def scale(name: str, out: Tensor, mask: Tensor) -> Tensor:
        """``out`` (B, H, T, E) times the mask (H,) or (B, H) over the heads.

        Raises:
            ValueError: the output is not 4-d or the mask does not match its heads.
        """
        if out.dim() != 4:
            raise ValueError(f"layer {name!r}: SDPA output of shape {tuple(out.shape)}; head masks need (B, H, T, E)")
        b, h = out.shape[:2]
        m = mask.to(device=out.device, dtype=out.dtype)
        if m.dim() == 1 and m.shape[0] == h:
            return out * m.view(1, h, 1, 1)
        if m.dim() == 2 and m.shape[1] == h and m.shape[0] in (1, b):
            return out * m.view(m.shape[0], h, 1, 1)
        raise ValueError(f"layer {name!r} has {h} heads (batch {b}) but its head mask has shape {tuple(m.shape)}")


#: module -> (the attached SDPAHeadMask masking it, the module's path in that mask's model)
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, tuple[SDPAHeadMask, str]] = weakref.WeakKeyDictionary()


def active_heads(module: nn.Module) -> dict[str, list[bool]]:
    """``{layer name: (H,) bool}`` of the attached :class:`SDPAHeadMask` masks inside ``module``.

    Layer names are module paths within ``module`` (the names :class:`SDPAAdapter` gives when it
    captures ``module``); False marks a head whose mask is 0. Per-sequence (B, H) masks and layers
    without an attached mask are left out.
    """
    out: dict[str, list[bool]] = {}
    for path, sub in module.named_modules():
        entry = _ATTACHED.get(sub)
        if entry is None:
            continue
        owner, owner_path = entry
        for name, mask in owner.masks.items():
            base, sep, index = name.partition("#")
            if base == owner_path and mask.dim() == 1:
                out[_clean(path) + (sep + index)] = [bool(v != 0) for v in mask.detach().tolist()]
    return out


__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "SDPA",
    "SELF_CHECK_TOLERANCE",
    "Recomputed",
    "active_heads",
    "SDPAAdapter",
    "SDPACall",
    "SDPAHeadMask",
    "class_calls_sdpa",
    "head_count",
    "mask_blocks",
    "recompute",
    "sdpa_modules",
]
