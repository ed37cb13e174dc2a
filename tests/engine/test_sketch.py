"""Bounded-memory POD (Frequent Directions sketch): guarantees against numpy, merge, persistence, modes."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
from torch import Tensor

from podmonitor import MemoryBudgetError, PODAccumulator, PODConfig, analyze, estimate_memory
from podmonitor.engine.accumulator import sketch_rank_for
from podmonitor.engine.sketch import FrequentDirections, sketch_pod
from podmonitor.engine.spectrum import effective_rank, spectral_fit
from podmonitor.synthetic import Oscillation, oscillation_ensemble, prescribed_spectrum_ensemble
from tests.engine.test_pod import literal_filtered_fluctuation

SKETCH = PODConfig(n_dominant=2, mode="sketch", sketch_rank=12, coherency=False)
#: a sketch that resolves the leading eigenvalues of the decaying (k^-2) ensemble below
DECAY_SKETCH = PODConfig(n_dominant=2, mode="sketch", sketch_rank=32, coherency=False)


def decaying_rows(n: int, p: int, seed: int, beta: float = 1.5, offset: float = 3.0) -> torch.Tensor:
    """(n, p) rows with a power-law covariance spectrum k^-beta in a random basis, plus an offset (a mean)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(p, p, generator=g, dtype=torch.float64))
    lam = torch.arange(1, p + 1, dtype=torch.float64) ** -beta
    return (torch.randn(n, p, generator=g, dtype=torch.float64) * lam.sqrt()) @ q.T + offset


def fd_guarantee(centred: np.ndarray, rank: int) -> float:
    """min over k < l + 1 of ||A - A_k||_F^2 / (l + 1 - k) (Ghashami et al. 2016), from numpy's SVD."""
    s2 = np.linalg.svd(centred, compute_uv=False) ** 2
    return min(s2[k:].sum() / (rank + 1 - k) for k in range(rank + 1))


def check_sketch_against_rows(fd: FrequentDirections, x: np.ndarray) -> None:
    """0 <= S - B^T B <= Delta I for the literal centred scatter S, and Delta within the FD guarantee."""
    centred = x - x.mean(0)
    scatter = centred.T @ centred
    b = torch.cat(fd.rows()).numpy() if fd.rows() else np.zeros((0, x.shape[1]))
    gap = np.linalg.eigvalsh(scatter - b.T @ b)
    tol = 1e-10 * np.trace(scatter)
    assert gap.min() >= -tol
    assert gap.max() <= fd.delta_total + tol
    assert fd.delta_total <= fd_guarantee(centred, fd.rank) * (1 + 1e-9) + tol
    np.testing.assert_allclose(fd.mean.numpy(), x.mean(0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(fd.m2.numpy(), (centred**2).sum(0), rtol=1e-10, atol=1e-12)


def test_frequent_directions_guarantee_against_numpy_svd():
    x = decaying_rows(230, 60, seed=0)
    fd = FrequentDirections(60, rank=10)
    for lo, hi in [(0, 1), (1, 8), (8, 47), (47, 48), (48, 230)]:  # uneven batches, one single row
        fd.update(x[lo:hi])
    assert fd.n_shrinks > 0 and fd.delta_total > 0
    assert fd.n_rows <= 2 * fd.rank
    check_sketch_against_rows(fd, x.numpy())


def test_frequent_directions_is_exact_until_the_buffer_is_full():
    x = decaying_rows(20, 30, seed=1)
    fd = FrequentDirections(30, rank=10)
    fd.update(x[:7])
    fd.update(x[7:])
    assert fd.n_shrinks == 0 and fd.delta_total == 0.0
    centred = (x - x.mean(0)).numpy()
    b = torch.cat(fd.rows()).numpy()
    np.testing.assert_allclose(b.T @ b, centred.T @ centred, rtol=1e-10, atol=1e-10)


def test_sketch_pod_brackets_the_exact_windowed_eigenvalues():
    x = decaying_rows(300, 80, seed=2)
    fd = FrequentDirections(80, rank=16)
    for lo in range(0, 300, 25):
        fd.update(x[lo:lo + 25])
    w = torch.exp(-torch.arange(80, dtype=torch.float64) ** 2 / (2 * 30.0**2))
    res = sketch_pod(fd, w, n_modes=4)
    u = ((x - x.mean(0)) * w).numpy()
    exact = np.linalg.svd(u, compute_uv=False) ** 2 / 300
    m = res.eigenvalues.numel()
    lo, est, e = res.eigenvalues_lower.numpy(), res.eigenvalues.numpy(), res.error_bound
    tol = 1e-12 * exact[0]
    assert 0 < e <= fd.delta_total / 300 + tol
    assert np.all(lo <= exact[:m] + tol) and np.all(exact[:m] <= lo + e + tol)
    assert np.all(np.abs(est - exact[:m]) <= e + tol)
    assert math.isclose(res.total_energy, exact.sum(), rel_tol=1e-12)
    # compensation makes the leading estimates much closer than the raw sketch
    assert abs(est[0] / exact[0] - 1) < 0.5 * abs(lo[0] / exact[0] - 1)
    # modes: unit norm, and the leading one close to the exact leading right singular vector
    np.testing.assert_allclose(res.modes.norm(dim=1).numpy(), 1.0, atol=1e-12)
    v1 = np.linalg.svd(u, full_matrices=False)[2][0]
    assert abs(float(res.modes[0].numpy() @ v1)) > 0.99


def test_sketch_merge_of_two_processes_equals_one_sketch_within_the_bound():
    x = decaying_rows(260, 50, seed=3)
    one = FrequentDirections(50, rank=8)
    for lo in range(0, 260, 20):
        one.update(x[lo:lo + 20])
    # two "processes": each sketches its share, ships its state (serialised), rank 0 merges
    parts = []
    for share in (x[:110], x[110:]):
        fd = FrequentDirections(50, rank=8)
        for lo in range(0, share.shape[0], 20):
            fd.update(share[lo:lo + 20])
        buf = io.BytesIO()
        torch.save(fd.state_dict(), buf)
        buf.seek(0)
        parts.append(torch.load(buf, weights_only=True))
    merged = FrequentDirections(50, rank=8)
    for state in parts:
        other = FrequentDirections(50, rank=8)
        other.load_state_dict(state)
        merged.merge(other)
    assert merged.n == one.n == 260
    check_sketch_against_rows(merged, x.numpy())  # the same guarantee as one sketch
    w = torch.ones(50, dtype=torch.float64)
    a, b = sketch_pod(one, w), sketch_pod(merged, w)
    k = min(a.eigenvalues.numel(), b.eigenvalues.numel())
    diff = (a.eigenvalues[:k] - b.eigenvalues[:k]).abs()
    assert bool((diff <= max(a.error_bound, b.error_bound) + 1e-12).all())
    assert math.isclose(a.total_energy, b.total_energy, rel_tol=1e-12)


@pytest.fixture(scope="module")
def fields():
    return oscillation_ensemble(120, 48, [Oscillation(6.0, 8.0, 8.0, 0.03), Oscillation(16.0, 20.0, 16.0, 0.03)],
                                seed=4)


@pytest.fixture(scope="module")
def sketch_report(fields):
    """Two oscillations plus noise at l = 12: a flat tail that this small sketch cannot resolve (R = 0)."""
    acc = PODAccumulator(SKETCH)
    for lo in range(0, 120, 16):
        acc.update(fields[lo:lo + 16])
    assert acc.mode == "sketch" and acc.sketch is not None and acc.sketch.n_shrinks > 0
    return acc.compute()


@pytest.fixture(scope="module")
def decaying_fields():
    """N = 160 causal fields (L = 32) with 60 modes on lags < 8 and a k^-2 POD spectrum (T_spec ~ 0.5)."""
    lam = torch.arange(1, 61, dtype=torch.float64) ** -2.0 * 1e-3
    window = torch.exp(-torch.arange(8, dtype=torch.float64) ** 2 / (2 * 8.0**2))
    return prescribed_spectrum_ensemble(160, 32, lam, n_lags=8, window=window, seed=7)


@pytest.fixture(scope="module")
def decaying_report(decaying_fields):
    """The decaying ensemble through a sketch of l = 32 rows (fewer than N = 160 and than the 60 modes)."""
    acc = PODAccumulator(DECAY_SKETCH)
    for lo in range(0, 160, 20):
        acc.update(decaying_fields[lo:lo + 20])
    assert acc.mode == "sketch" and acc.sketch is not None and acc.sketch.n_shrinks > 0
    return acc.compute()


def fit_slope_sensitivity(n_fit: int) -> float:
    """sum |x_c| / sum x_c^2 for x = ln k, k = 1..n_fit: |d beta| <= this * max_k |d ln lambda_k| (OLS)."""
    x = np.log(np.arange(1, n_fit + 1, dtype=np.float64))
    xc = x - x.mean()
    return float(np.abs(xc).sum() / (xc**2).sum())


def check_sketch_report_against_literal(fields: Tensor, rep, cfg: PODConfig) -> list[tuple]:
    """The guarantees of docs/memory.md for every dominant scale, against the literal ensemble.

    Returns, per scale, (scale report, numpy eigenvalues of the literal windowed fluctuation,
    numpy right singular vectors, numpy H*(eps)) for the caller's further checks.
    """
    exact = analyze(fields, PODConfig(n_dominant=cfg.n_dominant, mode="exact", coherency=False))
    assert rep.mode == "sketch" and exact.mode == "exact"
    # the parts whose state does not grow with N are exact in both modes
    assert rep.dominant_scales == exact.dominant_scales
    torch.testing.assert_close(rep.scalogram, exact.scalogram, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(rep.mean_field, exact.mean_field, rtol=1e-12, atol=1e-15)
    assert math.isclose(rep.entropy, exact.entropy, rel_tol=1e-12)
    out = []
    for sc in rep.per_scale:
        u = literal_filtered_fluctuation(fields.numpy(), sc.scale)
        _, sv, vt = np.linalg.svd(u, full_matrices=False)  # independent reference
        lam = sv**2 / u.shape[0]
        m = sc.eigenvalues.numel()
        e, lo, est = sc.error_bound, sc.eigenvalues_lower.numpy(), sc.eigenvalues.numpy()
        tol = 1e-10 * lam[0]
        assert e > 0
        assert np.all(lo <= lam[:m] + tol) and np.all(lam[:m] <= lo + e + tol)
        assert np.all(np.abs(est - lam[:m]) <= e + tol)
        assert math.isclose(sc.total_energy, lam.sum(), rel_tol=1e-10)  # the trace is exact
        assert math.isclose(float(sc.energy_fractions.sum()), float(est.sum() / lam.sum()), rel_tol=1e-12)
        # resolved: estimates at least sketch_resolve_factor times the bound, so within 1 / factor
        r = sc.resolved_rank
        assert r == int((est >= cfg.sketch_resolve_factor * e).sum())
        assert np.all(np.abs(est[:r] / lam[:r] - 1) <= 1 / cfg.sketch_resolve_factor + 1e-9)
        assert sc.n_fit == min(r, cfg.k_fit)  # T_spec only on resolved eigenvalues
        truth = effective_rank(torch.from_numpy(lam), cfg.eps)
        for eps in cfg.eps:
            h_lo, h_hi = sc.effective_rank_bounds[eps]
            assert h_lo <= truth.ranks[eps]
            assert h_hi is None or truth.ranks[eps] <= h_hi
            if sc.beyond_resolved[eps]:
                assert sc.effective_rank[eps] is None
            else:
                assert sc.effective_rank[eps] is not None and sc.effective_rank[eps] <= r
            assert sc.saturated[eps] is False
        assert sc.coefficients is None  # no snapshots kept
        out.append((sc, lam, vt, truth.ranks))
    return out


def test_sketch_report_against_the_literal_ensemble(decaying_fields, decaying_report):
    cfg = DECAY_SKETCH
    f = cfg.sketch_resolve_factor
    checked = check_sketch_report_against_literal(decaying_fields, decaying_report, cfg)
    exact = analyze(decaying_fields, PODConfig(n_dominant=2, mode="exact", coherency=False))
    assert len(checked) == 2
    for (sc, lam, vt, truth), ref in zip(checked, exact.per_scale, strict=True):
        r = sc.resolved_rank
        assert r >= 3  # the branches below run on non-empty slices
        est = sc.eigenvalues.numpy()
        # resolved eigenvalues: within 1 / factor by construction; here much closer (< 1 %)
        assert np.all(np.abs(est[:r] / lam[:r] - 1) <= 0.01)
        # H*(eps): at least one eps resolved and equal to the exact H*, the others bounded
        resolved_eps = [e for e in cfg.eps if not sc.beyond_resolved[e]]
        assert 0.1 in resolved_eps
        for e in cfg.eps:
            h_lo, h_hi = sc.effective_rank_bounds[e]
            if e in resolved_eps:
                assert sc.effective_rank[e] == truth[e] == ref.effective_rank[e]
                assert h_hi is not None and h_lo <= sc.effective_rank[e] <= h_hi
            else:  # "more than R": and indeed the exact H* is more than R
                assert truth[e] > r and h_lo <= truth[e]
        # T_spec: finite, fitted on the first n_fit = min(R, k_fit) estimates, each within a
        # relative 1 / factor of the exact eigenvalue, so ln lambda moves by at most
        # -ln(1 - 1 / factor) and beta (OLS slope) by at most that times the slope sensitivity
        assert sc.status == "ok" and math.isfinite(sc.t_spec) and math.isfinite(sc.beta)
        same_points = spectral_fit(torch.from_numpy(lam), sc.n_fit)  # exact fit on the same k
        assert same_points.n_points == sc.n_fit
        d_beta = -math.log(1 - 1 / f) * fit_slope_sensitivity(sc.n_fit)
        assert abs(sc.beta - same_points.beta) <= d_beta
        assert abs(sc.t_spec - same_points.t_spec) <= d_beta / (sc.beta * same_points.beta)
        # the bound from the actual errors (here well under 1 %) is much tighter
        actual = float(np.abs(np.log(est[:sc.n_fit] / lam[:sc.n_fit])).max())
        assert abs(sc.beta - same_points.beta) <= actual * fit_slope_sensitivity(sc.n_fit) + 1e-12
        assert abs(sc.t_spec / same_points.t_spec - 1) <= 0.01
        # against exact mode's own T_spec (k_fit = 30 points): the 5 % target
        assert abs(sc.t_spec / ref.t_spec - 1) <= 0.05
        # the leading mode is the exact leading right singular vector of the literal ensemble
        assert sc.modes is not None
        assert abs(float(sc.modes[0].reshape(-1).numpy() @ vt[0])) > 0.99


def test_sketch_report_says_when_it_resolves_nothing(fields, sketch_report):
    """Flat, noise-dominated tail, l = 12: error_bound > lambda_1, so R = 0 and the report says so."""
    checked = check_sketch_report_against_literal(fields, sketch_report, SKETCH)
    for sc, lam, _, truth in checked:
        assert sc.error_bound > lam[0] / SKETCH.sketch_resolve_factor
        assert sc.resolved_rank == 0 and sc.n_fit == 0
        assert sc.status == "degenerate" and math.isnan(sc.t_spec)
        for e in SKETCH.eps:
            assert sc.beyond_resolved[e] and sc.effective_rank[e] is None
            assert truth[e] > 0
    assert any("more than the resolved rank R = 0" in m for m in sketch_report.messages)


def test_sketch_report_is_strict_json_with_its_new_fields(sketch_report):
    d = sketch_report.to_dict()
    text = json.dumps(d, allow_nan=False)
    assert "NaN" not in text and "Infinity" not in text
    assert d["mode"] == "sketch"
    assert d["error_bound"] > 0 and isinstance(d["resolved_rank"], int)
    assert set(d["beyond_resolved"]) == {"0.1", "0.05", "0.01"}
    assert d["sketch"]["rank"] == 12 and d["sketch"]["n_shrinks"] > 0
    ps = d["per_scale"][0]
    for key in ("mode", "error_bound", "eigenvalues_lower", "resolved_rank", "effective_rank_bounds",
                "beyond_resolved"):
        assert key in ps
    exact = analyze(oscillation_ensemble(10, 16, [Oscillation(4.0, 3.0, 3.0, 0.05)], seed=0),
                    PODConfig(n_dominant=1, coherency=False)).to_dict()
    json.dumps(exact, allow_nan=False)
    assert exact["mode"] == "exact" and exact["error_bound"] == 0.0 and exact["sketch"] is None
    assert exact["per_scale"][0]["effective_rank_bounds"]["0.1"] == [exact["effective_rank"]["0.1"]] * 2


def test_sketch_state_dict_round_trip_then_continue(fields, sketch_report):
    acc = PODAccumulator(SKETCH)
    for lo in range(0, 64, 16):
        acc.update(fields[lo:lo + 16])
    buf = io.BytesIO()
    torch.save(acc.state_dict(), buf)
    buf.seek(0)
    restored = PODAccumulator(SKETCH)
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert restored.mode == "sketch" and restored.nbytes() == acc.nbytes()
    for lo in range(64, 120, 16):
        restored.update(fields[lo:lo + 16])
    rep = restored.compute()  # deterministic: the same sketch as one uninterrupted run
    for a, b in zip(rep.per_scale, sketch_report.per_scale, strict=True):
        torch.testing.assert_close(a.eigenvalues, b.eigenvalues, rtol=1e-12, atol=1e-18)
        assert a.error_bound == pytest.approx(b.error_bound, rel=1e-12)


def test_accumulator_merge_in_sketch_mode(fields):
    left, right = PODAccumulator(SKETCH), PODAccumulator(SKETCH)
    for lo in range(0, 48, 16):
        left.update(fields[lo:lo + 16])
    for lo in range(48, 120, 24):
        right.update(fields[lo:lo + 24])
    rep = left.merge(right).compute()
    exact = analyze(fields, PODConfig(n_dominant=2, mode="exact", coherency=False))
    torch.testing.assert_close(rep.scalogram, exact.scalogram, rtol=1e-10, atol=1e-15)
    for sc, ref in zip(rep.per_scale, exact.per_scale, strict=True):
        m = sc.eigenvalues.numel()
        lam = ref.eigenvalues[:m]
        assert bool((sc.eigenvalues_lower <= lam + 1e-12).all())
        assert bool((lam <= sc.eigenvalues_lower + sc.error_bound + 1e-12).all())
        assert math.isclose(sc.total_energy, ref.total_energy, rel_tol=1e-10)


def test_auto_mode_is_exact_within_the_budget_then_sketches(fields):
    cfg0 = PODConfig(n_dominant=2, coherency=False, k_fit=3)  # auto needs l >= 2 k_fit = 6
    per_row = estimate_memory(48, 1, cfg0, mode="exact")["state"] - estimate_memory(48, 0, cfg0, mode="exact")["state"]
    # the O(L^2) state, the sketch's mean and scatter (2 P), 40 rows, and twice the eigenproblems
    # of a sketch of l = 10 (5 (2 l)^2 values: auto mode gives the sketch half of what is left)
    budget = estimate_memory(48, 0, cfg0, mode="exact")["state"] + 2 * 1176 * 8 + 40 * per_row + 2 * 5 * 20**2 * 8
    cfg = PODConfig(n_dominant=2, coherency=False, k_fit=3, memory_budget_bytes=budget)
    rank = sketch_rank_for(48, cfg)
    assert rank == 10  # a quarter of the 40 rows left after the O(L^2) state and the sketch's 2 P
    acc = PODAccumulator(cfg)
    acc.update(fields[:16])
    assert acc.mode == "exact"  # 16 snapshots fit next to a future 2 l = 20 row buffer
    exact16 = analyze(fields[:16], PODConfig(n_dominant=2, coherency=False, k_fit=3))
    got = acc.compute()
    torch.testing.assert_close(got.per_scale[0].eigenvalues, exact16.per_scale[0].eigenvalues)
    for lo in range(16, 120, 8):
        acc.update(fields[lo:lo + 8])  # no MemoryBudgetError: it switched
        assert acc.nbytes() <= budget
    assert acc.mode == "sketch" and acc.n == 120
    assert acc.nbytes() == estimate_memory(48, 120, cfg)["state"]
    assert estimate_memory(48, 120, cfg)["sketch_rank"] == rank
    rep = acc.compute()
    assert rep.mode == "sketch" and rep.sketch["rank"] == rank
    assert any("sketch mode" in m for m in rep.messages)


def test_auto_mode_computes_the_sketch_rank_once(fields, monkeypatch):
    """The rank and the switch limit are fixed after the first batch: no per-update recomputation,
    and a restored or merged accumulator switches exactly as an uninterrupted one."""
    import podmonitor.engine.accumulator as accumulator

    cfg0 = PODConfig(n_dominant=2, coherency=False, k_fit=3)
    per_row = estimate_memory(48, 1, cfg0, mode="exact")["state"] - estimate_memory(48, 0, cfg0, mode="exact")["state"]
    budget = estimate_memory(48, 0, cfg0, mode="exact")["state"] + 2 * 1176 * 8 + 40 * per_row + 2 * 5 * 20**2 * 8
    cfg = PODConfig(n_dominant=2, coherency=False, k_fit=3, memory_budget_bytes=budget)
    calls = []
    real = accumulator.sketch_rank_for
    monkeypatch.setattr(accumulator, "sketch_rank_for", lambda *a, **k: calls.append(a) or real(*a, **k))
    one, first, second, third = (PODAccumulator(cfg) for _ in range(4))
    modes = []
    for lo in range(0, 120, 8):
        one.update(fields[lo:lo + 8])
        modes.append(one.mode)
    assert len(calls) == 1  # in _init_state only, not once per update
    # 20 rows fit next to the future 2 l = 20 row buffer: the switch comes with the 3rd batch of 8
    assert modes.index("sketch") == 2 and one.nbytes() <= budget
    # restored mid-way (exact phase) then continued: the same switch, the same sketch
    for lo in range(0, 16, 8):
        first.update(fields[lo:lo + 8])
    restored = PODAccumulator(cfg)
    restored.load_state_dict(first.state_dict())
    assert restored.mode == "exact" and restored._sketch_rank == one._sketch_rank == 10
    for lo in range(16, 120, 8):
        restored.update(fields[lo:lo + 8])
    assert restored.mode == "sketch"
    a, b = one.compute(), restored.compute()
    torch.testing.assert_close(b.per_scale[0].eigenvalues, a.per_scale[0].eigenvalues, rtol=1e-12, atol=0.0)
    # merging exact-phase accumulators: the merged one switches once it is over the budget
    for acc, lo in ((second, 16), (third, 32)):
        acc.update(fields[lo:lo + 16])
    merged = first.merge(second)
    assert merged.mode == "exact" and merged.n == 32  # 32 rows still fit the budget
    merged.merge(third)
    assert merged.mode == "sketch" and merged.n == 48 and merged.nbytes() <= budget
    assert len(calls) == 5  # one per accumulator's _init_state (one, first, second, third, restored)


def test_exact_mode_refuses_with_a_message_naming_the_budget(fields):
    budget = estimate_memory(48, 10, PODConfig(mode="exact"))["budgeted"]  # the state and the 10 x 10 eigenproblem
    acc = PODAccumulator(PODConfig(mode="exact", memory_budget_bytes=budget))
    acc.update(fields[:10])
    with pytest.raises(MemoryBudgetError, match=r"budget of [0-9.]+ MiB.*mode='auto'"):
        acc.update(fields[10:12])
    assert acc.n == 10
    # sketch mode with a budget too small for even its buffer refuses at the first update
    with pytest.raises(MemoryBudgetError, match="cannot hold a useful sketch"):
        PODAccumulator(PODConfig(mode="sketch", memory_budget_bytes=budget // 4)).update(fields[:2])


def test_coherency_streamed_in_sketch_mode_equals_exact_at_a_fixed_scale(fields):
    cfg_s = PODConfig(n_dominant=1, mode="sketch", sketch_rank=12, coherency_scale=6.0)
    cfg_e = PODConfig(n_dominant=1, mode="exact", coherency_scale=6.0)
    acc = PODAccumulator(cfg_s)
    for lo in range(0, 60, 20):
        acc.update(fields[lo:lo + 20])
    rep, ref = acc.compute(), analyze(fields[:60], cfg_e)
    assert rep.coherency_scale == ref.coherency_scale == 6.0
    torch.testing.assert_close(rep.coherency, ref.coherency, rtol=1e-9, atol=1e-12, equal_nan=True)
    # without a fixed scale the sketch cannot know which scale to stream: no map, and it says so
    rep2 = analyze(fields[:40], PODConfig(n_dominant=1, mode="sketch", sketch_rank=12))
    assert rep2.coherency is None and any("coherency not computed" in m for m in rep2.messages)


@pytest.mark.parametrize("which", ["decaying_report", "sketch_report"])
def test_reporting_readers_accept_a_sketch_report(which, request):
    from podmonitor.reporting.scalars import eps_label, layer_scalars, summary_markdown

    report = request.getfixturevalue(which)
    scalars = layer_scalars(report, "layer_00")
    head = report.headline
    eps = DECAY_SKETCH.eps
    if which == "decaying_report":  # both branches: H*(0.10) resolved, the smaller eps beyond R
        assert head.resolved_rank >= 3 and not head.beyond_resolved[0.1] and head.beyond_resolved[0.01]
        assert math.isfinite(head.t_spec) and scalars["pod/headline/t_spec/layer_00"] == head.t_spec
        assert scalars["pod/fit/n_fit/layer_00"] == head.n_fit == min(head.resolved_rank, DECAY_SKETCH.k_fit)
    else:  # nothing resolved: every H* is "more than 0", T_spec NaN
        assert head.resolved_rank == 0 and all(head.beyond_resolved.values())
        assert math.isnan(scalars["pod/headline/t_spec/layer_00"])
    for e in eps:
        beyond = head.beyond_resolved[e]
        group = "headline" if e == eps[0] else "fit"
        value = scalars[f"pod/{group}/effective_rank_{100 * (1 - e):g}pct/layer_00"]
        if beyond:
            assert math.isnan(value)
        else:
            assert head.effective_rank[e] is not None and value == head.effective_rank[e]
        assert scalars[f"pod/sketch/beyond_resolved_{100 * (1 - e):g}pct/layer_00"] == float(beyond)
    assert scalars["pod/sketch/resolved_rank/layer_00"] == head.resolved_rank
    assert scalars["pod/sketch/error_bound/layer_00"] == head.error_bound
    table = summary_markdown([report], ["layer_00"])
    header, _, row = table.strip().splitlines()[2:5]
    cols = [c.strip() for c in header.strip("|").split("|")]
    cells = dict(zip(cols, (c.strip() for c in row.strip("|").split("|")), strict=True))
    assert cells["layer"] == "layer_00"
    assert cells["T_spec"] == ("n/a" if math.isnan(head.t_spec) else format(head.t_spec, ".3g"))
    for e in eps:
        expected = f"> {head.resolved_rank} (sketch)" if head.beyond_resolved[e] else str(head.effective_rank[e])
        assert cells[f"H*({eps_label(e)}) [modes]"] == expected


def test_fitted_power_law_of_a_sketch_spans_only_the_fitted_points(decaying_report):
    from podmonitor.reporting.figures import fitted_power_law

    sr = decaying_report.per_scale[0]
    assert sr.n_fit >= 3 and sr.n_fit < DECAY_SKETCH.k_fit  # fewer resolved points than k_fit
    line = fitted_power_law(sr, k_fit=30)
    assert line is not None and line[0].size == sr.n_fit
    np.testing.assert_allclose(line[1][1:] / line[1][:-1], (line[0][1:] / line[0][:-1]) ** -sr.beta, rtol=1e-12)


def test_version_1_state_still_loads(fields):
    acc = PODAccumulator(PODConfig(n_dominant=2))
    acc.update(fields[:12])
    state = acc.state_dict()
    state = {k: v for k, v in state.items() if k != "mode"} | {"version": 1}
    restored = PODAccumulator(PODConfig(n_dominant=2))
    restored.load_state_dict(state)
    assert restored.mode == "exact" and restored.n == 12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_sketch_matches_cpu(fields, sketch_report):
    acc = PODAccumulator(SKETCH)
    for lo in range(0, 120, 16):
        acc.update(fields[lo:lo + 16].cuda())
    assert acc.sketch is not None and acc.sketch.buffer.is_cuda  # all work on the device
    rep = acc.compute()
    for a, b in zip(rep.per_scale, sketch_report.per_scale, strict=True):
        torch.testing.assert_close(a.eigenvalues, b.eigenvalues, rtol=1e-7, atol=1e-9 * float(b.eigenvalues[0]))
        assert a.error_bound == pytest.approx(b.error_bound, rel=1e-6, abs=1e-12)
        assert a.resolved_rank == b.resolved_rank


@pytest.mark.slow
def test_sketch_at_n1000_l512_against_exact_with_a_quarter_of_the_memory():
    """The issue's acceptance check (about 80 s on one core): power-law spectrum, sketch rank 120."""
    seq_len, n, n_modes = 512, 1000, 600
    g = torch.Generator().manual_seed(0)
    i, j = torch.arange(seq_len).unsqueeze(1), torch.arange(seq_len).unsqueeze(0)
    support = ((i - j) >= 0) & ((i - j) < 48)
    psi, _ = torch.linalg.qr(torch.randn(int(support.sum()), n_modes, generator=g, dtype=torch.float64))
    sd = torch.arange(1, n_modes + 1, dtype=torch.float64) ** -1.0 * 0.05  # eigenvalues ~ k^-2
    base = (1.0 / torch.arange(1, seq_len + 1, dtype=torch.float64)).unsqueeze(1) * (i >= j)
    common = dict(n_dominant=2, coherency=False, keep_mode_fields=False)
    exact = PODAccumulator(PODConfig(mode="exact", **common))
    sketch = PODAccumulator(PODConfig(mode="sketch", sketch_rank=120, **common))
    for _ in range(0, n, 50):
        x = base.expand(50, seq_len, seq_len).clone()
        x[:, support] += (torch.randn(50, n_modes, generator=g, dtype=torch.float64) * sd) @ psi.T
        exact.update(x)
        sketch.update(x)
    assert sketch.nbytes() <= exact.nbytes() / 4
    re, rs = exact.compute(), sketch.compute()
    assert rs.dominant_scales == re.dominant_scales
    for a, b in zip(re.per_scale, rs.per_scale, strict=True):
        la, lb = a.eigenvalues[:30], b.eigenvalues[:30]
        assert float(((lb / la) - 1).abs().max()) <= 0.02
        assert abs(b.t_spec / a.t_spec - 1) <= 0.05
        assert b.effective_rank[0.1] == a.effective_rank[0.1] or (
            b.beyond_resolved[0.1] and a.effective_rank[0.1] > b.resolved_rank)
        lo, hi = b.effective_rank_bounds[0.1]
        assert lo <= a.effective_rank[0.1] and (hi is None or a.effective_rank[0.1] <= hi)
