"""Incremental accumulation == one-shot analysis; persistence; merging; memory budget."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from podmonitor import MemoryBudgetError, PODAccumulator, PODConfig, analyze, estimate_memory
from podmonitor.synthetic import Oscillation, oscillation_ensemble
from tests.conftest import random_causal_fields

CFG = PODConfig(n_dominant=3)


def assert_reports_equal(a, b, rtol=1e-9):
    assert a.status == b.status
    assert a.n_snapshots == b.n_snapshots
    assert a.dominant_scales == b.dominant_scales
    torch.testing.assert_close(a.scalogram, b.scalogram, rtol=rtol, atol=1e-15)
    torch.testing.assert_close(a.mean_scalogram, b.mean_scalogram, rtol=rtol, atol=1e-15)
    torch.testing.assert_close(a.mean_field, b.mean_field, rtol=rtol, atol=1e-15)
    assert math.isclose(a.entropy, b.entropy, rel_tol=1e-12)
    assert math.isclose(a.mean_attention_distance, b.mean_attention_distance, rel_tol=1e-12)
    for sa, sb in zip(a.per_scale, b.per_scale, strict=True):
        lam1 = float(sa.eigenvalues[0])
        torch.testing.assert_close(sa.eigenvalues, sb.eigenvalues, rtol=rtol, atol=1e-12 * lam1)
        assert sa.effective_rank == sb.effective_rank
        assert math.isclose(sa.t_spec, sb.t_spec, rel_tol=1e-8)
        # modes with distinct eigenvalues are unique up to sign, and signs are fixed
        k = 3
        torch.testing.assert_close(sa.mode_lag_profiles[:k], sb.mode_lag_profiles[:k], rtol=1e-6, atol=1e-9)
    if a.coherency is not None:
        torch.testing.assert_close(a.coherency, b.coherency, rtol=1e-7, atol=1e-9, equal_nan=True)


@pytest.fixture(scope="module")
def fields():
    return oscillation_ensemble(40, 48, [Oscillation(6.0, 8.0, 8.0, 0.03), Oscillation(16.0, 20.0, 16.0, 0.03)], seed=0)


@pytest.fixture(scope="module")
def reference(fields):
    return analyze(fields, CFG)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(min_value=1, max_value=39), max_size=6, unique=True))
def test_incremental_equals_one_shot(fields, reference, cuts):
    bounds = [0, *sorted(cuts), 40]
    acc = PODAccumulator(CFG)
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        acc.update(fields[lo:hi])
    assert_reports_equal(acc.compute(), reference)


def test_single_snapshots_numpy_and_float32_storage(fields, reference):
    acc = PODAccumulator(CFG)
    for s in range(40):
        acc.update(fields[s].numpy())  # one (L, L) numpy field at a time
    assert_reports_equal(acc.compute(), reference)


def test_state_dict_round_trip_then_continue(fields, reference):
    acc = PODAccumulator(CFG)
    acc.update(fields[:17])
    buf = io.BytesIO()
    torch.save(acc.state_dict(), buf)
    buf.seek(0)
    restored = PODAccumulator(CFG)
    restored.load_state_dict(torch.load(buf, weights_only=True))
    restored.update(fields[17:])
    assert_reports_equal(restored.compute(), reference)


def test_state_dict_rejects_other_config(fields):
    acc = PODAccumulator(CFG)
    acc.update(fields[:5])
    other = PODAccumulator(PODConfig(n_dominant=2))
    with pytest.raises(ValueError, match="different PODConfig"):
        other.load_state_dict(acc.state_dict())


def test_merge_equals_one_accumulator_over_both_halves(fields, reference):
    left, right = PODAccumulator(CFG), PODAccumulator(CFG)
    left.update(fields[:13])
    right.update(fields[13:25])
    right.update(fields[25:])
    merged = left.merge(right)
    assert merged is left
    assert_reports_equal(merged.compute(), reference)
    # merging into an empty accumulator
    empty = PODAccumulator(CFG)
    full = PODAccumulator(CFG)
    full.update(fields)
    assert_reports_equal(empty.merge(full).compute(), reference)


def test_merge_rejects_mismatch(fields):
    a, b = PODAccumulator(CFG), PODAccumulator(CFG)
    a.update(fields[:5])
    b.update(random_causal_fields(5, 32))
    with pytest.raises(ValueError, match="L = 48 and L = 32"):
        a.merge(b)
    c = PODAccumulator(PODConfig())
    c.update(fields[:5])
    with pytest.raises(ValueError, match="different PODConfig"):
        a.merge(c)


def test_memory_budget_refuses_without_losing_data(fields):
    per_snapshot = estimate_memory(48, 1, CFG)["state"] - estimate_memory(48, 0, CFG)["state"]
    budget = estimate_memory(48, 10, CFG)["state"] + per_snapshot // 2
    acc = PODAccumulator(PODConfig(n_dominant=3, memory_budget_bytes=budget))
    acc.update(fields[:10])
    assert acc.nbytes() == estimate_memory(48, 10, CFG)["state"]
    with pytest.raises(MemoryBudgetError, match="budget"):
        acc.update(fields[10:12])
    assert acc.n == 10  # nothing lost, nothing half-added
    ref = analyze(fields[:10], CFG)
    assert_reports_equal(acc.compute(), ref)


def test_band_storage_holds_only_lags_with_window_weight():
    # L = 512 with the default grid (largest scale 64, lowpass, tol 1e-8): lags up to 64 * 6.07
    acc = PODAccumulator(PODConfig())
    acc.update(random_causal_fields(2, 512, seed=1))
    expected_lags = int(64 * math.sqrt(2 * math.log(1e8))) + 1
    assert acc.band.n_lags == expected_lags
    assert acc.band.size == sum(512 - t for t in range(expected_lags))
    assert acc.band.size < 512 * 513 // 2


def test_update_cost_does_not_depend_on_snapshots_seen(monkeypatch):
    # update() touches only the new batch: count the floating-point work of the matrix
    # products it runs (not a timing) after 5 and after 50 snapshots
    import podmonitor.engine.accumulator as accmod
    from podmonitor.engine.lags import LagShear

    work = []
    real_moment = accmod.lag_moment
    real_back, real_fwd = LagShear.add_backward_moment, LagShear.add_forward_moment

    def counting(signals, **kw):
        work.append(signals.numel() * signals.shape[-1])
        return real_moment(signals, **kw)

    def counting_back(self, out):
        work.append(self.loaded * self.seq_len ** 3)
        return real_back(self, out)

    def counting_fwd(self, out):
        work.append(self.loaded * self.seq_len ** 3)
        return real_fwd(self, out)

    monkeypatch.setattr(accmod, "lag_moment", counting)
    monkeypatch.setattr(LagShear, "add_backward_moment", counting_back)
    monkeypatch.setattr(LagShear, "add_forward_moment", counting_fwd)
    for causal in (True, False):
        acc = PODAccumulator(PODConfig(causal=causal))
        batch = random_causal_fields(5, 32, seed=2)
        if not causal:
            batch = batch + batch.transpose(1, 2)
        acc.update(batch)  # the first update has no between-group term: compare from the second on
        work.clear()
        acc.update(batch)
        second = sum(work)
        assert second > 0
        for _ in range(9):
            acc.update(batch)
        work.clear()
        acc.update(batch)
        assert acc.n == 60
        assert sum(work) == second


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu(fields, reference):
    acc = PODAccumulator(CFG)
    acc.update(fields.cuda())
    report = acc.compute()
    assert_reports_equal(report, reference, rtol=1e-7)


def _state_snapshot(acc):
    return {
        "n": acc.n, "skipped": acc.n_skipped_nonfinite, "negative": acc.n_negative,
        "dtypes": set(acc.input_dtypes), "seq_len": acc.seq_len, "chunks": len(acc.chunks),
        "mean": None if acc.mean_field is None else acc.mean_field.clone(),
        "m2": None if acc.m2_back is None else acc.m2_back.clone(),
        "entropy": None if acc.entropy_sum is None else acc.entropy_sum.clone(),
    }


def test_failure_while_adding_leaves_the_accumulator_as_it_was(monkeypatch):
    import podmonitor.engine.running as accmod  # the entropy is a step of the running state

    def failing(*args, **kwargs):
        raise MemoryError("simulated")

    fields = random_causal_fields(6, 16, seed=30)
    bad = fields.clone()
    bad[0, 3, 1] = float("nan")  # skipped and counted, but only if the batch is added
    bad[1, 4, 2] = -0.1  # negative, counted only if added

    # first batch: the accumulator goes back to empty
    acc = PODAccumulator(PODConfig())
    with monkeypatch.context() as m:
        m.setattr(accmod, "row_entropy", failing)
        with pytest.raises(MemoryError):
            acc.update(bad)
    assert acc.seq_len is None and acc.n == 0 and acc.n_skipped_nonfinite == 0 and acc.n_negative == 0
    # a later batch: nothing of it is added
    acc.update(fields)
    before = _state_snapshot(acc)
    with monkeypatch.context() as m:
        m.setattr(accmod, "row_entropy", failing)
        with pytest.raises(MemoryError):
            acc.update(bad)
    after = _state_snapshot(acc)
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key]), key
        else:
            assert value == after[key], key
    # and the accumulator still works, equal to one fed the same good batches
    acc.update(bad)
    ref = PODAccumulator(PODConfig())
    ref.update(fields)
    ref.update(bad)
    assert acc.n == ref.n == 11 and acc.n_skipped_nonfinite == 1 and acc.n_negative == 1
    torch.testing.assert_close(acc.m2_back, ref.m2_back, rtol=0, atol=0)


def test_non_contiguous_and_converted_input_match_the_literal_moments():
    from tests.conftest import literal_lag_signals

    def literal(x):
        """mean field and centred backward lag moment by the formula, in numpy float64"""
        x = x.astype("float64")
        d = literal_lag_signals(x - x.mean(0))
        return x.mean(0), np.einsum("sit,siu->tu", d, d)

    fields = random_causal_fields(5, 20, seed=31)
    strided = torch.zeros(5, 20, 40, dtype=torch.float64)
    strided[:, :, ::2] = fields  # a non-contiguous view with the same values
    mean, moment = literal(fields.numpy())
    acc = PODAccumulator(PODConfig())
    acc.update(strided[:, :, ::2])
    np.testing.assert_allclose(acc.mean_field.numpy(), mean, rtol=1e-14, atol=1e-17)
    np.testing.assert_allclose(acc.m2_back.numpy(), moment, rtol=1e-12, atol=1e-15)
    assert torch.equal(acc.chunks[0], acc.band.extract(fields))
    f32 = fields.float()  # converted step by step inside the update
    mean, moment = literal(f32.numpy())
    # float64 products on request (the default's float32 products: tests/engine/test_moment_precision.py)
    as_f32 = PODAccumulator(PODConfig(moment_dtype=torch.float64))
    as_f32.update(f32)
    np.testing.assert_allclose(as_f32.mean_field.numpy(), mean, rtol=1e-14, atol=1e-17)
    np.testing.assert_allclose(as_f32.m2_back.numpy(), moment, rtol=1e-12, atol=1e-15)


def test_sketch_is_fed_in_bounded_parts(monkeypatch):
    import podmonitor.engine.accumulator as accmod
    import podmonitor.engine.store as storemod

    cfg = PODConfig(n_dominant=1, mode="sketch", sketch_rank=8, coherency=False)
    fields = random_causal_fields(40, 16, seed=32)
    acc = PODAccumulator(cfg)
    sizes = []
    real = storemod.SketchStore.add

    def recording(self, rows):
        sizes.append(rows.shape[0])
        return real(self, rows)

    monkeypatch.setattr(storemod.SketchStore, "add", recording)
    row_bytes = 136 * 8  # 16 * 17 / 2 band entries of float64
    monkeypatch.setattr(storemod, "SKETCH_FEED_BYTES", 7 * row_bytes)
    monkeypatch.setattr(accmod, "SUB_BYTES", 3 * 16 * 16 * 8)  # steps of 3 fields
    acc.update(fields)
    assert sum(sizes) == 40 and max(sizes) <= 7 and acc.sketch.n == 40
    whole = PODAccumulator(cfg)
    monkeypatch.setattr(storemod, "SKETCH_FEED_BYTES", 2**30)
    whole.update(fields)  # the mean, moments and entropies do not depend on the parts
    torch.testing.assert_close(acc.m2_back, whole.m2_back, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(acc.entropy_sum, whole.entropy_sum, rtol=1e-13, atol=0)
