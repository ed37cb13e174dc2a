"""The pruning action: :class:`HeadPruning`, a Lightning callback that masks heads mid-training.

It prunes once, at the first training batch at or after ``at_step`` optimiser steps, or (with
``when_ready=True``) at the first training batch after a validation run in which the readiness
signal said "stable" (both: whichever comes first). The readiness is that of the monitor's
:class:`~podmonitor.pruning.HeadImportanceProbe` (stability of the measured ranking) when it has
one, else the monitor's POD readiness (``PODMonitor(per_head=True)``). The heads come from a strategy:

* ``"advice"`` (default): measured. The ranking of the monitor's
  :class:`~podmonitor.pruning.HeadImportanceProbe` (its last measurement, also after a resume),
  or, without a probe, single-head ablation measured now on the first ``importance_batches``
  validation batches; then, with ``refine=True`` (default) and more than one head to prune, a
  greedy refinement on those batches (every remaining candidate re-measured after each drop, or
  each ``group`` of drops), since head effects interact;
* ``"hstar"``: the first ``n_heads`` of the monitor's H*-based drop order (``PODMonitor(per_head=True)``):
  the hypothesis of METHOD.md section 7, which measured badly on two trained models; kept to test it;
* ``"random"``: ``n_heads`` heads drawn uniformly (seeded), each layer keeping ``min_heads``;
* ``"michel"``: the lowest gradient importance of Michel et al. 2019 on the first
  ``importance_batches`` validation batches;
* a mapping ``{layer index: [heads]}``, or a function ``fn(trainer, pl_module) -> mapping``.

Right after masking, the damage of the masked set is measured on the first ``importance_batches``
validation batches (outputs before vs after masking; the probe's measure, KL by default) and logged
with the action (``measure_damage=False`` skips it).

Training goes on with the heads masked (:class:`~podmonitor.pruning.masking.HeadMasker`):
reversible with :meth:`HeadPruning.restore` until :meth:`HeadPruning.make_permanent` (or
``make_permanent_at_end=True``). What it did is logged as text and scalars to every logger, kept in
``actions`` (checkpointed) and appended to ``<output_dir>/pruning.jsonl``. In DDP the heads are
chosen (and the damage measured) on rank 0 and broadcast, so every process masks the same heads.

Like the monitor it never stops training unless ``strict=True``: a failure becomes one warning and
the callback tries again at the next trigger point, the end of the next validation run (one attempt,
one warning, per validation run; not one per training batch).

In DDP every decision that chooses a branch with a collective in it is collective: the readiness is
read on rank 0 and broadcast, and whether the callback can still prune (a mask on every rank, not
done yet) is agreed by all ranks, once at the start of fitting and once at the end of every
validation run (all ranks call these hooks); the training-batch hook itself has no collective
unless it prunes, and then all ranks prune at the same batch. The measurements run on rank 0 only,
on the module itself (not the DDP wrapper), so they call no collective.

Example:
    >>> monitor = PODMonitor(extras=[HeadImportanceProbe()])
    >>> pruning = HeadPruning(n_heads=4, when_ready=True, at_step=4000)
    >>> trainer = Trainer(callbacks=[monitor, pruning])
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import os
import random
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer

from ..callback_base import MonitorCallback
from ..distributed import all_ranks_true, broadcast_object, resolve_run_dir
from ..extras import HeadAdviceSource
from ..reporting.delivery import Outputs
from .ablation import (
    Measurer,
    as_heads,
    first_order_importance,
    measured_drop,
    single_head_damage,
)
from .advisor import HeadAllocationAdvice
from .heads import HeadGates
from .importance import lowest_importance_heads, michel_head_importance
from .masking import HeadMasker
from .probe import HeadImportanceProbe, MeasuredAdvice, find_probe

Heads = dict[int, list[int]]
Strategy = str | Mapping[int, Any] | Callable[[Trainer, LightningModule], Mapping[int, Any]]
STATE_VERSION = 1
STRATEGIES = ("advice", "hstar", "random", "michel")


class PruningWarning(UserWarning):
    """A problem inside the pruning callback that did not stop training."""


def random_heads(n_heads: list[int], n: int, seed: int, min_heads: int = 1) -> Heads:
    """``n`` heads drawn uniformly without replacement among those that keep ``min_heads`` per layer.

    Draws head after head; a head whose layer is already down to ``min_heads`` is skipped.

    Raises:
        ValueError: fewer than ``n`` heads can be pruned.
    """
    rng = random.Random(seed)
    pool = [(layer, h) for layer, k in enumerate(n_heads) for h in range(k)]
    rng.shuffle(pool)
    left = list(n_heads)
    out: Heads = {}
    for layer, h in pool:
        if sum(map(len, out.values())) == n:
            break
        if left[layer] - 1 >= min_heads:
            out.setdefault(layer, []).append(h)
            left[layer] -= 1
    if sum(map(len, out.values())) < n:
        raise ValueError(f"cannot prune {n} heads keeping {min_heads} per layer")
    return {k: sorted(v) for k, v in sorted(out.items())}


def advice_heads(advice: HeadAllocationAdvice | Mapping[str, Any], n: int) -> Heads:
    """The first ``n`` heads of an advice's drop order (an advice object or its ``to_dict()``).

    Raises:
        ValueError: the drop order holds fewer than ``n`` heads.
    """
    if isinstance(advice, HeadAllocationAdvice):
        return advice.heads_to_prune(n)
    order = list(advice.get("drop_order", []))
    if n > len(order):
        raise ValueError(f"the advice can drop {len(order)} heads, asked for {n}")
    out: Heads = {}
    for d in order[:n]:
        out.setdefault(int(d["layer_index"]), []).append(int(d["head"]))
    return {k: sorted(v) for k, v in sorted(out.items())}


def find_monitor(trainer: Trainer) -> HeadAdviceSource | None:
    """The trainer's monitor: its first callback with head advice, readiness and history (a PODMonitor), or None.

    Read through :class:`~podmonitor.extras.HeadAdviceSource` (the monitor's properties, which read
    its head analysis extra), not through an import of the monitor.
    """
    found = [cb for cb in trainer.callbacks if isinstance(cb, HeadAdviceSource)]  # type: ignore[attr-defined]
    return found[0] if found else None


def latest_measured_advice(monitor: Any) -> MeasuredAdvice | None:
    """The newest measurement of the monitor's probe: its live advice, else the last one in the
    monitor's (checkpointed) history; None without one."""
    probe = find_probe(monitor)
    if probe is not None and probe.last_advice is not None:
        return probe.last_advice
    name = probe.name if probe is not None else HeadImportanceProbe.name
    for entry in reversed(getattr(monitor, "history", []) or []):
        rec = entry.get(name)
        if rec and rec.get("drop_order"):
            return MeasuredAdvice.from_dict(rec)
    return None


@contextlib.contextmanager
def _evaluating(module: Any) -> Iterator[None]:
    """Eval mode and no gradients within the block; every submodule's mode back afterwards."""
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, mode in modes.items():
            m.training = mode


def latest_advice(monitor: HeadAdviceSource | None) -> HeadAllocationAdvice | Mapping[str, Any] | None:
    """The monitor's newest H*-based advice (the hypothesis): its live object, else the last one in
    its (checkpointed) history."""
    if monitor is None:
        return None
    if getattr(monitor, "last_advice", None) is not None:
        return monitor.last_advice
    for entry in reversed(getattr(monitor, "history", [])):
        if entry.get("head_allocation"):
            return entry["head_allocation"]
    return None


class HeadPruning(MonitorCallback):
    """Mask attention heads once during training (see the module docstring).

    Args:
        n_heads: how many heads to prune (ignored by an explicit mapping).
        at_step: prune at the first training batch with ``trainer.global_step >= at_step``.
        when_ready: prune after the first monitored validation run whose readiness says "stable".
        strategy: "advice" (measured), "hstar", "random", "michel", a mapping ``{layer index: [heads]}``
            or a function.
        monitor: the PODMonitor giving the advice and the readiness (default: found among the
            trainer's callbacks).
        seed: seed of the random strategy.
        min_heads: heads every layer keeps.
        importance_batches: validation batches measured on at pruning time (the advice's
            measurement and refinement, the michel strategy, the damage after masking).
        refine: "advice": refine the drops greedily on those batches when more than one head goes.
        group: heads dropped per greedy round (default ``ceil(n_heads / 8)``: at most 8 rounds).
        damage, forward, loss_fn: how damage is measured (see
            :class:`~podmonitor.pruning.HeadImportanceProbe`); default: the monitor's probe's, else
            "kl" with the default forward.
        measure_damage: measure and log the damage of the masked set right after masking.
        make_permanent_at_end: make the pruning permanent when fitting ends.
        output_dir: folder of ``pruning.jsonl`` (default: the monitor's run directory, else
            ``<log_dir or default_root_dir>/podmonitor``).
        prefix: tag prefix of the logged text and scalars.
        strict: re-raise errors instead of warning.

    Raises:
        ValueError: invalid arguments (no trigger, bad strategy, negative counts).
    """

    def __init__(self, n_heads: int = 0, *, at_step: int | None = None, when_ready: bool = False,
                 strategy: Strategy = "advice", monitor: Any = None, seed: int = 0, min_heads: int = 1,
                 importance_batches: int = 4, refine: bool = True, group: int | None = None,
                 damage: Any = None, forward: Any = None, loss_fn: Any = None, measure_damage: bool = True,
                 make_permanent_at_end: bool = False, output_dir: str | None = None,
                 prefix: str = "pod", strict: bool = False) -> None:
        if at_step is None and not when_ready:
            raise ValueError("give at_step, when_ready=True, or both")
        if at_step is not None and (not isinstance(at_step, int) or at_step < 0):
            raise ValueError(f"at_step must be an int >= 0, got {at_step!r}")
        if isinstance(strategy, str) and strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, a mapping or a function, got {strategy!r}")
        if not (isinstance(strategy, (str, Mapping)) or callable(strategy)):
            raise ValueError(f"strategy must be one of {STRATEGIES}, a mapping or a function")
        if isinstance(strategy, str) and (not isinstance(n_heads, int) or n_heads < 1):
            raise ValueError(f"n_heads must be an int >= 1, got {n_heads!r}")
        if min_heads < 1 or importance_batches < 1:
            raise ValueError("min_heads and importance_batches must be >= 1")
        if group is not None and group < 1:
            raise ValueError(f"group must be >= 1, got {group}")
        self.n_heads = n_heads
        self.at_step = at_step
        self.when_ready = when_ready
        self.strategy = strategy
        self.monitor = monitor
        self.seed = seed
        self.min_heads = min_heads
        self.importance_batches = importance_batches
        self.refine = refine
        self.group = group
        self.damage = damage
        self.forward = forward
        self.loss_fn = loss_fn
        self.measure_damage = measure_damage
        self.make_permanent_at_end = make_permanent_at_end
        self.output_dir = output_dir
        self.prefix = prefix
        self.strict = strict
        self._init_shell()  # history = actions (checkpointed), run dir
        self.done = False
        self.masker: HeadMasker | None = None
        self._ready_seen = False
        # armed: every rank may attempt at the next trigger (agreed collectively at fit start and at
        # every validation end; cleared on all ranks after an attempt, successful or not)
        self._armed = False
        self._loaded_masker_state: dict[str, Any] | None = None
        self._outputs: Outputs | None = None

    warning_class = PruningWarning

    @property
    def actions(self) -> list[dict[str, Any]]:
        """What the callback did, one record per action (checkpointed; after ``ddp_spawn``, rank zero's)."""
        return self.history

    @actions.setter
    def actions(self, value: list[dict[str, Any]]) -> None:
        self.history = value

    @property
    def state_key(self) -> str:
        return self._generate_state_key(at_step=self.at_step, when_ready=self.when_ready)

    # ------------------------------------------------------------------ helpers
    def _monitor(self, trainer: Trainer) -> HeadAdviceSource | None:
        return self.monitor if self.monitor is not None else find_monitor(trainer)

    def _setup_run_dir(self, trainer: Trainer) -> None:
        """``output_dir``, else the monitor's folder, else ``<log_dir or default_root_dir>/podmonitor``;
        a collective (``trainer.log_dir``): called from ``setup`` on every rank."""
        mon = self._monitor(trainer)
        out = self.output_dir if self.output_dir is not None else getattr(mon, "output_dir", None)
        self._run_dir = resolve_run_dir(trainer, out)

    def _warn(self, where: str, err: BaseException) -> None:
        self._warn_or_raise(f"HeadPruning: {where} failed ({type(err).__name__}: {err}); training goes on", err,
                            stacklevel=4)

    def select(self, trainer: Trainer, pl_module: LightningModule, masker: HeadMasker) -> tuple[Heads, str]:
        """(heads to prune, evidence text) by the strategy."""
        s = self.strategy
        if isinstance(s, Mapping):
            return {int(k): [int(h) for h in v] for k, v in s.items()}, "explicit heads"
        if callable(s) and not isinstance(s, str):
            heads = s(trainer, pl_module)
            return {int(k): [int(h) for h in v] for k, v in heads.items()}, f"function {getattr(s, '__name__', s)}"
        if s == "random":
            return random_heads(masker.n_heads, self.n_heads, self.seed, self.min_heads), f"random, seed {self.seed}"
        if s == "michel":
            batches = self._validation_batches(trainer, pl_module)
            if not batches:
                raise ValueError("the michel strategy needs a validation dataloader")
            if masker.kind == "reference":
                scores = michel_head_importance(pl_module, batches)
            else:
                gates = HeadGates(pl_module)
                with gates, _evaluating(pl_module):
                    total, count = first_order_importance(self._measurer(trainer, pl_module, gates, {}), batches)
                scores = total / count.clamp_min(1.0)
                scores = scores / scores.norm(dim=1, keepdim=True).clamp_min(1e-300)
            heads = lowest_importance_heads(scores, self.n_heads, exclude=masker.pruned, min_heads=self.min_heads)
            text = "michel importance (per-layer l2-normalised): " + ", ".join(
                f"L{k}h{h}={float(scores[k, h]):.3f}" for k, hs in heads.items() for h in hs)
            return heads, text
        if s == "hstar":
            advice = latest_advice(self._monitor(trainer))
            if advice is None:
                raise ValueError("no H*-based advice yet (PODMonitor(per_head=True) must have run)")
            heads = advice_heads(advice, self.n_heads)
            order = advice.drop_order if isinstance(advice, HeadAllocationAdvice) else advice["drop_order"]
            lines = []
            for d in order[: self.n_heads]:
                get = (lambda k, d=d: getattr(d, k)) if isinstance(advice, HeadAllocationAdvice) else d.get
                lines.append(f"{get('layer')} head {get('head')} ({get('reason')}): {get('evidence')}")
            return heads, ("H*-based allocation (a hypothesis, METHOD.md section 7; not validated):\n"
                           + "\n".join(f"- {line}" for line in lines))
        return self._measured_heads(trainer, pl_module, masker)

    # ------------------------------------------------------------------ measuring
    def _probe(self, trainer: Trainer) -> HeadImportanceProbe | None:
        return find_probe(self._monitor(trainer))

    def _measurer(self, trainer: Trainer, pl_module: LightningModule, gates: HeadGates,
                  pruned: Mapping[int, list[int]]) -> Measurer:
        probe = self._probe(trainer)
        damage = self.damage if self.damage is not None else (probe.damage if probe is not None else "kl")
        forward = self.forward if self.forward is not None else (probe.forward if probe is not None else None)
        loss_fn = self.loss_fn if self.loss_fn is not None else (probe.loss_fn if probe is not None else None)
        return Measurer(pl_module, gates, damage=damage, forward=forward, loss_fn=loss_fn,
                        base_pruned={int(k): list(v) for k, v in pruned.items()})

    def _validation_batches(self, trainer: Trainer, pl_module: LightningModule) -> list[Any]:
        """The first ``importance_batches`` validation batches on the module's device ([] without any)."""
        from lightning.fabric.utilities.apply_func import move_data_to_device

        loader = None
        candidates = [lambda: trainer.val_dataloaders,
                      lambda: trainer.datamodule.val_dataloader() if getattr(trainer, "datamodule", None) else None,
                      lambda: trainer.fit_loop.epoch_loop.val_loop._data_source.dataloader()]
        for get in candidates:
            try:
                found = get()
            except Exception:  # noqa: BLE001 - try the next source
                continue
            found = found[0] if isinstance(found, (list, tuple)) and found else found
            if found is not None and not isinstance(found, (list, tuple)):
                loader = found
                break
        if loader is None:
            return []
        batches = []
        for i, batch in enumerate(loader):
            if i >= self.importance_batches:
                break
            batches.append(move_data_to_device(batch, pl_module.device))
        return batches

    def _measured_heads(self, trainer: Trainer, pl_module: LightningModule,
                        masker: HeadMasker) -> tuple[Heads, str]:
        """The measured advice's heads and the evidence text (see the module docstring)."""
        monitor = self._monitor(trainer)
        advice = latest_measured_advice(monitor)
        gates = HeadGates(pl_module)
        if gates.n_heads != masker.n_heads:
            raise ValueError(f"the gated layers {gates.n_heads} do not match the masked ones {masker.n_heads}")
        pruned = {int(k): list(v) for k, v in masker.pruned.items()}
        batches = self._validation_batches(trainer, pl_module)
        lines: list[str] = []
        measurer = self._measurer(trainer, pl_module, gates, pruned)
        scores = None
        if advice is not None and len(advice.damage) == len(gates.n_heads):
            scores = torch.tensor([row + [math.nan] * (max(gates.n_heads) - len(row)) for row in advice.damage],
                                  dtype=torch.float64)
            lines.append(f"ranking: the probe's measurement at step {advice.step} ({advice.damage_kind}, "
                         f"{advice.n_sequences} sequences; readiness: {advice.readiness.get('reason', 'n/a')})")
        elif batches:
            with gates, _evaluating(pl_module):
                total, count = single_head_damage(measurer, batches)
            scores = total / count.clamp_min(1.0)
            scores[count == 0] = math.nan
            lines.append(f"ranking: single-head ablation measured now on {len(batches)} validation batches")
        else:
            raise ValueError("no measured head importance: no HeadImportanceProbe measurement and no validation "
                             "batches to measure on")
        n = self.n_heads
        refine = self.refine and n > 1 and bool(batches)
        with gates, _evaluating(pl_module):
            picked, steps, _ = measured_drop(measurer, batches, n, scores=scores, refine=refine, group=self.group,
                                             min_heads=self.min_heads)
        heads = as_heads(picked)
        if steps is not None:
            group = self.group or max(1, math.ceil(n / 8))
            lines.append(f"greedy refinement on {len(batches)} validation batches, {group} head(s) per round: "
                         + ", ".join(f"L{st.layer}h{st.head} (set damage {st.set_damage:.4g})" for st in steps))
        lines.append("single-head damage of the chosen heads: " + ", ".join(
            f"L{i}h{h}={float(scores[i, h]):.4g}" for i, hs in heads.items() for h in hs))
        c = measurer.cost
        lines.append(f"cost at pruning time: {c.forward_passes} forward passes, {c.seconds:.2f} s")
        return heads, "measured advice:\n" + "\n".join(f"- {line}" for line in lines)

    def _reference_outputs(self, trainer: Trainer, pl_module: LightningModule) -> tuple[Measurer, list[Any], list[Any]]:
        """(measurer, batches, outputs before masking) for the damage after masking."""
        gates = HeadGates(pl_module)
        measurer = self._measurer(trainer, pl_module, gates, {})
        batches = self._validation_batches(trainer, pl_module)
        with gates, _evaluating(pl_module):
            refs = [measurer.reference(b) for b in batches]
        return measurer, batches, refs

    @staticmethod
    def _damage_now(pl_module: LightningModule, measurer: Measurer, batches: list[Any],
                    refs: list[Any]) -> dict[str, Any]:
        """The damage of the masks now in the model against the outputs before masking."""
        total = n = 0.0
        with measurer.gates, _evaluating(pl_module):
            for batch, ref in zip(batches, refs, strict=True):
                ds, dn = measurer.measure(batch, ref, {})
                total, n = total + ds, n + dn
        kind = measurer.damage if isinstance(measurer.damage, str) else "function"
        return {"damage": total / max(n, 1.0), "kind": kind, "sequences": int(n), "batches": len(batches)}

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._setup_shell(trainer)  # a collective: here, on every rank
        try:
            self.masker = HeadMasker(pl_module)
        except Exception as err:  # noqa: BLE001
            self.masker = None
            self._warn("finding attention heads to mask", err)
            return
        if self._loaded_masker_state is not None:
            self.masker.load_state_dict(self._loaded_masker_state)
            self._loaded_masker_state = None

    def _all_ranks(self, trainer: Trainer, flag: bool) -> bool:
        """True when ``flag`` holds on every rank (a collective in DDP: call it on all ranks)."""
        return all_ranks_true(trainer, flag)

    def _arm(self, trainer: Trainer) -> None:
        """Agree (all ranks) whether the callback may attempt to prune at the next trigger."""
        self._armed = self._all_ranks(trainer, self.masker is not None and not self.done)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._arm(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        # every rank gets here once per validation run: the collective decisions are taken here
        if self.when_ready:
            ready = False
            if trainer.global_rank == 0:  # the monitor's readiness lives on rank 0
                probe = self._probe(trainer)
                readiness = probe.readiness if probe is not None else getattr(self._monitor(trainer), "readiness", None)
                ready = bool(readiness is not None and readiness.stable)
            self._ready_seen = bool(broadcast_object(trainer, ready, src=0))
        self._arm(trainer)  # also re-arms after a failed attempt: the next try is after this run

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # no collective here unless pruning: _armed, _ready_seen and global_step agree on every rank
        if not self._armed:
            return
        by_step = self.at_step is not None and trainer.global_step >= self.at_step
        ready = self.when_ready and self._ready_seen
        if not (by_step or ready):
            return
        self._armed = False  # one attempt per trigger point: a failure waits for the next validation end
        self.prune_now(trainer, pl_module, trigger=f"step {trainer.global_step}" if by_step else "readiness: stable")

    def prune_now(self, trainer: Trainer, pl_module: LightningModule, trigger: str = "manual") -> Heads:
        """Choose (rank 0), broadcast and mask the heads now; returns what was masked ({} on failure)."""
        assert self.masker is not None
        try:
            heads, evidence = self.select(trainer, pl_module, self.masker) if trainer.global_rank == 0 else ({}, "")
        except Exception as err:  # noqa: BLE001
            heads, evidence = {}, f"error: {type(err).__name__}: {err}"
            if trainer.world_size == 1:
                self._warn("choosing heads", err)
                return {}
        heads, evidence = broadcast_object(trainer, (heads, evidence), src=0)
        if not heads:
            if trainer.world_size > 1 and evidence.startswith("error"):
                self._warn("choosing heads", RuntimeError(evidence))
            return {}
        before: tuple[Measurer, list[Any], list[Any]] | None = None
        damage: dict[str, Any] | None = None
        if self.measure_damage and trainer.global_rank == 0:  # rank 0 only, no collective
            try:
                before = self._reference_outputs(trainer, pl_module)
            except Exception as err:  # noqa: BLE001 - the pruning goes ahead without the measurement
                damage = {"error": f"{type(err).__name__}: {err}"}
        try:
            new = self.masker.apply(heads)
        except Exception as err:  # noqa: BLE001
            self._warn("masking heads", err)
            return {}
        self.done = True
        if before is not None:
            if before[1]:
                try:
                    damage = self._damage_now(pl_module, *before)
                except Exception as err:  # noqa: BLE001
                    damage = {"error": f"{type(err).__name__}: {err}"}
            else:
                damage = {"error": "no validation batches to measure on"}
        self._record(trainer, "prune", trigger, new, evidence, damage=damage)
        return new

    def _record(self, trainer: Trainer, action: str, trigger: str, heads: Heads, evidence: str,
                damage: dict[str, Any] | None = None) -> None:
        assert self.masker is not None
        if damage is not None:
            if "damage" in damage:
                evidence += (f"\n\nmeasured damage of the masked set right after masking: {damage['damage']:.4g} "
                             f"({damage['kind']}, {damage['sequences']} sequences of {damage['batches']} validation "
                             "batches)")
            else:
                evidence += f"\n\ndamage after masking not measured: {damage.get('error')}"
        entry = {
            "action": action,
            "step": int(trainer.global_step),
            "epoch": int(trainer.current_epoch),
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "trigger": trigger,
            "strategy": self.strategy if isinstance(self.strategy, str) else "explicit",
            "heads": {str(k): v for k, v in heads.items()},
            "pruned_total": {str(k): v for k, v in self.masker.pruned.items()},
            "n_pruned": sum(len(v) for v in self.masker.pruned.values()),
            "permanent": self.masker.permanent,
            "model": self.masker.kind,
            "evidence": evidence,
        }
        if damage is not None:
            entry["damage_after_masking"] = damage
        self.actions.append(entry)
        if trainer.global_rank != 0:
            return
        try:
            run_dir = self.run_dir(trainer)
            if self._outputs is None:
                self._outputs = Outputs("HeadPruning", PruningWarning,
                                        jsonl_path=os.path.join(run_dir, "pruning.jsonl"),
                                        fallback_dir=os.path.join(run_dir, "images"), prefix=self.prefix,
                                        layout={}, strict=self.strict)
            self._outputs.record(entry)
            heads_text = "; ".join(f"layer {k}: heads {v}" for k, v in heads.items()) or "none"
            text = (f"### head pruning: {action} at step {entry['step']} ({trigger})\n\n"
                    f"- heads: {heads_text}\n- pruned in total: {entry['n_pruned']}\n"
                    f"- permanent: {entry['permanent']}\n- strategy: {entry['strategy']}\n\n{evidence}\n")
            p = self.prefix
            scalars = {f"{p}/pruning/n_pruned": float(entry["n_pruned"])}
            if damage is not None and "damage" in damage:
                scalars[f"{p}/pruning/damage_after_masking"] = float(damage["damage"])
            for i, active in enumerate(self.masker.active()):
                scalars[f"{p}/heads_active/layer_{i:02d}"] = float(sum(active))

            def write(sink: Any) -> None:
                sink.log_scalars(scalars, entry["step"])
                sink.log_text(f"{p}/pruning", text, entry["step"])

            self._outputs.send(trainer.loggers, write)
        except Exception as err:  # noqa: BLE001
            self._warn("logging the pruning", err)

    def restore(self, trainer: Trainer | None = None) -> None:
        """Give every pruned head back (see :meth:`HeadMasker.restore`); the callback may prune again
        (from the next validation end, or the next fit)."""
        if self.masker is None:
            return
        before = {k: list(v) for k, v in self.masker.pruned.items()}
        self.masker.restore()
        self.done = False
        self._ready_seen = False
        if trainer is not None:
            self._record(trainer, "restore", "manual", before, "heads restored")

    def make_permanent(self, trainer: Trainer | None = None) -> None:
        """End reversibility (see :meth:`HeadMasker.make_permanent`)."""
        if self.masker is None or not self.masker.pruned:
            return
        self.masker.make_permanent()
        if trainer is not None:
            self._record(trainer, "make_permanent", "manual", dict(self.masker.pruned), "pruning made permanent")

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.make_permanent_at_end and self.masker is not None and self.masker.pruned and not self.masker.permanent:
            self.make_permanent(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._outputs is not None:
            self._outputs.close()
            self._outputs = None
        self._hand_over(trainer)

    def _load_handoff(self, state: dict[str, Any]) -> None:
        # the main process after ddp_spawn: what was done; the masks come back with the model's weights
        self._history = list(state.get("actions", []))
        self.done = bool(state.get("done", False))

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "actions": list(self._history),
            "done": self.done,
            "masker": self.masker.state_dict() if self.masker is not None else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != STATE_VERSION:
            warnings.warn("HeadPruning: unknown checkpoint state version, not restored", PruningWarning, stacklevel=2)
            return
        self._history = list(state_dict.get("actions", []))
        self.done = bool(state_dict.get("done", False))
        masker_state = state_dict.get("masker")
        if masker_state is not None:
            if self.masker is not None:
                self.masker.load_state_dict(masker_state)
            else:
                self._loaded_masker_state = masker_state


__all__ = ["STRATEGIES", "HeadPruning", "PruningWarning", "advice_heads", "find_monitor", "latest_advice",
           "latest_measured_advice", "random_heads"]
