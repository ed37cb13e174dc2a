"""The memory budget: refused cleanly on any batch, bounding what compute will build, sketch rank capped."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from podmonitor import MemoryBudgetError, PODAccumulator, PODConfig, analyze, estimate_memory
from podmonitor.engine.accumulator import sketch_rank_for
from tests.conftest import random_causal_fields
from tests.engine.test_pod import literal_filtered_fluctuation


@pytest.mark.parametrize("mode", ["exact", "auto", "sketch"])
def test_a_budget_exceeded_by_the_first_batch_is_refused_and_leaves_the_accumulator_empty(mode):
    fields = random_causal_fields(20, 32, seed=4)
    acc = PODAccumulator(PODConfig(mode=mode, memory_budget_bytes=20_000))  # 20 snapshots need ~85 kB
    with pytest.raises(MemoryBudgetError, match="budget of"):
        acc.update(fields)
    # nothing of the batch, and no half-built layout, is left behind
    assert acc.n == 0 and acc.seq_len is None and acc.band is None and acc.sketch is None
    assert acc.nbytes() == 0 and acc.chunks == []
    assert acc.compute().status == "empty"
    # refused again, with the same clear error (no AttributeError from a half-built state)
    with pytest.raises(MemoryBudgetError):
        acc.update(fields)
    # the refused batch fixed nothing: a batch of another length that fits is taken
    if mode != "sketch":  # (20 kB hold no sketch at any of these lengths)
        assert acc.update(random_causal_fields(1, 16, seed=5)) == 1 and acc.seq_len == 16


def test_a_failed_first_batch_in_sketch_mode_does_not_fall_back_to_storing_snapshots():
    fields = random_causal_fields(20, 32, seed=4)
    acc = PODAccumulator(PODConfig(mode="sketch", memory_budget_bytes=30_000))  # too small for a sketch
    for batch in (fields, fields[:2]):  # neither the first batch nor a smaller one is taken
        with pytest.raises(MemoryBudgetError, match="cannot hold a useful sketch"):
            acc.update(batch)
        assert acc.n == 0 and acc.chunks == [] and acc.seq_len is None


def test_the_budget_counts_the_eigenproblem_of_compute_not_only_the_stored_snapshots():
    # float16 storage: a snapshot costs 2 bytes per band entry, its row and column of the N x N
    # Gram matrix (and eigenvectors) 16 bytes per snapshot: from N ~ 130 on the Gram outgrows the state
    cfg = PODConfig(mode="exact", storage_dtype=torch.float16, coherency=False, n_dominant=1,
                    memory_budget_bytes=2**20)
    fields = random_causal_fields(400, 32, seed=6)
    acc = PODAccumulator(cfg)
    with pytest.raises(MemoryBudgetError, match="eigenproblem of compute") as err:
        for lo in range(0, 400, 20):
            acc.update(fields[lo:lo + 20])
    n = acc.n
    # refused exactly when the state plus the N x N problem would pass the budget ...
    assert estimate_memory(32, n, cfg)["budgeted"] <= cfg.memory_budget_bytes
    assert estimate_memory(32, n + 20, cfg)["budgeted"] > cfg.memory_budget_bytes
    # ... which is far earlier than the stored snapshots alone would reach it (~990 snapshots)
    assert estimate_memory(32, 2 * n, cfg)["state"] < cfg.memory_budget_bytes
    p = 32 * 33 // 2
    assert estimate_memory(32, n, cfg)["budgeted"] == estimate_memory(32, n, cfg)["state"] + 2 * n * n * 8
    assert f"{n} snapshots are kept" in str(err.value)
    assert acc.nbytes() == n * p * 2 + estimate_memory(32, 0, cfg)["state"]
    assert acc.compute().n_snapshots == n  # what was kept is analysed


def test_narrow_fields_are_counted_as_the_store_keeps_them_so_more_of_them_fit():
    cfg = PODConfig(mode="exact", coherency=False, n_dominant=1, memory_budget_bytes=2**20)
    fields = random_causal_fields(400, 32, seed=6)
    fixed = estimate_memory(32, 0, cfg)["state"]  # the O(L^2) running state, whatever the dtype
    p = 32 * 33 // 2  # the whole lower triangle: the default windows reach every lag at L = 32

    def kept(dtype):
        acc = PODAccumulator(cfg)
        with pytest.raises(MemoryBudgetError, match="budget of") as err:
            for lo in range(0, 400, 10):
                acc.update(fields[lo:lo + 10].to(dtype))
        return acc, err.value

    for dtype, itemsize in ((torch.float64, 8), (torch.float32, 4), (torch.bfloat16, 2)):
        acc, err = kept(dtype)
        n = acc.n

        def need(m, itemsize=itemsize):  # the literal count: state, stored snapshots, N x N Gram + vectors
            return fixed + m * p * itemsize + 2 * m * m * 8

        assert need(n) <= cfg.memory_budget_bytes < need(n + 10), dtype
        assert acc.nbytes() == fixed + n * p * itemsize
        assert f"{n} snapshots are kept" in str(err)
        if dtype == torch.float64:
            n_f64 = n
            assert estimate_memory(32, n, cfg)["budgeted"] == need(n)  # the planner's count, exactly
        else:
            assert n > n_f64, dtype  # a narrow capture fills the budget with more snapshots
            assert acc.compute().n_snapshots == n


def test_auto_mode_switches_to_the_sketch_before_the_gram_matrix_would_pass_the_budget():
    cfg = PODConfig(storage_dtype=torch.float16, coherency=False, n_dominant=1, k_fit=5, memory_budget_bytes=2**20)
    fields = random_causal_fields(400, 32, seed=6)
    acc = PODAccumulator(cfg)
    modes = []
    for lo in range(0, 400, 20):
        acc.update(fields[lo:lo + 20])
        modes.append(acc.mode)
        if acc.mode == "exact":
            assert estimate_memory(32, acc.n, cfg, mode="exact")["budgeted"] <= cfg.memory_budget_bytes
    assert modes[-1] == "sketch" and acc.n == 400
    rank = acc.sketch.rank
    assert estimate_memory(32, 400, cfg)["sketch_rank"] == rank
    assert estimate_memory(32, 400, cfg)["budgeted"] <= cfg.memory_budget_bytes
    # the switch came once the exact state and its Gram matrix reached the limit left next to the sketch
    n_switch = 20 * modes.index("sketch") + 20
    assert estimate_memory(32, n_switch - 20, cfg, mode="exact")["budgeted"] <= cfg.memory_budget_bytes
    report = acc.compute()
    assert report.mode == "sketch" and report.n_snapshots == 400


def test_a_short_field_with_many_snapshots_is_accepted_and_analysed_from_its_small_covariance():
    # N = 25,000 at L = 8: a field has 36 stored entries; the budget of 8 MiB holds the snapshots
    # (6.9 MiB) and the 36 x 36 covariance, and compute never builds the 25,000 x 25,000 Gram (9.3 GiB)
    cfg = PODConfig(memory_budget_bytes=8 * 2**20, n_dominant=2)
    est = estimate_memory(8, 25_000, cfg)
    assert est["sketch_rank"] == 0 and est["budgeted"] <= 8 * 2**20
    assert est["budgeted"] - est["state"] == 2 * 36 * 36 * 8
    fields = random_causal_fields(25_000, 8, seed=7, temperature=0.3)
    acc = PODAccumulator(cfg)
    for lo in range(0, 25_000, 5_000):
        acc.update(fields[lo:lo + 5_000])
    assert acc.mode == "exact"
    report = acc.compute()
    assert report.status == "ok" and report.n_snapshots == 25_000
    sc = report.per_scale[0]
    u = literal_filtered_fluctuation(fields.numpy(), sc.scale)  # (N, 64)
    ref = np.linalg.eigvalsh(u.T @ u / u.shape[0])[::-1]  # the literal 64 x 64 covariance
    lam = sc.eigenvalues.numpy()
    assert lam.shape == (25_000,)  # one per snapshot, as in the method of snapshots: the rest are 0
    np.testing.assert_allclose(lam[:36], ref[:36], rtol=1e-9, atol=1e-13 * ref[0])
    assert np.all(lam[36:] == 0)
    assert abs(ref[36:]).max() <= 1e-13 * ref[0]  # the 28 entries above the diagonal carry nothing


def test_sketch_rank_is_never_more_than_the_entries_of_a_field():
    # L = 8: 36 stored entries. A sketch of 36 rows already holds the whole scatter.
    assert sketch_rank_for(8, PODConfig(mode="sketch")) == 36  # not 4 k_fit = 120
    assert sketch_rank_for(8, PODConfig(mode="sketch", sketch_rank=100)) == 36
    assert sketch_rank_for(8, PODConfig(mode="sketch", memory_budget_bytes=2**20)) == 36
    # auto mode takes a lossless sketch even below 2 k_fit rows
    assert sketch_rank_for(8, PODConfig(memory_budget_bytes=2**20)) == 36
    assert estimate_memory(8, 1000, PODConfig(mode="sketch"))["sketch_rank"] == 36
    assert sketch_rank_for(32, PODConfig(mode="sketch")) == 120  # 528 entries: the default stands
    fields = random_causal_fields(200, 8, seed=8, temperature=0.3)
    cfg = PODConfig(mode="sketch", sketch_rank=100, coherency=False, n_dominant=2)
    acc = PODAccumulator(cfg)
    acc.update(fields)
    assert acc.sketch.rank == 36 and acc.sketch.buffer.shape == (72, 36)
    report = acc.compute()
    assert any("sketch rank l = 36 instead of PODConfig.sketch_rank = 100" in m for m in report.messages)
    exact = analyze(fields, PODConfig(coherency=False, n_dominant=2))
    assert report.dominant_scales == exact.dominant_scales
    for sk, ex in zip(report.per_scale, exact.per_scale, strict=True):
        # 36 rows hold every direction: nothing was lost (the bound is at rounding level)
        assert sk.error_bound <= 1e-12 * float(ex.eigenvalues[0])
        torch.testing.assert_close(sk.eigenvalues[:36], ex.eigenvalues[:36], rtol=1e-8,
                                   atol=1e-12 * float(ex.eigenvalues[0]))
        assert math.isclose(sk.total_energy, ex.total_energy, rel_tol=1e-10)
