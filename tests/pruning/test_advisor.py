"""Head allocation advice on synthetic cases with a known answer."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from podmonitor import PODConfig, analyze
from podmonitor.engine.accumulator import PODAccumulator
from podmonitor.pruning import (
    AdviceSettings,
    HeadRedundancyAccumulator,
    LayerEvidence,
    advise_from_reports,
    advise_head_allocation,
    evidence_from_reports,
)
from tests.pruning.helpers import causal_softmax, low_rank_fields

CFG = PODConfig(n_dominant=1, coherency=False)


def brute_force_min_max_load(demand: list[int], budget: int, min_heads: int = 1) -> float:
    """min over every allocation (sum = budget, each >= min_heads) of max_l H*_l / r_l."""
    best = math.inf
    for r in itertools.product(range(min_heads, budget + 1), repeat=len(demand)):
        if sum(r) == budget:
            best = min(best, max(d / k for d, k in zip(demand, r, strict=True)))
    return best


@pytest.mark.parametrize("demand", [[2, 2, 12, 12], [1, 5, 9], [7, 7, 7], [0, 3, 20], [4, 1, 1, 30]])
def test_allocation_minimises_the_largest_load_under_the_same_budget(demand):
    layers = [LayerEvidence(name=f"l{i}", n_heads=4, effective_rank=d) for i, d in enumerate(demand)]
    advice = advise_head_allocation(layers)
    rec = [r.recommended for r in advice.layers]
    assert sum(rec) == 4 * len(demand) == advice.total_budget
    assert min(rec) >= 1
    load = max(d / r for d, r in zip(demand, rec, strict=True))
    assert load == pytest.approx(brute_force_min_max_load(demand, 4 * len(demand)))


def test_drop_order_takes_the_lowest_load_layers_first_and_keeps_one_head():
    layers = [LayerEvidence(name=f"l{i}", n_heads=4, effective_rank=d) for i, d in enumerate([2, 2, 12, 12])]
    advice = advise_head_allocation(layers)
    assert [r.recommended for r in advice.layers] == [2, 2, 6, 6]
    assert [d.layer_index for d in advice.drop_order[:4]] == [0, 1, 0, 1]
    assert [r.drop for r in advice.layers][2:] == [[], []]
    assert len(advice.drop_order) == 12  # every head but one per layer
    assert advice.heads_to_prune(4) == {0: [2, 3], 1: [2, 3]}  # no per-head evidence: last heads first
    with pytest.raises(ValueError, match="0..12"):
        advice.heads_to_prune(13)


def test_low_rank_layer_gives_heads_to_high_rank_layer_end_to_end():
    # layer 0: every head's fluctuation spans the same single pattern; layer 1: twelve patterns per head
    n, L, H = 40, 24, 4
    fields = {0: torch.stack([low_rank_fields(n, L, 1, seed=10 + h, pattern_seed=99) for h in range(H)], 1),
              1: torch.stack([low_rank_fields(n, L, 12, seed=20 + h) for h in range(H)], 1)}  # (N, H, L, L)
    reports, redundancy = {}, {}
    for layer, f in fields.items():
        name = f"layer_{layer:02d}"
        reports[name] = analyze(f.mean(1), CFG)
        for h in range(H):
            reports[f"{name}/head_{h:02d}"] = analyze(f[:, h], CFG)
        acc = HeadRedundancyAccumulator()
        acc.update(f)
        redundancy[name] = acc.compute()
    low, high = reports["layer_00"].effective_rank[0.1], reports["layer_01"].effective_rank[0.1]
    assert low <= 2 < 8 <= high  # the synthetic ranks came out as designed
    advice = advise_from_reports(reports, ["layer_00", "layer_01"], redundancy)
    rows = {r.layer: r for r in advice.layers}
    assert rows["layer_00"].recommended < 4 < rows["layer_01"].recommended
    assert rows["layer_00"].recommended + rows["layer_01"].recommended == 8
    assert all(d.layer == "layer_00" for d in advice.drop_order[:3])
    # the heads of layer 0 share one mean pattern: they are near copies, hence "redundant"
    assert [d.reason for d in advice.drop_order[:3]] == ["redundant"] * 3
    md = advice.markdown()
    assert "| layer_00 | 4 |" in md and "Drop order" in md
    assert advice.to_dict()["layers"][0]["recommended"] == rows["layer_00"].recommended


def test_exact_copy_heads_are_dropped_first_as_redundant():
    n, L = 30, 16
    a, b, c = (low_rank_fields(n, L, 6, seed=s) for s in (1, 2, 3))
    f = torch.stack([a, b, a, c], dim=1)  # heads 0 and 2 are exact copies
    reports = {"layer_00": analyze(f.mean(1), CFG)}
    for h in range(4):
        reports[f"layer_00/head_{h:02d}"] = analyze(f[:, h], CFG)
    acc = HeadRedundancyAccumulator()
    acc.update(f)
    advice = advise_from_reports(reports, ["layer_00"], {"layer_00": acc.compute()})
    first = advice.drop_order[0]
    assert first.reason == "redundant"
    assert {first.head, first.partner} == {0, 2}
    assert first.similarity == pytest.approx(1.0, abs=1e-9)
    # once one copy is gone no pair is redundant any more
    assert all(d.reason == "low_rank" for d in advice.drop_order[1:])


def test_within_layer_lowest_head_rank_goes_first_and_pruned_heads_are_skipped():
    ev = LayerEvidence(name="l0", n_heads=4, effective_rank=2, head_ranks=[5.0, 1.0, math.nan, 3.0],
                       head_t_spec=[0.5, 0.9, 0.1, 0.2])
    advice = advise_head_allocation([ev, LayerEvidence(name="l1", n_heads=4, effective_rank=40)])
    assert [d.head for d in advice.drop_order if d.layer == "l0"] == [1, 3, 0]  # unknown rank (head 2) kept
    ev.active = [True, False, True, True]  # head 1 already pruned
    advice = advise_head_allocation([ev, LayerEvidence(name="l1", n_heads=4, effective_rank=40)])
    assert advice.layers[0].heads_now == 3
    assert [d.head for d in advice.drop_order if d.layer == "l0"] == [3, 0]


def test_layer_without_evidence_keeps_its_heads():
    layers = [LayerEvidence(name="bad", n_heads=4, effective_rank=None, status="too_few_snapshots"),
              LayerEvidence(name="a", n_heads=4, effective_rank=1), LayerEvidence(name="b", n_heads=4,
                                                                                 effective_rank=9)]
    advice = advise_head_allocation(layers, AdviceSettings(min_heads=2))
    assert advice.layers[0].recommended == 4 and advice.total_budget == 8
    assert all(d.layer != "bad" for d in advice.drop_order)
    assert [r.recommended for r in advice.layers[1:]] == [2, 6]
    assert any("bad" in m for m in advice.messages)


def test_settings_are_validated():
    with pytest.raises(ValueError, match="eps"):
        AdviceSettings(eps=1.5)
    with pytest.raises(ValueError, match="min_heads"):
        AdviceSettings(min_heads=0)
    rep = analyze(low_rank_fields(6, 8, 2, seed=0), CFG)
    with pytest.raises(ValueError, match="eps=0.2"):
        advise_from_reports({"l": rep}, ["l"], settings=AdviceSettings(eps=0.2))


def _power_law_fields(n: int, L: int, n_patterns: int, seed: int, decay: float = 0.5) -> torch.Tensor:
    """(n, L, L) causal fields whose fluctuation spans ``n_patterns`` patterns with coefficient
    standard deviations ``k^-decay`` (a slowly decaying spectrum: high H*)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(L, L, generator=g, dtype=torch.float64)
    patterns = torch.randn(n_patterns, L, L, generator=g, dtype=torch.float64)
    sd = torch.arange(1, n_patterns + 1, dtype=torch.float64) ** -decay
    coef = torch.randn(n, n_patterns, generator=g, dtype=torch.float64) * sd
    return causal_softmax(base + 0.3 * torch.einsum("sk,kij->sij", coef, patterns))


def test_sketch_layer_with_rank_beyond_resolved_uses_the_lower_bound_as_demand():
    # a real bounded-memory report: 40 decaying patterns, a sketch of 12 rows resolves only a few modes
    sketch_cfg = PODConfig(n_dominant=1, coherency=False, mode="sketch", sketch_rank=12, sketch_resolve_factor=1.0)
    acc = PODAccumulator(sketch_cfg)
    f = _power_law_fields(64, 24, 40, seed=3)
    for lo in range(0, 64, 16):
        acc.update(f[lo:lo + 16])
    complex_rep = acc.compute()
    head = complex_rep.headline
    assert head.mode == "sketch" and head.beyond_resolved[0.1] and complex_rep.effective_rank[0.1] is None
    R = head.resolved_rank
    lower = max(head.effective_rank_bounds[0.1][0] or 0, R + 1)
    simple_rep = analyze(low_rank_fields(64, 24, 1, seed=5), sketch_cfg)  # resolved: H* known
    assert simple_rep.effective_rank[0.1] is not None and simple_rep.effective_rank[0.1] < lower
    reports = {"layer_00": simple_rep, "layer_01": complex_rep,
               "layer_01/head_00": complex_rep, "layer_01/head_01": simple_rep}
    advice = advise_from_reports(reports, ["layer_00", "layer_01"], active={"layer_00": [True] * 4,
                                                                            "layer_01": [True] * 4})
    rows = {r.layer: r for r in advice.layers}
    # the sketch layer is the most complex one: it gains heads, it is not "kept as is"
    assert advice.total_budget == 8
    assert rows["layer_01"].recommended > 4 > rows["layer_00"].recommended
    assert rows["layer_01"].rank_lower_bound == lower and rows["layer_01"].effective_rank is None
    assert f"H*(0.1) > {R} (sketch), using lower bound {lower}" in rows["layer_01"].evidence
    assert "kept as is" not in rows["layer_01"].evidence
    assert all(d.layer == "layer_00" for d in advice.drop_order[:3])
    assert f">= {lower} (sketch)" in advice.markdown()
    assert not any("no usable" in m for m in advice.messages)
    # per head: the head beyond R counts with its lower bound (not as unknown), so it is the more complex
    (ev0, ev1) = evidence_from_reports(reports, ["layer_00", "layer_01"], active={"layer_00": [True] * 4,
                                                                                   "layer_01": [True] * 4})
    assert ev1.head_ranks[:2] == [float(lower), float(simple_rep.effective_rank[0.1])]


def test_sketch_lower_bound_on_evidence_drives_the_allocation():
    layers = [LayerEvidence(name="a", n_heads=4, effective_rank=2),
              LayerEvidence(name="sk", n_heads=4, effective_rank=None, rank_lower_bound=13, resolved_rank=12)]
    advice = advise_head_allocation(layers)
    assert [r.recommended for r in advice.layers] == [1, 7]
    assert advice.layers[1].evidence.startswith("H*(0.1) > 12 (sketch), using lower bound 13")
    assert {d.layer for d in advice.drop_order[:3]} == {"a"}
