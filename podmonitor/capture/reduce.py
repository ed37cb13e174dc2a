"""Attention reduced as it is formed: each layer's head average and stability sums, without its maps.

What the monitor keeps of a layer's (B, H, T, T) attention is its head average (B, T, T), the
field the POD analyses (METHOD.md section 1), and per head a few row sums (the stability signals,
section 10). A capture that forms the probabilities itself, row block by row block (the reference
models' explicit attention, the ``sdpa`` adapter's recomputation), can hand each block to a
:class:`LayerReduction` while it is in cache instead of writing the whole (B, H, T, T) maps to
memory and reading them back twice: about a twelfth of the memory traffic and of the memory held
at 12 heads. The monitor asks for this (:attr:`CaptureAdapter.reduction
<podmonitor.capture.base.CaptureAdapter.reduction>`) when nothing downstream needs per-head maps
(no ``per_head``, no extra with ``on_attention``); a capture that cannot reduce returns its maps
as before, and the monitor reduces those itself.

The numbers are those of the maps path: the head average is ``torch.mean`` over the heads of each
block (the same bits as over the whole maps), the stability sums are the same per-row sums
(:class:`~podmonitor.engine.stability.StabilityRows`; float rounding of a row's sum may differ in
the last bit between block widths). A capture that forms the probabilities as a softmax also hands
over the centred scores, and the row entropies come from them without a logarithm per entry
(:func:`~podmonitor.engine.stability.softmax_plogp_rows`: within float32 rounding of the maps
path's ``p log p``).

Example::

    reduction = Reduction()
    with reducing(reduction):
        model(idx, return_attention=True)   # the reference GPT reduces its layers (returns None maps)
    captured = reduction.captured(layer_names, causal=True)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from podmonitor import hugepages
from podmonitor.engine.stability import StabilityRows, StabilitySums

#: which heads of the layer at a position (0, 1, ... in call order) with H heads enter its
#: average: a list of head indices, or None for all
HeadsFor = Callable[[int, int], Sequence[int] | None]


class LayerReduction:
    """One layer's head average and stability sums, built from its row blocks.

    Args:
        b, h, t: the layer's (B, H, T, T) shape.
        causal: row i sees the keys ``[0, i]`` (else all T); the blocks hold +0 right of their keys.
        device: where the blocks are.
        heads: the heads the average is taken over (indices into H), or None for all.
    """

    def __init__(self, b: int, h: int, t: int, causal: bool, device: torch.device,
                 heads: Sequence[int] | None = None) -> None:
        self.shape = (b, h, t, t)
        self.causal = causal
        # (a buffer of the monitor's pool while it captures: no page faults from batch to batch)
        self.average = hugepages.empty((b, t, t), torch.float32, device)  # (B, T, T)
        self.rows = StabilityRows(b, h, t, causal, device)
        self._heads = None if heads is None or list(heads) == list(range(h)) else \
            torch.tensor(list(heads), dtype=torch.long, device=device)
        self.rows_done = 0  # rows added (of B * T), a check that every row came

    def add(self, seqs: slice, r0: int, block: Tensor, centred: Tensor | None = None) -> None:
        """Add the rows ``[r0, r0 + rows)`` of the sequences ``seqs``, every head.

        Args:
            seqs: which sequences of the batch (a slice of B).
            r0: the first row.
            block: (b, H, rows, k) probabilities of the keys ``[0, k)``; every key right of ``k``
                is +0. Converted to float32 (as the maps path stores them).
            centred: (b, H, rows, k), when ``block`` is ``softmax(centred)``: the scores less their
                row maximum, finite at masked keys (the entropy then takes no logarithm per
                entry: :func:`~podmonitor.engine.stability.softmax_plogp_rows`).
        """
        block = block.float()
        b, rows, k = block.shape[0], block.shape[-2], block.shape[-1]
        t = self.shape[-1]
        self.rows.add(seqs, slice(None), r0, block, centred=None if centred is None else centred.float())
        heads = block if self._heads is None else block.index_select(1, self._heads)
        torch.mean(heads, dim=1, out=self.average[seqs, r0:r0 + rows, :k])
        if k < t:
            self.average[seqs, r0:r0 + rows, k:].zero_()
        self.rows_done += b * rows
        if self.rows_done == self.shape[0] * self.shape[2]:
            self.rows.work = None  # the scratch goes once every row is in (not held until collect)

    def add_maps(self, maps: Tensor, zeros_above_diagonal: bool = False, rows_per_block: int = 128) -> None:
        """Add whole (B, H, T, T) maps (a capture that formed them at once), in row blocks.

        Args:
            maps: the layer's probabilities.
            zeros_above_diagonal: every key after its query holds +0 (then only the keys a
                causal row block can see are read), else every key is.
            rows_per_block: rows per block.
        """
        t = maps.shape[-1]
        for r0 in range(0, t, rows_per_block):
            r1 = min(t, r0 + rows_per_block)
            self.add(slice(None), r0, maps[:, :, r0:r1, :r1 if zeros_above_diagonal else t])

    def result(self) -> ReducedLayer:
        """The reduced layer.

        Raises:
            RuntimeError: not every row of every sequence was added.
        """
        b, _, t, _ = self.shape
        if self.rows_done != b * t:
            raise RuntimeError(f"the reduction received {self.rows_done} of {b * t} rows")
        return ReducedLayer(average=self.average, stability=self.rows.sums(), n_heads=self.shape[1])


@dataclass
class ReducedLayer:
    """What the monitor keeps of one layer's attention for one batch.

    Attributes:
        average: (B, T, T) float32, the mean over the averaged heads of the probabilities.
        stability: the per-sequence stability sums of every head.
        n_heads: H.
    """

    average: Tensor
    stability: StabilitySums
    n_heads: int


@dataclass
class ReducedAttention:
    """A capture's batch, reduced as it was formed (see the module docstring); the metadata mean
    what they mean in :class:`~podmonitor.capture.base.CapturedAttention`.

    Attributes:
        layers: one :class:`ReducedLayer` per reported layer, all of the same B and T.
        layer_names: one unique name per layer.
        valid: (B,) bool, sequences without padding; None: all.
        causal: True (every layer is causal), False (none is) or None (they differ: each layer's
            analysis reads it from its own average, whose upper triangle a causal layer leaves 0).
        logit_max: one (B, H) float32 tensor (or None) per layer, or None.
        flagged: layers excluded this batch, with the reason.
        counters: the capture's event counts.
    """

    layers: list[ReducedLayer]
    layer_names: list[str]
    valid: Tensor | None = None
    causal: bool | None = None
    logit_max: list[Tensor | None] | None = None
    flagged: dict[str, str] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("no attention layer was reduced")
        if len(self.layers) != len(self.layer_names) or len(set(self.layer_names)) != len(self.layer_names):
            raise ValueError(f"{len(self.layers)} reduced layers need as many unique names, got {self.layer_names}")
        shapes = {tuple(layer.average.shape) for layer in self.layers}
        if len(shapes) != 1:
            raise ValueError(f"reduced layers differ in (B, T, T): {sorted(shapes)}")

    @property
    def batch_size(self) -> int:
        return self.layers[0].average.shape[0]

    @property
    def seq_len(self) -> int:
        return self.layers[0].average.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.layers[0].average.device


class Reduction:
    """The layers reduced during one capture, in call order.

    Args:
        heads_for: which heads enter the average of the layer at a position (see :data:`HeadsFor`);
            None: every head.
    """

    def __init__(self, heads_for: HeadsFor | None = None) -> None:
        self.heads_for = heads_for
        self.layers: list[LayerReduction] = []
        #: seconds a model spent reducing inside the validation step's own forward
        #: (:func:`reducing_in_step`), for the monitor's capture timing
        self.step_seconds = 0.0

    def layer(self, b: int, h: int, t: int, causal: bool, device: torch.device) -> LayerReduction:
        """A new layer (the next in call order, added to :attr:`layers`), to
        :meth:`LayerReduction.add` its row blocks to."""
        layer = self.make_layer(b, h, t, causal, device, len(self.layers))
        self.layers.append(layer)
        return layer

    def make_layer(self, b: int, h: int, t: int, causal: bool, device: torch.device,
                   position: int) -> LayerReduction:
        """A layer at ``position`` that the caller keeps (a capture that may still drop it)."""
        heads = None if self.heads_for is None else self.heads_for(position, h)
        return LayerReduction(b, h, t, causal, device, heads)

    def clear(self) -> None:
        self.layers = []


_CURRENT: contextvars.ContextVar[Reduction | None] = contextvars.ContextVar("podmonitor_reduction", default=None)


def current_reduction() -> Reduction | None:
    """The reduction a capture asked for around this forward (:func:`reducing`), or None."""
    return _CURRENT.get()


@contextlib.contextmanager
def reducing(reduction: Reduction) -> Iterator[Reduction]:
    """Within the block, code that forms attention in row blocks and supports it (the reference
    models' explicit attention) hands each layer to ``reduction`` instead of returning its maps."""
    token = _CURRENT.set(reduction)
    try:
        yield reduction
    finally:
        _CURRENT.reset(token)


_IN_STEP: contextvars.ContextVar[Reduction | None] = contextvars.ContextVar("podmonitor_step_reduction",
                                                                            default=None)


def step_reduction() -> Reduction | None:
    """The reduction a capture asked the model's own forward to feed while the validation step
    runs (:func:`reducing_in_step`), or None."""
    return _IN_STEP.get()


def reducing_in_step(reduction: Reduction) -> contextvars.Token:
    """Ask a model that supports it (the reference models' softmax attention) to hand each layer
    of the forward passes that follow to ``reduction``, besides computing its output as usual,
    until :func:`stop_reducing_in_step` with the returned token. Not a ``with`` block: the capture
    starts before the validation step and stops after it, in two hooks."""
    return _IN_STEP.set(reduction)


def stop_reducing_in_step(token: contextvars.Token) -> None:
    """End what :func:`reducing_in_step` started."""
    _IN_STEP.reset(token)


__all__ = ["LayerReduction", "ReducedAttention", "ReducedLayer", "Reduction", "current_reduction", "reducing",
           "reducing_in_step", "step_reduction", "stop_reducing_in_step"]
