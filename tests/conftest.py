"""Shared test fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch


def literal_lag_signals(a: np.ndarray, forward: bool = False) -> np.ndarray:
    """d_i(tau) = A[i, i - tau] (or A[i, i + tau]) by explicit loops: the formula, literally."""
    n_rows = a.shape[-1]
    out = np.zeros(a.shape, dtype=a.dtype)
    for i in range(n_rows):
        for tau in range(n_rows):
            j = i + tau if forward else i - tau
            if 0 <= j < n_rows:
                out[..., i, tau] = a[..., i, j]
    return out


def literal_cwt(x: np.ndarray, scales: np.ndarray, omega0: float = 5.0) -> np.ndarray:
    """METHOD.md section 3 in numpy: psihat_a(f) = sqrt(2 pi a) exp(-(2 pi f a - omega0)^2 / 2), f > 0."""
    n = x.shape[-1]
    f = np.fft.fftfreq(2 * n)
    spec = np.fft.fft(x, 2 * n)
    out = []
    for a in scales:
        psi = np.where(f > 0, np.sqrt(2 * np.pi * a) * np.exp(-((2 * np.pi * f * a - omega0) ** 2) / 2), 0.0)
        out.append(np.fft.ifft(spec * np.conj(psi))[..., :n])
    return np.stack(out, axis=-2)


def random_causal_fields(n: int, seq_len: int, seed: int = 0, temperature: float = 1.0) -> torch.Tensor:
    """(n, L, L) float64 causal softmax attention with random logits."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, seq_len, seq_len, generator=g, dtype=torch.float64) / temperature
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~mask, -torch.inf), dim=-1)


@pytest.fixture
def causal_fields() -> torch.Tensor:
    return random_causal_fields(24, 32, seed=1)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Run a test on one torch thread.

    Tiny models make every small op an OpenMP parallel region; on a machine whose other core is
    busy each region waits a scheduler time slice for its second thread (measured: ~8 ms per
    LayerNorm of a (2, 32, 32) tensor, a 20x slowdown). One thread is faster at these sizes.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
