"""Lag signals, lag moments, lag-band layout and the cheap per-layer statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from podmonitor.engine.lags import (
    LagBand,
    lag_moment,
    lag_signals,
    lag_window,
    mean_attention_distance,
    row_entropy,
    window_support,
)
from tests.conftest import literal_lag_signals, random_causal_fields


def test_lag_signals_backward_matches_literal_definition(causal_fields):
    a = causal_fields[:3]
    got = lag_signals(a).numpy()
    np.testing.assert_array_equal(got, literal_lag_signals(a.numpy()))


def test_lag_signals_forward_matches_literal_definition():
    a = torch.randn(2, 9, 9, dtype=torch.float64)
    np.testing.assert_array_equal(lag_signals(a, forward=True).numpy(), literal_lag_signals(a.numpy(), forward=True))


def test_published_forward_reading_of_causal_field_is_an_impulse(causal_fields):
    # The published code reads A[i, i + tau]: on a causal field only tau = 0 survives, so every
    # lag signal is an impulse. The backward lag keeps the attention mass at tau > 0.
    fwd = lag_signals(causal_fields, forward=True)
    assert torch.count_nonzero(fwd[..., 1:]) == 0
    back = lag_signals(causal_fields)
    off_diag_mass = back[..., 1:].sum() / back.sum()
    assert off_diag_mass > 0.5


def test_lag_moment_equals_dense_second_moment(causal_fields):
    d = lag_signals(causal_fields)
    dense = np.einsum("sit,siu->tu", d.numpy(), d.numpy())
    for n_blocks in (1, 3, 8, 64):
        np.testing.assert_allclose(lag_moment(d, n_blocks=n_blocks).numpy(), dense, rtol=1e-12, atol=1e-14)


def test_lag_moment_forward_signals_with_reversed_rows():
    a = torch.randn(3, 11, 11, dtype=torch.float64)
    d = lag_signals(a, forward=True)
    dense = np.einsum("sit,siu->tu", d.numpy(), d.numpy())
    np.testing.assert_allclose(lag_moment(d.flip(1)).numpy(), dense, rtol=1e-12, atol=1e-14)


def _literal_band(seq_len: int, n_lags: int, causal: bool) -> dict[str, list[int]]:
    """The band layout written out entry by entry: lag 0, then for each lag the backward entries
    (i, i - tau) by ascending i, then the forward ones (i, i + tau); offsets[T] = entries with
    |lag| < T."""
    rows, cols, lags, offsets = [], [], [], [0]
    for tau in range(n_lags):
        for i in range(tau, seq_len):
            rows.append(i)
            cols.append(i - tau)
            lags.append(tau)
        if not causal and tau > 0:
            for i in range(seq_len - tau):
                rows.append(i)
                cols.append(i + tau)
                lags.append(-tau)
        offsets.append(len(rows))
    return {"rows": rows, "cols": cols, "lag": lags, "offsets": offsets,
            "flat_index": [r * seq_len + c for r, c in zip(rows, cols, strict=True)]}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("seq_len", "n_lags"), [(1, 1), (2, 1), (2, 2), (7, 3), (10, 10), (33, 12), (64, 64)])
def test_lag_band_build_equals_the_literal_layout(seq_len, n_lags, causal):
    band = LagBand.build(seq_len, n_lags, causal)
    ref = _literal_band(seq_len, n_lags, causal)
    assert band.n_lags == n_lags and band.seq_len == seq_len and band.causal is causal
    for name, values in ref.items():
        got = getattr(band, name)
        assert got.dtype == torch.int64, name
        assert got.tolist() == values, name


def test_lag_band_build_clamps_the_lags_and_is_shared():
    assert LagBand.build(5, 0, True).n_lags == 1
    assert LagBand.build(5, 99, False).n_lags == 5
    assert LagBand.build(12, 4, True) is LagBand.build(12, 4, True)  # built once per layout


def test_lag_band_layout_roundtrip_and_prefix():
    seq_len = 10
    for causal in (True, False):
        band = LagBand.build(seq_len, n_lags=4, causal=causal)
        expected_size = sum((seq_len - t) * (1 if causal or t == 0 else 2) for t in range(4))
        assert band.size == expected_size
        a = torch.randn(2, seq_len, seq_len, dtype=torch.float64)
        stored = band.extract(a)
        dense = band.to_dense(stored)
        i = torch.arange(seq_len)
        lag = i.unsqueeze(1) - i.unsqueeze(0)
        inside = (lag >= 0) & (lag < 4) if causal else lag.abs() < 4
        torch.testing.assert_close(dense[:, inside], a[:, inside], rtol=0, atol=0)
        assert torch.count_nonzero(dense[:, ~inside]) == 0
        # a prefix of the layout is exactly the entries of smaller lag
        for t in range(1, 5):
            width = band.prefix(t)
            assert int(band.lag[:width].abs().max()) == t - 1
            assert width == int(inside.logical_and(lag.abs() < t).sum())
        # entries agree with their recorded positions and lags
        torch.testing.assert_close(stored[0], a[0, band.rows, band.cols], rtol=0, atol=0)
        assert torch.equal(band.lag, band.rows - band.cols)


def test_band_gather_in_row_chunks_equals_the_literal_entries():
    # LagBand.gather_into splits each field's entries into row chunks (one thread per chunk); the
    # entries, in lag order, are the fields' entries at (i, i - tau) (and (i, i + tau)), whatever
    # the remainder of the split, the number of fields, or a widening destination dtype
    gen = torch.Generator().manual_seed(5)
    for seq_len, n_lags, causal, n in [(10, 4, True, 2), (200, 150, True, 1), (200, 90, False, 3), (333, 333, True, 2)]:
        band = LagBand.build(seq_len, n_lags=n_lags, causal=causal)
        a = torch.randn(n, seq_len, seq_len, dtype=torch.float32, generator=gen)
        literal = a[:, band.rows, band.cols]
        for dtype in (torch.float32, torch.float64):
            out = torch.full((n + 1, band.size), float("nan"), dtype=dtype)
            band.gather_into(a.reshape(n, -1), out[1:])
            assert torch.equal(out[1:], literal.to(dtype))
            assert torch.isnan(out[0]).all()  # (nothing written outside the destination rows)


def test_lag_window_kinds_and_support():
    tau = torch.arange(0, 200)
    low = lag_window(tau, 8.0, "lowpass")
    np.testing.assert_allclose(low.numpy(), np.exp(-(np.arange(200.0) ** 2) / (2 * 64.0)))
    band = lag_window(tau, 8.0, "band")
    np.testing.assert_allclose(band.numpy(), np.exp(-((np.arange(200.0) - 8) ** 2) / (2 * 16.0)))
    assert int(band.argmax()) == 8
    for kind in ("lowpass", "band"):
        support = window_support(8.0, kind, 1e-8)
        w = lag_window(tau, 8.0, kind)
        assert bool((w[tau > support] < 1e-8).all())
        assert float(w[int(support)]) >= 1e-8


def test_mean_attention_distance_matches_literal_sum():
    a = random_causal_fields(5, 12, seed=3)
    lit = np.mean([[sum(a[s, i, j].item() * abs(i - j) for j in range(12)) for i in range(12)] for s in range(5)])
    assert abs(mean_attention_distance(a.mean(0)) - lit) < 1e-12


def test_mean_attention_distance_of_analytic_fields():
    seq_len = 16
    eye = torch.eye(seq_len, dtype=torch.float64)
    assert mean_attention_distance(eye) == 0.0
    uniform = torch.ones(seq_len, seq_len, dtype=torch.float64).tril()
    uniform = uniform / uniform.sum(-1, keepdim=True)
    # row i of uniform causal attention has mean distance i / 2
    assert abs(mean_attention_distance(uniform) - np.mean(np.arange(seq_len) / 2)) < 1e-12


def test_row_entropy_uniform_is_one_and_one_hot_is_zero():
    seq_len = 8
    uniform = torch.ones(seq_len, seq_len, dtype=torch.float64).tril()
    uniform = (uniform / uniform.sum(-1, keepdim=True)).unsqueeze(0)
    sums, valid = row_entropy(uniform, causal=True)
    assert not bool(valid[0]) and bool(valid[1:].all())
    torch.testing.assert_close(sums[1:], torch.ones(seq_len - 1, dtype=torch.float64))
    one_hot = torch.eye(seq_len, dtype=torch.float64).unsqueeze(0)
    sums, _ = row_entropy(one_hot, causal=True)
    assert float(sums.abs().max()) == 0.0


def test_row_entropy_matches_literal_formula():
    a = random_causal_fields(3, 10, seed=4).numpy()
    sums, _ = row_entropy(torch.from_numpy(a), causal=True)
    for i in range(1, 10):
        lit = sum(-np.sum(a[s, i, : i + 1] * np.log(a[s, i, : i + 1])) / np.log(i + 1) for s in range(3))
        assert abs(float(sums[i]) - lit) < 1e-12


def test_lag_signals_of_causal_field_without_mask_pass(causal_fields):
    # the shortcut for fields with nothing above the diagonal gives the literal result
    got = lag_signals(causal_fields[:2], upper_is_zero=True).numpy()
    np.testing.assert_array_equal(got, literal_lag_signals(causal_fields[:2].numpy()))


def test_max_above_diagonal():
    from podmonitor.engine.lags import max_above_diagonal

    a = torch.zeros(2, 5, 5, dtype=torch.float64)
    a[:, 2, 1] = 3.0  # below: ignored
    assert max_above_diagonal(a) == 0.0
    a[1, 1, 3] = -0.5
    assert max_above_diagonal(a) == 0.5


def test_lag_shear_moments_equal_literal_second_moments():
    # backward and forward lag moments of (fields - reference) from the sheared workspace equal
    # the literal sums of outer products of lag signals, for any panel count and partial loads
    from podmonitor.engine.lags import LagShear

    gen = torch.Generator().manual_seed(3)
    for seq_len, batch, loaded, n_panels in [(1, 2, 1, 8), (7, 3, 3, 1), (10, 4, 3, 3), (33, 2, 2, 8), (20, 5, 5, 64)]:
        fields = torch.randn(loaded, seq_len, seq_len, dtype=torch.float64, generator=gen)
        ref = torch.randn(seq_len, seq_len, dtype=torch.float64, generator=gen)
        shear = LagShear(seq_len, batch, torch.float64, torch.device("cpu"), n_panels=n_panels)
        shear.load(torch.randn(batch, seq_len, seq_len, dtype=torch.float64, generator=gen))  # stale data
        shear.load(fields, ref)
        back = torch.zeros(seq_len, seq_len, dtype=torch.float64)
        fwd = torch.zeros(seq_len, seq_len, dtype=torch.float64)
        shear.add_backward_moment(back)
        shear.add_forward_moment(fwd)
        u = (fields - ref).numpy()
        lit_back = literal_lag_signals(u)
        lit_fwd = literal_lag_signals(u, forward=True)
        np.testing.assert_allclose(shear.finish(back, backward=True).numpy(),
                                   np.einsum("sit,siu->tu", lit_back, lit_back), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(shear.finish(fwd, backward=False).numpy(),
                                   np.einsum("sit,siu->tu", lit_fwd, lit_fwd), rtol=1e-12, atol=1e-12)


def test_lag_shear_finish_equals_the_panel_mask_selection_bit_for_bit():
    # finish mirrors panel by panel in place; the reference is the selection it replaced: entries
    # whose row-lag panel is at most the column-lag panel from the transpose, a literal mask
    from podmonitor.engine.lags import LagShear, _panel_edges

    gen = torch.Generator().manual_seed(11)
    for seq_len, n_panels, dtype in [(1, 8, torch.float64), (20, 64, torch.float64), (37, 8, torch.float32),
                                     (64, 3, torch.float64)]:
        shear = LagShear(seq_len, 1, dtype, torch.device("cpu"), n_panels=n_panels)
        partial = torch.randn(seq_len, seq_len, dtype=dtype, generator=gen)
        before = partial.clone()
        inner = torch.tensor(_panel_edges(seq_len, shear.n_panels)[1:-1])
        panel = torch.bucketize(torch.arange(seq_len), inner, right=True)
        mask = panel.unsqueeze(1) <= panel.unsqueeze(0)
        for backward in (True, False):
            moment = partial.flip(0, 1) if backward else partial
            out = shear.finish(partial, backward=backward)
            assert torch.equal(out, torch.where(mask, moment.T, moment))
            assert torch.equal(partial, before)  # the accumulated partial is left as it was


def test_row_entropy_with_work_buffer_matches_literal_formula():
    a = random_causal_fields(4, 12, seed=5)
    a[:, :, :] += 0.01 * torch.rand(4, 12, 12, generator=torch.Generator().manual_seed(6)).triu(1)  # some mass above
    x = a.numpy()
    work = torch.full((40 * 12 * 12,), float("nan"), dtype=torch.float64)  # larger than needed, dirty
    for causal in (True, False):
        got, valid = row_entropy(a, causal, work=work)
        for i in range(1 if causal else 0, 12):
            keys = i + 1 if causal else 12
            row = x[:, i, :]  # the formula sums over every key of the row (zeros contribute 0)
            lit = sum(-np.sum(r[r > 0] * np.log(r[r > 0])) for r in row) / np.log(keys)
            assert abs(float(got[i]) - lit) < 1e-12
        assert bool(valid[0]) is (not causal)
        if causal:  # one key: no entropy to normalise
            assert float(got[0]) == 0.0


def test_max_above_diagonal_propagates_nan_and_reads_strided_fields():
    from podmonitor.engine.lags import max_above_diagonal

    a = torch.zeros(3, 6, 6, dtype=torch.float64)
    a[2, 0, 4] = 0.25
    a[0, 1, 3] = float("nan")
    assert math.isnan(max_above_diagonal(a))  # a NaN must not hide mass above the diagonal
    b = torch.zeros(3, 6, 12, dtype=torch.float64)
    b[2, 0, 8] = -0.75  # column 4 of the strided view
    assert max_above_diagonal(b[:, :, ::2]) == 0.75


def test_long_fields_are_read_in_row_blocks_with_the_same_results():
    # from L = BLOCKS_FROM on, the causality check and the causal entropy read row blocks of views
    from podmonitor.engine.lags import BLOCKS_FROM, max_above_diagonal

    seq_len = BLOCKS_FROM + 40
    a = random_causal_fields(2, seq_len, seed=8)
    assert max_above_diagonal(a) == 0.0
    b = a.clone()
    b[0, 3, 5] = -0.25  # inside a diagonal square of the blocks
    b[1, 10, seq_len - 1] = 0.5  # in the rectangle right of a square
    assert max_above_diagonal(b) == 0.5
    b[1, 10, seq_len - 1] = 0.0
    assert max_above_diagonal(b) == 0.25
    wide = torch.zeros(2, seq_len, 2 * seq_len, dtype=torch.float64)
    wide[:, :, ::2] = b  # strided input
    assert max_above_diagonal(wide[:, :, ::2]) == 0.25
    b[1, 400, 401] = float("nan")
    assert math.isnan(max_above_diagonal(b))
    # entropy over the row blocks equals the literal formula, with a reused work buffer
    x = a.numpy()
    work = torch.zeros(2 * seq_len * seq_len, dtype=torch.float64)
    for _ in range(2):
        got, _ = row_entropy(a, True, work=work, upper_is_zero=True)
        for i in (1, 2, 100, BLOCKS_FROM - 1, seq_len - 1):
            row = x[:, i, : i + 1]
            lit = sum(-np.sum(r * np.log(r)) for r in row) / np.log(i + 1)
            assert abs(float(got[i]) - lit) < 1e-11
        torch.testing.assert_close(got, row_entropy(a, True)[0], rtol=0, atol=0)
