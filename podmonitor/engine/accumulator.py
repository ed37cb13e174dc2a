"""Incremental scale-selective POD of one layer: :class:`PODAccumulator`.

torchmetrics-style ``update`` / ``compute`` / ``reset``, plus ``merge`` (for snapshots gathered on
several processes) and ``state_dict`` / ``load_state_dict`` (for checkpoints).

State, for a field of length L and N snapshots kept so far:

* the mean field (L, L) and the centred lag second moments (L, L) (backward, plus forward for
  bidirectional fields), updated by Chan et al.'s pairwise formula: the scalograms need nothing
  else, so they are exact at any N with O(L^2) state;
* the snapshots themselves in lag-band form (N x P, P <= L (L + 1) / 2 for causal fields): exact
  POD by the method of snapshots needs them, because the dominant scales, the mean and
  therefore the fluctuations are only known at the end;
* the sum of row entropies (L,).

The cost of ``update`` depends on the batch only (a lag gather, one blocked L x L moment
product per snapshot and a copy), not on how many snapshots were seen before.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .coherency import CoherencyAccumulator
from .config import PODConfig
from .lags import (
    LagBand,
    lag_moment,
    lag_signals,
    lag_window,
    max_above_diagonal,
    mean_attention_distance,
    row_entropy,
    window_support,
)
from .pod import fix_signs, mode_lag_profiles, snapshot_pod
from .report import PODReport, ScaleReport
from .spectrum import effective_rank, spectral_fit
from .wavelets import dominant_scale_indices, scale_centroid, scalogram_from_moment

STATE_VERSION = 1

#: Size of one sub-batch of fields processed at a time by ``update`` (bytes).
UPDATE_BYTES = 32 * 2**20


class MemoryBudgetError(RuntimeError):
    """An update would make the accumulator's state exceed ``PODConfig.memory_budget_bytes``."""


def _as_tensor(fields: Any) -> Tensor:
    if isinstance(fields, np.ndarray):
        return torch.from_numpy(fields)
    if isinstance(fields, Tensor):
        return fields.detach()
    raise TypeError(f"fields must be a torch.Tensor or numpy.ndarray, got {type(fields).__name__}")


def band_lags(config: PODConfig, seq_len: int) -> int:
    """How many lags the accumulator stores for length L: the support of the widest window."""
    scales = config.scales_for(seq_len)
    if not scales:
        return seq_len
    support = window_support(max(scales), config.window, config.window_tol)
    return seq_len if math.isinf(support) else min(seq_len, int(math.floor(support)) + 1)


def estimate_memory(seq_len: int, n_snapshots: int, config: PODConfig | None = None,
                    causal: bool = True) -> dict[str, int]:
    """Bytes the accumulator needs for one layer.

    Args:
        seq_len: L.
        n_snapshots: N.
        config: the engine configuration.
        causal: causal (one triangle) or bidirectional (both) fields.

    Returns:
        dict with "state" (kept between updates: snapshots in lag-band form plus moments),
        "compute_extra" (transient during ``compute``: Gram, one windowed block, modes,
        coherency sums) and "total".
    """
    config = config or PODConfig()
    itemsize = torch.empty((), dtype=config.dtype).element_size()
    s_itemsize = torch.empty((), dtype=config.resolved_storage_dtype).element_size()
    band = band_lags(config, seq_len)
    p = sum((seq_len - t) * (1 if causal or t == 0 else 2) for t in range(band))
    moments = (2 if causal else 3) * seq_len * seq_len * itemsize
    state = n_snapshots * p * s_itemsize + moments + seq_len * itemsize
    from .pod import BLOCK_BYTES

    block = min(n_snapshots * p * itemsize, BLOCK_BYTES)
    gram = 2 * n_snapshots * n_snapshots * itemsize  # Gram + eigenvectors
    modes = config.n_modes * (p + (seq_len * seq_len if config.keep_mode_fields else 0)) * itemsize
    coh = 3 * seq_len * seq_len * itemsize * 2 if config.coherency else 0
    extra = 2 * block + gram + modes + coh
    return {"state": int(state), "compute_extra": int(extra), "total": int(state + extra)}


class PODAccumulator:
    """Incremental scale-selective POD of one layer's attention ensemble.

    Feed it batches of fields with :meth:`update` as they arrive; :meth:`compute` returns the
    same :class:`PODReport` as :func:`podmonitor.analyze` on the concatenated ensemble.

    Args:
        config: engine settings (default :class:`PODConfig`).
        device: where the state lives; None = the device of the first batch.

    Example:
        >>> acc = PODAccumulator(PODConfig())
        >>> for batch in batches:          # each (B, L, L)
        ...     acc.update(batch)
        >>> report = acc.compute()
        >>> report.dominant_scales, report.t_spec
    """

    def __init__(self, config: PODConfig | None = None, *, device: torch.device | str | None = None) -> None:
        self.config = config or PODConfig()
        self._device = torch.device(device) if device is not None else None
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget every snapshot."""
        self.seq_len: int | None = None
        self.causal: bool | None = self.config.causal
        self.n = 0
        self.n_skipped_nonfinite = 0
        self.input_dtypes: set[str] = set()
        self.n_negative = 0
        self.mean_field: Tensor | None = None  # (L, L)
        self.m2_back: Tensor | None = None  # (L, L) centred backward lag moment
        self.m2_fwd: Tensor | None = None  # (L, L) centred forward lag moment (bidirectional)
        self.entropy_sum: Tensor | None = None  # (L,)
        self.band: LagBand | None = None
        self.chunks: list[Tensor] = []

    @property
    def device(self) -> torch.device:
        return self._device if self._device is not None else torch.device("cpu")

    def nbytes(self) -> int:
        """Bytes held by the state now."""
        tensors = [self.mean_field, self.m2_back, self.m2_fwd, self.entropy_sum, *self.chunks]
        return int(sum(t.numel() * t.element_size() for t in tensors if t is not None))

    def _init_state(self, seq_len: int, causal: bool, device: torch.device) -> None:
        dt = self.config.dtype
        self.seq_len = seq_len
        self.causal = causal
        self._device = device
        self.mean_field = torch.zeros(seq_len, seq_len, dtype=dt, device=device)
        self.m2_back = torch.zeros(seq_len, seq_len, dtype=dt, device=device)
        self.m2_fwd = None if causal else torch.zeros(seq_len, seq_len, dtype=dt, device=device)
        self.entropy_sum = torch.zeros(seq_len, dtype=dt, device=device)
        self.band = LagBand.build(seq_len, band_lags(self.config, seq_len), causal)

    # ----------------------------------------------------------------- update
    def _validate(self, fields: Any) -> Tensor:
        x = _as_tensor(fields)
        if x.is_complex() or not (x.is_floating_point() or x.dtype in (torch.int32, torch.int64)):
            raise TypeError(f"attention fields must be real floating point, got dtype {x.dtype}")
        if x.ndim == 2:
            x = x.unsqueeze(0)
        if x.ndim != 3:
            raise ValueError(
                f"expected fields of shape (N, L, L) (or one (L, L) field), got shape {tuple(x.shape)}"
            )
        if x.shape[1] != x.shape[2]:
            raise ValueError(f"attention fields must be square (L, L); got {x.shape[1]} x {x.shape[2]}")
        if self.seq_len is not None and x.shape[1] != self.seq_len:
            raise ValueError(
                f"field length changed: this accumulator holds L = {self.seq_len}, got L = {x.shape[1]}"
            )
        return x

    def update(self, fields: Tensor | np.ndarray) -> int:
        """Add a batch of snapshots.

        Args:
            fields: (B, L, L) or (L, L) attention fields of one layer (rows are queries), any real
                dtype (float16/bfloat16 are upcast to ``config.dtype``), torch or numpy.

        Returns:
            The number of snapshots taken (non-finite ones are skipped and counted in
            ``n_skipped_nonfinite``).

        Raises:
            ValueError: wrong shape, a length different from earlier batches, or mass above
                the diagonal of a field declared (or inferred) causal.
            TypeError: non-real input.
            MemoryBudgetError: the state would exceed ``config.memory_budget_bytes`` (nothing is
                added then).
        """
        x = self._validate(fields)
        self.input_dtypes.add(str(x.dtype).replace("torch.", ""))
        # A sum is finite iff every entry is (barring overflow, which the exact check catches).
        finite = torch.isfinite(x.sum(dim=(1, 2)))
        if not bool(finite.all()):
            finite = torch.isfinite(x).flatten(1).all(dim=1)
        n_bad = int((~finite).sum())
        if n_bad:
            x = x[finite]
        if x.shape[0] == 0:
            self.n_skipped_nonfinite += n_bad
            return 0
        seq_len = x.shape[1]
        device = self._device if self._device is not None else x.device
        x = x.to(device=device, dtype=self.config.dtype)
        upper = max_above_diagonal(x)
        causal = self.causal
        if causal is None:
            causal = upper == 0
        elif causal and upper > 0:
            raise ValueError(
                f"field has mass above the diagonal (max {upper:.3g}) but is treated as causal"
                + (" (inferred from the first batch)" if self.config.causal is None else "")
                + ": pass PODConfig(causal=False) for bidirectional attention"
            )
        if self.seq_len is None:
            self._init_state(seq_len, causal, device)
        assert self.band is not None and self.mean_field is not None and self.m2_back is not None
        s_dtype = self.config.resolved_storage_dtype
        budget = self.config.memory_budget_bytes
        if budget is not None:
            need = self.nbytes() + x.shape[0] * self.band.size * torch.empty((), dtype=s_dtype).element_size()
            if need > budget:
                raise MemoryBudgetError(
                    f"storing {x.shape[0]} more snapshots (L = {seq_len}, {self.band.size} lag-band "
                    f"entries each) would bring this accumulator to {need / 2**20:.1f} MiB, over its "
                    f"budget of {budget / 2**20:.1f} MiB (PODConfig.memory_budget_bytes); "
                    f"{self.n} snapshots are kept"
                )
        self.n_skipped_nonfinite += n_bad
        any_negative = bool(x.amin() < 0)  # one reduction; count per snapshot only when needed
        if any_negative:
            self.n_negative += int((x < 0).flatten(1).any(dim=1).sum())

        # Work through the batch in sub-batches of bounded size, so that the temporaries of an
        # update stay small whatever the batch size (the result does not depend on the split).
        n_b = x.shape[0]
        sub = max(1, UPDATE_BYTES // (x.element_size() * seq_len * seq_len))
        for start in range(0, n_b, sub):
            part = x[start:start + sub]
            # Chan et al. pairwise update of the mean field and the centred lag moments.
            mean_p = part.mean(0)  # (L, L)
            dev = part - mean_p
            m2p_back = lag_moment(lag_signals(dev, upper_is_zero=causal))
            m2p_fwd = None if causal else lag_moment(lag_signals(dev, forward=True).flip(1))
            del dev
            self._combine(part.shape[0], mean_p, m2p_back, m2p_fwd)
            h_sum, _ = row_entropy(part, causal, has_negative=any_negative)
            self.entropy_sum += h_sum
            self.chunks.append(self.band.extract(part).to(s_dtype))
        return n_b

    def _combine(self, n_b: int, mean_b: Tensor, m2b_back: Tensor, m2b_fwd: Tensor | None) -> None:
        """Merge a group of n_b snapshots (mean, centred moments) into the running state."""
        assert self.mean_field is not None and self.m2_back is not None
        n_a = self.n
        n = n_a + n_b
        delta = mean_b - self.mean_field  # (L, L)
        w = n_a * n_b / n
        self.m2_back += m2b_back
        if n_a > 0:  # the between-group term vanishes for the first group
            self.m2_back += w * lag_moment(lag_signals(delta).unsqueeze(0))
        if self.m2_fwd is not None:
            assert m2b_fwd is not None
            self.m2_fwd += m2b_fwd
            if n_a > 0:
                self.m2_fwd += w * lag_moment(lag_signals(delta, forward=True).flip(0).unsqueeze(0))
        self.mean_field += delta * (n_b / n)
        self.n = n

    # ------------------------------------------------------------------ merge
    def merge(self, other: PODAccumulator) -> PODAccumulator:
        """Absorb another accumulator's snapshots (e.g. from another process); returns self.

        The result equals one accumulator fed self's snapshots, then other's.
        """
        if other.seq_len is None:
            self.n_skipped_nonfinite += other.n_skipped_nonfinite
            return self
        if self.config != other.config:
            raise ValueError("cannot merge accumulators with different PODConfig")
        if self.seq_len is None:
            self.load_state_dict(other.state_dict())
            return self
        if other.seq_len != self.seq_len:
            raise ValueError(f"cannot merge accumulators of L = {self.seq_len} and L = {other.seq_len}")
        if other.causal != self.causal:
            raise ValueError("cannot merge a causal accumulator with a bidirectional one")
        assert other.mean_field is not None and other.m2_back is not None and other.entropy_sum is not None
        dev = self.device
        self._combine(other.n, other.mean_field.to(dev), other.m2_back.to(dev),
                      None if other.m2_fwd is None else other.m2_fwd.to(dev))
        assert self.entropy_sum is not None
        self.entropy_sum += other.entropy_sum.to(dev)
        self.chunks.extend(c.to(dev) for c in other.chunks)
        self.n_skipped_nonfinite += other.n_skipped_nonfinite
        self.n_negative += other.n_negative
        self.input_dtypes |= other.input_dtypes
        return self

    # ------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """Picklable state (tensors on their device; the snapshots as one (N, P) tensor)."""
        return {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "seq_len": self.seq_len,
            "causal": self.causal,
            "n": self.n,
            "n_skipped_nonfinite": self.n_skipped_nonfinite,
            "n_negative": self.n_negative,
            "input_dtypes": sorted(self.input_dtypes),
            "mean_field": self.mean_field,
            "m2_back": self.m2_back,
            "m2_fwd": self.m2_fwd,
            "entropy_sum": self.entropy_sum,
            "snapshots": torch.cat(self.chunks) if len(self.chunks) > 1 else (self.chunks[0] if self.chunks else None),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (the configuration must match)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported PODAccumulator state version {state.get('version')}")
        saved = PODConfig.from_dict(state["config"])
        if saved != self.config:
            raise ValueError("the saved state was made with a different PODConfig")
        self.reset()
        if state["seq_len"] is None:
            self.n_skipped_nonfinite = int(state["n_skipped_nonfinite"])
            return
        dev = self._device or state["mean_field"].device
        self._init_state(int(state["seq_len"]), bool(state["causal"]), torch.device(dev))
        self.n = int(state["n"])
        self.n_skipped_nonfinite = int(state["n_skipped_nonfinite"])
        self.n_negative = int(state.get("n_negative", 0))
        self.input_dtypes = set(state.get("input_dtypes", []))
        self.mean_field = state["mean_field"].to(self.device, self.config.dtype).clone()
        self.m2_back = state["m2_back"].to(self.device, self.config.dtype).clone()
        self.m2_fwd = None if state["m2_fwd"] is None else state["m2_fwd"].to(self.device, self.config.dtype).clone()
        self.entropy_sum = state["entropy_sum"].to(self.device, self.config.dtype).clone()
        snaps = state["snapshots"]
        self.chunks = [] if snaps is None else [snaps.to(self.device).clone()]
        assert self.band is not None
        if snaps is not None and (snaps.shape[0] != self.n or snaps.shape[1] != self.band.size):
            raise ValueError("corrupt PODAccumulator state: snapshot store does not match its counts")

    # ---------------------------------------------------------------- compute
    def compute(self) -> PODReport:
        """Analyse every snapshot seen so far (METHOD.md sections 1 to 6)."""
        t0 = time.perf_counter()
        cfg = self.config
        messages: list[str] = []
        if self.n_skipped_nonfinite:
            messages.append(f"{self.n_skipped_nonfinite} snapshot(s) with NaN/Inf entries were skipped")
        if self.n_negative:
            messages.append(
                f"{self.n_negative} snapshot(s) have negative entries: not probabilities "
                "(the entropy ignores negative entries)"
            )
        if self.seq_len is None:
            return self._empty_report(messages)
        assert self.mean_field is not None and self.m2_back is not None and self.band is not None
        assert self.entropy_sum is not None and self.causal is not None
        seq_len, n, causal, dt, dev = self.seq_len, self.n, self.causal, cfg.dtype, self.device

        scales_list = cfg.scales_for(seq_len)
        scales = torch.tensor(scales_list, dtype=dt, device=dev)
        n_rows = float(n * seq_len)
        # Fluctuation scalogram from the centred lag moments; mean-field scalogram from Abar.
        scalogram = scalogram_from_moment(self.m2_back, scales, cfg.omega0, n_rows)
        d_mean = lag_signals(self.mean_field)
        mean_scalogram = scalogram_from_moment(d_mean.T @ d_mean, scales, cfg.omega0, float(seq_len))
        if self.m2_fwd is not None:
            scalogram += scalogram_from_moment(self.m2_fwd, scales, cfg.omega0, n_rows)
            d_mean_f = lag_signals(self.mean_field, forward=True)
            mean_scalogram += scalogram_from_moment(d_mean_f.T @ d_mean_f, scales, cfg.omega0, float(seq_len))
        energy = scalogram.sum(-1)
        mean_energy = mean_scalogram.sum(-1)

        valid_rows = (torch.arange(1, seq_len + 1, device=dev) >= 2) if causal else torch.full(
            (seq_len,), seq_len >= 2, device=dev)
        entropy_profile = torch.where(valid_rows, self.entropy_sum / n, torch.full_like(self.entropy_sum, math.nan))
        entropy = float(entropy_profile[valid_rows].mean()) if bool(valid_rows.any()) else math.nan

        status = "ok"
        dominant_idx: list[int] = []
        if not scales_list:
            status = "no_scales"
            messages.append(
                f"L = {seq_len} supports no scale of the grid (smallest {cfg.scales[0]:g} needs "
                f"L >= {cfg.scales[0] / cfg.max_scale_fraction:g})"
            )
        elif n < cfg.min_snapshots:
            status = "too_few_snapshots"
            messages.append(f"{n} snapshot(s): the POD needs at least {cfg.min_snapshots}")
        elif not float(energy.sum()) > self._rounding_floor(mean_energy):
            status = "zero_variance"
            messages.append("all snapshots are identical: the fluctuation field is zero")
        else:
            dominant_idx = dominant_scale_indices(energy, cfg.n_dominant, cfg.dominant_method)

        per_scale: list[ScaleReport] = []
        if status == "ok":
            center = self._band_mean()
            for k in dominant_idx:
                per_scale.append(self._analyse_scale(scales_list[k], center))
            if per_scale and per_scale[0].status != "ok":
                status = per_scale[0].status
                messages.append(f"top dominant scale: {per_scale[0].status}")

        coherency, coh_scale = None, None
        if cfg.coherency and n > 0 and (cfg.coherency_scale is not None or dominant_idx):
            coh_scale = cfg.coherency_scale if cfg.coherency_scale is not None else scales_list[dominant_idx[0]]
            coherency = self._coherency(coh_scale)
            if self.causal and bool(torch.isnan(coherency).any()):
                messages.append(
                    f"coherency: positions more than {self._coherency_reach} tokens right of a query "
                    "(where the wavelet no longer reaches any of its keys) are NaN"
                )
            if self.band.n_lags < seq_len:
                messages.append(
                    f"coherency computed over the stored lag band |i - j| < {self.band.n_lags}; "
                    "entries beyond it are NaN"
                )
        return PODReport(
            status=status,
            n_snapshots=n,
            n_skipped_nonfinite=self.n_skipped_nonfinite,
            seq_len=seq_len,
            causal=causal,
            scales=scales.cpu(),
            scalogram=scalogram.cpu(),
            mean_scalogram=mean_scalogram.cpu(),
            scale_energy=energy.cpu(),
            mean_scale_energy=mean_energy.cpu(),
            dominant_scales=[scales_list[k] for k in dominant_idx],
            scale_centroid=scale_centroid(energy, scales) if status not in ("no_scales", "zero_variance") else math.nan,
            per_scale=per_scale,
            mean_attention_distance=mean_attention_distance(self.mean_field),
            entropy=entropy,
            entropy_profile=entropy_profile.cpu(),
            coherency=None if coherency is None else coherency.cpu(),
            coherency_scale=coh_scale,
            mean_field=self.mean_field.cpu().clone(),
            config=cfg.to_dict(),
            messages=messages,
            analysis_seconds=time.perf_counter() - t0,
        )

    def _rounding_floor(self, mean_energy: Tensor) -> float:
        """Fluctuation energy indistinguishable from rounding of the mean (relative (100 eps)^2)."""
        eps = torch.finfo(self.config.dtype).eps
        return float(mean_energy.sum()) * (100 * eps) ** 2

    def _band_mean(self) -> Tensor:
        """(P,) the mean field in lag-band layout."""
        assert self.band is not None and self.mean_field is not None
        return self.band.extract(self.mean_field.unsqueeze(0))[0]

    def _analyse_scale(self, scale: float, center: Tensor) -> ScaleReport:
        cfg = self.config
        assert self.band is not None and self.causal is not None and self.seq_len is not None
        support = window_support(scale, cfg.window, cfg.window_tol)
        n_lags = self.band.n_lags if math.isinf(support) else min(self.band.n_lags, int(math.floor(support)) + 1)
        width = self.band.prefix(n_lags)
        lags = self.band.lag[:width].to(self.device)
        weights = lag_window(lags, scale, cfg.window).to(cfg.dtype)
        res = snapshot_pod(self.chunks, center=center, weights=weights, n_modes=cfg.n_modes,
                           floor=cfg.eig_floor, dtype=cfg.dtype)
        lam = res.eigenvalues
        total = float(lam.sum())
        fit = spectral_fit(lam, cfg.k_fit, cfg.eig_floor)
        er = effective_rank(lam, cfg.eps, cfg.eig_floor)
        axis, profiles = mode_lag_profiles(res.modes, lags, self.causal)
        signs = fix_signs(profiles)
        profiles = profiles * signs.unsqueeze(1)
        modes = res.modes * signs.unsqueeze(1)
        coefficients = res.coefficients * signs.unsqueeze(0)
        fields = self.band.to_dense(modes) if cfg.keep_mode_fields else None
        return ScaleReport(
            scale=scale,
            window=cfg.window,
            n_lags=n_lags,
            eigenvalues=lam.cpu(),
            energy_fractions=(lam / total).cpu() if total > 0 else torch.zeros_like(lam).cpu(),
            total_energy=total,
            t_spec=fit.t_spec,
            beta=fit.beta,
            r2=fit.r2,
            n_fit=fit.n_points,
            status=fit.status if total > 0 else "zero_variance",
            effective_rank=er.ranks,
            saturated=er.saturated,
            n_nonzero=er.n_nonzero,
            lags=axis.cpu(),
            mode_lag_profiles=profiles.cpu(),
            modes=None if fields is None else fields.cpu(),
            coefficients=coefficients.cpu(),
        )

    def _coherency(self, scale: float) -> Tensor:
        assert self.band is not None and self.seq_len is not None
        acc = CoherencyAccumulator(self.seq_len, scale, self.config.omega0, self.config.dtype, self.device,
                                   causal=bool(self.causal))
        sub = max(1, UPDATE_BYTES // (4 * 8 * self.seq_len * self.seq_len))  # fields + 3 transforms
        for chunk in self.chunks:
            for start in range(0, chunk.shape[0], sub):
                acc.update(self.band.to_dense(chunk[start:start + sub].to(self.config.dtype)))
        gamma = acc.compute()
        self._coherency_reach = acc.reach if self.causal else None
        if self.band.n_lags < self.seq_len:
            pos = torch.arange(self.seq_len, device=gamma.device)
            far = (pos.unsqueeze(1) - pos.unsqueeze(0)).abs() >= self.band.n_lags
            gamma = gamma.masked_fill(far, math.nan)
        return gamma

    def _empty_report(self, messages: list[str]) -> PODReport:
        messages = messages + ["no finite snapshot was given"]
        empty = torch.zeros(0)
        return PODReport(
            status="empty", n_snapshots=0, n_skipped_nonfinite=self.n_skipped_nonfinite, seq_len=0,
            causal=bool(self.causal) if self.causal is not None else True, scales=empty,
            scalogram=torch.zeros(0, 0), mean_scalogram=torch.zeros(0, 0), scale_energy=empty,
            mean_scale_energy=empty, dominant_scales=[], scale_centroid=math.nan, per_scale=[],
            mean_attention_distance=math.nan, entropy=math.nan, entropy_profile=empty,
            coherency=None, coherency_scale=None, mean_field=torch.zeros(0, 0),
            config=self.config.to_dict(), messages=messages,
        )
