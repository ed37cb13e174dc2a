"""The update's passes over long causal fields (from L = BLOCKS_FROM on they read row blocks of the
lower triangle and form float32 products in a staging buffer) against literal numpy references:
the lag moment, the mean field, the stored band entries and the row entropies."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from podmonitor import PODAccumulator, PODConfig
from podmonitor.engine.lags import BLOCKS_FROM, lower_row_blocks
from tests.conftest import random_causal_fields

U32 = 2.0**-24


def _lag_rows(a: np.ndarray) -> np.ndarray:
    """(S, L, L) causal fields -> (S * L, L) backward lag signals d_i(tau) = A[i, i - tau], row by row."""
    s, n, _ = a.shape
    out = np.zeros((s, n, n))
    for i in range(n):
        out[:, i, : i + 1] = a[:, i, i::-1]
    return out.reshape(s * n, n)


def _band(a: np.ndarray, n_lags: int) -> np.ndarray:
    """(S, P) band entries in lag order: lag 0 (the diagonal), lag 1 (A[i, i - 1]), ..."""
    n = a.shape[-1]
    return np.concatenate([a[:, np.arange(tau, n), np.arange(0, n - tau)] for tau in range(n_lags)], axis=1)


def _entropy_sums(a: np.ndarray) -> np.ndarray:
    """(L,) sum over snapshots of each row's entropy over its i + 1 keys, divided by log(i + 1)."""
    n = a.shape[-1]
    out = np.zeros(n)
    for i in range(1, n):
        p = a[:, i, : i + 1]
        out[i] = float(-np.sum(p * np.log(p))) / math.log(i + 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_long_causal_fields_give_the_literal_moment_mean_band_and_entropy(dtype):
    seq_len, n = BLOCKS_FROM + 8, 6
    fields = random_causal_fields(n, seq_len, seed=11, temperature=0.5).to(dtype)
    acc = PODAccumulator(PODConfig())
    for part in fields.chunk(2):  # two batches: Chan et al.'s between-group field enters too
        acc.update(part)
    a = fields.double().numpy()
    mean = a.mean(axis=0)
    rows = _lag_rows(a - mean)
    exact = rows.T @ rows
    got = acc.m2_back.numpy()
    if dtype == torch.float64:
        np.testing.assert_allclose(got, exact, rtol=0, atol=1e-12 * np.abs(exact).max())
    else:  # float32 products: inside the rounding bound of test_moment_precision (K: all rows of a batch)
        weight = np.zeros_like(exact)
        n_a, mean_a = 0, None
        for b in np.split(a, 2):
            n_b, mean_b = b.shape[0], b.mean(axis=0)
            r = np.abs(_lag_rows(b - mean_b))
            weight += r.T @ r
            if n_a:
                between = np.abs(_lag_rows(math.sqrt(n_a * n_b / (n_a + n_b)) * (mean_b - mean_a)[None]))
                weight += between.T @ between
                mean_a = (n_a * mean_a + n_b * mean_b) / (n_a + n_b)
            else:
                mean_a = mean_b
            n_a += n_b
        k = (n // 2 + 1) * seq_len
        gamma = k * U32 / (1 - k * U32)
        bound = (2 * U32 + U32**2 + gamma * (1 + U32) ** 2) * weight + 1e-13 * np.abs(exact).max()
        assert np.all(np.abs(got - exact) <= bound)
    np.testing.assert_allclose(acc.mean_field.numpy(), mean, rtol=0, atol=1e-15)
    # the stored snapshots are the fields' band entries, exactly (float32 entries widen exactly)
    stored = torch.cat(acc.chunks).numpy()
    np.testing.assert_array_equal(stored, _band(a, acc.band.n_lags))
    np.testing.assert_allclose(acc.entropy_sum.numpy(), _entropy_sums(a), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seq_len", [8, BLOCKS_FROM, BLOCKS_FROM + 37])
def test_lower_row_blocks_cover_the_lower_triangle(seq_len):
    covered = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for r0, r1 in lower_row_blocks(seq_len, causal=True):
        covered[r0:r1, :r1] = True
    assert covered[torch.ones(seq_len, seq_len, dtype=torch.bool).tril()].all()
    if seq_len >= BLOCKS_FROM:  # and skip most of the upper one
        assert covered.sum() < 0.6 * seq_len * seq_len
    assert lower_row_blocks(seq_len, causal=False) == [(0, seq_len)]


def test_float32_state_of_float64_fields_rounds_each_addition_once():
    # PODConfig(dtype=float32) with float64 fields: the batch mean adds each field as given (one
    # rounding to float32 per addition), not a float32 copy of it (two roundings)
    fields = random_causal_fields(5, 16, seed=4)
    acc = PODAccumulator(PODConfig(dtype=torch.float32))
    acc.update(fields)
    total = np.zeros((16, 16), dtype=np.float32)
    for f in fields.numpy():
        total = (total.astype(np.float64) + f).astype(np.float32)
    np.testing.assert_array_equal(acc.mean_field.numpy(), total / np.float32(5))
