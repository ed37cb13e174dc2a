"""Where one layer's snapshots go: an exact store and a sketch store behind one interface.

The POD needs the snapshots (the dominant scales, and so the windows, are known only at the end).
A :class:`SnapshotStore` receives each batch's lag-band entries (``add``), combines with another
store (``merge``), says how much memory it holds (``nbytes``), saves and restores itself
(``state_dict`` / ``load_state_dict``) and, at the end, gives the POD at a scale
(``pod(weights)``: eigenpairs with a guaranteed error bound, 0 when exact) and the coherency sums.

* :class:`ExactStore` keeps every snapshot (N x P numbers; exact POD by the method of snapshots,
  or from the D x D covariance when D < N, see :mod:`podmonitor.engine.pod`).
* :class:`SketchStore` keeps a Frequent Directions sketch of 2 l rows whatever N (eigenvalues
  within a reported bound, see :mod:`podmonitor.engine.sketch`), and the coherency sums at a
  fixed scale when one is set.

"auto" mode is one move, :meth:`ExactStore.to_sketch`: the stored snapshots go into a new sketch
store, oldest first, each freed once it is in.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .budget import streamed_coherency
from .coherency import CoherencyAccumulator
from .config import PODConfig
from .lags import LagBand
from .pod import snapshot_pod
from .sketch import FrequentDirections, sketch_pod

#: In sketch mode, band entries are fed to the sketch (and the streamed coherency) in parts of
#: at most this size (bytes), so that an update's temporaries stay bounded whatever the batch.
SKETCH_FEED_BYTES = 32 * 2**20


@dataclass
class Eigenpairs:
    """The POD of the windowed fluctuation ensemble at one scale.

    Attributes:
        eigenvalues: (K,) descending (exact, or estimates within ``error_bound``).
        modes: (k, P') unit-norm modes in lag-band layout (k <= n_modes).
        total_energy: the exact sum of all eigenvalues.
        error_bound: e, with ``|lambda_k - eigenvalues_k| <= e`` (0.0 when exact).
        eigenvalues_lower: (K,) guaranteed lower bounds (None when exact).
        coefficients: (N, k) temporal coefficients ``a_k(s) = <u_s, phi_k>`` (None when the
            snapshots are not kept).
    """

    eigenvalues: Tensor
    modes: Tensor
    total_energy: float
    error_bound: float = 0.0
    eigenvalues_lower: Tensor | None = None
    coefficients: Tensor | None = None


#: Capture dtypes an exact store keeps as given (every operation on them is supported and exact
#: once widened; float8 and other exotic types are converted to ``config.dtype``).
NARROW_EXACT = (torch.float32, torch.float16, torch.bfloat16)


def stored_dtype(config: PODConfig, input_dtype: torch.dtype) -> torch.dtype:
    """The dtype an exact store keeps a batch's band entries in.

    ``config.storage_dtype`` when set; else floating-point fields narrower than ``config.dtype``
    (float32, float16, bfloat16 captures) are kept in their own dtype, which holds them exactly
    (the analysis widens them to ``config.dtype`` first, so every number is the same as with
    ``config.dtype`` storage, in half the memory or less); other fields in ``config.dtype``. The
    memory planner (:mod:`podmonitor.engine.budget`) counts ``config.dtype`` bytes for them, an
    upper bound.
    """
    if config.storage_dtype is not None:
        return config.storage_dtype
    if input_dtype in NARROW_EXACT and input_dtype.itemsize < config.dtype.itemsize:
        return input_dtype
    return config.dtype


class SnapshotStore(ABC):
    """The snapshots of one layer, in lag-band form (see :class:`~podmonitor.engine.lags.LagBand`).

    Args:
        band: the layout of the entries.
        config: the engine settings.
        device: where the store lives.
    """

    #: "exact" or "sketch" (``PODReport.mode``)
    mode: ClassVar[str]
    #: whether every snapshot is kept (then any coherency scale can be computed at the end)
    keeps_snapshots: ClassVar[bool]

    def __init__(self, band: LagBand, config: PODConfig, device: torch.device) -> None:
        self.band = band
        self.config = config
        self.device = device

    @property
    @abstractmethod
    def n(self) -> int:
        """Snapshots held."""

    @abstractmethod
    def feed(self, n_batch: int, step: int, input_dtype: torch.dtype) -> tuple[int, torch.dtype]:
        """How a batch of ``n_batch`` fields of ``input_dtype``, converted ``step`` fields at a
        time, is handed over: (rows per :meth:`add`, dtype of the rows)."""

    @abstractmethod
    def add(self, rows: Tensor) -> None:
        """Take (b, P) band entries of b snapshots (in the dtype :meth:`feed` asks for)."""

    @abstractmethod
    def merge(self, other: SnapshotStore) -> None:
        """Absorb another store's snapshots (of the same layout)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held now."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The store's entries of the accumulator's ``state_dict`` (flat keys)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any], n: int) -> None:
        """Restore from the accumulator's ``state_dict``, which holds ``n`` snapshots.

        Raises:
            ValueError: the saved store does not match ``n`` or the layout.
        """

    @abstractmethod
    def pod(self, weights: Tensor, center: Tensor) -> Eigenpairs:
        """The POD of the centred ensemble windowed by ``weights``.

        Args:
            weights: (P',) lag-window weights of the first P' band entries.
            center: (P,) the exact mean field in band layout (the exact store centres with it;
                the sketch keeps its own exact mean).
        """

    @abstractmethod
    def coherency(self, scale: float, causal: bool) -> CoherencyAccumulator | None:
        """The coherency sums at ``scale`` (None when this store cannot give them)."""

    def info(self, state_bytes: int) -> dict[str, Any] | None:
        """``PODReport.sketch``: the facts of an approximation (None when exact)."""
        return None

    def notes(self, head: Any) -> list[str]:
        """Messages about the approximation, given the report of the top scale (or None)."""
        return []


class ExactStore(SnapshotStore):
    """Every snapshot, as a list of (n_c, P) chunks (one per batch) in :func:`stored_dtype`."""

    mode = "exact"
    keeps_snapshots = True

    def __init__(self, band: LagBand, config: PODConfig, device: torch.device) -> None:
        super().__init__(band, config, device)
        self.chunks: list[Tensor] = []

    @property
    def n(self) -> int:
        return sum(int(c.shape[0]) for c in self.chunks)

    def feed(self, n_batch: int, step: int, input_dtype: torch.dtype) -> tuple[int, torch.dtype]:
        return n_batch, stored_dtype(self.config, input_dtype)  # the whole batch, in one piece

    def add(self, rows: Tensor) -> None:
        self.chunks.append(rows)

    def merge(self, other: SnapshotStore) -> None:
        if not isinstance(other, ExactStore):
            raise TypeError("an exact store takes only exact snapshots: turn it into a sketch first")
        self.chunks.extend(c.to(self.device) for c in other.chunks)

    def nbytes(self) -> int:
        return int(sum(c.numel() * c.element_size() for c in self.chunks))

    def state_dict(self) -> dict[str, Any]:
        chunks = self.chunks
        return {"snapshots": torch.cat(chunks) if len(chunks) > 1 else (chunks[0] if chunks else None)}

    def load_state_dict(self, state: dict[str, Any], n: int) -> None:
        snaps = state["snapshots"]
        self.chunks = [] if snaps is None else [snaps.to(self.device).clone()]
        if snaps is not None and (snaps.shape[0] != n or snaps.shape[1] != self.band.size):
            raise ValueError("corrupt PODAccumulator state: snapshot store does not match its counts")

    def pod(self, weights: Tensor, center: Tensor) -> Eigenpairs:
        cfg = self.config
        res = snapshot_pod(self.chunks, center=center, weights=weights, n_modes=cfg.n_modes,
                           floor=cfg.eig_floor, dtype=cfg.dtype)
        return Eigenpairs(res.eigenvalues, res.modes, float(res.eigenvalues.sum()), coefficients=res.coefficients)

    def coherency(self, scale: float, causal: bool) -> CoherencyAccumulator:
        cfg = self.config
        acc = CoherencyAccumulator(self.band.seq_len, scale, cfg.omega0, cfg.dtype, self.device, causal=causal)
        for chunk in self.chunks:
            acc.update_band(self.band, chunk)
        return acc

    def to_sketch(self, rank: int) -> SketchStore:
        """A sketch store of ``rank`` rows holding these snapshots; this store is emptied."""
        sketch = SketchStore(self.band, self.config, self.device, rank)
        self.chunks.reverse()  # oldest first, each freed once it is in the sketch
        while self.chunks:
            chunk = self.chunks.pop()
            sketch.add(chunk)
            del chunk
        return sketch


class SketchStore(SnapshotStore):
    """A centred Frequent Directions sketch of the snapshots (2 l x P, whatever N) and, when
    ``coherency_scale`` is fixed, the coherency sums at that scale, streamed.

    Args:
        band, config, device: as for :class:`SnapshotStore`.
        rank: l, the rows kept after a shrink.
    """

    mode = "sketch"
    keeps_snapshots = False

    def __init__(self, band: LagBand, config: PODConfig, device: torch.device, rank: int) -> None:
        super().__init__(band, config, device)
        self.sketch = FrequentDirections(band.size, rank, dtype=config.dtype,
                                         storage_dtype=config.resolved_storage_dtype, device=device)
        self.streamed: CoherencyAccumulator | None = None
        if streamed_coherency(config):
            assert config.coherency_scale is not None
            self.streamed = CoherencyAccumulator(band.seq_len, config.coherency_scale, config.omega0, config.dtype,
                                                 device, causal=band.causal)

    @property
    def n(self) -> int:
        return self.sketch.n

    def feed(self, n_batch: int, step: int, input_dtype: torch.dtype) -> tuple[int, torch.dtype]:
        row_bytes = self.band.size * self.config.dtype.itemsize
        return min(n_batch, max(step, SKETCH_FEED_BYTES // row_bytes)), self.config.dtype

    def add(self, rows: Tensor) -> None:
        self.sketch.update(rows)
        if self.streamed is not None:
            self.streamed.update_band(self.band, rows)

    def merge(self, other: SnapshotStore) -> None:
        if isinstance(other, SketchStore):
            self.sketch.merge(other.sketch)
            if self.streamed is not None and other.streamed is not None:
                self.streamed.merge(other.streamed)
        elif isinstance(other, ExactStore):
            for chunk in other.chunks:
                self.add(chunk.to(self.device))
        else:
            raise TypeError(f"cannot merge a {type(other).__name__} into a sketch store")

    def nbytes(self) -> int:
        return self.sketch.nbytes() + (self.streamed.nbytes() if self.streamed is not None else 0)

    def state_dict(self) -> dict[str, Any]:
        # flat keys, so that a caller moving the top-level tensors (e.g. to the CPU before a
        # gather) moves these too
        out: dict[str, Any] = {"snapshots": None, **{f"sketch_{k}": v for k, v in self.sketch.state_dict().items()}}
        if self.streamed is not None:
            out.update({f"coherency_{name}": getattr(self.streamed, name) for name in CoherencyAccumulator.SUMS})
            out["coherency_n"] = self.streamed.n
        return out

    def load_state_dict(self, state: dict[str, Any], n: int) -> None:
        saved = {k[len("sketch_"):]: v for k, v in state.items() if k.startswith("sketch_")}
        if int(saved["n_cols"]) != self.band.size or int(saved["n"]) != n:
            raise ValueError("corrupt PODAccumulator state: the sketch does not match its counts")
        self.sketch.load_state_dict(saved)
        if self.streamed is not None and "coherency_power" in state:
            for name in CoherencyAccumulator.SUMS:
                getattr(self.streamed, name).copy_(state[f"coherency_{name}"])
            self.streamed.n = int(state["coherency_n"])

    def pod(self, weights: Tensor, center: Tensor) -> Eigenpairs:
        cfg = self.config
        res = sketch_pod(self.sketch, weights, n_modes=cfg.n_modes, floor=cfg.eig_floor)
        return Eigenpairs(res.eigenvalues, res.modes, res.total_energy, res.error_bound, res.eigenvalues_lower)

    def coherency(self, scale: float, causal: bool) -> CoherencyAccumulator | None:
        return self.streamed  # at the fixed coherency_scale only

    def info(self, state_bytes: int) -> dict[str, Any]:
        sk = self.sketch
        return {"rank": sk.rank, "rows": sk.n_rows, "delta_total": sk.delta_total,
                "n_shrinks": sk.n_shrinks, "state_bytes": state_bytes}

    def notes(self, head: Any) -> list[str]:
        cfg, sk = self.config, self.sketch
        notes = []
        if cfg.sketch_rank is not None and sk.rank < cfg.sketch_rank:
            notes.append(f"sketch rank l = {sk.rank} instead of PODConfig.sketch_rank = {cfg.sketch_rank}: "
                         f"a field has only {self.band.size} stored entries, and a sketch of that many "
                         "rows is already lossless")
        notes.append(
            f"sketch mode (Frequent Directions, l = {sk.rank} rows, {sk.n_shrinks} shrinks): eigenvalues "
            "within error_bound of the exact POD, energies and scalograms exact"
            + ("" if head is None else
               f"; at the top scale error_bound = {head.error_bound:.3g}, resolved rank R = {head.resolved_rank}")
        )
        if head is not None:
            for e, beyond in head.beyond_resolved.items():
                if beyond:
                    lo = head.effective_rank_bounds[e][0]
                    notes.append(f"H*({e:g}) is more than the resolved rank R = {head.resolved_rank} "
                                 f"(guaranteed >= {lo})")
            if head.resolved_rank is not None and head.resolved_rank < cfg.k_fit:
                notes.append(f"T_spec fitted on the {min(head.resolved_rank, cfg.k_fit)} resolved eigenvalues "
                             f"(fewer than k_fit = {cfg.k_fit})")
        if cfg.coherency and self.streamed is None:
            notes.append("coherency not computed: in sketch mode it needs a fixed PODConfig.coherency_scale "
                         "(the snapshots are not kept until the dominant scale is known)")
        return notes
