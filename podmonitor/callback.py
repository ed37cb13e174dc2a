"""The Lightning callback: :class:`PODMonitor`.

Data flows one way: capture (``podmonitor.capture``) -> accumulate (``podmonitor.engine``) ->
analyse (``PODAccumulator.compute``) -> report (``podmonitor.reporting``). This module only
orchestrates them inside Lightning's validation loop.

Distributed runs: every collective is in :mod:`podmonitor.distributed` and is called on every
rank from hooks Lightning runs on every rank, decided by state that is the same on every rank
(docs/reliability.md). Rank zero alone analyses and writes, with no collective in that path.
"""

from __future__ import annotations

import math
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer

from . import hugepages
from .callback_base import MonitorCallback
from .capture import CaptureAdapter, CapturedAttention, select_adapter
from .capture.reduce import HeadsFor, ReducedAttention, Reduction
from .distributed import all_gather_ints, all_gather_object, global_rank, is_distributed, share_quota, world_size
from .engine import MemoryBudgetError, PODAccumulator, PODConfig, PODReport
from .engine.stability import StabilityAccumulator
from .engine.wavelets import release_scalogram_buffers
from .extras import (
    ExtraContext,
    ExtraResult,
    HeadAdvice,
    HeadAnalysis,
    MonitorExtra,
    Readiness,
    find_extra,
    per_head_analysis,
)

STATE_VERSION = 1
#: default scale of the coherency map (tokens): scales[4] of the default grid, 2^(1 + 5 * 4 / 19) = 4.15
COHERENCY_SCALE = 2.0 ** (1.0 + 5.0 * 4.0 / 19.0)
#: a layer's head-averaged fields are handed to its accumulator in groups of at least this many
#: bytes (a validation batch of a few long sequences is small): each update pays a few passes over
#: (L, L) state and one more field in its products, once per group instead of once per batch
FEED_BYTES = 32 * 2**20
# the state of version 1 without a run id still loads (run_id then unknown)


class PODMonitorWarning(UserWarning):
    """A problem inside the monitor that did not stop training."""


class PODMonitor(MonitorCallback):
    """Watch the attention of a transformer while it trains, by scale-selective POD.

    During validation runs (never during training steps) it captures the post-softmax attention
    probabilities of every attention layer on the first batches of the first validation loader
    until it holds ``n_snapshots`` sequences (over all processes), feeds them to one incremental
    :class:`~podmonitor.PODAccumulator` per layer as they arrive, and at the end of the run
    computes and logs, per layer, T_spec, beta, R^2, H*(eps), dominant scales, the scale
    centroid, mean attention distance, entropy and pictures (scalograms, the layers x scales
    heatmap, spectra, mode lag profiles, coherency) to every logger of the Trainer
    (TensorBoard, Weights & Biases; PNG files next to the run otherwise). The full report of
    every monitored run is appended to ``podmonitor.jsonl`` in the run directory, with the stage
    ("fit" or "validate") and the monitor's ``run_id``; a resumed run writes a marker first.

    It never stops or stalls training: an error inside the monitor becomes one warning and the
    run goes on (``strict=True`` re-raises instead); an output that fails (a read-only folder, a
    logger that went away) costs that output only.

    In DDP the snapshot quota is shared by the processes: after each captured batch the ranks
    exchange how many usable sequences they hold and take them round-robin until ``n_snapshots``
    are taken in all (one small collective per captured batch). When the ranks' validation loaders
    differ in length (no ``DistributedSampler``) each rank takes ``ceil(n_snapshots / world)``
    instead, with no per-batch collective. After ``strategy="ddp_spawn"`` the main process's
    ``history`` is rank zero's (handed over at the end of fitting).

    Args:
        n_snapshots: N, sequences to analyse per monitored validation run (all processes).
        every_n_validations: monitor every k-th validation run (the first one included); the
            sanity-check run is never monitored.
        config: engine settings (:class:`~podmonitor.PODConfig`).
        capture: how to get attention: "auto" (the model's own ``attention_maps`` protocol,
            then the other adapters, see :func:`~podmonitor.capture.select_adapter`), an adapter
            name, a :class:`~podmonitor.capture.CaptureAdapter`, or a function
            ``fn(pl_module, batch) -> list[Tensor (B, H, T, T)]``.
        per_head: also analyse each head's field (H times the work and memory), and with it the
            redundancy of the heads of each layer, the head allocation advice (heads per layer
            now, recommended under the same budget, heads to drop first; METHOD.md section 7) and
            its readiness (drift of the dominant POD subspaces and of H* between runs): the head
            analysis, an extra of the pruning package added first to ``extras``
            (:func:`~podmonitor.extras.per_head_analysis`; see docs/pruning.md). Kept in
            ``last_advice``, ``last_redundancy``, ``readiness``, the history and the JSON-lines
            record.
        advice: settings of the head allocation advisor, a
            :class:`~podmonitor.pruning.AdviceSettings` (default ``AdviceSettings()``; per_head only).
        readiness: the readiness tracker, a :class:`~podmonitor.pruning.AdviceReadiness` (default
            ``AdviceReadiness(eps=advice.eps)``; per_head only).
        log_images: log pictures: True (all), False (none), or the names of the pictures to draw,
            from :data:`~podmonitor.reporting.figures.PICTURES`: ``"scale_organisation"``, the
            per-layer ``"scalogram"``, ``"mean_scalogram"``, ``"spectrum"``, ``"modes"`` and
            ``"coherency"``, and ``"trend"`` (the layers x validation-steps heatmaps), as a list,
            tuple or set. Pictures are the largest part of the monitor's cost on a CPU, so fewer
            of them cost less; the coherency map is only computed when it is drawn. The extras'
            own pictures (the head allocation of ``per_head=True``) are drawn on every picture run.
        images_every_n: pictures on every n-th monitored run, the first one included (default 2:
            drawing about five pictures per layer costs more than the analysis itself; set 1 for
            pictures on every monitored run).
        output_dir: where the JSON-lines report and PNG pictures go; default
            ``<trainer.log_dir or default_root_dir>/podmonitor``.
        prefix: name prefix of the logged scalars.
        strict: re-raise errors inside the monitor instead of warning.
        dataloader_idx: the validation loader to monitor (default 0, the first); batches of the
            other loaders are ignored, with one message saying so.
        coherency_max_len: the cross-coherency map (METHOD.md section 6; a picture, and by far the
            costliest part of the analysis at long contexts: 25 s per layer at L = 1024) is computed
            on picture runs for sequences up to this length (default 512); raise it to see the map
            of longer sequences, or set ``PODConfig(coherency=False)`` for none.
        extras: extra analyses run on the same monitored batches and published with the POD
            metrics (:class:`~podmonitor.extras.MonitorExtra`; for example
            :class:`~podmonitor.pruning.HeadImportanceProbe`).

    Raises:
        ValueError: invalid arguments.

    Example:
        >>> from lightning import Trainer
        >>> from lightning.pytorch.loggers import TensorBoardLogger
        >>> from podmonitor import PODMonitor
        >>> trainer = Trainer(callbacks=[PODMonitor()], logger=TensorBoardLogger("logs"))
    """

    warning_class = PODMonitorWarning

    def __init__(
        self,
        n_snapshots: int = 150,
        every_n_validations: int = 1,
        config: PODConfig | None = None,
        capture: str | Callable[..., Any] | CaptureAdapter = "auto",
        per_head: bool = False,
        log_images: bool | Sequence[str] = True,
        images_every_n: int = 2,
        output_dir: str | None = None,
        prefix: str = "pod",
        strict: bool = False,
        advice: Any = None,
        readiness: Any = None,
        dataloader_idx: int = 0,
        extras: Sequence[MonitorExtra] = (),
        coherency_max_len: int = 512,
    ) -> None:
        if not isinstance(n_snapshots, int) or n_snapshots < 3:
            raise ValueError(f"n_snapshots must be an int >= 3, got {n_snapshots!r}")
        if not isinstance(every_n_validations, int) or every_n_validations < 1:
            raise ValueError(f"every_n_validations must be an int >= 1, got {every_n_validations!r}")
        pictures = _picture_names(log_images)
        if not isinstance(images_every_n, int) or images_every_n < 1:
            raise ValueError(f"images_every_n must be an int >= 1, got {images_every_n!r}")
        if not isinstance(dataloader_idx, int) or isinstance(dataloader_idx, bool) or dataloader_idx < 0:
            raise ValueError(f"dataloader_idx must be an int >= 0, got {dataloader_idx!r}")
        extras = list(extras)
        if not all(isinstance(e, MonitorExtra) for e in extras):
            raise ValueError("extras must be MonitorExtra instances")
        if config is not None and not isinstance(config, PODConfig):
            raise ValueError(f"config must be a PODConfig, got {type(config).__name__}")
        if not (isinstance(capture, (str, CaptureAdapter)) or callable(capture)):
            raise ValueError("capture must be 'auto', an adapter name, a CaptureAdapter or a function")
        if per_head and not any(isinstance(e, HeadAnalysis) for e in extras):
            # the head analysis comes first: later extras (the probe) read its redundancy
            extras.insert(0, per_head_analysis(config or PODConfig(), advice=advice, readiness=readiness))
        elif per_head and (advice is not None or readiness is not None):
            raise ValueError("advice and readiness belong to the head analysis given in extras; give them there")
        if len({e.name for e in extras}) != len(extras):
            raise ValueError(f"extras need unique names, got {[e.name for e in extras]}")
        self.n_snapshots = n_snapshots
        self.every_n_validations = every_n_validations
        self.config = config or PODConfig()
        self.capture = capture
        self.per_head = per_head
        self.pictures = pictures  # the pictures a picture run draws (None: all; empty: none)
        self.log_images = pictures is None or bool(pictures)
        self.images_every_n = images_every_n
        self.output_dir = output_dir
        self.prefix = prefix
        self.strict = strict
        self.dataloader_idx = dataloader_idx
        self.coherency_max_len = int(coherency_max_len)
        self.extras = extras
        self.last_extras: dict[str, ExtraResult] = {}
        self.last_stability: dict[str, dict[str, float]] = {}  # {layer: {metric key: value}}
        self.last_stability_reports: dict[str, Any] = {}  # {layer: StabilityReport}
        self.reference_scales: dict[str, float] = {}  # layer -> fixed reference scale (checkpointed)
        self.last_reference: dict[str, dict[str, Any]] = {}

        self._init_shell()  # history (one summary per monitored validation run), run dir
        self.run_id = uuid.uuid4().hex[:12]  # the same on every rank (the object is copied to them)
        self.validation_count = 0
        self.monitored_count = 0
        self.last_reports: dict[str, PODReport] = {}
        self.timings: dict[str, float] = {}  # the last monitored run's cost inside the validation loop
        # the outputs' cost in the background, summed over the fits: the worker's busy and CPU
        # seconds (sinks; pictures too when drawn on it) and the picture process's CPU seconds
        self.background_timings: dict[str, float] = {"wall_s": 0.0, "cpu_s": 0.0, "picture_cpu_s": 0.0}
        self._adapter: CaptureAdapter | None = None
        self._adapter_error: str | None = None
        self._publisher: Any = None
        self._resumed_from: dict[str, Any] | None = None  # set by load_state_dict (a checkpoint)
        self._notes_once: set[str] = set()
        self._stage = "fit"
        self._reset_run()

    # ------------------------------------------------ the head analysis (per_head)
    @property
    def head_analysis(self) -> HeadAnalysis | None:
        """The head analysis among ``extras`` (``per_head=True``), or None."""
        return find_extra(self, HeadAnalysis)

    @property
    def last_advice(self) -> HeadAdvice | None:
        """The last run's H*-based head allocation advice (:class:`~podmonitor.pruning.HeadAllocationAdvice`;
        ``per_head=True``), or None."""
        head = self.head_analysis
        return None if head is None else head.last_advice

    @property
    def last_redundancy(self) -> Mapping[str, Any]:
        """``{layer: HeadRedundancy}`` of the last run (``per_head=True``; else empty)."""
        head = self.head_analysis
        return {} if head is None else head.last_redundancy

    @property
    def last_readiness(self) -> dict[str, Any] | None:
        """The last run's readiness record (``per_head=True``), or None."""
        head = self.head_analysis
        return None if head is None else head.last_readiness

    @property
    def readiness(self) -> Readiness | None:
        """The readiness tracker of the head allocation advice (:class:`~podmonitor.pruning.AdviceReadiness`;
        ``per_head=True``), or None."""
        head = self.head_analysis
        return None if head is None else head.readiness

    @property
    def advice_settings(self) -> Any:
        """The head allocation advisor's settings (:class:`~podmonitor.pruning.AdviceSettings`;
        ``per_head=True``), or None."""
        head = self.head_analysis
        return None if head is None else head.settings

    # ----------------------------------------------------------- bookkeeping
    @property
    def state_key(self) -> str:
        return self._generate_state_key(n_snapshots=self.n_snapshots, prefix=self.prefix)

    def _reset_run(self) -> None:
        self._monitored_run = False  # this validation run is monitored: the same on every rank
        self._picture_run = False  # this run draws pictures (and computes the coherency map)
        self._monitoring = False  # this rank still captures (False after an error on this rank)
        self._capturing = False
        self._quota_shared = False  # the ranks share the quota batch by batch (same on every rank)
        self._quota_open = False  # more snapshots wanted (same on every rank when shared)
        self._shared_batches = 0  # batches over which the quota is shared (same on every rank)
        self._taken_all = 0  # snapshots taken by all ranks so far (shared quota only)
        self._accumulators: dict[str, PODAccumulator] = {}
        self._pending: dict[str, list[torch.Tensor]] = {}  # head-averaged fields not yet added, per layer
        self._stability: dict[str, StabilityAccumulator] = {}  # METHOD.md section 10, per layer
        self._flagged: dict[str, str] = {}  # layers the capture excluded (e.g. a failed self-check)
        self._counters: dict[str, int] = {}  # the capture's event counts (e.g. cross-attention calls)
        self._active: dict[str, list[bool]] | None = None
        self._layer_names: list[str] = []
        self._seq_len: int | None = None
        self._taken = 0
        self._skipped = {"padding": 0, "length": 0, "budget": 0}
        self._run_errors: list[str] = []
        self._budget_hit = False
        self._capture_seconds = 0.0
        self._accumulate_seconds = 0.0
        # the captures' large map buffers, kept mapped from one batch to the next while nobody
        # else holds them (hugepages.BufferPool: no page faults for every batch's fresh maps)
        self._map_pool = hugepages.BufferPool()

    def _handle(self, where: str, err: BaseException) -> None:
        """One clear warning (or a re-raise when strict); this rank stops capturing for this run
        (it still takes part in the run's collectives)."""
        msg = f"PODMonitor: {where} failed ({type(err).__name__}: {err}); monitoring skipped for this validation run"
        self._run_errors.append(msg)
        self._monitoring = False
        self._stop_capture()
        if self.strict:
            raise err
        self._note_once(msg, msg)  # the same failure run after run: one warning (every record keeps it)

    def _note_once(self, key: str, msg: str) -> None:
        """A warning given once per monitor (not at every validation run)."""
        if key in self._notes_once:
            return
        self._notes_once.add(key)
        warnings.warn(msg, PODMonitorWarning, stacklevel=3)

    def _stop_capture(self) -> None:
        if self._capturing:
            hugepages.remove_pool(self._map_pool)
        if self._adapter is not None and self._capturing:
            self._adapter.reduction = None
            try:
                self._adapter.stop()
            except Exception as err:  # noqa: BLE001 - stop must never raise into training
                warnings.warn(f"PODMonitor: removing capture hooks failed: {err}", PODMonitorWarning, stacklevel=2)
        self._capturing = False

    def _world(self, trainer: Trainer) -> tuple[int, int]:
        return world_size(trainer), global_rank(trainer)

    def _per_rank_target(self, trainer: Trainer) -> int:
        """Snapshots this rank may take when the ranks do not share the quota: ``ceil(N / world)``."""
        return math.ceil(self.n_snapshots / world_size(trainer))

    # ----------------------------------------------------------------- hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._setup_shell(trainer)  # a collective (trainer.log_dir): here, on every rank
        self._stage = str(getattr(stage, "value", stage))  # "fit", "validate", ...
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
        for extra in self.extras:
            self._call_extra(extra, "setup", trainer, pl_module, self._stage)

    def _call_extra(self, extra: MonitorExtra, hook: str, *args: Any) -> Any:
        """Call one hook of an extra; an error costs that extra's hook only (warned, or raised when strict)."""
        try:
            return getattr(extra, hook)(*args)
        except Exception as err:  # noqa: BLE001
            msg = f"PODMonitor: extra {extra.name!r} failed in {hook} ({type(err).__name__}: {err})"
            self._run_errors.append(msg)
            self._warn_or_raise(msg, err, stacklevel=4)
            return None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # after the checkpoint restored the loops: the step training resumes from is known
        if self._resumed_from is None or global_rank(trainer) != 0:
            return
        try:
            marker = self._get_publisher().mark_resume(step=int(trainer.global_step),
                                                       previous_run_id=self._resumed_from.get("run_id"))
            if marker["superseded_steps"]:
                warnings.warn(
                    f"PODMonitor: resumed at step {marker['step']}; {self.run_dir()}/podmonitor.jsonl already holds "
                    f"records of steps {marker['superseded_steps']} from the resumed run; they are measured again "
                    "(the new records say 'repeats', a 'resume' marker stands before them)",
                    PODMonitorWarning, stacklevel=2)
        except Exception as err:  # noqa: BLE001
            self._warn_or_raise(f"PODMonitor: writing the resume marker failed: {err}", err)
        self._resumed_from = None

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset_run()
        if trainer.sanity_checking or self._adapter is None:
            return
        self.validation_count += 1
        self._monitored_run = (self.validation_count - 1) % self.every_n_validations == 0
        self._monitoring = self._monitored_run
        if not self._monitored_run:
            return
        # pictures (and with them the costly coherency map) on every images_every_n-th monitored run;
        # decided from the validation count, the same on every rank
        monitored_index = (self.validation_count - 1) // self.every_n_validations
        self._picture_run = self.log_images and monitored_index % self.images_every_n == 0
        for extra in self.extras:  # the index is the same on every rank
            self._call_extra(extra, "start_run", trainer, pl_module,
                             (self.validation_count - 1) // self.every_n_validations)
        n_loaders = len(trainer.num_val_batches)
        if self.dataloader_idx >= n_loaders:
            self._monitoring = False
            self._note_once("loader-missing", f"PODMonitor: dataloader_idx={self.dataloader_idx} but the run has "
                            f"{n_loaders} validation loader(s); nothing is monitored")
        elif n_loaders > 1:
            self._note_once("loaders", f"PODMonitor: monitoring validation loader {self.dataloader_idx} of "
                            f"{n_loaders}; the others are ignored (choose one with PODMonitor(dataloader_idx=...))")
        self._quota_open = self._monitoring
        if is_distributed(trainer):
            # share the quota batch by batch only if every rank runs the same number of batches
            n = trainer.num_val_batches[self.dataloader_idx] if self.dataloader_idx < n_loaders else 0
            n = int(n) if math.isfinite(n) else -1
            counts = [c[0] for c in all_gather_ints(trainer, [n], device=pl_module.device)]
            self._quota_shared = min(counts) > 0 and len(set(counts)) == 1
            self._shared_batches = counts[0] if self._quota_shared else 0
            if not self._quota_shared:
                self._note_once("uneven", "PODMonitor: the processes' validation loaders differ in length "
                                f"({counts} batches); each process takes its fixed share of n_snapshots")

    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if dataloader_idx != self.dataloader_idx or not self._wants_more(trainer):
            return
        assert self._adapter is not None
        try:
            self._capturing = True
            hugepages.push_pool(self._map_pool)  # until _stop_capture
            # without per-head consumers, captures that can reduce each layer as they form it
            heads_for = _heads_for(pl_module)
            # (head masks are matched by layer position, which the sdpa adapter's flagged calls can
            # shift: with masked heads only the protocol adapter reduces)
            reduces = self._reduces() and (heads_for is None or self._adapter.name == "protocol")
            self._adapter.reduction = Reduction(heads_for) if reduces else None
            self._adapter.start(pl_module)
        except Exception as err:  # noqa: BLE001
            self._handle("attaching the attention capture", err)

    def _reduces(self) -> bool:
        """Whether the captures may hand over each layer reduced to its head average and stability
        sums (:mod:`podmonitor.capture.reduce`): nothing needs the per-head maps (no per-head
        accumulators, no extra with an ``on_attention`` hook)."""
        return not self.per_head and all(type(e).on_attention is MonitorExtra.on_attention for e in self.extras)

    def _wants_more(self, trainer: Trainer) -> bool:
        """Whether this rank captures more batches in this run."""
        if not self._monitoring or not self._quota_open or self._budget_hit:
            return False
        return self._quota_shared or self._taken < self._per_rank_target(trainer)

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if dataloader_idx != self.dataloader_idx:
            return
        captured = self._collect(pl_module, batch, outputs) if self._capturing else None
        t1 = time.perf_counter()
        index = None
        if captured is not None:
            try:
                index = self._usable(pl_module, captured)
            except Exception as err:  # noqa: BLE001
                self._handle("accumulating attention fields", err)
        if self._quota_shared and self._quota_open and batch_idx < self._shared_batches:
            # every rank gets here with the same state: one collective per batch while the quota is open
            usable = 0 if index is None else int(index.numel())
            counts = [c[0] for c in all_gather_ints(trainer, [usable], device=pl_module.device)]
            share = share_quota(counts, self.n_snapshots - self._taken_all)
            self._taken_all += sum(share)
            self._quota_open = self._taken_all < self.n_snapshots and batch_idx + 1 < self._shared_batches
            if index is not None:
                index = index[: share[global_rank(trainer)]]
        elif index is not None:
            index = index[: max(0, self._per_rank_target(trainer) - self._taken)]
        if index is not None and captured is not None and index.numel() > 0:
            try:
                # the engine's work buffers come from the same pool as the maps: already faulted
                # in, from one layer's update to the next
                with hugepages.use_pool(self._map_pool):
                    self._add(captured, index)
            except Exception as err:  # noqa: BLE001
                self._handle("accumulating attention fields", err)
        self._accumulate_seconds += time.perf_counter() - t1
        if not self._wants_more(trainer):
            self._map_pool.clear()  # no more maps this run: their memory goes back now
        if self._monitored_run:
            for extra in self.extras:  # after the capture is off: extras may run forward passes
                self._call_extra(extra, "on_batch", trainer, pl_module, batch, batch_idx, outputs)

    def _collect(self, pl_module: LightningModule, batch: Any,
                 outputs: Any) -> CapturedAttention | ReducedAttention | None:
        """The batch's attention from the adapter (None after a failure, which is warned)."""
        assert self._adapter is not None
        t0 = time.perf_counter()
        reduction = self._adapter.reduction
        try:
            return self._adapter.collect(pl_module, batch, outputs)
        except Exception as err:  # noqa: BLE001
            self._handle("capturing attention", err)
            return None
        finally:
            self._stop_capture()
            # (and what the model spent reducing inside the step's own forward, if it did)
            in_step = reduction.step_seconds if reduction is not None else 0.0
            self._capture_seconds += time.perf_counter() - t0 + in_step

    def _usable(self, pl_module: LightningModule, captured: CapturedAttention | ReducedAttention) -> torch.Tensor:
        """Set up the accumulators on the first batch; the indices (b,) of the batch's usable
        sequences: without padding and of the run's sequence length (the others are counted)."""
        for name, reason in captured.flagged.items():
            if name not in self._flagged:
                self._flagged[name] = reason
                self._run_errors.append(f"layer {name} not reported: {reason}")
        for key, count in captured.counters.items():
            self._counters[key] = self._counters.get(key, 0) + int(count)
        if self._flagged and self._layer_names:
            # a layer flagged after the first batch leaves the analysis of this run
            for name in [n for n in self._layer_names if n in self._flagged]:
                self._layer_names.remove(name)
                for key in [k for k in self._accumulators if k == name or k.startswith(name + "/")]:
                    del self._accumulators[key]
                self._pending.pop(name, None)
                self._stability.pop(name, None)
        if not captured.layer_names:
            raise ValueError("the capture returned no attention layers")
        if not self._layer_names:
            if self._active is None:
                self._active = _active_heads(pl_module, list(captured.layer_names))
                if isinstance(captured, ReducedAttention) and _masks_partial(pl_module) and self._active is None:
                    raise ValueError("the model's head masks do not match its captured attention layers: the "
                                     "head averages cannot leave out the masked heads")
            self._layer_names = [n for n in captured.layer_names if n not in self._flagged]
            config = self.config
            if captured.causal is not None and config.causal is None:
                config = _replace(config, causal=captured.causal)
            draws_map = self.pictures is None or "coherency" in self.pictures
            if config.coherency and (not (self._picture_run and draws_map)
                                     or captured.seq_len > self.coherency_max_len):
                # METHOD.md section 6: a picture, by far the costliest part at long contexts
                config = _replace(config, coherency=False)
            elif config.coherency and config.coherency_scale is None:
                # one scale for every layer, so that the maps compare: the published "word scale"
                config = _replace(config, coherency_scale=COHERENCY_SCALE)
            for name in self._layer_names:
                self._accumulators[name] = PODAccumulator(config)
                self._stability[name] = StabilityAccumulator()
            if self.per_head and isinstance(captured, CapturedAttention):
                for name, f in zip(captured.layer_names, captured.fields, strict=True):
                    if name in self._flagged:
                        continue
                    for h in range(f.shape[1]):
                        self._accumulators[f"{name}/head_{h:02d}"] = PODAccumulator(config)
        elif [n for n in captured.layer_names if n not in self._flagged] != self._layer_names:
            raise ValueError("the captured layers changed between batches")
        n_seq, seq_len, device = captured.batch_size, captured.seq_len, captured.device
        if self._seq_len is None:
            self._seq_len = seq_len
        if seq_len != self._seq_len:
            self._skipped["length"] += n_seq
            return torch.zeros(0, dtype=torch.long, device=device)
        keep = torch.ones(n_seq, dtype=torch.bool, device=device)
        if captured.valid is not None:
            valid = captured.valid.to(device).bool()
            self._skipped["padding"] += int((~valid).sum())
            keep &= valid
        return torch.nonzero(keep).flatten()

    def _add(self, captured: CapturedAttention | ReducedAttention, index: torch.Tensor) -> None:
        """Head-average the sequences ``index`` (b,) of every reported layer and feed the
        accumulators (POD, per head, the extras' ``on_attention``, stability signals)."""
        if isinstance(captured, ReducedAttention):
            self._add_reduced(captured, index)
            return
        logits = captured.logit_max or [None] * len(captured.fields)
        try:
            for name, f, lm in zip(captured.layer_names, captured.fields, logits, strict=True):
                if name in self._flagged:
                    continue
                # (b, H, T, T); index is sorted and unique (nonzero, then a prefix): all of it is
                # the whole batch, used as is (no copy of every layer's maps)
                sel = f if index.numel() == f.shape[0] else f.index_select(0, index.to(f.device))
                self._feed(name, _head_average(sel, (self._active or {}).get(name)))
                if self.per_head:
                    for h in range(sel.shape[1]):
                        self._accumulators[f"{name}/head_{h:02d}"].update(sel[:, h])
                for extra in self.extras:  # e.g. the head analysis's redundancy sums
                    self._call_extra(extra, "on_attention", name, sel)
                stab = self._stability.get(name)
                if stab is not None:
                    stab.update(sel, None if lm is None else lm.index_select(0, index.to(lm.device)),
                                causal=captured.causal, zeros_above_diagonal=captured.zeros_above_diagonal)
        except MemoryBudgetError as err:
            self._budget_refused(err, int(index.numel()))
            return
        self._taken += int(index.numel())

    def _add_reduced(self, captured: ReducedAttention, index: torch.Tensor) -> None:
        """:meth:`_add` for a capture that reduced every layer as it formed it: the head averages
        of the sequences ``index`` (b,) to the POD accumulators, their stability sums to the
        stability signals."""
        logits = captured.logit_max or [None] * len(captured.layers)
        try:
            for name, layer, lm in zip(captured.layer_names, captured.layers, logits, strict=True):
                if name in self._flagged:
                    continue
                whole = index.numel() == layer.average.shape[0]
                average = layer.average if whole else layer.average.index_select(0, index.to(layer.average.device))
                self._feed(name, average)
                stab = self._stability.get(name)
                if stab is not None:
                    sums = layer.stability if whole else layer.stability.select(index)
                    stab.add_sums(sums, None if lm is None else lm.index_select(0, index.to(lm.device)))
        except MemoryBudgetError as err:
            self._budget_refused(err, int(index.numel()))
            return
        self._taken += int(index.numel())

    def _feed(self, name: str, fields: torch.Tensor) -> None:
        """Queue a layer's (b, T, T) head-averaged fields; add the queue to the layer's accumulator
        once it holds :data:`FEED_BYTES` (the rest at the end of the run, :meth:`_flush_all`).

        Under a memory budget every batch is added at once, as it comes: the budget does not count
        a queue, and refuses the batch that would exceed it (the capture then stops)."""
        pending = self._pending.setdefault(name, [])
        pending.append(fields)
        if self._accumulators[name].config.memory_budget_bytes is not None \
                or sum(p.numel() for p in pending) * fields.element_size() >= FEED_BYTES:
            self._flush(name)

    def _flush(self, name: str) -> None:
        """Add a layer's queued fields to its accumulator, as one batch."""
        pending = self._pending.pop(name, [])
        if len(pending) > 1:  # (one batch, into a buffer of the pool while the monitor accumulates)
            first = pending[0]
            out = hugepages.scratch((sum(p.shape[0] for p in pending), *first.shape[1:]), first.dtype, first.device)
            pending = [torch.cat(pending, out=out)]
        if pending:
            self._accumulators[name].update(pending[0])

    def _flush_all(self) -> None:
        """Add every layer's queued fields (at the end of a run, before the states are gathered);
        a failure is handled like one while accumulating (warned, or raised when strict)."""
        try:
            for name in list(self._pending):
                self._flush(name)
        except Exception as err:  # noqa: BLE001
            self._handle("accumulating attention fields", err)
        self._pending.clear()

    def _budget_refused(self, err: MemoryBudgetError, n_new: int) -> None:
        """The memory budget refused snapshots: the capture stops for this run, once warned."""
        self._budget_hit = True
        self._skipped["budget"] += n_new
        msg = f"PODMonitor: memory budget exceeded, capture stopped for this run (MemoryBudgetError: {err})"
        self._run_errors.append(msg)
        self._note_once(msg, msg)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop_capture()
        t_flush = time.perf_counter()
        with hugepages.use_pool(self._map_pool):
            self._flush_all()
        self._map_pool.clear()  # (the work buffers' memory goes back now)
        self._accumulate_seconds += time.perf_counter() - t_flush
        if trainer.sanity_checking or self._adapter is None or not self._monitored_run:
            # every rank decides the same way (same validation count), so nobody waits here
            return
        _, rank = self._world(trainer)
        t0 = time.perf_counter()
        states = self._gather_states(trainer)  # a collective on every rank; never raises
        if rank != 0:
            self._reset_run()
            return
        if self.per_head:
            self._active = _active_heads(pl_module, self._layer_names or next(
                (s["layer_names"] for s in states if s["layer_names"]), []))
        try:
            reports = self._merge_and_compute(states)
        except Exception as err:  # noqa: BLE001
            self._handle("analysing", err)
            self._reset_run()
            return
        self._warn_if_short(reports)
        self._compute_extras(trainer, states, reports)
        t1 = time.perf_counter()
        self.timings = {"capture_s": self._capture_seconds, "accumulate_s": self._accumulate_seconds,
                        "compute_s": t1 - t0}
        try:
            self._report(trainer, reports)
            self.timings["logging_s"] = time.perf_counter() - t1
            if self._history:
                self._history[-1]["timings"] = dict(self.timings)
        except Exception as err:  # noqa: BLE001
            self._handle("logging", err)
        self._reset_run()

    def _gather_states(self, trainer: Trainer) -> list[dict[str, Any]]:
        """Every rank calls the collective (also with nothing to send, or after an error), rank 0
        gets all states. In a single process the accumulators themselves are passed on (no copy of
        the snapshots)."""
        payload: dict[str, Any] = {
            "layer_names": self._layer_names,
            "accumulators": dict(self._accumulators),
            "skipped": dict(self._skipped),
            "taken": self._taken,
            "errors": list(self._run_errors),
            "extras": {e.name: self._call_extra(e, "gather_state") for e in self.extras},
            "stability": dict(self._stability),
            "flagged": dict(self._flagged),
            "counters": dict(self._counters),
        }
        if not is_distributed(trainer):
            return [payload]
        try:
            payload["accumulators"] = {
                name: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in acc.state_dict().items()}
                for name, acc in self._accumulators.items()}
            payload["stability"] = {name: acc.state_dict() for name, acc in self._stability.items()}
        except Exception as err:  # noqa: BLE001 - this rank still joins the collective, with its error
            payload.update(layer_names=[], accumulators={}, stability={}, taken=0)
            payload["errors"].append(f"rank {global_rank(trainer)}: preparing its snapshots failed "
                                     f"({type(err).__name__}: {err})")
        try:
            return all_gather_object(trainer, payload)
        except Exception as err:  # noqa: BLE001
            self._handle("gathering snapshots across processes", err)
            return [payload]

    def _merge_and_compute(self, states: list[dict[str, Any]]) -> dict[str, PODReport]:
        self.last_reference = {}
        names: list[str] = next((s["layer_names"] for s in states if s["layer_names"]), [])
        self._layer_names = names
        totals: dict[str, int] = {}
        for s in states:
            for k, v in s["skipped"].items():
                totals[k] = totals.get(k, 0) + int(v)
        self._skipped = totals
        self._taken = sum(int(s.get("taken", 0)) for s in states)
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
                if "/" not in key:
                    self._reference(key, acc, reports[key])
        release_scalogram_buffers()  # (kept from one layer's scalograms to the next)
        self.last_reports = reports
        self._merge_stability(states, names)
        return reports

    def _merge_stability(self, states: list[dict[str, Any]], names: Sequence[str]) -> None:
        """Rank zero: every process's stability sums merged per layer (METHOD.md section 10), into
        ``last_stability`` (registry keys) and ``last_stability_reports``; the run's flagged
        layers and capture counters are totalled too."""
        self.last_stability, self.last_stability_reports = {}, {}
        self._flagged, self._counters = {}, {}
        for s in states:
            self._flagged.update(s.get("flagged", {}))
            for k, v in s.get("counters", {}).items():
                self._counters[k] = self._counters.get(k, 0) + int(v)
        for name in names:
            merged: StabilityAccumulator | None = None
            try:
                for s in states:
                    item = s.get("stability", {}).get(name)
                    if item is None:
                        continue
                    part = (item if isinstance(item, StabilityAccumulator)
                            else StabilityAccumulator.from_state_dict(item))
                    merged = part if merged is None else merged.merge(part)
                if merged is None:
                    continue
                rep = merged.compute()
            except Exception as err:  # noqa: BLE001 - the signals are extra; the POD report stands
                self._run_errors.append(f"stability signals of {name}: {type(err).__name__}: {err}")
                continue
            self.last_stability_reports[name] = rep
            self.last_stability[name] = {
                "max_logit": math.nan if rep.max_logit_layer is None else float(rep.max_logit_layer),
                "entropy_min_head": math.nan if rep.entropy_min is None else float(rep.entropy_min),
                "sink_mass": math.nan if rep.sink_mass_mean is None else float(rep.sink_mass_mean),
                "max_prob": math.nan if rep.max_prob_layer is None else float(rep.max_prob_layer),
            }

    def _reference(self, layer: str, acc: PODAccumulator, report: PODReport) -> None:
        """The layer's headline numbers at its fixed reference scale (its top dominant scale at its
        first analysable run, kept in the checkpoint), into ``last_reference``."""
        from .engine.analysis import analyse_at_scale

        if layer not in self.reference_scales:
            if report.status != "ok" or not report.dominant_scales:
                return
            self.reference_scales[layer] = float(report.dominant_scales[0])
        scale = self.reference_scales[layer]
        # at one of the run's dominant scales the report holds that POD already: the same call of
        # analysis.analyse_scale on the same store, so the same values without a second POD (at
        # long contexts about a second per layer at a coarse scale)
        sr = next((s for s in report.per_scale if s.scale == scale), None)
        try:
            sr = analyse_at_scale(acc, scale) if sr is None else sr
        except Exception as err:  # noqa: BLE001 - the reference is extra evidence; the report stands
            self._run_errors.append(f"reference scale of {layer}: {type(err).__name__}: {err}")
            return
        if sr is None:
            return
        eps0 = self.config.eps[0]
        rank = next((v for e, v in sr.effective_rank.items() if math.isclose(e, eps0)), None)
        self.last_reference[layer] = {"scale": scale, "t_spec": sr.t_spec, "r2": sr.r2,
                                      "effective_rank": rank, "status": sr.status}

    def _warn_if_short(self, reports: dict[str, PODReport]) -> None:
        """One warning per monitor when a run had fewer usable sequences than asked, saying why."""
        if self._taken >= self.n_snapshots or not self._monitored_run:
            return
        pad, length, budget = (self._skipped.get(k, 0) for k in ("padding", "length", "budget"))
        reasons = []
        if pad:
            reasons.append(f"{pad} had padding (padding never enters a field)")
        if length:
            reasons.append(f"{length} had another length than the first batch's {self._seq_len} tokens")
        if budget:
            reasons.append(f"{budget} did not fit the memory budget")
        short = [name for name, r in reports.items() if "/" not in name and r.status != "ok"]
        if short:
            reasons.append(f"layers {short} report {sorted({reports[n].status for n in short})}")
        if self._run_errors:
            reasons.append(f"capture or accumulation failed ({len(self._run_errors)} error(s), see the run's errors)")
        if not reasons:
            reasons.append("the validation loader ran out of sequences")
        msg = (f"PODMonitor: only {self._taken} of the requested {self.n_snapshots} sequences were usable in this "
               f"validation run: {'; '.join(reasons)}. What to do: give the monitored validation loader "
               "fixed-length windows without padding (pack or concatenate the text, or drop short sequences), "
               "choose another loader with PODMonitor(dataloader_idx=...), or lower n_snapshots.")
        warned_already = bool(self._run_errors)  # an error of this run was warned (it is the reason)
        self._run_errors.append(msg)
        if not warned_already:
            self._note_once("short", msg)

    def _compute_extras(self, trainer: Trainer, states: list[dict[str, Any]], reports: dict[str, PODReport]) -> None:
        """Rank zero: each extra's result from every rank's part (a failing extra is left out)."""
        self.last_extras = {}
        context = ExtraContext(step=int(trainer.global_step), stage=self._stage, layer_names=list(self._layer_names),
                               reports=reports, prefix=self.prefix, active=self._active, strict=self.strict)
        for extra in self.extras:
            parts = [s.get("extras", {}).get(extra.name) for s in states]
            result = self._call_extra(extra, "compute", parts, context)
            if result is not None:
                self.last_extras[extra.name] = result
                self._run_errors.extend(result.notes)

    def _get_publisher(self) -> Any:
        from .reporting.figures import PICTURES
        from .reporting.publish import Publisher

        if self._publisher is None:
            self._publisher = Publisher(self.run_dir(), self.prefix, run_id=self.run_id,
                                        warning=PODMonitorWarning, strict=self.strict,
                                        pictures=PICTURES if self.pictures is None else self.pictures)
        return self._publisher

    def _report(self, trainer: Trainer, reports: dict[str, PODReport]) -> None:
        """Rank zero only (no collective in here): write the run's outputs, keep its summary."""
        images = self._picture_run
        summary = self._get_publisher().publish(
            loggers=trainer.loggers,
            reports=reports,
            layer_names=self._layer_names,
            step=int(trainer.global_step),
            epoch=int(trainer.current_epoch),
            images=images,
            skipped=dict(self._skipped),
            errors=list(self._run_errors),
            timings=dict(self.timings),
            stage=self._stage,
            stability=self._layer_extras(),
            extra_record={"n_requested": self.n_snapshots, "n_taken": self._taken,
                          "reference": self.last_reference,
                          "stability": {k: v.to_dict() for k, v in self.last_stability_reports.items()},
                          "capture": {"flagged": dict(self._flagged), "counters": dict(self._counters)}},
            extras=self.last_extras,
        )
        self.monitored_count += 1
        self._history.append(summary)

    def _layer_extras(self) -> dict[str, dict[str, float]]:
        """Per-layer values computed outside the reports (stability signals, reference scale), by
        registry key."""
        out = {layer: dict(v) for layer, v in self.last_stability.items()}
        from .reporting.metrics import effective_rank_key

        key = effective_rank_key(self.config.eps[0]) + "_at_ref"
        for layer, ref in self.last_reference.items():
            values = out.setdefault(layer, {})
            values["reference_scale"] = float(ref["scale"])
            values["t_spec_at_ref"] = float(ref["t_spec"])
            values[key] = math.nan if ref["effective_rank"] is None else float(ref["effective_rank"])
        return out

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the last monitored run of a fit always gets its pictures (rank zero; no collective)
        if self._publisher is not None and self.log_images:
            try:
                self._publisher.publish_last_pictures()
            except Exception as err:  # noqa: BLE001
                self._warn_or_raise(f"PODMonitor: drawing the last run's pictures failed: {err}", err)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop_capture()
        if self._publisher is not None:
            self._publisher.flush()  # what was measured reaches the outputs before the run dies

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop_capture()
        if self._publisher is not None:
            self._publisher.close()  # waits for the outputs still queued in the background
            for key, seconds in self._publisher.background_seconds().items():
                self.background_timings[key] = self.background_timings.get(key, 0.0) + seconds
            self._publisher = None
        self._hand_over(trainer)

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "history": list(self._history),
            "validation_count": self.validation_count,
            "monitored_count": self.monitored_count,
            "n_snapshots": self.n_snapshots,
            "every_n_validations": self.every_n_validations,
            "config": self.config.to_dict(),
            "run_id": self.run_id,
            "reference_scales": dict(self.reference_scales),
            "extras": {e.name: e.state_dict() for e in self.extras},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != STATE_VERSION:
            warnings.warn("PODMonitor: unknown checkpoint state version, history not restored",
                          PODMonitorWarning, stacklevel=2)
            return
        self._history = list(state_dict.get("history", []))
        self.validation_count = int(state_dict.get("validation_count", 0))
        self.monitored_count = int(state_dict.get("monitored_count", 0))
        head = self.head_analysis
        if head is not None and state_dict.get("readiness") and not (state_dict.get("extras") or {}).get(head.name):
            head.load_state_dict({"readiness": state_dict["readiness"]})  # a checkpoint from before the extras
        self.reference_scales = {str(k): float(v) for k, v in (state_dict.get("reference_scales") or {}).items()}
        for extra in self.extras:
            part = (state_dict.get("extras") or {}).get(extra.name)
            if part:
                extra.load_state_dict(part)
        self._resumed_from = {"run_id": state_dict.get("run_id")}

    def _load_handoff(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state)
        self._resumed_from = None  # the workers' state, not a resume


def _active_heads(pl_module: LightningModule, layer_names: Sequence[str]) -> dict[str, list[bool]] | None:
    """``{layer: (H,) bool}`` from the reference models' head masks (False: pruned head); None when
    the model has no such masks or their count does not match the captured layers."""
    from .models.gpt import CausalSelfAttention

    masks = [m.head_mask for m in pl_module.modules() if isinstance(m, CausalSelfAttention)]
    if not masks or len(masks) != len(layer_names):
        return None
    return {name: [bool(v != 0) for v in m.tolist()] for name, m in zip(layer_names, masks, strict=True)}


def _masks_partial(pl_module: LightningModule) -> bool:
    """Whether a reference model's head mask leaves some, not all, heads of a layer out."""
    from .models.gpt import CausalSelfAttention

    return any(0 < int((m.head_mask != 0).sum()) < m.head_mask.numel()
               for m in pl_module.modules() if isinstance(m, CausalSelfAttention))


def _heads_for(pl_module: LightningModule) -> HeadsFor | None:
    """For a reduction (:class:`~podmonitor.capture.reduce.Reduction`): the active heads of the
    reference models' layer at each position, as :func:`_head_average` takes them (all heads when
    the mask keeps all or none); None without such masks."""
    from .models.gpt import CausalSelfAttention

    masks = [[bool(v != 0) for v in m.head_mask.tolist()] for m in pl_module.modules()
             if isinstance(m, CausalSelfAttention)]
    if not any(0 < sum(m) < len(m) for m in masks):
        return None

    def heads(position: int, n_heads: int) -> list[int] | None:
        if position >= len(masks) or len(masks[position]) != n_heads or all(masks[position]) \
                or not any(masks[position]):
            return None
        return [i for i, a in enumerate(masks[position]) if a]

    return heads


def _head_average(fields: torch.Tensor, active: Sequence[bool] | None) -> torch.Tensor:
    """(b, H, T, T) -> (b, T, T): mean over the heads still active (masked heads carry no output,
    so the layer's field is the mean of the heads that reach the residual stream); all heads when
    ``active`` is None, does not match H, or masks every head."""
    if not (active is None or len(active) != fields.shape[1] or all(active) or not any(active)):
        keep = torch.tensor([i for i, a in enumerate(active) if a], device=fields.device)
        fields = fields.index_select(1, keep)
    # (into a buffer of the monitor's pool while it accumulates: reused once the queue is added)
    out = hugepages.scratch((fields.shape[0], *fields.shape[2:]), fields.dtype, fields.device)
    return torch.mean(fields, dim=1, out=out)


def _picture_names(log_images: bool | Sequence[str]) -> tuple[str, ...] | None:
    """The pictures ``log_images`` asks for: None for all (True), none for False, else the names
    given, checked against :data:`~podmonitor.reporting.figures.PICTURES`."""
    if isinstance(log_images, str):
        raise ValueError(f"log_images must be True, False or a list of picture names, got {log_images!r}")
    if not isinstance(log_images, Sequence | set | frozenset):
        return None if log_images else ()  # (a flag: True, False, None, numpy booleans)
    from .reporting.figures import check_pictures  # (matplotlib: only when pictures are chosen by name)

    try:
        return check_pictures(log_images)
    except ValueError as err:
        raise ValueError(f"log_images: {err}") from None


def _replace(config: PODConfig, **changes: Any) -> PODConfig:
    d = config.to_dict()
    d.update(changes)
    return PODConfig.from_dict(d)


__all__: Sequence[str] = ["PODMonitor", "PODMonitorWarning"]
