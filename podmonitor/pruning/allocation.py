"""The head analysis of ``PODMonitor(per_head=True)``: :class:`HeadAllocationExtra` (METHOD.md section 7).

An extra of the monitor (:mod:`podmonitor.extras`), made by
:func:`podmonitor.extras.per_head_analysis` when the monitor is asked for ``per_head=True``. On
every monitored validation run it

* accumulates, per layer, the redundancy of its heads (:mod:`.redundancy`) from the same per-head
  attention fields the monitor accumulates (``on_attention``);
* on rank zero merges every rank's sums, and from the monitor's per-head POD reports derives the
  H*-based head allocation advice (:mod:`.advisor`: heads per layer now, recommended under the
  same budget, heads to drop first; a hypothesis, see docs/pruning.md) and its readiness
  (:mod:`.readiness`: drift of the dominant POD subspaces, of H* and of the advice between runs);
* publishes them: the scalars ``<p>/heads_now/<layer>``, ``<p>/heads_recommended/<layer>``,
  ``<p>/head_redundancy/<layer>/head_<h>``, ``<p>/subspace_drift/<layer>``,
  ``<p>/h_eps_drift/<layer>``, ``<p>/run/advice_stable``, ``<p>/run/settled_runs``; the text
  ``<p>/head_allocation``, the table ``<p>/head_allocation_table``, the picture
  ``<p>/head_allocation``; the record keys ``head_allocation``, ``head_redundancy`` and
  ``readiness`` (the first and the last also in the monitor's history).

The monitor's ``last_advice``, ``last_redundancy``, ``readiness``, ``last_readiness`` and
``advice_settings`` read this extra's attributes of the same names (``settings`` for the last).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from ..distributed import is_distributed
from ..extras import ExtraContext, ExtraResult, MonitorExtra
from ..reporting.sinks import strict_jsonable
from .advisor import AdviceSettings, HeadAllocationAdvice, advise_from_reports
from .readiness import AdviceReadiness
from .redundancy import HeadRedundancy, HeadRedundancyAccumulator


class HeadAllocationExtra(MonitorExtra):
    """Head redundancy, the H*-based head allocation advice and its readiness (see the module docstring).

    Args:
        advice: settings of the advisor (default ``AdviceSettings()``).
        readiness: the readiness tracker (default ``AdviceReadiness(eps=advice.eps)``).
        config: the monitor's :class:`~podmonitor.PODConfig`: the advice's eps must be among its
            ``eps``, and the redundancy sums are kept in its ``dtype`` (default float64, no check).

    Attributes:
        settings: the advisor's settings.
        readiness: the readiness tracker (checkpointed with the monitor).
        last_advice: the last run's :class:`~podmonitor.pruning.HeadAllocationAdvice`, or None.
        last_redundancy: ``{layer: HeadRedundancy}`` of the last run.
        last_readiness: the last run's readiness record, or None.

    Raises:
        ValueError: ``advice`` or ``readiness`` of the wrong type; the advice's eps not among
            ``config.eps``.
    """

    name = "head_analysis"

    def __init__(self, advice: AdviceSettings | None = None, readiness: AdviceReadiness | None = None,
                 config: Any = None) -> None:
        if advice is not None and not isinstance(advice, AdviceSettings):
            raise ValueError(f"advice must be an AdviceSettings, got {type(advice).__name__}")
        if readiness is not None and not isinstance(readiness, AdviceReadiness):
            raise ValueError(f"readiness must be an AdviceReadiness, got {type(readiness).__name__}")
        self.settings = advice or AdviceSettings()
        if config is not None and not any(math.isclose(self.settings.eps, e, rel_tol=1e-9) for e in config.eps):
            raise ValueError(f"advice eps {self.settings.eps} is not among PODConfig.eps {config.eps}")
        self.readiness = readiness or AdviceReadiness(eps=self.settings.eps)
        self.dtype: torch.dtype = config.dtype if config is not None else torch.float64
        self.last_advice: HeadAllocationAdvice | None = None
        self.last_redundancy: dict[str, HeadRedundancy] = {}
        self.last_readiness: dict[str, Any] | None = None
        self._redundancy: dict[str, HeadRedundancyAccumulator] = {}
        self._distributed = False

    # ------------------------------------------------------------------ every rank
    def start_run(self, trainer: Any, pl_module: Any, monitored_index: int) -> None:
        self._redundancy = {}
        self._distributed = is_distributed(trainer)

    def on_attention(self, layer: str, fields: torch.Tensor) -> None:
        """Add the (b, H, T, T) per-head fields of ``layer`` to its redundancy sums."""
        acc = self._redundancy.get(layer)
        if acc is None:
            acc = self._redundancy[layer] = HeadRedundancyAccumulator(self.dtype)
        acc.update(fields)

    def gather_state(self) -> dict[str, Any]:
        """``{layer: accumulator}`` (in DDP: its state dict, on the CPU)."""
        if self._distributed:
            return {name: acc.state_dict() for name, acc in self._redundancy.items()}
        return dict(self._redundancy)

    # ------------------------------------------------------------------ rank zero
    def compute(self, parts: list[Any], context: ExtraContext) -> ExtraResult:
        """Merge the ranks' redundancy sums, advise, track the readiness, and build the outputs.

        A layer whose redundancy cannot be computed, a failing advisor or readiness tracker
        become notes of the run (the advisor's and the tracker's failures are raised when the monitor is
        strict).
        """
        notes: list[str] = []
        self.last_redundancy = self._merge(parts, context.layer_names, notes)
        self.last_advice, self.last_readiness = None, None
        try:
            self.last_advice = advise_from_reports(context.reports, list(context.layer_names), self.last_redundancy,
                                                   self.settings, active=context.active)
        except Exception as err:  # noqa: BLE001 - advice is optional; the reports still go out
            if context.strict:
                raise
            notes.append(f"head allocation advice failed: {type(err).__name__}: {err}")
        try:
            self.last_readiness = self.readiness.update(context.step, context.reports, list(context.layer_names),
                                                        self.last_advice)
        except Exception as err:  # noqa: BLE001
            if context.strict:
                raise
            notes.append(f"readiness tracking failed: {type(err).__name__}: {err}")
        result = allocation_outputs(self.last_advice, self.last_redundancy, self.last_readiness,
                                    prefix=context.prefix)
        result.notes = notes
        return result

    def _merge(self, parts: list[Any], layer_names: Sequence[str], notes: list[str]) -> dict[str, HeadRedundancy]:
        """``{layer: HeadRedundancy}`` from every rank's part (a layer that fails is left out, with a note)."""
        out: dict[str, HeadRedundancy] = {}
        for name in layer_names:
            merged = HeadRedundancyAccumulator(self.dtype)
            try:
                for part in parts:
                    item = (part or {}).get(name)
                    if item is None:
                        continue
                    if not isinstance(item, HeadRedundancyAccumulator):  # a state dict from another process
                        acc = HeadRedundancyAccumulator(self.dtype)
                        acc.load_state_dict(item)
                        item = acc
                    merged.merge(item)
                out[name] = merged.compute()
            except ValueError as err:
                notes.append(f"head redundancy of {name}: {err}")
        return out

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"readiness": self.readiness.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("readiness"):
            self.readiness.load_state_dict(state["readiness"])


def allocation_outputs(advice: HeadAllocationAdvice | None, redundancy: Mapping[str, HeadRedundancy] | None,
                       readiness: Mapping[str, Any] | None, *, prefix: str = "pod") -> ExtraResult:
    """Scalars, text, table, picture and record entries of an advice, the head redundancy and the readiness.

    Scalars: ``<p>/heads_now/<layer>``, ``<p>/heads_recommended/<layer>``,
    ``<p>/head_redundancy/<layer>/head_<h>`` (largest field similarity with another head),
    ``<p>/subspace_drift/<layer>``, ``<p>/h_eps_drift/<layer>``, ``<p>/run/advice_stable`` (1 / 0),
    ``<p>/run/settled_runs``. Text ``<p>/head_allocation``: the advice's markdown and the readiness
    line. Table ``<p>/head_allocation_table``. Picture ``<p>/head_allocation``
    (:func:`~podmonitor.reporting.figures.head_allocation_figure`, drawn by the publisher on runs
    with pictures). Record: ``head_allocation``, ``head_redundancy`` (when any), ``readiness``.
    """
    out = ExtraResult(history_keys=("head_allocation", "readiness"))
    text = ""
    if advice is not None:
        for row in advice.layers:
            out.scalars[f"{prefix}/heads_now/{row.layer}"] = float(row.heads_now)
            out.scalars[f"{prefix}/heads_recommended/{row.layer}"] = float(row.recommended)
        text = advice.markdown()
        out.tables[f"{prefix}/head_allocation_table"] = advice.table()
        out.images[f"{prefix}/head_allocation"] = partial(_draw, advice)
        out.record_top["head_allocation"] = advice.to_dict()
    for layer, red in (redundancy or {}).items():
        for h in range(red.n_heads):
            _, sim = red.most_similar(h)
            out.scalars[f"{prefix}/head_redundancy/{layer}/head_{h:02d}"] = float(sim)
    if redundancy:
        out.record_top["head_redundancy"] = {name: red.to_dict() for name, red in redundancy.items()}
    if readiness is not None:
        for layer, v in readiness.get("layers", {}).items():
            out.scalars[f"{prefix}/subspace_drift/{layer}"] = _float(v.get("subspace_drift"))
            out.scalars[f"{prefix}/h_eps_drift/{layer}"] = _float(v.get("h_drift"))
        out.scalars[f"{prefix}/run/advice_stable"] = 1.0 if readiness.get("stable") else 0.0
        out.scalars[f"{prefix}/run/settled_runs"] = float(readiness.get("settled_runs", 0))
        line = f"**readiness:** {readiness.get('reason', '')}"
        text = f"{text}\n{line}\n" if text else line + "\n"
        out.record_top["readiness"] = strict_jsonable(dict(readiness))
    if text:
        out.texts[f"{prefix}/head_allocation"] = text
    return out


def _draw(advice: HeadAllocationAdvice) -> np.ndarray:
    """(H, W, 3) uint8 picture of the advice (matplotlib; called on the publisher's worker)."""
    from ..reporting.figures import figure_to_array, head_allocation_figure

    return figure_to_array(head_allocation_figure(advice))


def _float(x: Any) -> float:
    try:
        return math.nan if x is None else float(x)
    except (TypeError, ValueError):
        return math.nan


__all__ = ["HeadAllocationExtra", "allocation_outputs"]
