"""The Lightning callback: :class:`PODMonitor`.

Data flows one way: capture (``podmonitor.capture``) -> accumulate (``podmonitor.engine``) ->
analyse (``PODAccumulator.compute``) -> report (``podmonitor.reporting``). This module only
orchestrates them inside Lightning's validation loop.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only

from .capture import CaptureAdapter, CapturedAttention, select_adapter
from .engine import MemoryBudgetError, PODAccumulator, PODConfig, PODReport
from .pruning.advisor import AdviceSettings, HeadAllocationAdvice, advise_from_reports
from .pruning.readiness import AdviceReadiness
from .pruning.redundancy import HeadRedundancy, HeadRedundancyAccumulator

STATE_VERSION = 1


class PODMonitorWarning(UserWarning):
    """A problem inside the monitor that did not stop training."""


class PODMonitor(Callback):
    """Watch the attention of a transformer while it trains, by scale-selective POD.

    During validation runs (never during training steps) it captures the post-softmax attention
    probabilities of every attention layer on the first validation batches until it holds
    ``n_snapshots`` sequences (over all processes), feeds them to one incremental
    :class:`~podmonitor.PODAccumulator` per layer as they arrive, and at the end of the run
    computes and logs, per layer, T_spec, beta, R^2, H*(eps), dominant scales, the scale
    centroid, mean attention distance, entropy and pictures (scalograms, the layers x scales
    heatmap, spectra, mode lag profiles, coherency) to every logger of the Trainer
    (TensorBoard, Weights & Biases; PNG files next to the run otherwise). The full report of
    every monitored run is appended to ``podmonitor.jsonl`` in the run directory.

    It never stops training: an error inside the monitor becomes one warning and the run goes
    on (``strict=True`` re-raises instead).

    Args:
        n_snapshots: N, sequences to analyse per monitored validation run (all processes).
        every_n_validations: monitor every k-th validation run (the first one included); the
            sanity-check run is never monitored.
        config: engine settings (:class:`~podmonitor.PODConfig`).
        capture: how to get attention: "auto" (the model's own ``attention_maps`` protocol,
            then Hugging Face, then ``torch.nn.MultiheadAttention``), an adapter name, a
            :class:`~podmonitor.capture.CaptureAdapter`, or a function
            ``fn(pl_module, batch) -> list[Tensor (B, H, T, T)]``.
        per_head: also analyse each head's field (H times the work and memory), and with it the
            redundancy of the heads of each layer, the head allocation advice (heads per layer
            now, recommended under the same budget, heads to drop first; METHOD.md section 7) and
            its readiness (drift of the dominant POD subspaces and of H* between runs); see
            :mod:`podmonitor.pruning` and docs/pruning.md. Kept in ``last_advice``,
            ``last_redundancy``, ``readiness``, the history and the JSON-lines record.
        advice: settings of the head allocation advisor (default ``AdviceSettings()``; per_head only).
        readiness: the readiness tracker (default ``AdviceReadiness(eps=advice.eps)``; per_head only).
        log_images: log pictures.
        images_every_n: pictures on every n-th monitored run, the first one included (default 2:
            drawing about five pictures per layer costs more than the analysis itself; set 1 for
            pictures on every monitored run).
        output_dir: where the JSON-lines report and PNG pictures go; default
            ``<trainer.log_dir or default_root_dir>/podmonitor``.
        prefix: name prefix of the logged scalars.
        strict: re-raise errors inside the monitor instead of warning.

    Raises:
        ValueError: invalid arguments.

    Example:
        >>> from lightning import Trainer
        >>> from lightning.pytorch.loggers import TensorBoardLogger
        >>> from podmonitor import PODMonitor
        >>> trainer = Trainer(callbacks=[PODMonitor()], logger=TensorBoardLogger("logs"))
    """

    def __init__(
        self,
        n_snapshots: int = 150,
        every_n_validations: int = 1,
        config: PODConfig | None = None,
        capture: str | Callable[..., Any] | CaptureAdapter = "auto",
        per_head: bool = False,
        log_images: bool = True,
        images_every_n: int = 2,
        output_dir: str | None = None,
        prefix: str = "pod",
        strict: bool = False,
        advice: AdviceSettings | None = None,
        readiness: AdviceReadiness | None = None,
    ) -> None:
        if not isinstance(n_snapshots, int) or n_snapshots < 3:
            raise ValueError(f"n_snapshots must be an int >= 3, got {n_snapshots!r}")
        if not isinstance(every_n_validations, int) or every_n_validations < 1:
            raise ValueError(f"every_n_validations must be an int >= 1, got {every_n_validations!r}")
        if not isinstance(images_every_n, int) or images_every_n < 1:
            raise ValueError(f"images_every_n must be an int >= 1, got {images_every_n!r}")
        if config is not None and not isinstance(config, PODConfig):
            raise ValueError(f"config must be a PODConfig, got {type(config).__name__}")
        if not (isinstance(capture, (str, CaptureAdapter)) or callable(capture)):
            raise ValueError("capture must be 'auto', an adapter name, a CaptureAdapter or a function")
        if advice is not None and not isinstance(advice, AdviceSettings):
            raise ValueError(f"advice must be an AdviceSettings, got {type(advice).__name__}")
        if readiness is not None and not isinstance(readiness, AdviceReadiness):
            raise ValueError(f"readiness must be an AdviceReadiness, got {type(readiness).__name__}")
        self.advice_settings = advice or AdviceSettings()
        cfg_eps = (config or PODConfig()).eps
        if per_head and not any(math.isclose(self.advice_settings.eps, e, rel_tol=1e-9) for e in cfg_eps):
            raise ValueError(f"advice eps {self.advice_settings.eps} is not among PODConfig.eps {cfg_eps}")
        self.readiness = readiness or (AdviceReadiness(eps=self.advice_settings.eps) if per_head else None)
        self.n_snapshots = n_snapshots
        self.every_n_validations = every_n_validations
        self.config = config or PODConfig()
        self.capture = capture
        self.per_head = per_head
        self.log_images = log_images
        self.images_every_n = images_every_n
        self.output_dir = output_dir
        self.prefix = prefix
        self.strict = strict

        self.history: list[dict[str, Any]] = []  # one summary per monitored validation run
        self.validation_count = 0
        self.monitored_count = 0
        self.last_reports: dict[str, PODReport] = {}
        self.last_redundancy: dict[str, HeadRedundancy] = {}
        self.last_advice: HeadAllocationAdvice | None = None
        self.last_readiness: dict[str, Any] | None = None
        self.timings: dict[str, float] = {}
        self._adapter: CaptureAdapter | None = None
        self._adapter_error: str | None = None
        self._publisher: Any = None
        self._reset_run()

    # ----------------------------------------------------------- bookkeeping
    @property
    def state_key(self) -> str:
        return self._generate_state_key(n_snapshots=self.n_snapshots, prefix=self.prefix)

    def _reset_run(self) -> None:
        self._monitoring = False
        self._capturing = False
        self._accumulators: dict[str, PODAccumulator] = {}
        self._redundancy: dict[str, HeadRedundancyAccumulator] = {}
        self._active: dict[str, list[bool]] | None = None
        self._layer_names: list[str] = []
        self._seq_len: int | None = None
        self._taken = 0
        self._skipped = {"padding": 0, "length": 0, "budget": 0}
        self._run_errors: list[str] = []
        self._budget_hit = False
        self._capture_seconds = 0.0
        self._accumulate_seconds = 0.0

    def _handle(self, where: str, err: BaseException) -> None:
        """One clear warning (or a re-raise when strict); the monitor stops for this run."""
        msg = f"PODMonitor: {where} failed ({type(err).__name__}: {err}); monitoring skipped for this validation run"
        self._run_errors.append(msg)
        self._monitoring = False
        self._stop_capture()
        if self.strict:
            raise err
        warnings.warn(msg, PODMonitorWarning, stacklevel=2)

    def _stop_capture(self) -> None:
        if self._adapter is not None and self._capturing:
            try:
                self._adapter.stop()
            except Exception as err:  # noqa: BLE001 - stop must never raise into training
                warnings.warn(f"PODMonitor: removing capture hooks failed: {err}", PODMonitorWarning, stacklevel=2)
        self._capturing = False

    def _world(self, trainer: Trainer) -> tuple[int, int]:
        return int(getattr(trainer, "world_size", 1) or 1), int(getattr(trainer, "global_rank", 0) or 0)

    def _per_rank_target(self, trainer: Trainer) -> int:
        world, _ = self._world(trainer)
        return math.ceil(self.n_snapshots / world)

    def run_dir(self, trainer: Trainer) -> str:
        """Directory of the JSON-lines report and the PNG pictures."""
        if self.output_dir is not None:
            return self.output_dir
        base = trainer.log_dir or trainer.default_root_dir
        return os.path.join(base, "podmonitor")

    # ----------------------------------------------------------------- hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        try:
            self._adapter = select_adapter(pl_module, self.capture)
            self._adapter_error = None
        except Exception as err:  # noqa: BLE001
            self._adapter = None
            self._adapter_error = f"{type(err).__name__}: {err}"
            if self.strict:
                raise
            warnings.warn(f"PODMonitor: no way to capture attention from this model, monitor inactive: {err}",
                          PODMonitorWarning, stacklevel=2)

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset_run()
        if trainer.sanity_checking or self._adapter is None:
            return
        self.validation_count += 1
        self._monitoring = (self.validation_count - 1) % self.every_n_validations == 0

    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if not self._monitoring or self._budget_hit or self._taken >= self._per_rank_target(trainer):
            return
        assert self._adapter is not None
        try:
            self._capturing = True
            self._adapter.start(pl_module)
        except Exception as err:  # noqa: BLE001
            self._handle("attaching the attention capture", err)

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if not self._capturing:
            return
        assert self._adapter is not None
        t0 = time.perf_counter()
        try:
            captured = self._adapter.collect(pl_module, batch, outputs)
        except Exception as err:  # noqa: BLE001
            self._handle("capturing attention", err)
            return
        finally:
            self._stop_capture()
        t1 = time.perf_counter()
        self._capture_seconds += t1 - t0
        try:
            if self._layer_names == [] and self._active is None:  # first batch of the run
                self._active = _active_heads(pl_module, list(captured.layer_names))
            self._accumulate(captured, self._per_rank_target(trainer))
        except Exception as err:  # noqa: BLE001
            self._handle("accumulating attention fields", err)
        self._accumulate_seconds += time.perf_counter() - t1

    def _accumulate(self, captured: CapturedAttention, target: int) -> None:
        """Head-average, drop padded or mismatched sequences, feed the accumulators."""
        if not captured.fields:
            raise ValueError("the capture returned no attention layers")
        if not self._layer_names:
            self._layer_names = list(captured.layer_names)
            config = self.config
            if captured.causal is not None and config.causal is None:
                config = _replace(config, causal=captured.causal)
            for name in self._layer_names:
                self._accumulators[name] = PODAccumulator(config)
            if self.per_head:
                for name, f in zip(self._layer_names, captured.fields, strict=True):
                    for h in range(f.shape[1]):
                        self._accumulators[f"{name}/head_{h:02d}"] = PODAccumulator(config)
                    self._redundancy[name] = HeadRedundancyAccumulator(config.dtype)
        elif list(captured.layer_names) != self._layer_names:
            raise ValueError("the captured layers changed between batches")
        n_seq, seq_len = captured.fields[0].shape[0], captured.fields[0].shape[-1]
        if self._seq_len is None:
            self._seq_len = seq_len
        if seq_len != self._seq_len:
            self._skipped["length"] += n_seq
            return
        keep = torch.ones(n_seq, dtype=torch.bool, device=captured.fields[0].device)
        if captured.valid is not None:
            valid = captured.valid.to(keep.device).bool()
            self._skipped["padding"] += int((~valid).sum())
            keep &= valid
        index = torch.nonzero(keep).flatten()[: max(0, target - self._taken)]
        if index.numel() == 0:
            return
        try:
            for name, f in zip(self._layer_names, captured.fields, strict=True):
                sel = f.index_select(0, index.to(f.device))  # (b, H, T, T)
                self._accumulators[name].update(_head_average(sel, (self._active or {}).get(name)))
                if self.per_head:
                    for h in range(sel.shape[1]):
                        self._accumulators[f"{name}/head_{h:02d}"].update(sel[:, h])
                    self._redundancy[name].update(sel)
        except MemoryBudgetError as err:
            self._budget_hit = True
            self._skipped["budget"] += int(index.numel())
            self._run_errors.append(f"memory budget exceeded, capture stopped: {err}")
            warnings.warn(f"PODMonitor: {err}", PODMonitorWarning, stacklevel=2)
            return
        self._taken += int(index.numel())

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or self._adapter is None:
            return
        _, rank = self._world(trainer)
        if not self._monitoring and not self._run_errors:
            # every rank decides the same way (same validation count), so nobody waits here
            return
        t0 = time.perf_counter()
        try:
            states = self._gather_states(trainer)
        except Exception as err:  # noqa: BLE001
            self._handle("gathering snapshots across processes", err)
            return
        if rank != 0:
            self._reset_run()
            return
        if self.per_head:
            self._active = _active_heads(pl_module, self._layer_names or next(
                (s["layer_names"] for s in states if s["layer_names"]), []))
        try:
            reports = self._merge_and_compute(states)
            t1 = time.perf_counter()
            self.timings = {"capture_s": self._capture_seconds, "accumulate_s": self._accumulate_seconds,
                            "compute_s": t1 - t0}
            self._report(trainer, reports)
            self.timings["logging_s"] = time.perf_counter() - t1
            if self.history:
                self.history[-1]["timings"] = dict(self.timings)
        except Exception as err:  # noqa: BLE001
            self._handle("analysing or logging", err)
        self._reset_run()

    def _gather_states(self, trainer: Trainer) -> list[dict[str, Any]]:
        """Every rank calls the collective (also with nothing to send), rank 0 gets all states.

        In a single process the accumulators themselves are passed on (no copy of the snapshots).
        """
        payload: dict[str, Any] = {
            "layer_names": self._layer_names,
            "accumulators": dict(self._accumulators),
            "redundancy": dict(self._redundancy),
            "skipped": dict(self._skipped),
            "errors": list(self._run_errors),
            "monitoring": self._monitoring,
        }
        world, _ = self._world(trainer)
        if world == 1 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return [payload]
        states = {}
        for name, acc in self._accumulators.items():
            state = acc.state_dict()
            states[name] = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        payload["accumulators"] = states
        payload["redundancy"] = {name: acc.state_dict() for name, acc in self._redundancy.items()}
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, payload)
        return gathered

    def _merge_and_compute(self, states: list[dict[str, Any]]) -> dict[str, PODReport]:
        names: list[str] = next((s["layer_names"] for s in states if s["layer_names"]), [])
        self._layer_names = names
        totals: dict[str, int] = {}
        for s in states:
            for k, v in s["skipped"].items():
                totals[k] = totals.get(k, 0) + int(v)
        self._skipped = totals
        for s in states:
            for e in s["errors"]:
                if e not in self._run_errors:
                    self._run_errors.append(e)
        keys = list(next((s["accumulators"] for s in states if s["accumulators"]), {}).keys())
        reports: dict[str, PODReport] = {}
        for key in keys:
            acc: PODAccumulator | None = None
            for s in states:
                item = s["accumulators"].get(key)
                if item is None:
                    continue
                if isinstance(item, PODAccumulator):
                    part = item
                else:  # a state dict from another process
                    part = PODAccumulator(PODConfig.from_dict(item["config"]))
                    part.load_state_dict(item)
                acc = part if acc is None else acc.merge(part)
            if acc is not None:
                reports[key] = acc.compute()
        self.last_reports = reports
        self.last_redundancy = {}
        if self.per_head:
            self.last_redundancy = self._merge_redundancy(states)
        return reports

    def _merge_redundancy(self, states: list[dict[str, Any]]) -> dict[str, HeadRedundancy]:
        """Merge every process's head-redundancy sums and compute them (a failing layer is left out
        with a note in the run's errors)."""
        out: dict[str, HeadRedundancy] = {}
        names = list(next((s["redundancy"] for s in states if s.get("redundancy")), {}).keys())
        for name in names:
            merged = HeadRedundancyAccumulator(self.config.dtype)
            try:
                for s in states:
                    item = s.get("redundancy", {}).get(name)
                    if item is None:
                        continue
                    if not isinstance(item, HeadRedundancyAccumulator):
                        part = HeadRedundancyAccumulator(self.config.dtype)
                        part.load_state_dict(item)
                        item = part
                    merged.merge(item)
                out[name] = merged.compute()
            except ValueError as err:
                self._run_errors.append(f"head redundancy of {name}: {err}")
        return out

    def _advise(self, step: int, reports: dict[str, PODReport]) -> None:
        """Head allocation advice and readiness of this run (per_head only); failures become notes."""
        self.last_advice, self.last_readiness = None, None
        try:
            self.last_advice = advise_from_reports(reports, self._layer_names, self.last_redundancy,
                                                   self.advice_settings, active=self._active)
        except Exception as err:  # noqa: BLE001 - advice is optional; the reports still go out
            if self.strict:
                raise
            self._run_errors.append(f"head allocation advice failed: {type(err).__name__}: {err}")
        if self.readiness is not None:
            try:
                self.last_readiness = self.readiness.update(step, reports, self._layer_names, self.last_advice)
            except Exception as err:  # noqa: BLE001
                if self.strict:
                    raise
                self._run_errors.append(f"readiness tracking failed: {type(err).__name__}: {err}")

    @rank_zero_only
    def _report(self, trainer: Trainer, reports: dict[str, PODReport]) -> None:
        from .reporting.publish import Publisher

        if self._publisher is None:
            self._publisher = Publisher(self.run_dir(trainer), self.prefix)
        images = self.log_images and (self.monitored_count % self.images_every_n == 0)
        if self.per_head:
            self._advise(int(trainer.global_step), reports)
        summary = self._publisher.publish(
            loggers=trainer.loggers,
            reports=reports,
            layer_names=self._layer_names,
            step=int(trainer.global_step),
            epoch=int(trainer.current_epoch),
            images=images,
            skipped=dict(self._skipped),
            errors=list(self._run_errors),
            timings=dict(self.timings),
            head_allocation=self.last_advice,
            head_redundancy=self.last_redundancy if self.per_head else None,
            readiness=self.last_readiness,
        )
        self.monitored_count += 1
        self.history.append(summary)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop_capture()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop_capture()

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "history": list(self.history),
            "validation_count": self.validation_count,
            "monitored_count": self.monitored_count,
            "n_snapshots": self.n_snapshots,
            "every_n_validations": self.every_n_validations,
            "config": self.config.to_dict(),
            "readiness": self.readiness.state_dict() if self.readiness is not None else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != STATE_VERSION:
            warnings.warn("PODMonitor: unknown checkpoint state version, history not restored",
                          PODMonitorWarning, stacklevel=2)
            return
        self.history = list(state_dict.get("history", []))
        self.validation_count = int(state_dict.get("validation_count", 0))
        self.monitored_count = int(state_dict.get("monitored_count", 0))
        if self.readiness is not None and state_dict.get("readiness"):
            self.readiness.load_state_dict(state_dict["readiness"])


def _active_heads(pl_module: LightningModule, layer_names: Sequence[str]) -> dict[str, list[bool]] | None:
    """``{layer: (H,) bool}`` from the reference models' head masks (False: pruned head); None when
    the model has no such masks or their count does not match the captured layers."""
    from .models.gpt import CausalSelfAttention

    masks = [m.head_mask for m in pl_module.modules() if isinstance(m, CausalSelfAttention)]
    if not masks or len(masks) != len(layer_names):
        return None
    return {name: [bool(v != 0) for v in m.tolist()] for name, m in zip(layer_names, masks, strict=True)}


def _head_average(fields: torch.Tensor, active: Sequence[bool] | None) -> torch.Tensor:
    """(b, H, T, T) -> (b, T, T): mean over the heads still active (masked heads carry no output,
    so the layer's field is the mean of the heads that reach the residual stream); all heads when
    ``active`` is None, does not match H, or masks every head."""
    if active is None or len(active) != fields.shape[1] or all(active) or not any(active):
        return fields.mean(dim=1)
    keep = torch.tensor([i for i, a in enumerate(active) if a], device=fields.device)
    return fields.index_select(1, keep).mean(dim=1)


def _replace(config: PODConfig, **changes: Any) -> PODConfig:
    d = config.to_dict()
    d.update(changes)
    return PODConfig.from_dict(d)


__all__: Sequence[str] = ["PODMonitor", "PODMonitorWarning"]
