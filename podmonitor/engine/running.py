"""The running state of one layer's accumulator, declared once (in the manner of torchmetrics' ``add_state``).

Every quantity the accumulator keeps between updates, apart from the snapshot store, is one row
of :data:`RUNNING`: its name (the attribute of :class:`~podmonitor.engine.PODAccumulator` and the
key of its ``state_dict``), its kind, how two groups of snapshots combine, and, for the
quantities a batch adds to, the function that computes one step's contribution. ``reset``,
``merge``, ``state_dict``, ``load_state_dict``, ``nbytes`` and the memory planner's O(L^2) state
(:func:`fixed_state_bytes`) all follow from the table.

Adding a running metric: one :class:`Running` row here (with its ``step`` and its ``result``,
which the analysis puts into ``PODReport.running``), its entry in the metric registry
(:mod:`podmonitor.reporting.metrics`, reading ``running_value(key)``) and its test: three files.
States saved before the row existed load with its initial value.

The centred moments (``n``, ``mean_field``, ``m2_back``, ``m2_fwd``) combine together by Chan et
al.'s pairwise formula ("moment"); the accumulator's update computes them from a sheared
workspace (:class:`~podmonitor.engine.lags.LagShear`), not per step here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import torch
from torch import Tensor

from .lags import row_entropy

Kind = Literal["tensor", "int", "float", "set"]
Merge = Literal["moment", "sum", "max", "union"]


@dataclass
class BatchStep:
    """A few fields of a batch, as every step function sees them.

    Attributes:
        part: (b, L, L) fields in the compute dtype, on the state's device.
        causal: whether the fields are causal (zero above the diagonal: checked before).
        work: a buffer of at least ``part.numel()`` elements of its dtype, for temporaries.
        tol: tolerance of ``|row sum - 1|`` for the input dtype (see :func:`normalisation_tol`).
        row_sums: (b, L) the row sums of the fields (computed once per batch, with its finiteness
            check).
        blocks: row blocks ``(r0, r1)`` whose rectangles ``[r0:r1, :r1]`` hold every entry that
            may be non-zero (:func:`~podmonitor.engine.lags.lower_row_blocks`; causal fields are
            checked to be exactly zero above the diagonal); None: the whole field.
    """

    part: Tensor
    causal: bool
    work: Tensor
    tol: float
    row_sums: Tensor
    blocks: list[tuple[int, int]] | None = None

    @cached_property
    def has_negative(self) -> bool:
        """Whether any entry of the step is negative (one reduction per row block)."""
        if self.blocks is None:
            return bool(self.part.amin() < 0)
        lows = torch.stack([self.part[:, r0:r1, :r1].amin() for r0, r1 in self.blocks])
        return bool(lows.amin() < 0)

    @cached_property
    def row_error(self) -> Tensor:
        """(b,) the largest ``|row sum - 1|`` of each field. Causal fields are zero above the
        diagonal, so a full row sums exactly the keys j <= i."""
        return (self.row_sums - 1.0).abs().amax(-1)


#: A snapshot counts as normalised when every row sums to 1 over its keys within
#: ``max(NORMALISATION_TOL, 4 eps)`` (eps of the input dtype: float16/bfloat16 entries round).
NORMALISATION_TOL = 1e-3


def normalisation_tol(dtype: torch.dtype) -> float:
    """Tolerance of ``|row sum - 1|`` for input of ``dtype`` (see :data:`NORMALISATION_TOL`)."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return max(NORMALISATION_TOL, 4 * eps)


@dataclass(frozen=True)
class Running:
    """One running quantity.

    Attributes:
        name: attribute of the accumulator and key of its ``state_dict``.
        kind: "tensor" (allocated when the field length is known), "int", "float" or "set".
        merge: how two groups combine: "moment" (Chan et al., with the other moments), "sum",
            "max" or "union".
        doc: what it holds.
        shape: tensors: the shape for field length L.
        bidirectional_only: tensors kept only for bidirectional fields (None for causal ones).
        step: the contribution of one :class:`BatchStep`, combined over the steps of a batch and
            then into the state by ``merge``; None for quantities the update sets otherwise.
        result: a per-layer metric read from the state: ``result(value, n) -> float`` (n: the
            snapshots added), put into :attr:`PODReport.running <podmonitor.engine.PODReport>`
            under ``name`` without its ``_sum`` suffix (also the key in the report's ``to_dict``);
            None for quantities the analysis reads itself.
    """

    name: str
    kind: Kind
    merge: Merge
    doc: str
    shape: Callable[[int], tuple[int, ...]] | None = None
    bidirectional_only: bool = False
    step: Callable[[BatchStep], Any] | None = None
    result: Callable[[Any, int], float] | None = None

    @property
    def result_key(self) -> str:
        """The key of :attr:`result` in the report: the name without a ``_sum`` suffix."""
        return self.name.removesuffix("_sum")

    def initial(self) -> Any:
        """The value before any snapshot (tensors: None until the length is known)."""
        if self.kind == "set":
            return set()
        return {"tensor": None, "int": 0, "float": 0.0}[self.kind]

    def allocate(self, seq_len: int, causal: bool, dtype: torch.dtype, device: torch.device) -> Any:
        """The zero value once the layout is known (tensors allocated, None where not kept)."""
        if self.kind != "tensor":
            return self.initial()
        if self.bidirectional_only and causal:
            return None
        assert self.shape is not None
        return torch.zeros(self.shape(seq_len), dtype=dtype, device=device)

    def nbytes(self, seq_len: int, causal: bool, dtype: torch.dtype) -> int:
        """Bytes of the allocated value (0 for non-tensors)."""
        if self.kind != "tensor" or (self.bidirectional_only and causal):
            return 0
        assert self.shape is not None
        return math.prod(self.shape(seq_len)) * dtype.itemsize

    def combine(self, value: Any, other: Any) -> Any:
        """``value`` combined with ``other`` by ``merge`` ("sum", "max", "union"); tensors in place."""
        if self.merge == "sum":
            if isinstance(value, Tensor):
                return value.add_(other.to(value.device))
            return value + other
        if self.merge == "max":
            return max(value, other)
        if self.merge == "union":
            return value | other
        raise ValueError(f"{self.name} combines with the other moments (merge 'moment')")

    def saved(self, value: Any) -> Any:
        """The ``state_dict`` form (sets as sorted lists)."""
        return sorted(value) if self.kind == "set" else value

    def restored(self, saved: Any, dtype: torch.dtype, device: torch.device) -> Any:
        """A ``state_dict`` value back (tensors moved to ``device`` and ``dtype``, copied)."""
        if self.kind == "tensor":
            return None if saved is None else saved.to(device, dtype).clone()
        return {"int": int, "float": float, "set": set}[self.kind](saved)


def _n_negative(step: BatchStep) -> int:
    return int((step.part < 0).flatten(1).any(dim=1).sum()) if step.has_negative else 0


def _entropy(step: BatchStep) -> Tensor:
    return row_entropy(step.part, step.causal, has_negative=step.has_negative, work=step.work,
                       upper_is_zero=step.causal)[0]


def _square(seq_len: int) -> tuple[int, int]:
    return (seq_len, seq_len)


def _row(seq_len: int) -> tuple[int]:
    return (seq_len,)


#: The running state, declared once.
RUNNING: tuple[Running, ...] = (
    Running("n", "int", "moment", "snapshots added"),
    Running("mean_field", "tensor", "moment", "(L, L) mean field Abar", _square),
    Running("m2_back", "tensor", "moment", "(L, L) centred backward lag moment R", _square),
    Running("m2_fwd", "tensor", "moment", "(L, L) centred forward lag moment (bidirectional fields)", _square,
            bidirectional_only=True),
    Running("entropy_sum", "tensor", "sum", "(L,) sum over snapshots of each row's normalised entropy", _row,
            step=_entropy),
    Running("n_skipped_nonfinite", "int", "sum", "snapshots skipped for NaN/Inf entries"),
    Running("n_negative", "int", "sum", "snapshots with a negative entry", step=_n_negative),
    Running("n_not_normalised", "int", "sum", "snapshots with a row that does not sum to 1 over its keys",
            step=lambda s: int((s.row_error > s.tol).sum())),
    Running("max_row_sum_error", "float", "max", "the largest |row sum - 1| seen",
            step=lambda s: float(s.row_error.max())),
    Running("input_dtypes", "set", "union", "dtypes of the batches given"),
)

#: The rows that give a per-layer metric of the report.
RESULTS: tuple[Running, ...] = tuple(r for r in RUNNING if r.result is not None)

#: The rows a batch step contributes to.
STEPPED: tuple[Running, ...] = tuple(r for r in RUNNING if r.step is not None)


def fixed_state_bytes(seq_len: int, causal: bool, dtype: torch.dtype) -> int:
    """Bytes of the running tensors for length L: the state that does not grow with N."""
    return sum(r.nbytes(seq_len, causal, dtype) for r in RUNNING)
