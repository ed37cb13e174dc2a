"""Dashboard scalars: names, values against the report, NaN handling, TensorBoard layout."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from podmonitor.reporting.scalars import (
    custom_scalars_layout,
    eps_label,
    layer_scalars,
    metric_names,
    summary_markdown,
)

EXPECTED = {"t_spec", "beta", "r2", "n_fit", "h_eps_0.10", "h_eps_0.05", "h_eps_0.01", "saturated_eps_0.10",
            "saturated_eps_0.05", "saturated_eps_0.01", "top_scale", "scale_centroid", "mean_attention_distance",
            "entropy", "n_snapshots", "n_skipped_nonfinite", "analysis_seconds", "status_ok"}


def test_layer_scalars_names_and_values_real_report(real_reports):
    rep = real_reports[2]
    s = layer_scalars(rep, "layer_02", analysis_seconds=0.25)
    assert set(s) == {f"pod/{m}/layer_02" for m in EXPECTED}
    assert all(isinstance(v, float) for v in s.values())
    assert s["pod/t_spec/layer_02"] == rep.t_spec
    assert s["pod/beta/layer_02"] == rep.beta
    assert s["pod/r2/layer_02"] == rep.r2
    assert s["pod/n_fit/layer_02"] == rep.per_scale[0].n_fit
    assert s["pod/h_eps_0.10/layer_02"] == rep.effective_rank[0.1]
    assert s["pod/h_eps_0.01/layer_02"] == rep.effective_rank[0.01]
    assert s["pod/saturated_eps_0.10/layer_02"] == float(rep.saturated[0.1])
    assert s["pod/top_scale/layer_02"] == rep.dominant_scales[0]
    assert s["pod/scale_centroid/layer_02"] == rep.scale_centroid
    assert s["pod/mean_attention_distance/layer_02"] == rep.mean_attention_distance
    assert s["pod/entropy/layer_02"] == rep.entropy
    assert s["pod/n_snapshots/layer_02"] == 40.0
    assert s["pod/n_skipped_nonfinite/layer_02"] == 0.0
    assert s["pod/analysis_seconds/layer_02"] == 0.25
    assert s["pod/status_ok/layer_02"] == 1.0


def test_layer_scalars_prefix_and_missing_values(flagged_reports):
    rep = flagged_reports["too_few_snapshots"]
    s = layer_scalars(rep, "blocks.0.attn", prefix="monitor")
    assert set(s) == {f"monitor/{m}/blocks.0.attn" for m in EXPECTED}
    for m in ("t_spec", "beta", "r2", "n_fit", "h_eps_0.10", "saturated_eps_0.10", "top_scale"):
        assert math.isnan(s[f"monitor/{m}/blocks.0.attn"]), m
    assert s["monitor/analysis_seconds/blocks.0.attn"] == rep.analysis_seconds  # the report's own timing
    assert s["monitor/status_ok/blocks.0.attn"] == 0.0
    assert s["monitor/n_snapshots/blocks.0.attn"] == 2.0
    assert math.isfinite(s["monitor/entropy/blocks.0.attn"])
    assert set(layer_scalars(rep, "x", prefix="")) == {f"{m}/x" for m in EXPECTED}
    flat = flagged_reports["degenerate_spectrum"]  # headline degenerate (NaN), not "ok"-looking
    assert math.isnan(layer_scalars(flat, "x")["pod/t_spec/x"])
    nan_report = flagged_reports["nan_arrays"]
    s = layer_scalars(nan_report, "x")
    assert math.isnan(s["pod/scale_centroid/x"]) and math.isnan(s["pod/entropy/x"])
    no_timing = dataclasses.replace(nan_report, analysis_seconds=math.nan)
    assert math.isnan(layer_scalars(no_timing, "x")["pod/analysis_seconds/x"])
    assert layer_scalars(no_timing, "x", analysis_seconds=1.5)["pod/analysis_seconds/x"] == 1.5


def test_eps_label():
    assert [eps_label(e) for e in (0.1, 0.05, 0.01, 0.001, 0.25)] == ["0.10", "0.05", "0.01", "0.001", "0.25"]
    assert len(metric_names()) == len(EXPECTED)


def test_custom_scalars_layout_matches_scalar_keys(real_reports):
    names = ["layer_00", "layer_01"]
    layout = custom_scalars_layout(names)
    charts = layout["podmonitor"]
    assert charts["T_spec"] == ["Multiline", ["pod/t_spec/.*"]]
    keys = [k for i, n in enumerate(names) for k in layer_scalars(real_reports[i], n)]
    for _title, (kind, regexes) in charts.items():
        assert kind == "Multiline"
        hits = [k for k in keys if any(re.search(r, k) for r in regexes)]
        assert len(hits) == len(names)  # one line per layer, one metric per chart
        assert len({k.split("/")[1] for k in hits}) == 1
    assert {k.split("/")[1] for k in keys} == {r[1][0].split("/")[1].replace("\\", "") for r in charts.values()}
    per_layer = layout["podmonitor per layer"]["H*(eps) layer_01"][1][0]
    assert sorted(k for k in keys if re.search(per_layer, k)) == [
        "pod/h_eps_0.01/layer_01", "pod/h_eps_0.05/layer_01", "pod/h_eps_0.10/layer_01"]
    assert "podmonitor per layer" not in custom_scalars_layout(None)


def test_summary_markdown(real_reports, flagged_reports):
    md = summary_markdown([real_reports[0], flagged_reports["zero_variance"]], ["layer_00", "layer_01"], step=7)
    lines = md.splitlines()
    assert lines[0] == "### podmonitor at step 7"
    assert lines[2].startswith("| layer | status |") and "H*(0.10)" in lines[2]
    assert lines[4].startswith("| layer_00 | ok | 3.46 |")
    assert lines[5].startswith("| layer_01 | zero_variance |")
    assert "- **layer_01** (zero_variance): all snapshots are identical" in md
    with pytest.raises(ValueError):
        summary_markdown(real_reports, ["a"])
