"""Cross-coherency sums: the band-storage path, the dense path and the literal definition agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from podmonitor.engine.coherency import CoherencyAccumulator
from podmonitor.engine.lags import LagBand
from tests.conftest import literal_cwt, random_causal_fields


def literal_sums(x: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """sum_s W_si(i) conj(W_si(j)) and sum_s |W_si(j)|^2 from one FFT transform per row."""
    n, seq_len, _ = x.shape
    w = literal_cwt(x.reshape(-1, seq_len), np.array([scale]))[:, 0, :].reshape(n, seq_len, seq_len)
    wd = np.stack([w[:, i, i] for i in range(seq_len)], axis=1)  # (s, i)
    return (wd[:, :, None] * np.conj(w)).sum(0), (np.abs(w) ** 2).sum(0)


@pytest.mark.parametrize("causal", [True, False])
def test_band_path_equals_dense_path_and_literal_sums(causal):
    seq_len, scale = 24, 3.0
    x = random_causal_fields(7, seq_len, seed=21)
    if not causal:
        x = 0.5 * (x + x.transpose(1, 2))
    band = LagBand.build(seq_len, 9, causal)  # a band narrower than L: entries beyond it are zero
    entries = band.extract(x)
    banded = band.to_dense(entries)

    dense_acc = CoherencyAccumulator(seq_len, scale, 5.0, torch.float64, causal=causal)
    dense_acc.update(banded[:3])
    dense_acc.update(banded[3:])
    band_acc = CoherencyAccumulator(seq_len, scale, 5.0, torch.float64, causal=causal)
    band_acc.update_band(band, entries)
    for name in ("cross_re", "cross_im", "power"):
        torch.testing.assert_close(getattr(band_acc, name), getattr(dense_acc, name), rtol=1e-12, atol=1e-14)
    assert band_acc.n == dense_acc.n == 7

    cross, power = literal_sums(banded.numpy(), scale)
    reached = ~band_acc.beyond_reach().numpy()
    np.testing.assert_allclose(band_acc.power.numpy()[reached], power[reached], rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(band_acc.cross_re.numpy()[reached], cross.real[reached], rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(band_acc.cross_im.numpy()[reached], cross.imag[reached], rtol=1e-9, atol=1e-13)
