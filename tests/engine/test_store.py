"""The snapshot stores behind one interface, and the running state declared once."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from podmonitor import PODAccumulator, PODConfig
from podmonitor.engine.lags import LagBand, lag_window
from podmonitor.engine.running import RUNNING
from podmonitor.engine.store import ExactStore, SketchStore, stored_dtype
from tests.conftest import random_causal_fields

CFG = PODConfig(coherency=False, n_modes=4)


def _band_rows(fields: torch.Tensor) -> tuple[LagBand, torch.Tensor]:
    band = LagBand.build(fields.shape[-1], fields.shape[-1], causal=True)
    return band, band.extract(fields)


def _literal_eigenvalues(rows: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Eigenvalues of C = U U^T / N for U = (X - mean) W, by numpy's SVD."""
    u = (rows - rows.mean(0))[:, : weights.size] * weights
    return np.linalg.svd(u, compute_uv=False) ** 2 / rows.shape[0]


@pytest.mark.parametrize("kind", ["exact", "sketch"])
def test_both_stores_give_the_literal_pod_and_say_how_exact_it_is(kind):
    fields = random_causal_fields(30, 12, seed=11)
    band, rows = _band_rows(fields)
    dev = torch.device("cpu")
    # a sketch of l = 12 rows of a 78-entry field: shrinks happen, and the bound is reported
    store = ExactStore(band, CFG, dev) if kind == "exact" else SketchStore(band, CFG, dev, rank=12)
    for lo in range(0, 30, 7):
        store.add(rows[lo:lo + 7].clone())
    assert store.n == 30 and store.nbytes() > 0
    weights = lag_window(band.lag[: band.prefix(6)], 3.0, "lowpass")
    eig = store.pod(weights, center=rows.mean(0))
    ref = _literal_eigenvalues(rows.numpy(), weights.numpy())
    lam = eig.eigenvalues.numpy()
    assert abs(eig.total_energy - ref.sum()) <= 1e-12 * ref.sum()  # exact in both stores
    if kind == "exact":
        assert eig.error_bound == 0.0 and eig.eigenvalues_lower is None
        np.testing.assert_allclose(lam[: ref.size], ref, rtol=1e-9, atol=1e-14 * ref[0])
        assert eig.coefficients is not None and eig.coefficients.shape == (30, 4)
    else:
        assert eig.error_bound > 0 and eig.coefficients is None
        k = lam.size
        assert np.all(eig.eigenvalues_lower.numpy() <= ref[:k] + 1e-12)
        assert np.all(ref[:k] <= eig.eigenvalues_lower.numpy() + eig.error_bound + 1e-12)
        assert np.all(np.abs(lam - ref[:k]) <= eig.error_bound + 1e-12)


def test_exact_store_turns_into_a_sketch_holding_the_same_snapshots():
    fields = random_causal_fields(20, 10, seed=12)
    band, rows = _band_rows(fields)
    dev = torch.device("cpu")
    exact = ExactStore(band, CFG, dev)
    exact.add(rows[:8].clone())
    exact.add(rows[8:].clone())
    direct = SketchStore(band, CFG, dev, rank=55)  # l = P: lossless
    direct.add(rows)
    moved = exact.to_sketch(55)
    assert exact.chunks == [] and moved.n == 20
    weights = lag_window(band.lag, 2.5, "lowpass")
    a, b = moved.pod(weights, rows.mean(0)), direct.pod(weights, rows.mean(0))
    torch.testing.assert_close(a.eigenvalues, b.eigenvalues, rtol=1e-10, atol=1e-15)
    assert a.error_bound <= 1e-12 * float(a.eigenvalues[0])
    # merging: a sketch takes exact snapshots and sketches; an exact store refuses a sketch
    other = ExactStore(band, CFG, dev)
    other.add(rows[:5].clone())
    moved.merge(other)
    assert moved.n == 25
    with pytest.raises(TypeError, match="sketch first"):
        other.merge(moved)


def test_every_running_quantity_is_saved_merged_and_reset_from_the_table():
    fields = random_causal_fields(12, 16, seed=13)
    fields[2] *= 2.0  # not normalised
    fields[5, 4, 0] = -0.01  # negative
    nan = fields[:2].clone()
    nan[0, 3, 1] = float("nan")
    batches = [fields[:6], nan, fields[6:].float(), fields[:1], fields[:0]]  # two dtypes, an empty batch
    # float64 products also for the float32 batch: the merge algebra is exact, float32 products
    # round differently for different groupings (their bound: tests/engine/test_moment_precision.py)
    cfg = replace(CFG, moment_dtype=torch.float64)
    one = PODAccumulator(cfg)
    for part in batches:
        one.update(part)
    a, b = PODAccumulator(cfg), PODAccumulator(cfg)
    for part in batches[:2]:
        a.update(part)
    for part in batches[2:]:
        b.update(part)
    merged = a.merge(b)
    restored = PODAccumulator(cfg)
    restored.load_state_dict(merged.state_dict())
    state = merged.state_dict()
    for r in RUNNING:
        assert r.name in state, r.name
        for acc in (merged, restored):
            got, want = getattr(acc, r.name), getattr(one, r.name)
            if isinstance(want, torch.Tensor):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
            elif r.kind == "float":
                assert got == pytest.approx(want, rel=1e-12), r.name
            else:
                assert got == want, r.name
    assert merged.n == 14 and merged.n_skipped_nonfinite == 1 and merged.n_negative == 1
    assert merged.n_not_normalised == 2  # (the negative entry moved a row sum off 1 too)
    assert merged.input_dtypes == {"float32", "float64"}
    merged.reset()
    assert all(getattr(merged, r.name) == r.initial() for r in RUNNING if r.kind != "tensor")
    assert all(getattr(merged, r.name) is None for r in RUNNING if r.kind == "tensor")
    assert merged.nbytes() == 0


def _same_report(a, b) -> None:
    """Every number of two reports equal (not merely close)."""
    assert a.dominant_scales == b.dominant_scales and a.t_spec == b.t_spec and a.entropy == b.entropy
    assert torch.equal(a.scalogram, b.scalogram)
    for sa, sb in zip(a.per_scale, b.per_scale, strict=True):
        assert torch.equal(sa.eigenvalues, sb.eigenvalues) and sa.t_spec == sb.t_spec
        assert sa.effective_rank == sb.effective_rank and torch.equal(sa.modes, sb.modes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_narrow_fields_are_stored_as_given_in_less_memory_with_the_same_numbers(dtype):
    fields = random_causal_fields(24, 40, seed=13).to(dtype)
    default = PODAccumulator(PODConfig(n_modes=4))  # storage_dtype None: narrow fields kept as given
    wide = PODAccumulator(PODConfig(n_modes=4, storage_dtype=torch.float64))  # as before
    for acc in (default, wide):
        acc.update(fields[:10])
        acc.update(fields[10:])
    # the stored entries are the input's own values, in its dtype: a literal numpy gather of the band
    band = default.band
    literal = fields.double().numpy()[:, band.rows.numpy(), band.cols.numpy()]
    assert all(c.dtype == dtype for c in default.chunks)
    np.testing.assert_array_equal(torch.cat(default.chunks).double().numpy(), literal)
    np.testing.assert_array_equal(torch.cat(wide.chunks).numpy(), literal)
    assert default.store.nbytes() * (8 // dtype.itemsize) == wide.store.nbytes()
    _same_report(default.compute(), wide.compute())
    # a checkpoint keeps the dtype, and an accumulator fed float64 fields merges with it
    restored = PODAccumulator(PODConfig(n_modes=4))
    restored.load_state_dict(default.state_dict())
    assert restored.chunks[0].dtype == dtype
    more = random_causal_fields(6, 40, seed=14)
    other_default = PODAccumulator(PODConfig(n_modes=4))
    other_wide = PODAccumulator(PODConfig(n_modes=4, storage_dtype=torch.float64))
    other_default.update(more)
    other_wide.update(more)
    _same_report(restored.merge(other_default).compute(), wide.merge(other_wide).compute())


def test_only_float32_float16_and_bfloat16_are_kept_as_given():
    cfg = PODConfig()  # float64 compute, storage_dtype None
    assert [stored_dtype(cfg, d) for d in (torch.float32, torch.float16, torch.bfloat16)] == \
        [torch.float32, torch.float16, torch.bfloat16]
    assert stored_dtype(cfg, torch.float64) == torch.float64
    assert stored_dtype(cfg, torch.int64) == torch.float64
    assert stored_dtype(cfg, torch.float8_e4m3fn) == torch.float64  # exotic types are converted
    assert stored_dtype(PODConfig(dtype=torch.float32), torch.float32) == torch.float32
    assert stored_dtype(PODConfig(dtype=torch.float32), torch.bfloat16) == torch.bfloat16
    assert stored_dtype(PODConfig(storage_dtype=torch.float64), torch.float32) == torch.float64
