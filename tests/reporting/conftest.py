"""Reports shared by the reporting tests: real ones with planted scales, and flagged ones."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from podmonitor import PODReport, analyze
from podmonitor.synthetic import layered_ensemble


@pytest.fixture(scope="session")
def real_reports() -> list[PODReport]:
    """Four layers whose planted scale grows with depth (layered_ensemble)."""
    return [analyze(f) for f in layered_ensemble(4, 40, 64)]


def _corrupt(report: PODReport) -> dict[str, PODReport]:
    """Hand-made broken reports: NaN arrays, zero-size arrays, degenerate spectra."""
    head = report.per_scale[0]
    nan = float("nan")
    g = torch.Generator().manual_seed(0)
    holes = torch.rand(report.scalogram.shape, generator=g, dtype=torch.float64) < 0.2
    nan_head = dataclasses.replace(
        head, eigenvalues=torch.full_like(head.eigenvalues, nan),
        energy_fractions=torch.full_like(head.eigenvalues, nan), t_spec=nan, beta=nan, r2=nan,
        status="degenerate", mode_lag_profiles=torch.full_like(head.mode_lag_profiles, nan))
    empty_head = dataclasses.replace(
        head, eigenvalues=torch.zeros(0, dtype=torch.float64), energy_fractions=torch.zeros(0, dtype=torch.float64),
        lags=torch.zeros(0), mode_lag_profiles=torch.zeros(0, 0), n_fit=0, status="degenerate",
        t_spec=nan, beta=nan, r2=nan, effective_rank={0.1: None, 0.05: None, 0.01: None},
        saturated={0.1: False, 0.05: False, 0.01: False})
    degenerate_head = dataclasses.replace(
        head, eigenvalues=torch.tensor([1.0, 0.5, 0.0, 0.0], dtype=torch.float64), n_fit=2, status="degenerate",
        t_spec=nan, beta=nan, r2=nan)
    flat_head = dataclasses.replace(
        head, eigenvalues=torch.ones(10, dtype=torch.float64), beta=0.0, t_spec=math.inf, r2=nan, status="flat")
    return {
        "nan_arrays": dataclasses.replace(
            report, scalogram=torch.full_like(report.scalogram, nan),
            scale_energy=torch.full_like(report.scale_energy, nan), scale_centroid=nan,
            coherency=torch.full_like(report.coherency, nan), per_scale=[nan_head],
            mean_attention_distance=nan, entropy=nan),
        "partly_nan": dataclasses.replace(
            report, scalogram=torch.where(holes, nan, report.scalogram)),
        "zero_size": dataclasses.replace(
            report, scales=torch.zeros(0), scalogram=torch.zeros(0, 0), mean_scalogram=torch.zeros(0, 0),
            scale_energy=torch.zeros(0), mean_scale_energy=torch.zeros(0), coherency=torch.zeros(0, 0),
            per_scale=[empty_head], dominant_scales=[]),
        "degenerate_spectrum": dataclasses.replace(report, per_scale=[degenerate_head, flat_head]),
        "ok_without_modes": dataclasses.replace(report, per_scale=[], dominant_scales=[]),
    }


@pytest.fixture(scope="session")
def flagged_reports(real_reports) -> dict[str, PODReport]:
    """Reports the engine flags, plus corrupted copies of a real one."""
    mean_field = torch.ones(16, 16, dtype=torch.float64).tril()
    mean_field = mean_field / mean_field.sum(-1, keepdim=True)
    out = {
        "too_few_snapshots": analyze(torch.rand(2, 8, 8, generator=torch.Generator().manual_seed(0)).tril()),
        "zero_variance": analyze(mean_field.expand(10, 16, 16).clone()),
        "no_scales": analyze(torch.rand(10, 3, 3, generator=torch.Generator().manual_seed(0)).tril()),
    }
    assert {k: r.status for k, r in out.items()} == {k: k for k in out}
    out.update(_corrupt(real_reports[0]))
    return out
