"""Extra analyses that ride along with :class:`~podmonitor.PODMonitor`'s validation runs.

An extra sees the same monitored validation batches as the POD analysis, keeps what it needs on
each rank, and on rank zero turns the gathered parts into scalars, text, tables and a JSON-lines
entry, which the monitor publishes next to its own (every output failing on its own). This is how
other packages (``podmonitor.pruning``'s measured head importance, for example) plug into the
monitor without ``callback.py`` importing them.

The monitor drives an extra like this, on every rank unless said otherwise::

    extra.setup(trainer, pl_module, stage)                       # in PODMonitor.setup
    extra.start_run(trainer, pl_module, monitored_run_index)     # each monitored validation run
    extra.on_batch(trainer, pl_module, batch, batch_idx, outputs)  # each batch of the monitored loader
    part = extra.gather_state()                                 # picklable; sent with the monitor's states
    result = extra.compute(parts, context)                      # rank zero only, no collective
    extra.state_dict() / load_state_dict(...)                   # checkpointed with the monitor

Rules: ``on_batch`` may run forward passes of the model (it is called inside the validation
loop, in eval mode, under ``torch.inference_mode``) but must leave the model as it found it, and
must not call collectives (the monitor gathers ``gather_state()`` in its own collective).
An exception in any hook becomes a warning of the monitor and costs only that extra's result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


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
    """

    step: int
    stage: str
    layer_names: Sequence[str]
    reports: Mapping[str, Any]
    prefix: str = "pod"


@dataclass
class ExtraResult:
    """What an extra adds to one monitored run's outputs.

    Attributes:
        scalars: ``{tag: value}`` logged to every logger at the run's step.
        texts: ``{tag: markdown}``.
        tables: ``{tag: (columns, rows)}`` (a W&B table, a CSV file, markdown elsewhere).
        images: ``{tag: (H, W, 3) uint8}``.
        record: JSON-able entry of the run's JSON-lines record (under the extra's ``name``) and of
            the history entry.
    """

    scalars: dict[str, float] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    tables: dict[str, tuple[list[str], list[list[Any]]]] = field(default_factory=dict)
    images: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)


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


__all__ = ["ExtraContext", "ExtraResult", "MonitorExtra"]
