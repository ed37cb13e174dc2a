"""Morlet CWT (against pywt and the formula), scalogram from lag moments, dominant scales."""

from __future__ import annotations

import math

import numpy as np
import pytest
import pywt
import torch

from podmonitor.engine.config import default_scales
from podmonitor.engine.lags import lag_moment, lag_signals
from podmonitor.engine.wavelets import (
    cwt,
    cwt_operators,
    dominant_scale_indices,
    morlet_psihat,
    scale_centroid,
    scalogram_from_moment,
)
from tests.conftest import literal_cwt, random_causal_fields

OMEGA0 = 5.0
# With psihat_a = sqrt(2 pi a) exp(-(2 pi f a - omega0)^2 / 2) a pure tone of period P has
# |W|^2 proportional to a exp(-(2 pi a / P - omega0)^2), maximal at a = c P / (2 pi) with
# c = (omega0 + sqrt(omega0^2 + 2)) / 2.
PEAK_C = (OMEGA0 + math.sqrt(OMEGA0**2 + 2)) / 2


def test_cwt_matches_formula():
    x = np.random.default_rng(0).normal(size=(3, 40))
    scales = np.array([2.0, 5.5, 13.0])
    got = cwt(torch.from_numpy(x), torch.from_numpy(scales), OMEGA0).numpy()
    np.testing.assert_allclose(got, literal_cwt(x, scales, OMEGA0), rtol=1e-12, atol=1e-12)


def test_psihat_is_analytic_and_peaks_at_centre_frequency():
    scales = torch.tensor([4.0, 16.0], dtype=torch.float64)
    psi = morlet_psihat(scales, 512, OMEGA0)
    f = torch.fft.fftfreq(512, dtype=torch.float64)
    assert float(psi[:, f <= 0].abs().max()) == 0.0
    for k, a in enumerate(scales.tolist()):
        f_peak = float(f[psi[k].argmax()])
        assert abs(f_peak - OMEGA0 / (2 * math.pi * a)) <= 1 / 512


@pytest.mark.parametrize("kind", ["sinusoid", "chirp"])
def test_cwt_agrees_with_pywt_cmor_up_to_a_constant(kind):
    n = 512
    t = np.arange(n, dtype=np.float64)
    if kind == "sinusoid":
        x = np.cos(2 * np.pi * t / 20.0)
    else:  # period falls from 40 to 10 tokens
        period = 40.0 * (10.0 / 40.0) ** (t / n)
        x = np.cos(2 * np.pi * np.cumsum(1.0 / period))
    scales = np.geomspace(4.0, 24.0, 9)
    ours = np.abs(cwt(torch.from_numpy(x), torch.from_numpy(scales), OMEGA0).numpy())  # (S, n)
    ref, _ = pywt.cwt(x, scales, "cmor2.0-0.7958", method="fft")
    ref = np.abs(ref)
    interior = slice(150, n - 150)  # away from the edges (different padding conventions)
    ratio = ours[:, interior] / ref[:, interior]
    # same wavelet up to one constant factor: the ratio is the same at every scale and time
    # wherever there is signal energy
    strong = ref[:, interior] > 0.2 * ref[:, interior].max()
    r = ratio[strong]
    assert r.std() / r.mean() < 0.01
    # and both put the energy at the same scale for each time
    arg_ours = ours[:, interior].argmax(0)
    arg_ref = ref[:, interior].argmax(0)
    assert np.mean(arg_ours == arg_ref) > 0.95


def test_sinusoid_peaks_at_known_scale_for_every_scale_of_default_grid():
    # MODULO's lesson: every scale of the filter bank must carry known energy in some test.
    scales = torch.tensor(default_scales(), dtype=torch.float64)
    n = 1024
    t = torch.arange(n, dtype=torch.float64)
    for k, a in enumerate(scales.tolist()):
        period = 2 * math.pi * a / PEAK_C
        x = torch.cos(2 * math.pi * t / period)
        energy = (cwt(x, scales, OMEGA0).abs() ** 2)[:, 200:-200].sum(-1)
        assert int(energy.argmax()) == k, f"scale {a:.2f} (period {period:.2f})"


def test_cwt_operators_apply_the_transform():
    scales = torch.tensor([2.0, 9.0, 30.0], dtype=torch.float64)
    x = torch.randn(4, 64, dtype=torch.float64)
    ops = cwt_operators(64, scales, OMEGA0)
    direct = cwt(x, scales, OMEGA0)
    via_ops = torch.einsum("stu,bu->bst", ops, x.to(ops.dtype))
    torch.testing.assert_close(via_ops, direct, rtol=1e-12, atol=1e-12)


def test_scalogram_from_moment_equals_mean_of_row_transforms():
    a = random_causal_fields(6, 48, seed=2)
    u = a - a.mean(0)
    d = lag_signals(u).numpy()
    scales = np.asarray(default_scales())[:14]
    # literal: one CWT per row per snapshot, then the mean of |W|^2
    w = literal_cwt(d.reshape(-1, 48), scales)  # (rows, S, L)
    expected = (np.abs(w) ** 2).mean(0)
    moment = lag_moment(lag_signals(u))
    got = scalogram_from_moment(moment, torch.from_numpy(scales), OMEGA0, n_rows=6 * 48).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("seq_len", [2, 3, 17, 64])
def test_scalogram_from_moment_equals_quadratic_form(seq_len):
    # S(a, t) = diag(K_a R K_a^H)[t] / n_rows with the literal (L, L) transform matrix K_a
    import podmonitor.engine.wavelets as wv

    moment = torch.randn(seq_len, seq_len, dtype=torch.float64)
    moment = moment @ moment.T
    scales = torch.tensor(default_scales()[:12], dtype=torch.float64)
    got = wv.scalogram_from_moment(moment, scales, OMEGA0, 3.0)
    k = wv.cwt_operators(seq_len, scales, OMEGA0)  # (S, L, L) complex
    expected = torch.einsum("stk,kl,stl->st", k, moment.to(k.dtype), k.conj()).real / 3.0
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12 * float(expected.abs().max()))


def test_dominant_scales_peaks_and_top():
    e = torch.tensor([1.0, 3.0, 2.0, 2.5, 5.0, 4.0, 1.0, 0.5, 0.7], dtype=torch.float64)
    assert dominant_scale_indices(e, 4, "peaks") == [4, 1, 8]  # local maxima by energy; the end 8 > 7
    assert dominant_scale_indices(e, 2, "peaks") == [4, 1]
    assert dominant_scale_indices(e, 3, "top") == [4, 5, 1]
    rising = torch.arange(1.0, 10.0, dtype=torch.float64)
    assert dominant_scale_indices(rising, 4, "peaks") == [8]  # monotone: only the largest scale
    assert dominant_scale_indices(rising.flip(0), 4, "peaks") == [0]
    assert dominant_scale_indices(torch.zeros(5, dtype=torch.float64), 4, "peaks") == []
    plateau = torch.tensor([1.0, 2.0, 2.0, 1.0], dtype=torch.float64)
    assert dominant_scale_indices(plateau, 4, "peaks") == [1]


def test_scale_centroid_of_single_scale_energy():
    scales = torch.tensor([2.0, 4.0, 8.0], dtype=torch.float64)
    assert abs(scale_centroid(torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64), scales) - 4.0) < 1e-12
    # equal energy at 2 and 8: geometric mean 4
    assert abs(scale_centroid(torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64), scales) - 4.0) < 1e-12
    assert math.isnan(scale_centroid(torch.zeros(3, dtype=torch.float64), scales))


def test_scalograms_from_kept_buffers_equal_those_from_fresh_ones():
    """scalogram_from_moment keeps its rotated buffers between calls (only the rotation's entries
    are written, the rest must stay zero): after other moments, of other lengths and dtypes too,
    a moment gives the bits it gives from freshly zeroed buffers, and the quadratic form's values."""
    import podmonitor.engine.wavelets as wv

    g = torch.Generator().manual_seed(3)
    scales = torch.tensor(default_scales()[:12], dtype=torch.float64)

    def moment(seq_len: int) -> torch.Tensor:
        x = torch.randn(3 * seq_len, seq_len, generator=g, dtype=torch.float64)
        return x.T @ x

    target = moment(40)
    wv.release_scalogram_buffers()
    fresh = wv.scalogram_from_moment(target, scales, OMEGA0, 5.0)
    for other in (moment(40), 1e6 * moment(40), moment(33), moment(40).float()):
        wv.scalogram_from_moment(other, scales.to(other.dtype), OMEGA0, 5.0)
        assert torch.equal(wv.scalogram_from_moment(target, scales, OMEGA0, 5.0), fresh)
    k = wv.cwt_operators(40, scales, OMEGA0)
    expected = torch.einsum("stk,kl,stl->st", k, target.to(k.dtype), k.conj()).real / 5.0
    torch.testing.assert_close(fresh, expected, rtol=1e-10, atol=1e-12 * float(expected.abs().max()))
