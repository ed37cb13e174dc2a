"""Extra analyses that ride along with :class:`~podmonitor.PODMonitor`'s validation runs.

An extra sees the same monitored validation batches as the POD analysis, keeps what it needs on
each rank, and on rank zero turns the gathered parts into scalars, text, tables and a JSON-lines
entry, which the monitor publishes next to its own (every output failing on its own). This is how
other packages (``podmonitor.pruning``'s measured head importance, for example) plug into the
monitor without ``callback.py`` importing them.

The monitor drives an extra like this, on every rank unless said otherwise::

    extra.setup(trainer, pl_module, stage)                       # in PODMonitor.setup
    extra.start_run(trainer, pl_module, monitored_run_index)     # each monitored validation run
    extra.on_attention(layer, fields)                            # each accumulated batch, per layer
    extra.on_batch(trainer, pl_module, batch, batch_idx, outputs)  # each batch of the monitored loader
    part = extra.gather_state()                                 # picklable; sent with the monitor's states
    result = extra.compute(parts, context)                      # rank zero only, no collective
    extra.state_dict() / load_state_dict(...)                   # checkpointed with the monitor

Rules: ``on_batch`` may run forward passes of the model (it is called inside the validation
loop, in eval mode, under ``torch.inference_mode``) but must leave the model as it found it, and
must not call collectives (the monitor gathers ``gather_state()`` in its own collective).
``on_attention`` runs in the monitor's accumulate path with the (b, H, T, T) attention of the
sequences the monitor itself accumulates (usable, within the quota): keep sums, not the tensors.
An exception in any hook becomes a warning of the monitor and costs only that extra's result.

``PODMonitor(per_head=True)`` adds one extra of its own, the head analysis (:class:`HeadAnalysis`,
made by :func:`per_head_analysis`: :class:`podmonitor.pruning.allocation.HeadAllocationExtra`,
head redundancy, the H*-based head allocation hypothesis and its readiness); the monitor's
``last_advice``, ``last_redundancy``, ``readiness`` and ``last_readiness`` read it. That function
is the only place where the extras interface names the pruning package; ``callback.py`` imports
nothing of it. :class:`HeadAdviceSource` is what :class:`~podmonitor.pruning.HeadPruning` reads
of a monitor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch


@dataclass
class ExtraContext:
    """What rank zero's :meth:`MonitorExtra.compute` is given besides the gathered parts.

    Attributes:
        step: the trainer's global step of this validation run.
        stage: "fit" or "validate".
        layer_names: the monitor's layer names, in model order.
        reports: ``{layer or "layer/head_hh": PODReport}`` of this run (per-head reports only with
            ``per_head=True``).
        prefix: the monitor's tag prefix ("pod").
        active: ``{layer: (H,) bool}``, the heads still active (False: masked) where the monitor
            knows them (the reference models' head masks), else None.
        strict: the monitor's ``strict``: an extra that turns its own failures into notes should
            raise them instead.
    """

    step: int
    stage: str
    layer_names: Sequence[str]
    reports: Mapping[str, Any]
    prefix: str = "pod"
    active: Mapping[str, Sequence[bool]] | None = None
    strict: bool = False


@dataclass
class ExtraResult:
    """What an extra adds to one monitored run's outputs.

    Attributes:
        scalars: ``{tag: value}`` logged to every logger at the run's step.
        texts: ``{tag: markdown}``.
        tables: ``{tag: (columns, rows)}`` (a W&B table, a CSV file, markdown elsewhere).
        images: ``{tag: (H, W, 3) uint8 array}``, or ``{tag: function () -> array}`` to draw it on
            the publisher's worker (only runs with pictures draw; a failing drawing costs that
            picture only).
        record: JSON-able entry of the run's JSON-lines record (under the extra's ``name``) and of
            the history entry (none when empty).
        record_top: JSON-able entries at the top level of the run's record, for keys that predate
            the extras interface (the head analysis's ``head_allocation``, ``head_redundancy``,
            ``readiness``); a key the monitor writes itself is left out with an error in the record.
        history_keys: which ``record_top`` keys also go into the history entry (checkpointed).
        notes: problems of the run the extra handled itself; added to the run's errors.
    """

    scalars: dict[str, float] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    tables: dict[str, tuple[list[str], list[list[Any]]]] = field(default_factory=dict)
    images: dict[str, np.ndarray | Callable[[], np.ndarray]] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)
    record_top: dict[str, Any] = field(default_factory=dict)
    history_keys: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)


class MonitorExtra:
    """Base class of an extra analysis (see the module docstring); every hook defaults to nothing.

    Subclasses set ``name`` (unique among a monitor's extras; the key of its JSON-lines entry).
    """

    name: str = "extra"

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Called from the monitor's ``setup`` on every rank."""

    def start_run(self, trainer: Any, pl_module: Any, monitored_index: int) -> None:
        """A monitored validation run starts (``monitored_index`` counts them from 0, the same on
        every rank)."""

    def on_attention(self, layer: str, fields: torch.Tensor) -> None:
        """The monitor accumulated ``fields`` (b, H, T, T), float32 post-softmax attention of the
        sequences it took from this batch, of one reported layer (this rank's; on the model's
        device; do not keep the tensor)."""

    def on_batch(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, outputs: Any) -> None:
        """A batch of the monitored validation loader ended (every batch of a monitored run)."""

    def gather_state(self) -> Any:
        """This rank's part of the run (picklable), sent to rank zero; default None."""
        return None

    def compute(self, parts: list[Any], context: ExtraContext) -> ExtraResult | None:
        """Rank zero: the run's result from every rank's part (no collective in here)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


# ------------------------------------------------------------------ the head analysis (per_head=True)
@runtime_checkable
class Readiness(Protocol):
    """A readiness tracker: whether an advice has settled enough to act on."""

    @property
    def stable(self) -> bool: ...


@runtime_checkable
class HeadAdvice(Protocol):
    """A head allocation advice (:class:`~podmonitor.pruning.HeadAllocationAdvice`)."""

    drop_order: Sequence[Any]

    def heads_to_prune(self, n: int) -> dict[int, list[int]]: ...

    def to_dict(self) -> dict[str, Any]: ...


@runtime_checkable
class HeadAnalysis(Protocol):
    """The per-head analysis a monitor carries with ``per_head=True`` (an extra; see the module docstring).

    Attributes:
        name: its name among the monitor's extras (``"head_analysis"``).
        settings: the advisor's settings (:class:`~podmonitor.pruning.AdviceSettings`).
        readiness: the readiness tracker (:class:`~podmonitor.pruning.AdviceReadiness`).
        last_advice: the last run's H*-based head allocation advice, or None.
        last_redundancy: ``{layer: HeadRedundancy}`` of the last run.
        last_readiness: the readiness record of the last run, or None.
    """

    name: str
    settings: Any
    readiness: Readiness
    last_advice: HeadAdvice | None
    last_redundancy: Mapping[str, Any]
    last_readiness: dict[str, Any] | None


@runtime_checkable
class HeadAdviceSource(Protocol):
    """What :class:`~podmonitor.pruning.HeadPruning` reads of its monitor (PODMonitor is one)."""

    @property
    def readiness(self) -> Readiness | None: ...

    @property
    def last_advice(self) -> HeadAdvice | None: ...

    @property
    def history(self) -> list[dict[str, Any]]: ...


def per_head_analysis(config: Any, advice: Any = None, readiness: Any = None) -> MonitorExtra:
    """The head analysis of ``PODMonitor(per_head=True)``: a
    :class:`~podmonitor.pruning.allocation.HeadAllocationExtra` (imported here, when asked).

    Args:
        config: the monitor's :class:`~podmonitor.PODConfig` (its eps and dtype).
        advice: :class:`~podmonitor.pruning.AdviceSettings` or None (the default).
        readiness: :class:`~podmonitor.pruning.AdviceReadiness` or None (the default).

    Raises:
        ValueError: ``advice`` or ``readiness`` of the wrong type, or the advice's eps not among
            ``config.eps``.
    """
    from .pruning.allocation import HeadAllocationExtra

    return HeadAllocationExtra(advice=advice, readiness=readiness, config=config)


def find_extra(host: Any, kind: type) -> Any:
    """The first of ``host.extras`` that is a ``kind`` (a class or a runtime-checkable Protocol), or None."""
    for extra in getattr(host, "extras", None) or []:
        if isinstance(extra, kind):
            return extra
    return None


__all__ = ["ExtraContext", "ExtraResult", "HeadAdvice", "HeadAdviceSource", "HeadAnalysis", "MonitorExtra",
           "Readiness", "find_extra", "per_head_analysis"]
