"""Ground truth: planted structure is found, prescribed spectra come back, both field kinds work."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from podmonitor import PODConfig, analyze
from podmonitor.engine.lags import lag_window
from podmonitor.synthetic import Oscillation, oscillation_ensemble, prescribed_spectrum_ensemble
from tests.conftest import literal_cwt, random_causal_fields

OMEGA0 = 5.0
PEAK_C = (OMEGA0 + math.sqrt(OMEGA0**2 + 2)) / 2  # a* = PEAK_C * P / (2 pi) for a tone of period P


def nearest_grid_scale(grid: list[float], a: float) -> float:
    return min(grid, key=lambda s: abs(math.log(s / a)))


@pytest.mark.parametrize(("periods", "lags"), [((6.0, 26.0), (10.0, 60.0)), ((9.0, 40.0), (20.0, 80.0))])
def test_planted_oscillations_are_the_dominant_scales(periods, lags):
    seq_len = 160
    patterns = [
        Oscillation(period=p, lag=lag, width=2 * p, amplitude=0.02) for p, lag in zip(periods, lags, strict=True)
    ]
    fields = oscillation_ensemble(60, seq_len, patterns, seed=1)
    report = analyze(fields, PODConfig(coherency=False))
    # the planted cosines move the row sums off 1 (these fields are not probabilities): the
    # analysis is complete and says so
    assert report.status == "not_normalised" and report.n_not_normalised == 60
    grid = report.scales.tolist()
    expected = {nearest_grid_scale(grid, PEAK_C * p / (2 * math.pi)) for p in periods}
    assert set(report.dominant_scales[:2]) == expected
    # each planted pattern sits at its lag: the scalogram row of its scale peaks where its
    # energy density, (rows reaching lag tau = L - tau) x envelope^2, peaks
    tau = np.arange(seq_len)
    for p, lag in zip(periods, lags, strict=True):
        a = nearest_grid_scale(grid, PEAK_C * p / (2 * math.pi))
        row = report.scalogram[grid.index(a)]
        density = (seq_len - tau) * np.exp(-((tau - lag) ** 2) / (2 * p) ** 2)
        assert abs(int(row.argmax()) - int(density.argmax())) <= p / 2


def test_planted_pattern_is_the_first_mode_and_its_lag_profile():
    # one pattern whose amplitude changes from snapshot to snapshot (shared by all rows): the
    # filtered fluctuation has rank one and its mode is the planted pattern times the window
    period, lag, width = 10.0, 12.0, 8.0
    fields = oscillation_ensemble(30, 96, [Oscillation(period, lag, width, 0.05, per_row=False)], seed=3)
    report = analyze(fields, PODConfig(coherency=False))
    for sc in report.per_scale:
        assert float(sc.energy_fractions[0]) > 1 - 1e-10
        tau = sc.lags.double()
        planted = torch.cos(2 * math.pi * tau / period) * torch.exp(-((tau - lag) ** 2) / (2 * width**2))
        planted = planted * lag_window(tau, sc.scale, "lowpass")
        prof = sc.mode_lag_profiles[0]
        corr = float((prof * planted).sum() / (prof.norm() * planted.norm()))
        assert abs(corr) > 0.999


def test_dominant_scales_match_literal_row_by_row_scalogram():
    # independent route to the scale energy: one CWT per row of the literal fluctuation lag signals
    fields = oscillation_ensemble(20, 96, [Oscillation(12.0, 30.0, 20.0, 0.05)], seed=2)
    report = analyze(fields, PODConfig(coherency=False))
    a = fields.numpy()
    u = a - a.mean(0)
    n, seq_len, _ = u.shape
    d = np.zeros_like(u)
    for i in range(seq_len):
        for tau in range(i + 1):
            d[:, i, tau] = u[:, i, i - tau]
    scales = report.scales.numpy()
    w = literal_cwt(d.reshape(-1, seq_len), scales)
    s_lit = (np.abs(w) ** 2).mean(0)
    np.testing.assert_allclose(report.scalogram.numpy(), s_lit, rtol=1e-9, atol=1e-18)
    mean_rows = np.zeros((seq_len, seq_len))
    am = a.mean(0)
    for i in range(seq_len):
        for tau in range(i + 1):
            mean_rows[i, tau] = am[i, i - tau]
    m_lit = (np.abs(literal_cwt(mean_rows, scales)) ** 2).mean(0)
    np.testing.assert_allclose(report.mean_scalogram.numpy(), m_lit, rtol=1e-9, atol=1e-18)


@pytest.mark.parametrize("beta", [0.8, 1.5])
def test_prescribed_power_law_spectrum_gives_back_beta(beta):
    n_modes = 40
    lam = 3e-3 * torch.arange(1, n_modes + 1, dtype=torch.float64) ** -beta
    scale = 8.0
    tau = torch.arange(12, dtype=torch.float64)
    window = lag_window(tau, scale, "lowpass")
    fields = prescribed_spectrum_ensemble(120, 64, lam, n_lags=12, window=window, seed=3)
    report = analyze(fields, PODConfig(scales=(scale,), coherency=False, k_fit=30))
    sc = report.per_scale[0]
    assert sc.scale == scale
    np.testing.assert_allclose(sc.eigenvalues[:n_modes].numpy(), lam.numpy(), rtol=1e-9)
    assert float(sc.eigenvalues[n_modes:].max()) < 1e-12 * float(lam[0])
    assert abs(sc.beta - beta) / beta < 0.02
    assert abs(report.t_spec - 1 / beta) * beta < 0.02


def test_prescribed_spectrum_with_noise_still_within_two_percent():
    beta = 1.2
    lam = 1e-2 * torch.arange(1, 41, dtype=torch.float64) ** -beta
    tau = torch.arange(12, dtype=torch.float64)
    fields = prescribed_spectrum_ensemble(200, 64, lam, n_lags=12, window=lag_window(tau, 8.0, "lowpass"), seed=4)
    g = torch.Generator().manual_seed(0)
    noise = 1e-6 * torch.randn(fields.shape, generator=g, dtype=torch.float64).tril()
    report = analyze(fields + noise, PODConfig(scales=(8.0,), coherency=False))
    assert abs(report.beta - beta) / beta < 0.02


def test_lag_filtered_causal_field_is_not_its_diagonal():
    # The published bug (forward lag on a causal field) reduces every filtered field to its
    # diagonal. With the backward lag the modes live off the diagonal where the attention is.
    fields = oscillation_ensemble(40, 64, [Oscillation(8.0, 15.0, 10.0, 0.05)], seed=5)
    report = analyze(fields, PODConfig(coherency=False))
    for sc in report.per_scale:
        modes = sc.modes
        diag = torch.diagonal(modes, dim1=-2, dim2=-1)
        off_energy = 1.0 - float((diag**2).sum() / (modes**2).sum())
        assert off_energy > 0.5, sc.scale
        assert float(torch.triu(modes, diagonal=1).abs().max()) == 0.0  # nothing above it


def test_bidirectional_field_uses_both_sides():
    base = oscillation_ensemble(30, 48, [Oscillation(8.0, 12.0, 8.0, 0.05)], seed=6)
    backward_only = base
    forward_only = base.flip(-1, -2).contiguous()  # row L-1-i looks ahead as row i looked back
    cfg = PODConfig(causal=False, coherency=False)
    rb = analyze(backward_only, cfg)
    rf = analyze(forward_only, cfg)
    # mirror images have the same scale content, and both halves are seen
    torch.testing.assert_close(rb.scalogram, rf.scalogram, rtol=1e-10, atol=1e-15)
    assert rb.dominant_scales == rf.dominant_scales
    torch.testing.assert_close(rb.per_scale[0].eigenvalues, rf.per_scale[0].eigenvalues, rtol=1e-9, atol=1e-15)
    modes_f = rf.per_scale[0].modes
    assert float(torch.triu(modes_f, 1).pow(2).sum() / modes_f.pow(2).sum()) > 0.5
    assert float(torch.tril(modes_f, -1).abs().max()) == 0.0
    # two-sided: energies add
    both = base + base.transpose(-1, -2) - torch.diag_embed(torch.diagonal(base, dim1=-2, dim2=-1))
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(30, generator=g)
    both = base + forward_only[perm] - torch.diag_embed(torch.diagonal(forward_only[perm], dim1=-2, dim2=-1))
    r2 = analyze(both, cfg)
    assert float(r2.scale_energy.sum()) > 1.5 * float(rb.scale_energy.sum())
    # inferred as bidirectional from the data
    assert analyze(both, PODConfig(coherency=False)).causal is False
    assert analyze(backward_only, PODConfig(coherency=False)).causal is True


def test_coherency_matches_literal_definition():
    fields = random_causal_fields(12, 64, seed=8)
    a = 4.0
    report = analyze(fields, PODConfig(coherency_scale=a))
    x = fields.numpy()
    n, seq_len, _ = x.shape
    w = literal_cwt(x.reshape(-1, seq_len), np.array([a]))[:, 0, :].reshape(n, seq_len, seq_len)  # (s, i, j)
    wd = np.stack([w[:, i, i] for i in range(seq_len)], axis=1)  # (s, i)
    cross = np.mean(wd[:, :, None] * np.conj(w), axis=0)
    gamma = np.abs(cross) / np.sqrt(np.mean(np.abs(wd) ** 2, 0)[:, None] * np.mean(np.abs(w) ** 2, 0))
    got = report.coherency.numpy()
    # positions the wavelet no longer reaches from a causal row's keys are NaN, nothing else is
    i, j = np.meshgrid(np.arange(seq_len), np.arange(seq_len), indexing="ij")
    kernel = np.abs(np.fft.ifft(np.where(np.fft.fftfreq(2 * seq_len) > 0, np.sqrt(2 * np.pi * a)
                                         * np.exp(-((2 * np.pi * np.fft.fftfreq(2 * seq_len) * a - 5) ** 2) / 2), 0)))
    reach = int(np.nonzero(kernel[:seq_len] >= 1e-8 * kernel.max())[0].max())
    beyond = j > i + reach
    assert np.array_equal(np.isnan(got), beyond)
    np.testing.assert_allclose(got[~beyond], gamma[~beyond], atol=1e-9)
    assert report.coherency_scale == a
    assert float(report.coherency.max()) <= 1.0 and float(report.coherency.min()) >= 0.0


def test_report_to_dict_is_strict_json():
    report = analyze(random_causal_fields(10, 32, seed=9))
    text = json.dumps(report.to_dict(include_fields=True), allow_nan=False)
    back = json.loads(text)
    assert back["status"] == "ok"
    assert back["dominant_scales"] == report.dominant_scales
    assert len(back["per_scale"]) == len(report.per_scale)
    assert set(back["per_scale"][0]["effective_rank"]) == {"0.1", "0.05", "0.01"}


def test_top_method_picks_highest_energy_scales():
    fields = oscillation_ensemble(30, 96, [Oscillation(10.0, 30.0, 20.0, 0.03)], seed=10)
    report = analyze(fields, PODConfig(dominant_method="top", n_dominant=3, coherency=False))
    order = torch.argsort(report.scale_energy, descending=True)[:3]
    assert report.dominant_scales == [report.scales[k].item() for k in order]
    assert len(report.per_scale) == 3


def test_mean_field_scalogram_of_positive_mass_grows_with_scale():
    # METHOD.md's reason for analysing fluctuations: the raw field's positive mass puts the
    # largest energy at the largest scales.
    fields = random_causal_fields(10, 128, seed=11)
    report = analyze(fields, PODConfig(coherency=False))
    e = report.mean_scale_energy
    assert int(e.argmax()) == len(e) - 1


def test_coherency_fft_path_equals_matrix_path(monkeypatch):
    import podmonitor.engine.coherency as coh

    fields = random_causal_fields(6, 40, seed=12)
    ref = analyze(fields, PODConfig(coherency_scale=6.0)).coherency
    monkeypatch.setattr(coh, "FFT_ABOVE", 8)
    fft = analyze(fields, PODConfig(coherency_scale=6.0)).coherency
    kept = ~torch.isnan(ref)  # the matrix path leaves out positions beyond the wavelet's reach
    torch.testing.assert_close(fft[kept], ref[kept], rtol=1e-9, atol=1e-12)
    assert not bool(torch.isnan(fft).any())


def test_a_dominant_scales_pod_is_what_analyse_at_scale_gives_there():
    """PODMonitor takes a layer's reference-scale values from its report when the reference scale
    is one of the run's dominant scales: that must be what ``analyse_at_scale`` computes there."""
    import dataclasses

    from podmonitor.engine.accumulator import PODAccumulator
    from podmonitor.engine.analysis import analyse_at_scale
    from podmonitor.synthetic import layered_ensemble

    acc = PODAccumulator(PODConfig(coherency=False))
    fields = layered_ensemble(2, 40, 96)[1]
    acc.update(fields[:25])
    acc.update(fields[25:])
    report = acc.compute()
    assert len(report.per_scale) >= 2
    for own in report.per_scale:
        again = analyse_at_scale(acc, own.scale)
        for f in dataclasses.fields(own):
            a, b = getattr(own, f.name), getattr(again, f.name)
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), f.name
            elif isinstance(a, float) and math.isnan(a):
                assert math.isnan(b), f.name
            else:
                assert a == b, f.name
