"""Measured head importance: the damage of removing heads, by forward passes (METHOD.md section 7).

For a batch x and a set S of heads, the damage is how much the model's output changes when the
heads of S are removed (gate 0, :class:`~podmonitor.pruning.heads.HeadGates`):

* ``"kl"`` (default, label-free): per position, ``KL(p || p_S)`` of the output distributions
  ``p = softmax(logits)`` without and ``p_S`` with the heads removed, averaged over the positions
  of a sequence (weighted by the batch's ``attention_mask`` when it has one). An output without
  logits (an encoder's hidden states) is compared by ``"cosine"`` instead, and the result says so.
* ``"cosine"``: ``1 - cos(y, y_S)`` of the output vectors (last dimension), averaged over positions.
* ``"loss"``: ``loss(x; S) - loss(x)`` of a loss function, by default the model's own
  ``validation_step`` run again with its logging silenced (see :func:`validation_step_loss`).
* a function ``fn(base_output, masked_output, batch) -> (B,) or scalar``.

Importance of head h: the damage of removing h alone (single-head ablation, ``1 + n_heads``
forward passes per batch). Head effects interact, so several heads are best removed greedily
(:func:`greedy_drop_order`: re-measure every candidate after each drop, or each group of drops).
:func:`first_order_importance` is Michel et al.'s estimate ``E_x |d loss / d g_h|`` at g = 1,
one backward pass per batch instead of ``n_heads`` forward passes.

Lightning runs validation under ``torch.inference_mode``; the forward passes here run in it too,
the first-order estimate leaves it (``torch.inference_mode(False)``, ``torch.enable_grad()``) and
clones the batch's tensors so that they can be saved for the backward pass.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .heads import HeadGates

Heads = dict[int, list[int]]
ForwardFn = Callable[[nn.Module, Any], Any]
LossFn = Callable[[nn.Module, Any], Tensor]
DamageFn = Callable[[Any, Any, Any], Tensor]
DAMAGES = ("kl", "cosine", "loss")


# ----------------------------------------------------------------------------- running the model
def default_forward(module: nn.Module, batch: Any) -> Any:
    """The model's output for a batch: ``module(**batch)`` for a dict (keys its ``forward`` does not
    take are left out), ``module(batch[0])`` for a tuple or list, ``module(batch)`` otherwise.

    Raises:
        ValueError: the module has no ``forward`` of its own.
    """
    try:
        if isinstance(batch, Mapping):
            sig = inspect.signature(module.forward)
            takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
            kwargs = {k: v for k, v in batch.items() if takes_any or k in sig.parameters}
            return module(**kwargs)
        if isinstance(batch, (tuple, list)):
            return module(batch[0])
        return module(batch)
    except NotImplementedError as err:
        raise ValueError(f"{type(module).__name__} has no forward() to run the probe batches through: pass "
                         "forward=fn(pl_module, batch) -> logits") from err


def output_tensor(out: Any) -> tuple[Tensor, bool]:
    """(the tensor to compare, whether it holds logits) of a model output.

    A tensor, or the first tensor of a tuple or list (the reference GPT's ``(logits, loss)``),
    counts as logits; of a mapping (a Hugging Face ``ModelOutput``) the ``logits``, else the
    ``last_hidden_state`` (not logits), else its first tensor.

    Raises:
        ValueError: no tensor in the output.
    """
    if isinstance(out, Tensor):
        return out, True
    if isinstance(out, Mapping):
        if isinstance(out.get("logits"), Tensor):
            return out["logits"], True
        if isinstance(out.get("last_hidden_state"), Tensor):
            return out["last_hidden_state"], False
        values = list(out.values())
    elif isinstance(out, (tuple, list)):
        values = list(out)
    else:
        values = []
    for v in values:
        if isinstance(v, Tensor) and v.dim() >= 1:
            return v, True
    raise ValueError(f"the model's output ({type(out).__name__}) holds no tensor to compare")


def _position_weights(batch: Any, y: Tensor) -> Tensor | None:
    """(B, T) weights of the positions of y (B, T, D): the batch's attention_mask when it fits."""
    if isinstance(batch, Mapping) and isinstance(batch.get("attention_mask"), Tensor) and y.dim() == 3:
        m = batch["attention_mask"]
        if tuple(m.shape) == tuple(y.shape[:2]):
            return m.to(torch.float64)
    return None


def _per_sequence_mean(values: Tensor, weights: Tensor | None) -> Tensor:
    """(B, ...) -> (B,) mean over every dimension but the first (weighted over dim 1 by (B, T))."""
    if values.dim() == 1:
        return values
    if weights is not None and values.dim() == 2:
        return (values * weights).sum(1) / weights.sum(1).clamp_min(1.0)
    return values.reshape(values.shape[0], -1).mean(1)


def kl_damage(base: Tensor, masked: Tensor, weights: Tensor | None = None) -> Tensor:
    """(B,) mean over positions of ``KL(softmax(base) || softmax(masked))``; logits (B, ..., V)."""
    logp = F.log_softmax(base.to(torch.float64), dim=-1)
    logq = F.log_softmax(masked.to(torch.float64), dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).clamp_min(0.0)  # (B, ...)
    return _per_sequence_mean(kl, weights)


def cosine_damage(base: Tensor, masked: Tensor, weights: Tensor | None = None) -> Tensor:
    """(B,) mean over positions of ``1 - cos(base, masked)`` along the last dimension."""
    cos = F.cosine_similarity(base.to(torch.float64), masked.to(torch.float64), dim=-1)  # (B, ...)
    return _per_sequence_mean(1.0 - cos, weights)


@contextlib.contextmanager
def _silenced_logging(module: nn.Module) -> Iterator[None]:
    """``module.log`` and ``module.log_dict`` do nothing within the block (instance attributes)."""
    names = [n for n in ("log", "log_dict") if hasattr(module, n)]
    for n in names:
        object.__setattr__(module, n, lambda *a, **k: None)
    try:
        yield
    finally:
        for n in names:
            module.__dict__.pop(n, None)


def validation_step_loss(module: nn.Module, batch: Any, batch_idx: int = 0) -> Tensor:
    """The loss the module's ``validation_step`` returns (a tensor, or the ``"loss"`` of a mapping),
    with ``self.log`` / ``self.log_dict`` silenced so that nothing is logged twice.

    Raises:
        ValueError: the module holds torchmetrics metrics (running the step again would update
            them: pass ``loss_fn``), has no ``validation_step``, or the step returns no loss.
    """
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
        Metric = ()  # type: ignore[assignment,misc]
    if Metric and any(isinstance(m, Metric) for m in module.modules()):
        raise ValueError(f"{type(module).__name__} holds torchmetrics metrics: running its validation_step again "
                         "would update them; pass loss_fn=fn(pl_module, batch) -> loss")
    step = getattr(module, "validation_step", None)
    if step is None:
        raise ValueError(f"{type(module).__name__} has no validation_step: pass loss_fn=fn(pl_module, batch) -> loss")
    with _silenced_logging(module):
        out = step(batch, batch_idx)
    if isinstance(out, Mapping):
        out = out.get("loss")
    if not isinstance(out, Tensor):
        raise ValueError("validation_step returned no loss (a tensor or {'loss': tensor}): pass loss_fn or use "
                         "damage='kl'")
    return out


# ----------------------------------------------------------------------------- batches
def map_tensors(batch: Any, fn: Callable[[Tensor], Any]) -> Any:
    """The batch with ``fn`` applied to each tensor (tuples, lists, dicts; other leaves kept)."""
    if isinstance(batch, Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        out = {k: map_tensors(v, fn) for k, v in batch.items()}
        try:
            return type(batch)(out)  # dict, or a dict subclass such as transformers' BatchEncoding
        except Exception:  # noqa: BLE001
            return out
    if isinstance(batch, tuple):
        return tuple(map_tensors(v, fn) for v in batch)
    if isinstance(batch, list):
        return [map_tensors(v, fn) for v in batch]
    return batch


def batch_size(batch: Any) -> int:
    """Sequences of a batch: the first dimension of its first tensor."""
    found: list[int] = []
    map_tensors(batch, lambda t: found.append(int(t.shape[0])) if t.dim() else None)
    if not found:
        raise ValueError("the batch holds no tensor")
    return found[0]


def slice_batch(batch: Any, i: int) -> Any:
    """Sequence i of a batch (tensors sliced i:i+1 along their first dimension)."""
    n = batch_size(batch)
    return map_tensors(batch, lambda t: t[i:i + 1] if t.dim() and t.shape[0] == n else t)


# ----------------------------------------------------------------------------- measuring
@dataclass
class Cost:
    """What measuring cost: forward passes, backward passes, seconds."""

    forward_passes: int = 0
    backward_passes: int = 0
    seconds: float = 0.0

    def add(self, other: Cost) -> None:
        self.forward_passes += other.forward_passes
        self.backward_passes += other.backward_passes
        self.seconds += other.seconds

    def to_dict(self) -> dict[str, float]:
        return {"forward_passes": self.forward_passes, "backward_passes": self.backward_passes,
                "seconds": self.seconds}


@dataclass
class Measurer:
    """Runs the model with heads removed and measures the damage (see the module docstring).

    Args:
        module: the model (the module ``forward`` and ``loss_fn`` are given).
        gates: gates of ``module`` (attached by the caller: ``with gates:``).
        damage: "kl", "cosine", "loss" or a function ``fn(base_output, masked_output, batch)``.
        forward: ``fn(module, batch) -> output`` (default :func:`default_forward`).
        loss_fn: ``fn(module, batch) -> loss`` for damage "loss" and the first-order estimate
            (default :func:`validation_step_loss`); a scalar is taken as the mean over the batch.
        base_pruned: heads removed in every measurement (already pruned), ``{layer: [heads]}``.
    """

    module: nn.Module
    gates: HeadGates
    damage: str | DamageFn = "kl"
    forward: ForwardFn | None = None
    loss_fn: LossFn | None = None
    base_pruned: Heads = field(default_factory=dict)
    cost: Cost = field(default_factory=Cost)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.damage, str) and self.damage not in DAMAGES:
            raise ValueError(f"damage must be one of {DAMAGES} or a function, got {self.damage!r}")

    def _run(self, batch: Any) -> Any:
        self.cost.forward_passes += 1
        if self.damage == "loss":
            return (self.loss_fn or validation_step_loss)(self.module, batch)
        return (self.forward or default_forward)(self.module, batch)

    def reference(self, batch: Any) -> Any:
        """The output (or loss) with only the already pruned heads removed."""
        with self.gates.zeroed(self.base_pruned):
            return self._run(batch)

    def measure(self, batch: Any, ref: Any, heads: Mapping[int, Sequence[int]]) -> tuple[float, int]:
        """(sum over the batch's sequences of the damage of removing ``heads``, sequences)."""
        union = {int(k): list(v) for k, v in self.base_pruned.items()}
        for k, v in heads.items():
            union[int(k)] = sorted(set(union.get(int(k), [])) | {int(h) for h in v})
        with self.gates.zeroed(union):
            out = self._run(batch)
        b = batch_size(batch)
        if callable(self.damage):
            d = self.damage(ref, out, batch)
        elif self.damage == "loss":
            d = out.detach().double() - ref.detach().double()
        else:
            y0, logits0 = output_tensor(ref)
            y1, _ = output_tensor(out)
            w = _position_weights(batch, y0)
            if self.damage == "kl" and logits0:
                d = kl_damage(y0, y1, w)
            else:
                if self.damage == "kl" and "no logits: compared by 1 - cosine" not in self.notes:
                    self.notes.append("no logits: compared by 1 - cosine")
                d = cosine_damage(y0, y1, w)
        d = torch.as_tensor(d, dtype=torch.float64).detach()
        if d.dim() == 0:
            return float(d) * b, b
        return float(d.sum()), int(d.numel())


def removable(n_heads: Sequence[int], pruned: Mapping[int, Sequence[int]]) -> list[tuple[int, int]]:
    """(layer, head) of every active head, in model order (the candidates to measure)."""
    return [(i, h) for i, n in enumerate(n_heads) for h in range(n) if h not in pruned.get(i, [])]


def single_head_damage(measurer: Measurer, batches: Sequence[Any]) -> tuple[Tensor, Tensor]:
    """Sums and counts, each (L, H_max) float64, of the damage of removing each active head alone.

    Heads already pruned (``measurer.base_pruned``) and heads a layer does not have get count 0.
    Cost: ``1 + active heads`` forward passes per batch.
    """
    n_heads = measurer.gates.n_heads
    total = torch.zeros(len(n_heads), max(n_heads), dtype=torch.float64)
    count = torch.zeros_like(total)
    t0 = time.perf_counter()
    for batch in batches:
        ref = measurer.reference(batch)
        for i, h in removable(n_heads, measurer.base_pruned):
            s, n = measurer.measure(batch, ref, {i: [h]})
            total[i, h] += s
            count[i, h] += n
    measurer.cost.seconds += time.perf_counter() - t0
    return total, count


@dataclass
class GreedyStep:
    """One drop of a greedy order: the head, the damage of the whole set after it, re-measured."""

    layer: int
    head: int
    set_damage: float


def greedy_drop_order(measurer: Measurer, batches: Sequence[Any], n_drop: int, *, min_heads: int = 1,
                      group: int = 1, first: Tensor | None = None) -> list[GreedyStep]:
    """Drop ``n_drop`` heads greedily: each round re-measures every remaining candidate added to the
    set dropped so far and drops the ``group`` of least damage (each layer keeping ``min_heads``).

    Args:
        measurer: the measurer (its ``base_pruned`` heads are gone throughout).
        batches: the probe batches (every round sees all of them).
        n_drop: heads to drop (fewer when no more can go).
        min_heads: heads every layer keeps.
        group: heads dropped per round (1: re-measure after every drop).
        first: (L, H_max) mean single-head damage already measured on these batches (saves the first
            round).

    Returns:
        the drops in order with the re-measured damage of the set after each round (the heads of one
        group share their round's set damage). Cost: about ``n_drop / group`` rounds of
        ``1 + remaining heads`` forward passes per batch.
    """
    if n_drop < 0 or group < 1:
        raise ValueError(f"n_drop must be >= 0 and group >= 1, got {n_drop}, {group}")
    n_heads = measurer.gates.n_heads
    left = [n - len(measurer.base_pruned.get(i, [])) for i, n in enumerate(n_heads)]
    chosen: Heads = {}
    steps: list[GreedyStep] = []
    t0 = time.perf_counter()
    refs: list[Any] | None = None
    while len(steps) < n_drop:
        cands = [(i, h) for i, h in removable(n_heads, measurer.base_pruned)
                 if h not in chosen.get(i, []) and left[i] - 1 >= min_heads]
        if not cands:
            break
        if first is not None and not steps:
            scores = {c: float(first[c]) for c in cands}
        else:
            if refs is None:
                refs = [measurer.reference(b) for b in batches]
            scores = {}
            for c in cands:
                trial = {k: list(v) for k, v in chosen.items()}
                trial.setdefault(c[0], []).append(c[1])
                s = n = 0.0
                for batch, ref in zip(batches, refs, strict=True):
                    ds, dn = measurer.measure(batch, ref, trial)
                    s, n = s + ds, n + dn
                scores[c] = s / max(n, 1.0)
        ranked = sorted(cands, key=lambda c: (scores[c] if math.isfinite(scores[c]) else math.inf, c))
        taken: list[tuple[int, int]] = []
        for c in ranked:
            if len(taken) == min(group, n_drop - len(steps)):
                break
            if left[c[0]] - 1 >= min_heads:
                taken.append(c)
                left[c[0]] -= 1
                chosen.setdefault(c[0], []).append(c[1])
        if not taken:
            break
        if len(taken) == 1:  # the set was measured as this round's candidate (or alone, in `first`)
            set_damage = scores[taken[0]]
        else:  # a group: measure the set itself
            if refs is None:
                refs = [measurer.reference(b) for b in batches]
            s = n = 0.0
            for batch, ref in zip(batches, refs, strict=True):
                ds, dn = measurer.measure(batch, ref, chosen)
                s, n = s + ds, n + dn
            set_damage = s / max(n, 1.0)
        steps += [GreedyStep(i, h, float(set_damage)) for i, h in taken]
    measurer.cost.seconds += time.perf_counter() - t0
    return steps


def first_order_importance(measurer: Measurer, batches: Sequence[Any]) -> tuple[Tensor, Tensor]:
    """Sums and counts (L, H_max) of Michel et al.'s ``|d loss(x) / d g_h|`` at g = 1, per sequence.

    One forward and one backward per batch ((B, H) gates), or per sequence where the gates are
    per layer only (``nn.MultiheadAttention``). A scalar loss is taken as the batch mean of
    per-sequence losses (its gradient is multiplied by B). Parameter gradients are not touched.
    Runs outside inference mode with gradients on, on clones of the batch's tensors.
    """
    loss_fn = measurer.loss_fn or validation_step_loss
    n_heads = measurer.gates.n_heads
    t0 = time.perf_counter()
    with torch.inference_mode(False), torch.enable_grad():
        total = torch.zeros(len(n_heads), max(n_heads), dtype=torch.float64)
        count = torch.zeros_like(total)
        for raw in batches:
            batch = map_tensors(raw, lambda t: t.clone())
            parts = [batch] if measurer.gates.per_sequence else \
                [slice_batch(batch, i) for i in range(batch_size(batch))]
            for part in parts:
                b = batch_size(part)
                xis = []
                for i, n in enumerate(n_heads):
                    base = torch.ones(n)
                    base[measurer.base_pruned.get(i, [])] = 0.0
                    shape = (b, n) if measurer.gates.per_sequence else (n,)
                    xis.append(base.expand(shape).clone().requires_grad_(True))
                measurer.gates.set(dict(enumerate(xis)))
                try:
                    loss = loss_fn(measurer.module, part)
                    measurer.cost.forward_passes += 1
                    grads = torch.autograd.grad(loss.sum(), xis, allow_unused=True)
                    measurer.cost.backward_passes += 1
                finally:
                    measurer.gates.clear()
                scale = b if loss.dim() == 0 else 1
                for i, g in enumerate(grads):
                    if g is None:
                        continue
                    g = g.detach().double().abs() * scale
                    total[i, : n_heads[i]] += g.reshape(-1, n_heads[i]).sum(0).cpu()
                    count[i, : n_heads[i]] += b
    for i, hs in measurer.base_pruned.items():
        count[i, hs] = 0.0
    measurer.cost.seconds += time.perf_counter() - t0
    return total, count


def measured_drop(measurer: Measurer, batches: Sequence[Any], n: int, *, scores: Tensor | None = None,
                  refine: bool = True, group: int | None = None,
                  min_heads: int = 1) -> tuple[list[tuple[int, int]], list[GreedyStep] | None, Tensor | None]:
    """The ``n`` heads the measured advice drops: (heads in drop order, greedy steps or None, single-head
    damage (L, H_max) or None).

    With ``refine`` and ``n > 1``: greedy on ``batches``, ``group`` heads per round (default
    ``ceil(n / 8)``: at most 8 rounds). Otherwise the ``n`` heads of lowest single-head damage:
    ``scores`` when given, else measured on ``batches``.

    Raises:
        ValueError: fewer than ``n`` heads can go (``min_heads`` per layer), or nothing to measure on.
    """
    n_heads = measurer.gates.n_heads
    if refine and n > 1:
        if not batches:
            raise ValueError("the greedy refinement needs batches to measure on")
        steps = greedy_drop_order(measurer, batches, n, min_heads=min_heads, group=group or max(1, math.ceil(n / 8)))
        if len(steps) < n:
            raise ValueError(f"cannot drop {n} heads keeping {min_heads} per layer")
        return [(st.layer, st.head) for st in steps], steps, scores
    if scores is None:
        if not batches:
            raise ValueError("no scores and no batches to measure on")
        total, count = single_head_damage(measurer, batches)
        scores = total / count.clamp_min(1.0)
        scores[count == 0] = math.nan
    picked = lowest_first(scores, n_heads, measurer.base_pruned, n, min_heads)
    if len(picked) < n:
        raise ValueError(f"cannot drop {n} heads keeping {min_heads} per layer")
    return picked, None, scores


# ----------------------------------------------------------------------------- ranks
def rank_values(x: Sequence[float]) -> list[float]:
    """Ranks 1..n of the values (ties get their average rank)."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    ranks = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> tuple[float, int]:
    """(Spearman rank correlation of a and b over the pairs where both are finite, pairs used).

    NaN when fewer than 3 pairs or one side is constant.
    """
    pairs = [(float(x), float(y)) for x, y in zip(a, b, strict=True)
             if math.isfinite(float(x)) and math.isfinite(float(y))]
    n = len(pairs)
    if n < 3:
        return math.nan, n
    ra, rb = rank_values([p[0] for p in pairs]), rank_values([p[1] for p in pairs])
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    if va == 0 or vb == 0:
        return math.nan, n
    return cov / math.sqrt(va * vb), n


def lowest_first(scores: Tensor, n_heads: Sequence[int], pruned: Mapping[int, Sequence[int]], n: int,
                 min_heads: int = 1) -> list[tuple[int, int]]:
    """The ``n`` active heads of lowest score, lowest first, each layer keeping ``min_heads``
    (non-finite scores last)."""
    left = [k - len(pruned.get(i, [])) for i, k in enumerate(n_heads)]
    ranked = sorted(removable(n_heads, pruned),
                    key=lambda c: (float(scores[c]) if math.isfinite(float(scores[c])) else math.inf, c))
    out: list[tuple[int, int]] = []
    for i, h in ranked:
        if len(out) == n:
            break
        if left[i] - 1 >= min_heads:
            out.append((i, h))
            left[i] -= 1
    return out


def as_heads(pairs: Sequence[tuple[int, int]]) -> Heads:
    """[(layer, head), ...] -> {layer: [heads, sorted]}."""
    out: Heads = {}
    for i, h in pairs:
        out.setdefault(int(i), []).append(int(h))
    return {k: sorted(v) for k, v in sorted(out.items())}


__all__ = [
    "DAMAGES",
    "Cost",
    "GreedyStep",
    "Measurer",
    "as_heads",
    "batch_size",
    "cosine_damage",
    "default_forward",
    "first_order_importance",
    "greedy_drop_order",
    "kl_damage",
    "lowest_first",
    "map_tensors",
    "measured_drop",
    "output_tensor",
    "rank_values",
    "removable",
    "single_head_damage",
    "slice_batch",
    "spearman",
    "validation_step_loss",
]
