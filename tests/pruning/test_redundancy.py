"""Head redundancy: the similarity matrices against their literal formulas on synthetic fields."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from podmonitor.pruning import HeadRedundancyAccumulator
from tests.pruning.helpers import causal_softmax, low_rank_fields


def literal(fields: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """S and R of the module docstring by explicit loops over heads and snapshots."""
    n, h = fields.shape[:2]
    mean = fields.mean(axis=0)
    s = np.zeros((h, h))
    c = np.zeros((h, h))
    for a in range(h):
        for b in range(h):
            s[a, b] = sum((fields[k, a] * fields[k, b]).sum() for k in range(n)) / n
            c[a, b] = sum(((fields[k, a] - mean[a]) * (fields[k, b] - mean[b])).sum() for k in range(n)) / n
    d, e = np.sqrt(np.diag(s)), np.sqrt(np.diag(c))
    return s / np.outer(d, d), c / np.outer(e, e)


def test_redundancy_matches_literal_formula_and_is_batch_invariant():
    g = torch.Generator().manual_seed(0)
    fields = causal_softmax(torch.randn(12, 3, 10, 10, generator=g, dtype=torch.float64))  # (N, H, L, L)
    ref_s, ref_r = literal(fields.numpy())
    one = HeadRedundancyAccumulator()
    one.update(fields)
    parts = HeadRedundancyAccumulator()
    parts.update(fields[:5])
    other = HeadRedundancyAccumulator()
    other.update(fields[5:])
    parts.merge(other)
    for acc in (one, parts):
        red = acc.compute()
        assert red.n_snapshots == 12
        np.testing.assert_allclose(red.similarity.numpy(), ref_s, atol=1e-12)
        np.testing.assert_allclose(red.fluctuation_correlation.numpy(), ref_r, atol=1e-12)


def test_redundancy_exact_copies_are_one_and_state_round_trips():
    head = low_rank_fields(20, 12, 3, seed=1)  # (N, L, L)
    other = low_rank_fields(20, 12, 3, seed=2)
    fields = torch.stack([head, other, head], dim=1)  # heads 0 and 2 are copies
    acc = HeadRedundancyAccumulator()
    acc.update(fields)
    red = acc.compute()
    assert red.similarity[0, 2].item() == pytest.approx(1.0, abs=1e-12)
    assert red.fluctuation_correlation[0, 2].item() == pytest.approx(1.0, abs=1e-12)
    assert red.similarity[0, 1].item() < 0.99
    assert red.most_similar(0) == (2, pytest.approx(1.0, abs=1e-12))
    again = HeadRedundancyAccumulator()
    again.load_state_dict(acc.state_dict())
    torch.testing.assert_close(again.compute().similarity, red.similarity)


def test_redundancy_constant_head_has_no_fluctuation_correlation_and_nonfinite_is_skipped():
    varying = low_rank_fields(8, 10, 2, seed=3)
    constant = causal_softmax(torch.zeros(10, 10, dtype=torch.float64)).expand(8, 10, 10)
    fields = torch.stack([varying, constant], dim=1).clone()
    fields[3, 0, 4, 1] = math.nan
    acc = HeadRedundancyAccumulator()
    assert acc.update(fields) == 7
    red = acc.compute()
    assert red.n_skipped_nonfinite == 1
    assert math.isnan(red.fluctuation_correlation[0, 1].item())
    assert math.isfinite(red.similarity[0, 1].item())
    with pytest.raises(ValueError, match="no finite snapshot"):
        HeadRedundancyAccumulator().compute()
    with pytest.raises(ValueError, match=r"\(B, H, L, L\)"):
        acc.update(varying)
