"""The analysis of one layer: from the running state and the snapshot store to a :class:`PODReport`.

METHOD.md sections 1 to 6: scalograms from the lag moments (exact at any N), dominant scales,
the POD at each dominant scale (from the store: exact or bounded), T_spec and H*(eps) (from
:mod:`podmonitor.engine.spectrum`), entropy, attention distance and the coherency map.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .lags import lag_signals, lag_window, mean_attention_distance, window_support
from .pod import fix_signs, mode_lag_profiles
from .report import PODReport, ScaleReport
from .running import RESULTS
from .spectrum import summarise_spectrum
from .store import SnapshotStore
from .wavelets import dominant_scale_indices, scale_centroid, scalogram_from_moment

if TYPE_CHECKING:
    from .accumulator import PODAccumulator


def input_messages(acc: PODAccumulator) -> list[str]:
    """What was wrong with the input: skipped, negative or not normalised snapshots."""
    messages = []
    if acc.n_skipped_nonfinite:
        messages.append(f"{acc.n_skipped_nonfinite} snapshot(s) with NaN/Inf entries were skipped")
    if acc.n_negative:
        messages.append(
            f"{acc.n_negative} snapshot(s) have negative entries: not probabilities "
            "(the entropy ignores negative entries)"
        )
    if acc.n_not_normalised:
        keys = "j <= i" if acc.causal or acc.causal is None else "all j"
        messages.append(
            f"{acc.n_not_normalised} of {acc.n} snapshot(s) have rows that do not sum to 1 over their keys "
            f"({keys}; largest |row sum - 1| = {acc.max_row_sum_error:.3g}): not attention probabilities "
            "(raw scores, or heads summed instead of averaged?); the entropy and attention distance are "
            "not meaningful, the POD is of the fields as given"
        )
    return messages


def analyse(acc: PODAccumulator) -> PODReport:
    """Analyse every snapshot an accumulator has seen (its running state and its store).

    Args:
        acc: the accumulator (read only).

    Returns:
        :class:`PODReport`; data problems give a flagged report, never an exception.
    """
    t0 = time.perf_counter()
    cfg = acc.config
    messages = input_messages(acc)
    if acc.seq_len is None:
        return empty_report(acc, messages)
    store = acc.store
    assert acc.mean_field is not None and acc.m2_back is not None and acc.band is not None
    assert acc.entropy_sum is not None and acc.causal is not None and store is not None
    seq_len, n, causal, dt, dev = acc.seq_len, acc.n, acc.causal, cfg.dtype, acc.device

    scales_list = cfg.scales_for(seq_len)
    scales = torch.tensor(scales_list, dtype=dt, device=dev)
    n_rows = float(n * seq_len)
    # Fluctuation scalogram from the centred lag moments; mean-field scalogram from Abar.
    scalogram = scalogram_from_moment(acc.m2_back, scales, cfg.omega0, n_rows)
    d_mean = lag_signals(acc.mean_field)
    mean_scalogram = scalogram_from_moment(d_mean.T @ d_mean, scales, cfg.omega0, float(seq_len))
    if acc.m2_fwd is not None:
        scalogram += scalogram_from_moment(acc.m2_fwd, scales, cfg.omega0, n_rows)
        d_mean_f = lag_signals(acc.mean_field, forward=True)
        mean_scalogram += scalogram_from_moment(d_mean_f.T @ d_mean_f, scales, cfg.omega0, float(seq_len))
    energy = scalogram.sum(-1)
    mean_energy = mean_scalogram.sum(-1)

    valid_rows = (torch.arange(1, seq_len + 1, device=dev) >= 2) if causal else torch.full(
        (seq_len,), seq_len >= 2, device=dev)
    entropy_profile = torch.where(valid_rows, acc.entropy_sum / n, torch.full_like(acc.entropy_sum, math.nan))
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
    elif not float(energy.sum()) > _rounding_floor(mean_energy, dt):
        status = "zero_variance"
        messages.append("all snapshots are identical: the fluctuation field is zero")
    else:
        dominant_idx = dominant_scale_indices(energy, cfg.n_dominant, cfg.dominant_method)

    per_scale: list[ScaleReport] = []
    if status == "ok":
        center = acc.band.extract(acc.mean_field.unsqueeze(0))[0]  # (P,) the mean in band layout
        for k in dominant_idx:
            per_scale.append(analyse_scale(acc, store, scales_list[k], center))
        if per_scale and per_scale[0].status != "ok":
            status = per_scale[0].status
            messages.append(f"top dominant scale: {per_scale[0].status}")
    if status == "ok" and acc.n_not_normalised:
        status = "not_normalised"
    messages += store.notes(per_scale[0] if per_scale else None)

    coherency, coh_scale = None, None
    if cfg.coherency and n > 0 and (cfg.coherency_scale is not None or dominant_idx):
        coh_scale = cfg.coherency_scale if cfg.coherency_scale is not None else scales_list[dominant_idx[0]]
        sums = store.coherency(coh_scale, causal)
        if sums is None:
            coh_scale = None
        else:
            coherency = sums.compute()
            if acc.band.n_lags < seq_len:
                pos = torch.arange(seq_len, device=coherency.device)
                far = (pos.unsqueeze(1) - pos.unsqueeze(0)).abs() >= acc.band.n_lags
                coherency = coherency.masked_fill(far, math.nan)
            if causal and bool(torch.isnan(coherency).any()):
                messages.append(
                    f"coherency: positions more than {sums.reach} tokens right of a query "
                    "(where the wavelet no longer reaches any of its keys) are NaN"
                )
            if acc.band.n_lags < seq_len:
                messages.append(
                    f"coherency computed over the stored lag band |i - j| < {acc.band.n_lags}; "
                    "entries beyond it are NaN"
                )
    return PODReport(
        status=status,
        n_snapshots=n,
        n_skipped_nonfinite=acc.n_skipped_nonfinite,
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
        mean_attention_distance=mean_attention_distance(acc.mean_field),
        entropy=entropy,
        entropy_profile=entropy_profile.cpu(),
        running={r.result_key: float(r.result(getattr(acc, r.name), n)) for r in RESULTS},
        coherency=None if coherency is None else coherency.cpu(),
        coherency_scale=coh_scale,
        mean_field=acc.mean_field.cpu().clone(),
        config=cfg.to_dict(),
        messages=messages,
        analysis_seconds=time.perf_counter() - t0,
        mode=store.mode,
        sketch=store.info(acc.nbytes()),
        n_not_normalised=acc.n_not_normalised,
        max_row_sum_error=acc.max_row_sum_error,
    )


def _rounding_floor(mean_energy: Tensor, dtype: torch.dtype) -> float:
    """Fluctuation energy indistinguishable from rounding of the mean (relative (100 eps)^2)."""
    eps = torch.finfo(dtype).eps
    return float(mean_energy.sum()) * (100 * eps) ** 2


def analyse_scale(acc: PODAccumulator, store: SnapshotStore, scale: float, center: Tensor) -> ScaleReport:
    """The POD at one dominant scale: eigenpairs from the store, fit and ranks, signed modes.

    Args:
        acc: the accumulator (its layout and settings).
        store: its snapshot store.
        scale: the dominant scale a*.
        center: (P,) the exact mean field in band layout.
    """
    cfg = acc.config
    assert acc.band is not None and acc.causal is not None
    support = window_support(scale, cfg.window, cfg.window_tol)
    n_lags = acc.band.n_lags if math.isinf(support) else min(acc.band.n_lags, int(math.floor(support)) + 1)
    width = acc.band.prefix(n_lags)
    lags = acc.band.lag[:width].to(acc.device)
    weights = lag_window(lags, scale, cfg.window).to(cfg.dtype)
    eig = store.pod(weights, center)
    lam, total = eig.eigenvalues, eig.total_energy
    spec = summarise_spectrum(lam, lower=eig.eigenvalues_lower, error_bound=eig.error_bound, total=total,
                              k_fit=cfg.k_fit, floor=cfg.eig_floor, eps=cfg.eps,
                              resolve_factor=cfg.sketch_resolve_factor)
    # mode lag profiles with the sign convention: the largest-magnitude entry of each is positive
    axis, profiles = mode_lag_profiles(eig.modes, lags, acc.causal)
    signs = fix_signs(profiles)
    fields = acc.band.to_dense(eig.modes * signs.unsqueeze(1)) if cfg.keep_mode_fields else None
    fit = spec.fit
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
        lags=axis.cpu(),
        mode_lag_profiles=(profiles * signs.unsqueeze(1)).cpu(),
        modes=None if fields is None else fields.cpu(),
        effective_rank=spec.effective_rank,
        saturated=spec.saturated,
        n_nonzero=spec.n_nonzero,
        coefficients=None if eig.coefficients is None else (eig.coefficients * signs.unsqueeze(0)).cpu(),
        mode=store.mode,
        error_bound=eig.error_bound,
        eigenvalues_lower=None if eig.eigenvalues_lower is None else eig.eigenvalues_lower.cpu(),
        resolved_rank=spec.resolved_rank,
        effective_rank_bounds=spec.effective_rank_bounds,
        beyond_resolved=spec.beyond_resolved,
    )


def empty_report(acc: PODAccumulator, messages: list[str]) -> PODReport:
    """The report of an accumulator that holds no snapshot."""
    messages = messages + ["no finite snapshot was given"]
    empty = torch.zeros(0)
    return PODReport(
        status="empty", n_snapshots=0, n_skipped_nonfinite=acc.n_skipped_nonfinite, seq_len=0,
        causal=bool(acc.causal) if acc.causal is not None else True, scales=empty,
        scalogram=torch.zeros(0, 0), mean_scalogram=torch.zeros(0, 0), scale_energy=empty,
        mean_scale_energy=empty, dominant_scales=[], scale_centroid=math.nan, per_scale=[],
        mean_attention_distance=math.nan, entropy=math.nan, entropy_profile=empty,
        coherency=None, coherency_scale=None, mean_field=torch.zeros(0, 0),
        config=acc.config.to_dict(), messages=messages,
    )


def analyse_at_scale(acc: PODAccumulator, scale: float) -> ScaleReport | None:
    """The POD of everything ``acc`` has seen at one given lag scale (any scale, not only a dominant one).

    Used for a fixed reference scale per layer, so that a trend over training compares values
    measured at the same scale even when the dominant scales move.

    Args:
        acc: the accumulator (read only).
        scale: the lag scale a, in tokens (> 0).

    Returns:
        The :class:`ScaleReport` at ``scale``, or None when the accumulator holds fewer than
        ``min_snapshots`` snapshots.
    """
    if acc.seq_len is None or acc.store is None or acc.n < acc.config.min_snapshots:
        return None
    assert acc.band is not None and acc.mean_field is not None
    center = acc.band.extract(acc.mean_field.unsqueeze(0))[0]  # (P,) the mean in band layout
    return analyse_scale(acc, acc.store, float(scale), center)
