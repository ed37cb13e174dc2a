"""What a capture returns (:class:`CapturedAttention`), the adapter interface, and the choice of adapter.

The callback drives an adapter around the module's own validation step, only on the
batches it analyses::

    adapter = select_adapter(pl_module, "auto")
    adapter.start(pl_module)                  # hooks / settings on
    try:
        outputs = pl_module.validation_step(batch, batch_idx)
        captured = adapter.collect(pl_module, batch, outputs)
    finally:
        adapter.stop()                        # hooks / settings off, always

or, equivalently, ``with adapter.capturing(pl_module): ...``. Nothing is attached outside
``start()`` / ``stop()``, so training batches and unmonitored batches pay nothing.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from podmonitor.capture._util import layer_names
from podmonitor.capture.reduce import ReducedAttention, Reduction


@dataclass
class CapturedAttention:
    """Post-softmax attention of every attention layer for one batch (METHOD.md section 1).

    Construction validates and normalises: fields become detached float32, shapes are
    checked, so every adapter (and every user function) goes through the same checks.

    Attributes:
        fields: one tensor per layer, (B, H, T, T) float32, detached, on the model's
            device; rows are queries and sum to 1 over the real keys. The head count H
            may differ between layers (pruned models); B and T may not.
        layer_names: one stable, unique name per field ("layer_00" or a module path).
        valid: (B,) bool, True for sequences without any padding token; None means all
            are valid. Sequences with padding are not cut out of the fields: the callback
            skips them (padding never enters the analysed fields).
        causal: True for decoder (lower-triangular) attention, False for bidirectional,
            None when unknown.
        logit_max: optional, one (B, H) float32 tensor per layer: the largest pre-softmax
            logit q.k * scale over the queries and visible keys of each sequence and head
            (METHOD.md section 10); None for the whole capture when the adapter sees
            probabilities only, or a None entry for a layer where it is unknown.
        flagged: layer name -> reason, for layers the adapter excluded this batch (not in
            ``fields``), e.g. a failed self-check of the ``sdpa`` adapter. Empty by default.
        counters: named event counts of this batch, e.g. ``{"cross_attention_calls": 2}``.
            Empty by default.
        zeros_above_diagonal: True when the code that made the fields wrote +0 at every key
            after its query (podmonitor's own causal recomputation, the reference models;
            rows with a non-finite visible entry excepted), so that the stability signals need
            not check those entries (METHOD.md section 10). Only with ``causal=True``. Default
            False: the entries are checked.

    Raises:
        ValueError: a field is not (B, H, T, T), layers disagree on B or T, names are
            missing or repeated, ``valid`` is not a (B,) boolean tensor, or ``logit_max``
            does not hold one (B, H) tensor (or None) per layer.
        TypeError: a field, ``valid`` or a ``logit_max`` entry is not a tensor.
    """

    fields: list[torch.Tensor]
    layer_names: list[str]
    valid: torch.Tensor | None = None
    causal: bool | None = None
    logit_max: list[torch.Tensor | None] | None = None
    flagged: dict[str, str] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    zeros_above_diagonal: bool = False

    def __post_init__(self) -> None:
        fields = list(self.fields)
        names = [str(n) for n in self.layer_names]
        if not fields:
            raise ValueError("no attention field was captured (empty list of layers)")
        if len(names) != len(fields):
            raise ValueError(f"{len(fields)} attention fields but {len(names)} layer names")
        if len(set(names)) != len(names):
            raise ValueError(f"layer names must be unique, got {names}")
        out = []
        batch = seq = None
        for name, f in zip(names, fields, strict=True):
            if not isinstance(f, torch.Tensor):
                raise TypeError(f"attention of layer {name!r} is a {type(f).__name__}, not a torch.Tensor")
            if f.dim() != 4:
                raise ValueError(
                    f"attention of layer {name!r} has shape {tuple(f.shape)}; expected (B, H, T, T) "
                    "(batch, heads, queries, keys). Per-head maps are required: do not average over heads."
                )
            if f.shape[-1] != f.shape[-2]:
                raise ValueError(
                    f"attention of layer {name!r} has shape {tuple(f.shape)}: queries ({f.shape[-2]}) and keys "
                    f"({f.shape[-1]}) differ; only square self-attention (B, H, T, T) is supported "
                    "(cross-attention, key/value caches, extra bias or zero-attention keys are not)"
                )
            if batch is None:
                batch, seq = f.shape[0], f.shape[-1]
            elif f.shape[0] != batch or f.shape[-1] != seq:
                raise ValueError(
                    f"attention of layer {name!r} has shape {tuple(f.shape)}, but layer {names[0]!r} has batch "
                    f"{batch} and length {seq}: every layer must have the same B and T"
                )
            out.append(f.detach().float())
        if self.valid is not None:
            if not isinstance(self.valid, torch.Tensor):
                raise TypeError(f"valid must be a (B,) bool tensor or None, got {type(self.valid).__name__}")
            if self.valid.dtype != torch.bool or tuple(self.valid.shape) != (batch,):
                raise ValueError(
                    f"valid must be a ({batch},) bool tensor, got {self.valid.dtype} of shape {tuple(self.valid.shape)}"
                )
            self.valid = self.valid.detach()
        if self.causal is not None:
            self.causal = bool(self.causal)
        self.zeros_above_diagonal = bool(self.zeros_above_diagonal)
        if self.zeros_above_diagonal and self.causal is not True:
            raise ValueError(f"zeros_above_diagonal=True needs causal=True, got causal={self.causal}")
        if self.logit_max is not None:
            self.logit_max = _check_logit_max(self.logit_max, names, out)
        self.flagged = {str(k): str(v) for k, v in dict(self.flagged).items()}
        self.counters = {str(k): int(v) for k, v in dict(self.counters).items()}
        self.fields = out
        self.layer_names = names

    @property
    def batch_size(self) -> int:
        return self.fields[0].shape[0]

    @property
    def seq_len(self) -> int:
        return self.fields[0].shape[-1]

    @property
    def device(self) -> torch.device:
        return self.fields[0].device

    @classmethod
    def from_maps(
        cls, maps: list[torch.Tensor] | tuple[torch.Tensor, ...], causal: bool | None = None,
        zeros_above_diagonal: bool = False,
    ) -> CapturedAttention:
        """Wrap a plain list of (B, H, T, T) maps, named "layer_00", "layer_01", ...

        Raises:
            TypeError: ``maps`` is not a list or tuple of tensors.
        """
        if isinstance(maps, torch.Tensor) or not isinstance(maps, (list, tuple)):
            raise TypeError(f"expected a list of (B, H, T, T) tensors, one per layer, got {type(maps).__name__}")
        return cls(fields=list(maps), layer_names=layer_names(len(maps)), valid=None, causal=causal,
                   zeros_above_diagonal=zeros_above_diagonal)


def _check_logit_max(
    logit_max: list[torch.Tensor | None], names: list[str], fields: list[torch.Tensor]
) -> list[torch.Tensor | None]:
    """``logit_max`` as detached float32 (B, H) tensors, one entry (or None) per field."""
    entries = list(logit_max)
    if len(entries) != len(fields):
        raise ValueError(f"{len(fields)} attention fields but {len(entries)} logit_max entries")
    out: list[torch.Tensor | None] = []
    for name, m, f in zip(names, entries, fields, strict=True):
        if m is None:
            out.append(None)
            continue
        if not isinstance(m, torch.Tensor):
            raise TypeError(f"logit_max of layer {name!r} is a {type(m).__name__}, not a torch.Tensor")
        if tuple(m.shape) != tuple(f.shape[:2]):
            raise ValueError(
                f"logit_max of layer {name!r} has shape {tuple(m.shape)}; expected (B, H) = {tuple(f.shape[:2])}"
            )
        out.append(m.detach().float())
    return out


class CaptureAdapter(abc.ABC):
    """Gets the attention of a model out of its own validation step.

    Subclasses set ``name``, implement :meth:`applies` and :meth:`collect`, and, when they
    attach hooks or change settings, :meth:`start` and :meth:`stop`. ``stop()`` must undo
    everything ``start()`` did, be idempotent, and work after a ``start()`` that failed
    halfway or a forward that raised.
    """

    name: ClassVar[str]
    #: True when ``"auto"`` chose this adapter as a last resort (:meth:`may_apply`).
    last_resort: bool = False
    #: Set by the monitor, for the batches it captures, when nothing downstream needs per-head maps:
    #: an adapter that forms the probabilities itself may hand them to this
    #: :class:`~podmonitor.capture.reduce.Reduction` row block by row block and return a
    #: :class:`~podmonitor.capture.reduce.ReducedAttention` (head averages and stability sums)
    #: instead of a :class:`CapturedAttention`. None (default): return the maps.
    reduction: Reduction | None = None
    #: named explicitly (``capture="<name>"`` or the class), the adapter is used for any module: its
    #: first batch tells whether it fits (the ``sdpa`` adapter: whether the model calls SDPA at all)
    any_module_when_named: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def applies(cls, module: torch.nn.Module) -> bool:
        """Whether this adapter can capture the attention of ``module``."""

    @classmethod
    def may_apply(cls, module: torch.nn.Module) -> bool:
        """Whether this adapter might still capture ``module`` when :meth:`applies` cannot tell.

        ``"auto"`` tries such an adapter as a last resort, when no adapter applies; its
        first monitored batch then tells (see :class:`~podmonitor.capture.sdpa.SDPAAdapter`).
        Default: False.
        """
        return False

    def start(self, module: torch.nn.Module) -> None:  # noqa: B027 (optional hook, default: nothing)
        """Attach hooks / switch settings; called only for the batches being captured."""

    def stop(self) -> None:  # noqa: B027
        """Remove every hook and restore every setting; idempotent."""

    @abc.abstractmethod
    def collect(self, module: torch.nn.Module, batch: Any, outputs: Any) -> CapturedAttention | ReducedAttention:
        """The attention of ``batch``, called after ``module.validation_step(batch, ...)`` returned
        ``outputs`` (a :class:`~podmonitor.capture.reduce.ReducedAttention` only when
        :attr:`reduction` is set)."""

    @contextlib.contextmanager
    def capturing(self, module: torch.nn.Module) -> Iterator[CaptureAdapter]:
        """``start(module)`` on entry, ``stop()`` on exit, also when the body raises."""
        try:
            self.start(module)
            yield self
        finally:
            self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def adapter_classes() -> list[type[CaptureAdapter]]:
    """The built-in adapters, in the order ``"auto"`` tries them."""
    from podmonitor.capture.function import FunctionAdapter
    from podmonitor.capture.huggingface import HuggingFaceAdapter
    from podmonitor.capture.protocol import ProtocolAdapter
    from podmonitor.capture.sdpa import SDPAAdapter
    from podmonitor.capture.torch_mha import TorchMHAAdapter

    return [ProtocolAdapter, SDPAAdapter, HuggingFaceAdapter, TorchMHAAdapter, FunctionAdapter]


NOTHING_FITS = (
    "podmonitor cannot capture the attention of {module}. The adapters, tried in this order:\n"
    "  - 'protocol': the module defines attention_maps(batch) -> list of (B, H, T, T) tensors "
    "(and optionally attention_is_causal: bool);\n"
    "  - 'sdpa': the attention calls torch.nn.functional.scaled_dot_product_attention (nanoGPT, litgpt, timm, "
    "torchtune, hand-written models) during validation_step, with 4-d (B, H, T, E) query/key/value and as many "
    "queries as keys (self-attention; cross-attention and key/value-cache calls are skipped), eagerly or in a "
    "torch.compile'd module (run eagerly while capturing); chosen when the source of a submodule's class "
    "mentions scaled_dot_product_attention, otherwise tried on the first monitored batch; force it with "
    "capture='sdpa';\n"
    "  - 'huggingface': the module is, holds or contains a transformers.PreTrainedModel that its "
    "validation_step calls;\n"
    "  - 'torch_mha': the module contains torch.nn.MultiheadAttention layers (nn.TransformerEncoder, "
    "nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, ...);\n"
    "  - 'function': pass capture=fn with fn(module, batch) -> list of (B, H, T, T) tensors or a "
    "CapturedAttention.\n"
    "Not supported: attention computed by custom kernels that never call scaled_dot_product_attention "
    "(flash_attn, xformers, flex_attention, fused CUDA extensions) and attention that is never formed "
    "(linear attention): use capture=fn or an attention_maps(batch) method there."
)


def select_adapter(
    module: torch.nn.Module,
    capture: str | Callable[..., Any] | CaptureAdapter | type[CaptureAdapter] = "auto",
) -> CaptureAdapter:
    """The adapter that will capture the attention of ``module``.

    Args:
        module: the (Lightning)module being validated.
        capture: ``"auto"`` (try "protocol", "sdpa", "huggingface", "torch_mha" in this order;
            when none applies, an adapter whose :meth:`CaptureAdapter.may_apply` says it might,
            "sdpa" for any module with a class of its own, as a last resort), an adapter name, a
            :class:`CaptureAdapter` instance (used as is) or subclass (instantiated), or a function
            ``fn(module, batch) -> list[Tensor] | CapturedAttention`` (wrapped in a
            :class:`~podmonitor.capture.function.FunctionAdapter`).

    Returns:
        A fresh adapter (or the instance passed), with nothing attached yet.

    Raises:
        ValueError: nothing fits (the message lists the adapters and what each needs),
            the named adapter is unknown or does not apply to ``module``.
        TypeError: ``capture`` is of no accepted type.

    Example:
        >>> adapter = select_adapter(model)  # doctest: +SKIP
        >>> adapter = select_adapter(model, lambda m, b: m.my_maps(b))  # doctest: +SKIP
    """
    from podmonitor.capture.function import FunctionAdapter

    if isinstance(capture, CaptureAdapter):
        return capture
    if isinstance(capture, type) and issubclass(capture, CaptureAdapter):
        if not (capture.any_module_when_named or capture.applies(module)):
            raise ValueError(f"{capture.__name__} does not apply to {type(module).__name__}")
        return capture()
    classes = adapter_classes()
    if isinstance(capture, str):
        if capture == "auto":
            for cls in classes:
                if cls is not FunctionAdapter and cls.applies(module):
                    return cls()
            for cls in classes:
                if cls is not FunctionAdapter and cls.may_apply(module):
                    adapter = cls()
                    adapter.last_resort = True
                    return adapter
            raise ValueError(NOTHING_FITS.format(module=type(module).__name__))
        by_name = {cls.name: cls for cls in classes}
        if capture not in by_name:
            raise ValueError(f"unknown capture adapter {capture!r}; choose 'auto' or one of {sorted(by_name)}")
        if capture == FunctionAdapter.name:
            raise ValueError("capture='function' needs the function itself: pass capture=fn(module, batch)")
        cls = by_name[capture]
        if not (cls.any_module_when_named or cls.applies(module)):
            raise ValueError(
                f"the {capture!r} adapter does not apply to {type(module).__name__}.\n"
                + NOTHING_FITS.format(module=type(module).__name__)
            )
        return cls()
    if callable(capture):
        return FunctionAdapter(capture)
    raise TypeError(
        "capture must be 'auto', an adapter name, a CaptureAdapter or a function fn(module, batch), "
        f"got {type(capture).__name__}"
    )


__all__ = ["CaptureAdapter", "CapturedAttention", "adapter_classes", "select_adapter"]
