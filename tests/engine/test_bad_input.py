"""Bad input gets a clear error or a flagged report, never a crash deep inside."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from podmonitor import PODAccumulator, PODConfig, analyze
from tests.conftest import random_causal_fields


def test_non_square_and_wrong_rank_are_clear_errors():
    with pytest.raises(ValueError, match="square"):
        analyze(torch.rand(4, 8, 9))
    with pytest.raises(ValueError, match=r"\(N, L, L\)"):
        analyze(torch.rand(2, 3, 8, 8))
    with pytest.raises(ValueError, match=r"\(N, L, L\)"):
        analyze(torch.rand(8))
    with pytest.raises(TypeError, match="torch.Tensor or numpy.ndarray"):
        analyze([[1.0]])
    with pytest.raises(TypeError, match="real"):
        analyze(torch.rand(3, 8, 8, dtype=torch.complex64))


def test_length_change_between_updates_is_a_clear_error():
    acc = PODAccumulator()
    acc.update(random_causal_fields(3, 16))
    with pytest.raises(ValueError, match="L = 16, got L = 20"):
        acc.update(random_causal_fields(3, 20))
    assert acc.n == 3


def test_nan_and_inf_snapshots_are_skipped_and_counted():
    fields = random_causal_fields(12, 32, seed=1)
    bad = fields.clone()
    bad[2, 5, 3] = float("nan")
    bad[7, 0, 0] = float("inf")
    report = analyze(bad)
    assert report.n_snapshots == 10
    assert report.n_skipped_nonfinite == 2
    assert any("skipped" in m for m in report.messages)
    keep = [s for s in range(12) if s not in (2, 7)]
    clean = analyze(fields[keep])
    torch.testing.assert_close(report.per_scale[0].eigenvalues, clean.per_scale[0].eigenvalues)
    # a batch of only non-finite snapshots adds nothing
    acc = PODAccumulator()
    acc.update(torch.full((2, 8, 8), float("nan")))
    empty = acc.compute()
    assert empty.status == "empty" and empty.n_skipped_nonfinite == 2


@pytest.mark.parametrize("n", [1, 2])
def test_too_few_snapshots_is_flagged(n):
    report = analyze(random_causal_fields(n, 32))
    assert report.status == "too_few_snapshots"
    assert math.isnan(report.t_spec)
    assert report.per_scale == []
    assert report.effective_rank == {0.1: None, 0.05: None, 0.01: None}
    assert report.mean_scalogram.shape[0] == len(report.scales)  # what can be computed, is


def test_identical_snapshots_have_zero_variance_flag():
    one = random_causal_fields(1, 32)
    report = analyze(one.expand(6, 32, 32))
    assert report.status == "zero_variance"
    assert math.isnan(report.t_spec)
    assert report.dominant_scales == []
    assert float(report.scalogram.abs().max()) < 1e-25
    assert math.isnan(report.scale_centroid)


def test_sequence_shorter_than_smallest_scale():
    report = analyze(random_causal_fields(5, 3))
    assert report.status == "no_scales"
    assert len(report.scales) == 0
    assert "supports no scale" in " ".join(report.messages)
    assert not math.isnan(report.mean_attention_distance)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_input_is_upcast(dtype):
    fields = random_causal_fields(10, 32, seed=2).to(dtype)
    report = analyze(fields)
    ref = analyze(fields.to(torch.float64))
    assert report.status == "ok"
    torch.testing.assert_close(report.per_scale[0].eigenvalues, ref.per_scale[0].eigenvalues)
    assert report.dominant_scales == ref.dominant_scales


def test_mass_above_diagonal_of_causal_field_is_an_error():
    fields = random_causal_fields(4, 16)
    with pytest.raises(ValueError, match="above the diagonal"):
        analyze(fields + 0.01, PODConfig(causal=True))
    acc = PODAccumulator()
    acc.update(fields)  # inferred causal
    with pytest.raises(ValueError, match="inferred from the first batch"):
        acc.update(fields.transpose(1, 2))


def test_negative_entries_are_reported():
    fields = random_causal_fields(6, 16) - 0.01 * torch.eye(16, dtype=torch.float64)
    report = analyze(fields)
    assert any("negative" in m for m in report.messages)


def test_numpy_input_equals_torch_input():
    fields = random_causal_fields(8, 24, seed=3)
    a = analyze(fields.numpy())
    b = analyze(fields)
    np.testing.assert_array_equal(a.per_scale[0].eigenvalues.numpy(), b.per_scale[0].eigenvalues.numpy())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scales": ()}, "must not be empty"),
        ({"scales": (4.0, 2.0)}, "increasing"),
        ({"scales": (-1.0, 2.0)}, "positive"),
        ({"n_dominant": 0}, "n_dominant"),
        ({"dominant_method": "best"}, "dominant_method"),
        ({"window": "hann"}, "window"),
        ({"k_fit": 2}, "k_fit"),
        ({"eps": (0.0,)}, "eps"),
        ({"min_snapshots": 2}, "min_snapshots"),
        ({"memory_budget_bytes": 0}, "memory_budget_bytes"),
        ({"dtype": torch.float16}, "dtype"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PODConfig(**kwargs)


def test_config_dict_round_trip():
    cfg = PODConfig(window="band", dtype=torch.float32, storage_dtype=torch.float16, eps=(0.2,))
    assert PODConfig.from_dict(cfg.to_dict()) == cfg


def _causal_logits(n: int, seq_len: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return (torch.randn(n, seq_len, seq_len, generator=g, dtype=torch.float64) * 4).masked_fill(~mask, 0.0)


def test_raw_scores_are_flagged_not_normalised():
    # a capture function that returns pre-softmax scores (zero above the diagonal, so still causal)
    scores = _causal_logits(12, 32, seed=1)
    report = analyze(scores)
    assert report.status == "not_normalised"
    assert report.n_not_normalised == 12
    assert report.max_row_sum_error > 1
    assert any("do not sum to 1" in m and "12 of 12" in m for m in report.messages)
    assert report.to_dict()["n_not_normalised"] == 12


def test_heads_summed_instead_of_averaged_are_flagged_and_averaged_heads_are_ok():
    heads = torch.stack([random_causal_fields(10, 32, seed=s) for s in range(4)], dim=1)  # (N, H, L, L)
    summed = analyze(heads.sum(1))
    assert summed.status == "not_normalised" and summed.n_not_normalised == 10
    assert math.isclose(summed.max_row_sum_error, 3.0, rel_tol=1e-12)  # every row sums to H = 4
    averaged = analyze(heads.mean(1))
    assert averaged.status == "ok" and averaged.n_not_normalised == 0
    assert not any("do not sum to 1" in m for m in averaged.messages)


def test_only_the_snapshots_that_are_off_are_counted_and_the_count_survives_merge_and_checkpoint():
    fields = random_causal_fields(10, 24, seed=2)
    fields[3] *= 1.5
    fields[7, 5] *= 0.5  # one row of one snapshot
    acc = PODAccumulator()
    acc.update(fields[:5])
    other = PODAccumulator()
    other.update(fields[5:])
    restored = PODAccumulator()
    restored.load_state_dict(other.state_dict())
    acc.merge(restored)
    report = acc.compute()
    assert report.n_not_normalised == 2 and report.status == "not_normalised"
    assert math.isclose(report.max_row_sum_error, 0.5, rel_tol=1e-12)
    # states saved before the count existed load with a count of zero
    state = other.state_dict()
    del state["n_not_normalised"], state["max_row_sum_error"]
    old = PODAccumulator()
    old.load_state_dict(state)
    assert old.n_not_normalised == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rounded_probabilities_are_not_flagged(dtype):
    # softmax output stored in half precision: every row sums to 1 up to the rounding of its entries
    fields = random_causal_fields(8, 64, seed=3).to(dtype)
    assert analyze(fields).status == "ok"


def test_bidirectional_rows_are_checked_over_all_keys():
    g = torch.Generator().manual_seed(4)
    fields = torch.softmax(torch.randn(8, 16, 16, generator=g, dtype=torch.float64), dim=-1)
    assert analyze(fields).status == "ok"
    report = analyze(fields * 2)
    assert report.status == "not_normalised" and "all j" in " ".join(report.messages)
