"""StabilityAccumulator against literal formulas (numpy loops, METHOD.md section 10)."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
import torch

from podmonitor.engine.lags import plogp_
from podmonitor.engine.stability import StabilityAccumulator, StabilityRows


def random_fields(b: int, h: int, t: int, causal: bool, seed: int = 0, sharp: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = sharp * torch.randn(b, h, t, t, generator=g)
    if causal:
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf)
    return s.softmax(-1)


def literal(fields: np.ndarray, logits: np.ndarray | None, causal: bool) -> dict:
    """The section 10 signals by loops over sequences, heads, rows and keys (float64)."""
    n, h, t, _ = fields.shape
    out = {"entropy": [], "sink": [], "max_prob": [], "row_max": [], "max_logit": []}
    for head in range(h):
        ent, sink, row_max, max_prob = [], [], [], -np.inf
        for s in range(n):
            a = fields[s, head].astype(np.float64)
            for i in range(t):
                n_vis = i + 1 if causal else t
                if i >= 1:
                    sink.append(a[i, 0])
                if n_vis < 2:
                    continue
                e = 0.0
                for j in range(n_vis):
                    p = a[i, j]
                    if p > 0:
                        e -= p * math.log(p)
                ent.append(e / math.log(n_vis))
                row_max.append(a[i].max())
                max_prob = max(max_prob, a[i].max())
        out["entropy"].append(np.mean(ent))
        out["sink"].append(np.mean(sink))
        out["row_max"].append(np.mean(row_max))
        out["max_prob"].append(max_prob)
        if logits is not None:
            out["max_logit"].append(max(logits[s, head] for s in range(n)))
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_stability_signals_match_literal_formulas(causal) -> None:
    f1, f2 = random_fields(3, 4, 12, causal, seed=1), random_fields(2, 4, 12, causal, seed=2)
    l1, l2 = torch.randn(3, 4), torch.randn(2, 4) + 3.0
    acc = StabilityAccumulator()
    acc.update(f1, l1, causal=causal)
    acc.update(f2, l2, causal=causal)
    rep = acc.compute()
    ref = literal(torch.cat([f1, f2]).numpy(), torch.cat([l1, l2]).numpy(), causal)
    assert rep.n_snapshots == 5 and rep.n_heads == 4 and rep.causal is causal and rep.status == "ok"
    np.testing.assert_allclose(rep.entropy, ref["entropy"], rtol=1e-6)
    np.testing.assert_allclose(rep.sink_mass, ref["sink"], rtol=1e-6)
    np.testing.assert_allclose(rep.mean_row_max, ref["row_max"], rtol=1e-6)
    np.testing.assert_allclose(rep.max_prob, ref["max_prob"], rtol=1e-6)
    np.testing.assert_allclose(rep.max_logit, ref["max_logit"], rtol=1e-6)
    assert rep.entropy_min == pytest.approx(min(ref["entropy"]), rel=1e-6)
    assert rep.entropy_mean == pytest.approx(np.mean(ref["entropy"]), rel=1e-6)
    assert rep.sink_mass_max == pytest.approx(max(ref["sink"]), rel=1e-6)
    assert rep.max_logit_layer == pytest.approx(max(ref["max_logit"]), rel=1e-6)
    assert any("query 0" in m for m in rep.messages) is causal


def test_stability_entropy_collapse_of_one_head() -> None:
    """Head 2 driven to one-hot rows: its normalised entropy is 0 and it is the layer minimum."""
    t = 16
    fields = random_fields(4, 3, t, causal=True, sharp=0.5)
    g = torch.Generator().manual_seed(5)
    one_hot = torch.zeros(4, t, t)
    for s in range(4):
        for i in range(t):
            one_hot[s, i, int(torch.randint(0, i + 1, (1,), generator=g))] = 1.0
    fields[:, 2] = one_hot
    acc = StabilityAccumulator()
    acc.update(fields, causal=True)
    rep = acc.compute()
    ref = literal(fields.numpy(), None, causal=True)
    assert rep.entropy[2] == pytest.approx(0.0, abs=1e-12)
    assert rep.entropy_min == pytest.approx(0.0, abs=1e-12)
    assert min(rep.entropy[0], rep.entropy[1]) > 0.8  # soft heads: near-uniform rows
    np.testing.assert_allclose(rep.entropy, ref["entropy"], rtol=1e-6, atol=1e-12)
    assert rep.max_prob[2] == 1.0 and rep.mean_row_max[2] == pytest.approx(1.0)
    assert rep.max_logit is None and rep.max_logit_layer is None
    assert any("max_logit unknown" in m for m in rep.messages)


def test_stability_planted_sink() -> None:
    """Head 1 puts 0.9 on key 0 in every row i >= 1 (the rest spread uniformly): sink mass 0.9."""
    t = 10
    fields = random_fields(3, 2, t, causal=True)
    sink_head = torch.zeros(3, t, t)
    sink_head[:, 0, 0] = 1.0
    for i in range(1, t):
        sink_head[:, i, 0] = 0.9
        sink_head[:, i, 1 : i + 1] = 0.1 / i
    fields[:, 1] = sink_head
    acc = StabilityAccumulator()
    acc.update(fields, causal=True)
    rep = acc.compute()
    ref = literal(fields.numpy(), None, causal=True)
    assert rep.sink_mass[1] == pytest.approx(0.9, rel=1e-6)
    assert rep.sink_mass_max == pytest.approx(0.9, rel=1e-6)
    np.testing.assert_allclose(rep.sink_mass, ref["sink"], rtol=1e-6)
    assert rep.sink_mass[0] < 0.6


def test_stability_merge_and_state_dict_equal_one_accumulator() -> None:
    f = random_fields(6, 3, 8, causal=True, seed=3)
    lm = torch.randn(6, 3)
    whole = StabilityAccumulator()
    whole.update(f, lm, causal=True)
    a, b = StabilityAccumulator(), StabilityAccumulator()
    a.update(f[:2], lm[:2], causal=True)
    b.update(f[2:], lm[2:], causal=True)
    state = pickle.loads(pickle.dumps(b.state_dict()))  # what all_gather_object sends
    merged = a.merge(StabilityAccumulator.from_state_dict(state)).compute().to_dict()
    ref = whole.compute().to_dict()
    assert merged.keys() == ref.keys()
    for key, value in ref.items():
        if isinstance(value, list) and value and isinstance(value[0], float):
            np.testing.assert_allclose(merged[key], value, rtol=1e-12)
        elif isinstance(value, float):
            assert merged[key] == pytest.approx(value, rel=1e-12)
        else:
            assert merged[key] == value
    assert StabilityAccumulator().merge(a).n_snapshots == 6  # into an empty one


def test_stability_skips_nonfinite_sequences_and_writes_strict_json() -> None:
    f = random_fields(3, 2, 6, causal=False)
    f[1, 0, 2, 3] = float("nan")
    acc = StabilityAccumulator()
    acc.update(f, torch.randn(3, 2), causal=False)
    rep = acc.compute()
    assert rep.n_snapshots == 2 and rep.n_skipped_nonfinite == 1
    ref = literal(f[[0, 2]].numpy(), None, causal=False)
    np.testing.assert_allclose(rep.entropy, ref["entropy"], rtol=1e-6)
    json.dumps(rep.to_dict(), allow_nan=False)
    empty = StabilityAccumulator().compute()
    assert empty.status == "empty" and empty.n_snapshots == 0
    json.dumps(empty.to_dict(), allow_nan=False)


@pytest.mark.parametrize("causal", [True, None, False])
@pytest.mark.parametrize("t", [2, 7, 150])
def test_stability_skips_exactly_the_sequences_a_literal_isfinite_check_finds(causal, t) -> None:
    """Finiteness is read from the sums (every entry enters a block's p log p sum, row 0 apart):
    NaN or +-Inf placed in row 0, inside a row block, right of a causal block or at the last key
    skips exactly the sequences ``torch.isfinite`` flags, and the others give the literal signals."""
    g = torch.Generator().manual_seed(t)
    f = random_fields(8, 3, t, causal=causal is not False, seed=t)
    spots = [(0, 0, 0, t - 1), (1, 2, t - 1, 0), (2, 1, t // 2, min(t - 1, t // 2 + 1)), (3, 0, 0, 0),
             (4, 2, t - 1, t - 1), (5, 1, 1, t - 1)]
    bad_values = [float("nan"), float("inf"), float("-inf")]
    for k, spot in enumerate(spots):
        f[spot] = bad_values[int(torch.randint(0, 3, (1,), generator=g)) if k else 0]
    literal_finite = torch.isfinite(f).flatten(1).all(dim=1)
    assert int((~literal_finite).sum()) == len(spots)  # the check below can fail: six bad, two good
    acc = StabilityAccumulator()
    acc.update(f, causal=causal)
    rep = acc.compute()
    assert rep.n_skipped_nonfinite == len(spots) and rep.n_snapshots == 2
    # the good ones: as a literal computation (a field with a NaN above the diagonal is not causal)
    treated_causal = causal is True or (causal is None and bool((f.triu(1) == 0).all()))
    ref = literal(f[literal_finite].numpy(), None, treated_causal)
    np.testing.assert_allclose(rep.entropy, ref["entropy"], rtol=1e-6)
    np.testing.assert_allclose(rep.sink_mass, ref["sink"], rtol=1e-6)
    json.dumps(rep.to_dict(), allow_nan=False)


def test_stability_skips_a_sequence_whose_p_log_p_overflows() -> None:
    # not a probability: p log p of 3e38 overflows float32; the sequence is skipped (and counted)
    # instead of turning the running entropy into Inf
    f = random_fields(2, 2, 6, causal=True, seed=3)
    f[1, 0, 5, 0] = 3e38
    acc = StabilityAccumulator()
    acc.update(f, causal=True)
    rep = acc.compute()
    assert rep.n_skipped_nonfinite == 1 and rep.n_snapshots == 1
    np.testing.assert_allclose(rep.entropy, literal(f[:1].numpy(), None, True)["entropy"], rtol=1e-6)


def test_stability_infers_causality_and_rejects_bad_input() -> None:
    acc = StabilityAccumulator()
    acc.update(random_fields(1, 2, 5, causal=True))
    assert acc.compute().causal is True
    with pytest.raises(ValueError, match="heads"):
        acc.update(random_fields(1, 3, 5, causal=True))
    with pytest.raises(ValueError, match=r"\(B, H, T, T\)"):
        acc.update(torch.rand(2, 5, 5))
    with pytest.raises(ValueError, match="logit_max"):
        acc.update(random_fields(1, 2, 5, causal=True), torch.zeros(2, 2))
    with pytest.raises(TypeError):
        acc.update([[1.0]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="version"):
        acc.load_state_dict({"version": 99})


@pytest.mark.parametrize("causal", [True, False])
def test_stability_long_rows_in_blocks_match_literal_formulas(causal) -> None:
    # T = 150: the entropy pass works in row blocks of 64 (causal: only the keys left of a block's end)
    f = random_fields(2, 2, 150, causal, seed=5)
    acc = StabilityAccumulator()
    acc.update(f, causal=causal)
    rep = acc.compute()
    ref = literal(f.numpy(), None, causal)
    np.testing.assert_allclose(rep.entropy, ref["entropy"], rtol=1e-6)
    np.testing.assert_allclose(rep.mean_row_max, ref["row_max"], rtol=1e-6)
    np.testing.assert_allclose(rep.max_prob, ref["max_prob"], rtol=1e-6)
    np.testing.assert_allclose(rep.sink_mass, ref["sink"], rtol=1e-6)
    assert len(pickle.dumps(acc)) < 10_000  # the scratch buffers are not pickled


def test_stability_float32_row_sums_at_long_context_agree_with_float64_numpy() -> None:
    """At L = 1024 (rows of up to 1024 keys summed in float32) the entropy, sharp and flat, is
    within 1e-7 relative of the float64 formula in numpy (vectorised: the literal loops are too slow
    here)."""
    t = 1024
    for sharp in (0.1, 8.0):
        f = random_fields(1, 2, t, causal=True, seed=9, sharp=sharp)
        acc = StabilityAccumulator()
        acc.update(f, causal=True)
        a = f.double().numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            plogp = np.where(a > 0, a * np.log(a), 0.0)
        ent = (-plogp[:, :, 1:, :].sum(-1) / np.log(np.arange(2, t + 1))).mean(axis=(0, 2))
        np.testing.assert_allclose(acc.compute().entropy, ent, rtol=1e-7)


def test_stability_mass_above_the_diagonal_of_a_field_declared_causal_still_counts() -> None:
    # a field said to be causal that is not: the keys right of each row block enter the sums, as the
    # normalisation by log(i + 1) says (every key summed, the causal key count in the denominator)
    f = random_fields(1, 2, 150, causal=False, seed=6)
    acc = StabilityAccumulator()
    acc.update(f, causal=True)
    rep = acc.compute()
    a = f[0].double().numpy()  # (H, T, T)
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(a > 0, a * np.log(a), 0.0)
    rows = np.arange(1, 150)
    ent = (-plogp[:, 1:, :].sum(-1) / np.log(rows + 1)).mean(-1)
    np.testing.assert_allclose(rep.entropy, ent, rtol=1e-6)
    np.testing.assert_allclose(rep.mean_row_max, a[:, 1:, :].max(-1).mean(-1), rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_check_for_zeros_right_of_the_causal_blocks_takes_nothing_else_for_zero(dtype) -> None:
    """``_right_of_blocks_zero`` against the literal question (every such entry is +0): true
    for a causal field, false for one entry that is a denormal, -0 (conservative: summing -0 changes
    nothing), NaN, or two entries that cancel; an empty batch has nothing to check."""
    from podmonitor.engine.stability import _right_of_blocks_zero, _row_blocks

    t = 150
    blocks = _row_blocks(1, t, causal=True)
    f = random_fields(2, 3, t, causal=True, seed=8).to(dtype)
    assert _right_of_blocks_zero(f, blocks)
    assert _right_of_blocks_zero(f[:0], blocks)
    StabilityAccumulator().update(f[:0], causal=True)  # an empty batch: nothing added, no error
    tiny = torch.finfo(dtype).tiny / 4  # a subnormal of the field's dtype
    for entries in ([(70, 140, tiny)], [(70, 140, -0.0)], [(3, 149, float("nan"))],
                    [(70, 140, 0.25), (70, 141, -0.25)]):
        g = f.clone()
        for i, j, value in entries:
            g[1, 2, i, j] = value
        assert g[1, 2, entries[0][0], entries[0][1]].item() == entries[0][2] or math.isnan(entries[0][2])
        assert not _right_of_blocks_zero(g, blocks), entries


@pytest.mark.parametrize("above", ["cancelling", "nan"])
def test_stability_entries_above_the_diagonal_are_never_taken_for_zeros(above) -> None:
    """A field declared causal whose entries above the diagonal sum to zero without being zeros
    (+x and -x), or hold a NaN: the sums are still those over every key, as the literal formula
    gives them (NaN: the sequence is skipped)."""
    f = random_fields(2, 2, 150, causal=True, seed=7)
    if above == "cancelling":
        f[0, 1, 70, 140], f[0, 1, 70, 141] = 0.25, -0.25
    else:
        f[1, 0, 3, 149] = float("nan")
    acc = StabilityAccumulator()
    acc.update(f, causal=True)
    rep = acc.compute()
    used = f[:1] if above == "nan" else f
    assert acc.n_skipped_nonfinite == (1 if above == "nan" else 0)
    a = used.double().numpy()  # (B, H, T, T)
    # p log p as plogp_ defines it, log(max(p, tiny)) * p: 0 at p = 0 (and, for the invalid
    # negative entry, log(tiny) * p)
    plogp = a * np.log(np.maximum(a, np.finfo(np.float32).tiny))
    ent = (-plogp[:, :, 1:, :].sum(-1) / np.log(np.arange(2, 151))).mean(axis=(0, 2))
    np.testing.assert_allclose(rep.entropy, ent, rtol=1e-6)
    np.testing.assert_allclose(rep.mean_row_max, a[:, :, 1:, :].max(-1).mean(axis=(0, 2)), rtol=1e-6)


def test_plogp_matches_float64_p_log_p_and_is_zero_at_zero() -> None:
    """The fast p log p against the literal formula in float64: within float32 rounding, 0 at p = 0."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(4, 96, 96) * 6, dim=-1)  # (H, T, T) float32, peaked rows
    p[0, 0, :7] = 0.0
    p[1, 2, 3] = 1e-41  # subnormal
    got = plogp_(p, torch.empty_like(p)).double()
    pd = p.double()
    want = torch.where(pd > 0, pd * torch.log(pd.clamp_min(1e-300)), torch.zeros_like(pd))
    assert torch.all(got[0, 0, :7] == 0)
    assert (got - want).abs().max() < 4 * torch.finfo(torch.float32).eps * want.abs().clamp_min(1e-30).max()
    assert torch.allclose(got.sum(-1), want.sum(-1), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("sharpness", [0.1, 3.0, 40.0, 2000.0])
def test_entropy_from_the_centred_scores_equals_the_literal_formula(sharpness) -> None:
    """A capture that forms ``p = softmax(c)`` hands its centred scores (masked keys finite): the
    entropy, from ``sum_j p_j c_j + log max_j p_j`` without a logarithm per entry, equals the
    literal -sum p log p of the same float32 probabilities in float64, from near-uniform rows to
    one-hot ones (logits in the thousands, where sum_j p_j s_j - logsumexp(s) would lose every digit
    in float32), and the other signals are those of the probabilities alone."""
    b, h, t = 2, 3, 40
    g = torch.Generator().manual_seed(int(sharpness * 10))
    scores = torch.randn(b, h, t, t, generator=g) * sharpness + 500.0  # large uncentred logits
    above = torch.ones(t, t, dtype=torch.bool).triu(1)
    scores.masked_fill_(above, torch.finfo(torch.float32).min / 2)  # as the captures mask
    centred = scores - scores.amax(dim=-1, keepdim=True)
    probs = torch.softmax(centred, dim=-1)
    assert torch.all(probs[..., above] == 0)
    rows_fast, rows_log = (StabilityRows(b, h, t, True, torch.device("cpu")) for _ in range(2))
    for r0 in range(0, t, 16):  # in row blocks, as the captures hand them
        r1 = min(t, r0 + 16)
        rows_fast.add(slice(None), slice(None), r0, probs[..., r0:r1, :r1], centred=centred[..., r0:r1, :r1])
        rows_log.add(slice(None), slice(None), r0, probs[..., r0:r1, :r1])
    ref = literal(probs.numpy(), None, True)
    acc = StabilityAccumulator()
    acc.add_sums(rows_fast.sums())
    got = acc.compute().to_dict()
    np.testing.assert_allclose(got["entropy"], ref["entropy"], rtol=1e-6, atol=1e-7)
    assert got["mean_row_max"] == pytest.approx(ref["row_max"], rel=1e-6)
    assert got["sink_mass"] == pytest.approx(ref["sink"], rel=1e-6)
    fast, slow = rows_fast.sums(), rows_log.sums()
    assert torch.equal(fast.row_max_sum, slow.row_max_sum) and torch.equal(fast.sink, slow.sink)
    assert torch.isfinite(fast.check).all()


def test_entropy_from_centred_scores_flags_a_sequence_with_nan() -> None:
    """A NaN score makes its sequence's check non-finite (the monitor skips it), as on the log path."""
    scores = torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    scores[1, 0, 5, 2] = math.nan
    centred = scores - scores.amax(dim=-1, keepdim=True)
    rows = StabilityRows(2, 2, 8, False, torch.device("cpu"))
    rows.add(slice(None), slice(None), 0, torch.softmax(centred, dim=-1), centred=centred)
    assert torch.isfinite(rows.sums().check).tolist() == [True, False]


def test_the_zeros_promise_skips_the_check_and_changes_nothing_when_kept(monkeypatch) -> None:
    """``zeros_above_diagonal=True``: the entries above the diagonal are not read. Where the promise
    holds (a causal softmax, +0 above the diagonal) the signals are those of the checked update;
    where it is broken, the entries are ignored (the signals of the same fields with those entries
    zero), which is why only captures that write them so make it. Bidirectional fields ignore it."""
    import podmonitor.engine.stability as stability

    calls = []
    check = stability._right_of_blocks_zero
    monkeypatch.setattr(stability, "_right_of_blocks_zero", lambda *a: calls.append(1) or check(*a))
    f = random_fields(2, 3, 150, causal=True, seed=9)
    lm = torch.randn(2, 3, generator=torch.Generator().manual_seed(2))
    checked, promised = StabilityAccumulator(), StabilityAccumulator()
    checked.update(f, lm, causal=True)
    assert len(calls) == 1
    promised.update(f, lm, causal=True, zeros_above_diagonal=True)
    assert len(calls) == 1  # not checked
    assert promised.compute().to_dict() == checked.compute().to_dict()

    broken = f.clone()
    broken[1, 2, 70, 140] = 0.25
    trusted = StabilityAccumulator()
    trusted.update(broken, lm, causal=True, zeros_above_diagonal=True)
    assert trusted.compute().to_dict() == checked.compute().to_dict()
    looked = StabilityAccumulator()  # checked: the entry enters head 2's entropy (by 0.25 log 0.25 / log 71)
    looked.update(broken, lm, causal=True)
    entropy, reference = looked.compute().to_dict()["entropy"], checked.compute().to_dict()["entropy"]
    assert entropy[:2] == reference[:2]
    assert entropy[2] - reference[2] == pytest.approx(-0.25 * math.log(0.25) / math.log(71) / (2 * 149), rel=1e-4)

    g = random_fields(2, 3, 40, causal=False, seed=10)
    plain, flagged = StabilityAccumulator(), StabilityAccumulator()
    plain.update(g, causal=False)
    flagged.update(g, causal=False, zeros_above_diagonal=True)
    assert flagged.compute().to_dict() == plain.compute().to_dict()
