"""Configuration of the scale-selective POD engine (METHOD.md sections 2 to 6)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

DominantMethod = Literal["peaks", "top"]
WindowKind = Literal["lowpass", "band"]
PODMode = Literal["auto", "exact", "sketch"]


def default_scales() -> tuple[float, ...]:
    """The default scale grid: 20 log-spaced scales 2^linspace(1, 6, 20), 2 to 64 tokens."""
    return tuple(float(2.0**e) for e in torch.linspace(1.0, 6.0, 20, dtype=torch.float64).tolist())


@dataclass(frozen=True)
class PODConfig:
    """Settings of :func:`podmonitor.analyze` and :class:`podmonitor.PODAccumulator`.

    Args:
        scales: Morlet scales a (in tokens). Default: 2^linspace(1, 6, 20). Scales above
            ``max_scale_fraction * L`` are dropped for a field of length L.
        omega0: Morlet centre frequency (METHOD.md: 5).
        max_scale_fraction: keep scales a <= this fraction of L (0.5: the wavelet's Fourier
            period 2 pi a / omega0 ~ 1.26 a then spans at most ~0.63 L).
        n_dominant: M, how many dominant scales to analyse (default 4).
        dominant_method: "peaks" (local maxima of E(a) ranked by energy, default) or "top"
            (the M scales of largest energy, the published choice).
        window: lag window at a dominant scale a*: "lowpass" (exp(-tau^2 / 2 a*^2), the
            published choice) or "band" (exp(-(tau - a*)^2 / (2 (a*/2)^2))).
        window_tol: lags where the window is below this value are treated as zero weight
            (their squared weight is below window_tol**2 = 1e-16, under float64 rounding of
            the Gram matrix). It sets how many lags the accumulator stores (the lag band).
        k_fit: K_fit, how many leading eigenvalues the power-law fit of T_spec may use.
        eig_floor: relative floor; eigenvalues <= eig_floor * lambda_1 count as zero.
        eps: the tolerances of the effective rank H*(eps).
        n_modes: how many POD modes (and mode lag profiles) to keep per scale.
        keep_mode_fields: keep the full (L, L) mode fields in the report (memory: n_modes L^2
            per scale); the lag profiles are always kept.
        coherency: compute the cross-coherency map (METHOD.md section 6).
        coherency_scale: scale of the coherency map; None = the top dominant scale.
        causal: True for causal (decoder) fields, False for bidirectional ones, None to infer it
            from the first batch (causal when nothing lies above the diagonal).
        dtype: accumulation and analysis dtype (float64 default; float32 halves memory and
            time at ~1e-6 relative accuracy).
        storage_dtype: dtype of the stored snapshots (None: ``dtype``, except that float32,
            float16 and bfloat16 fields are stored as given, which is exact; see
            :func:`podmonitor.engine.store.stored_dtype`).
        moment_dtype: dtype of the lag-moment products, the heaviest part of an update (each
            step's product is then added to the running moment in ``dtype``). None (default): float32
            for fields that arrive in float32 or a lower precision (what a capture hands over:
            their own rounding is already of float32's order), else ``dtype``; the moments then
            differ from exact ones by at most ``(2 u + K u / (1 - K u))`` times the moment of the
            absolute centred signals, u = 2**-24, K the rows of one step (tested), and the products
            take about half the time (an update at L = 1024 about 12 % less). ``torch.float64``
            keeps every product exact to float64 whatever the input (as with float64 fields).
        memory_budget_bytes: bytes one layer's accumulator may use for its state plus the
            eigenproblem that ``compute`` will build from it (the N x N Gram matrix, or the D x D
            covariance when a filtered field has D < N entries, and the sketch's Gram matrices);
            None = no limit. ``estimate_memory(...)["budgeted"]`` is what it is compared with.
            In "exact" mode an update that would exceed it is refused with
            :class:`MemoryBudgetError` (the first update included: the accumulator stays as it
            was); in "auto" mode the accumulator switches to the sketch instead (see ``mode``).
            Compute's other temporaries do not grow with N and are bounded (one block of at most
            64 MiB, the modes, the coherency map): ``estimate_memory(...)["compute_extra"]``.
        mode: "exact" keeps every snapshot (exact POD, memory grows with N); "sketch" keeps a
            Frequent Directions sketch of ``sketch_rank`` rows from the first snapshot (memory
            bounded, eigenvalues within a reported error bound); "auto" (default) is exact while
            the snapshots fit in ``memory_budget_bytes`` (always, when there is no budget) and
            turns the stored snapshots into a sketch when they would not, provided the budget
            holds a sketch of at least ``2 * k_fit`` rows (else it refuses, like "exact").
            The scalograms, mean field, entropy and attention distance are exact in every mode.
        sketch_rank: l, the rows the sketch keeps (it holds up to 2 l); None = the largest that
            fits in ``memory_budget_bytes`` (half of what the budget leaves after the O(L^2)
            state, in auto mode; all of it in sketch mode), or ``4 * k_fit`` without a budget.
            Never more than P, the entries a field stores: a sketch of P rows is lossless.
        sketch_resolve_factor: an eigenvalue estimate counts as resolved when it is at least this
            many times the sketch's error bound (so its relative error is at most the inverse);
            T_spec is fitted on resolved eigenvalues only and H*(eps) beyond the resolved rank is
            reported as "more than R".
        min_snapshots: below this many finite snapshots the POD is not run (status
            "too_few_snapshots"); at least 3.
    """

    scales: tuple[float, ...] = field(default_factory=default_scales)
    omega0: float = 5.0
    max_scale_fraction: float = 0.5
    n_dominant: int = 4
    dominant_method: DominantMethod = "peaks"
    window: WindowKind = "lowpass"
    window_tol: float = 1e-8
    k_fit: int = 30
    eig_floor: float = 1e-12
    eps: tuple[float, ...] = (0.10, 0.05, 0.01)
    n_modes: int = 8
    keep_mode_fields: bool = True
    coherency: bool = True
    coherency_scale: float | None = None
    causal: bool | None = None
    dtype: torch.dtype = torch.float64
    storage_dtype: torch.dtype | None = None
    moment_dtype: torch.dtype | None = None
    memory_budget_bytes: int | None = None
    min_snapshots: int = 3
    mode: PODMode = "auto"
    sketch_rank: int | None = None
    sketch_resolve_factor: float = 10.0

    def __post_init__(self) -> None:
        scales = tuple(float(a) for a in self.scales)
        object.__setattr__(self, "scales", scales)
        object.__setattr__(self, "eps", tuple(float(e) for e in self.eps))
        if len(scales) == 0:
            raise ValueError("PODConfig.scales must not be empty")
        if any(not math.isfinite(a) or a <= 0 for a in scales):
            raise ValueError(f"PODConfig.scales must be finite and positive, got {scales}")
        if any(b <= a for a, b in zip(scales, scales[1:], strict=False)):
            raise ValueError("PODConfig.scales must be strictly increasing")
        if not self.omega0 > 0:
            raise ValueError(f"omega0 must be positive, got {self.omega0}")
        if not 0 < self.max_scale_fraction <= 1:
            raise ValueError(f"max_scale_fraction must lie in (0, 1], got {self.max_scale_fraction}")
        if self.n_dominant < 1:
            raise ValueError(f"n_dominant must be >= 1, got {self.n_dominant}")
        if self.dominant_method not in ("peaks", "top"):
            raise ValueError(f"dominant_method must be 'peaks' or 'top', got {self.dominant_method!r}")
        if self.window not in ("lowpass", "band"):
            raise ValueError(f"window must be 'lowpass' or 'band', got {self.window!r}")
        if not 0 <= self.window_tol < 1:
            raise ValueError(f"window_tol must lie in [0, 1), got {self.window_tol}")
        if self.k_fit < 3:
            raise ValueError(f"k_fit must be >= 3 (a line through fewer points is no fit), got {self.k_fit}")
        if not 0 <= self.eig_floor < 1:
            raise ValueError(f"eig_floor must lie in [0, 1), got {self.eig_floor}")
        if len(self.eps) == 0 or any(not 0 < e < 1 for e in self.eps):
            raise ValueError(f"eps values must lie in (0, 1), got {self.eps}")
        if self.n_modes < 0:
            raise ValueError(f"n_modes must be >= 0, got {self.n_modes}")
        if self.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {self.dtype}")
        if self.storage_dtype not in (None, torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise ValueError(f"unsupported storage_dtype {self.storage_dtype}")
        if self.moment_dtype not in (None, torch.float32, torch.float64):
            raise ValueError(f"moment_dtype must be None, torch.float32 or torch.float64, got {self.moment_dtype}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be positive, got {self.memory_budget_bytes}")
        if self.min_snapshots < 3:
            raise ValueError(f"min_snapshots must be >= 3, got {self.min_snapshots}")
        if self.mode not in ("auto", "exact", "sketch"):
            raise ValueError(f"mode must be 'auto', 'exact' or 'sketch', got {self.mode!r}")
        if self.sketch_rank is not None and self.sketch_rank < 1:
            raise ValueError(f"sketch_rank must be >= 1, got {self.sketch_rank}")
        if not self.sketch_resolve_factor >= 1:
            raise ValueError(f"sketch_resolve_factor must be >= 1, got {self.sketch_resolve_factor}")
        if self.coherency_scale is not None and not self.coherency_scale > 0:
            raise ValueError(f"coherency_scale must be positive, got {self.coherency_scale}")

    @property
    def resolved_storage_dtype(self) -> torch.dtype:
        return self.storage_dtype if self.storage_dtype is not None else self.dtype

    def moment_dtype_for(self, input_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the lag-moment products for fields given in ``input_dtype`` (see ``moment_dtype``)."""
        if self.moment_dtype is not None:
            return self.moment_dtype
        if input_dtype in (torch.float32, torch.float16, torch.bfloat16):
            return torch.float32
        return self.dtype

    def scales_for(self, seq_len: int) -> tuple[float, ...]:
        """The scales of the grid that a field of length ``seq_len`` supports."""
        limit = self.max_scale_fraction * seq_len
        return tuple(a for a in self.scales if a <= limit)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (dtypes as strings)."""
        out = asdict(self)
        out["dtype"] = str(self.dtype).replace("torch.", "")
        out["storage_dtype"] = None if self.storage_dtype is None else str(self.storage_dtype).replace("torch.", "")
        out["moment_dtype"] = None if self.moment_dtype is None else str(self.moment_dtype).replace("torch.", "")
        out["scales"] = list(self.scales)
        out["eps"] = list(self.eps)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PODConfig:
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        d["dtype"] = getattr(torch, d.get("dtype", "float64"))
        sd = d.get("storage_dtype")
        d["storage_dtype"] = None if sd is None else getattr(torch, sd)
        md = d.get("moment_dtype")
        d["moment_dtype"] = None if md is None else getattr(torch, md)
        d["scales"] = tuple(d["scales"])
        d["eps"] = tuple(d["eps"])
        return cls(**d)
