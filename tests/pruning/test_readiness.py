"""Readiness: principal angles against scipy and known geometry; the stability rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import torch

from podmonitor import PODConfig, analyze
from podmonitor.pruning import AdviceReadiness, LayerEvidence, advise_head_allocation, principal_angles, subspace_drift
from tests.pruning.helpers import low_rank_fields

CFG = PODConfig(n_dominant=1, coherency=False)


def test_principal_angles_known_geometry_and_basis_invariance():
    theta = 0.3
    a = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 0.0, 0.0], [0.0, math.cos(theta), math.sin(theta)]], dtype=torch.float64)
    got = principal_angles(a, b)
    np.testing.assert_allclose(got.numpy(), [0.0, theta], atol=1e-7)
    mix = torch.tensor([[2.0, 1.0], [0.5, -3.0]], dtype=torch.float64)  # another basis of span(b)
    np.testing.assert_allclose(principal_angles(a, mix @ b).numpy(), [0.0, theta], atol=1e-7)
    drift, largest = subspace_drift(a, b)
    assert drift == pytest.approx(math.sqrt(math.sin(theta) ** 2 / 2))
    assert largest == pytest.approx(math.degrees(theta))


def test_principal_angles_match_scipy_on_random_subspaces():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 40, generator=g, dtype=torch.float64)
    b = torch.randn(4, 40, generator=g, dtype=torch.float64)
    ref = np.sort(scipy.linalg.subspace_angles(a.T.numpy(), b.T.numpy()))
    np.testing.assert_allclose(principal_angles(a, b).numpy(), ref, atol=1e-10)


def _reports(seed: int, pattern_seed: int) -> dict:
    return {"layer_00": analyze(low_rank_fields(30, 16, 3, seed=seed, pattern_seed=pattern_seed), CFG)}


def test_readiness_is_stable_only_after_patience_settled_runs_and_resets_on_drift():
    r = AdviceReadiness(n_modes=3, drift_tol=0.3, h_tol=0.25, patience=2)  # k = the 3 patterns
    same = _reports(1, 5)
    states = [r.update(step, same, ["layer_00"]) for step in (10, 20, 30)]
    assert [s["settled"] for s in states] == [False, True, True]
    assert [s["stable"] for s in states] == [False, False, True]
    assert states[1]["layers"]["layer_00"]["subspace_drift"] == pytest.approx(0.0, abs=1e-6)
    # new attention patterns: the dominant subspace turns, the count starts again
    moved = r.update(40, _reports(1, 6), ["layer_00"])
    assert moved["layers"]["layer_00"]["subspace_drift"] > 0.3
    assert not moved["settled"] and not moved["stable"] and "subspace drift" in moved["reason"]
    # same patterns, other snapshots (coefficients): the subspace barely moves
    near = r.update(50, _reports(2, 6), ["layer_00"])
    assert near["layers"]["layer_00"]["subspace_drift"] < 0.3
    assert near["settled_runs"] == 1 and not near["stable"]


def test_readiness_counts_a_changed_advice_as_unsettled():
    r = AdviceReadiness(n_modes=2, drift_tol=1.0, h_tol=1e9, patience=1)
    reports = _reports(1, 5)

    def advice(demand):
        return advise_head_allocation([LayerEvidence(name=f"l{i}", n_heads=4, effective_rank=d)
                                       for i, d in enumerate(demand)])

    r.update(1, reports, ["layer_00"], advice([1, 9]))
    assert r.update(2, reports, ["layer_00"], advice([1, 9]))["stable"]
    changed = r.update(3, reports, ["layer_00"], advice([9, 1]))
    assert changed["advice_changed"] and not changed["stable"]
    state = r.state_dict()
    again = AdviceReadiness()
    again.load_state_dict(state)
    assert len(again.history) == 3 and again.settled_runs == 0


def test_readiness_arguments_are_validated():
    with pytest.raises(ValueError, match="drift_tol"):
        AdviceReadiness(drift_tol=2.0)
    with pytest.raises(ValueError, match="patience"):
        AdviceReadiness(patience=0)
    with pytest.raises(ValueError, match="k1"):
        principal_angles(torch.zeros(0, 3), torch.ones(1, 3))
