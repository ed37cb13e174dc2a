"""Dashboard scalars: names, values against the report, NaN handling, TensorBoard layout."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from podmonitor.reporting.metrics import GROUPS, RUN_METRICS, LogPolicy, by_key, registry
from podmonitor.reporting.scalars import (
    custom_scalars_layout,
    eps_label,
    layer_scalars,
    metric_names,
    summary_markdown,
)

# the tags every exact-mode report gives, written out by hand (group/key), independent of the registry code
EXPECTED = {
    "headline/t_spec", "headline/effective_rank_90pct", "headline/top_scale", "headline/mean_attention_distance",
    "headline/entropy", "fit/r2", "fit/n_fit", "fit/effective_rank_95pct", "fit/effective_rank_99pct",
    "scales/scale_centroid",
    "cost/analysis_seconds", "health/n_snapshots", "health/n_skipped_nonfinite", "health/n_not_normalised",
    "health/status_flagged", "health/saturated_90pct", "health/saturated_95pct", "health/saturated_99pct",
}


def test_layer_scalars_names_and_values_real_report(real_reports):
    rep = real_reports[2]
    s = layer_scalars(rep, "layer_02", analysis_seconds=0.25)
    assert set(s) == {f"pod/{m}/layer_02" for m in EXPECTED}
    assert all(isinstance(v, float) for v in s.values())
    assert s["pod/headline/t_spec/layer_02"] == rep.t_spec
    assert s["pod/fit/r2/layer_02"] == rep.r2
    assert s["pod/headline/effective_rank_90pct/layer_02"] == rep.effective_rank[0.1]
    assert s["pod/fit/effective_rank_99pct/layer_02"] == rep.effective_rank[0.01]
    assert s["pod/health/saturated_90pct/layer_02"] == float(rep.saturated[0.1])
    assert s["pod/headline/top_scale/layer_02"] == rep.dominant_scales[0]
    assert s["pod/scales/scale_centroid/layer_02"] == rep.scale_centroid
    assert s["pod/headline/mean_attention_distance/layer_02"] == rep.mean_attention_distance
    assert s["pod/headline/entropy/layer_02"] == rep.entropy
    assert s["pod/health/n_snapshots/layer_02"] == 40.0
    assert s["pod/health/n_skipped_nonfinite/layer_02"] == 0.0
    assert s["pod/cost/analysis_seconds/layer_02"] == 0.25
    assert s["pod/health/status_flagged/layer_02"] == 0.0
    # beta is 1/T_spec: one quantity, one chart (it stays in the JSON record)
    assert not any("/beta/" in k for k in s)
    extra = layer_scalars(rep, "layer_02", extra={"max_logit": 7.5, "sink_mass": 0.25})
    assert extra["pod/stability/max_logit/layer_02"] == 7.5 and extra["pod/stability/sink_mass/layer_02"] == 0.25


def test_layer_scalars_prefix_and_missing_values(flagged_reports):
    rep = flagged_reports["too_few_snapshots"]
    s = layer_scalars(rep, "blocks.0.attn", prefix="monitor")
    assert set(s) == {f"monitor/{m}/blocks.0.attn" for m in EXPECTED}
    for m in ("headline/t_spec", "fit/r2", "headline/effective_rank_90pct", "health/saturated_90pct",
              "headline/top_scale"):
        assert math.isnan(s[f"monitor/{m}/blocks.0.attn"]), m
    assert s["monitor/cost/analysis_seconds/blocks.0.attn"] == rep.analysis_seconds  # the report's own timing
    assert s["monitor/health/status_flagged/blocks.0.attn"] == 1.0
    assert s["monitor/health/n_snapshots/blocks.0.attn"] == 2.0
    assert math.isfinite(s["monitor/headline/entropy/blocks.0.attn"])
    assert set(layer_scalars(rep, "x", prefix="")) == {f"{m}/x" for m in EXPECTED}
    flat = flagged_reports["degenerate_spectrum"]  # headline degenerate (NaN), not "ok"-looking
    assert math.isnan(layer_scalars(flat, "x")["pod/headline/t_spec/x"])
    nan_report = flagged_reports["nan_arrays"]
    s = layer_scalars(nan_report, "x")
    assert math.isnan(s["pod/scales/scale_centroid/x"]) and math.isnan(s["pod/headline/entropy/x"])
    no_timing = dataclasses.replace(nan_report, analysis_seconds=math.nan)
    assert math.isnan(layer_scalars(no_timing, "x")["pod/cost/analysis_seconds/x"])
    assert layer_scalars(no_timing, "x", analysis_seconds=1.5)["pod/cost/analysis_seconds/x"] == 1.5


def test_eps_label():
    assert [eps_label(e) for e in (0.1, 0.05, 0.01, 0.001, 0.25)] == ["0.10", "0.05", "0.01", "0.001", "0.25"]


def test_registry_every_metric_named_titled_grouped_and_described():
    metrics = [*registry(), *RUN_METRICS]
    keys = [m.key for m in metrics]
    assert len(keys) == len(set(keys))  # no metric twice
    assert {m.group for m in metrics} <= set(GROUPS)
    for m in metrics:
        assert m.title and m.description.endswith(".") and m.log in ("always", "nonzero", "changes"), m.key
        if m.unit:  # the unit is in the title
            assert m.unit.rstrip("s") in m.title or m.unit in m.title, m.key
    # headline: the few numbers to watch
    assert [m.key for m in metrics if m.group == "headline"] == [
        "t_spec", "effective_rank_90pct", "top_scale", "mean_attention_distance", "entropy"]
    assert set(metric_names()) == {m.key for m in registry()}
    assert "modes for 90 % of the energy" in by_key()["effective_rank_90pct"].title


def test_log_policy_health_counters_only_when_nonzero_or_changed():
    metrics = by_key()
    tags = {"a": metrics["n_skipped_nonfinite"], "b": metrics["n_snapshots"], "c": metrics["t_spec"]}
    policy = LogPolicy()
    assert policy.select({"a": 0.0, "b": 24.0, "c": 1.5}, tags) == {"b": 24.0, "c": 1.5}
    assert policy.select({"a": 2.0, "b": 24.0, "c": 1.6}, tags) == {"a": 2.0, "c": 1.6}
    assert policy.select({"a": 0.0, "b": 12.0, "c": math.nan}, tags).keys() == {"b", "c"}


def test_custom_scalars_layout_matches_scalar_tags(real_reports):
    layout = custom_scalars_layout(extra_charts={"validation loss": ["^val_loss$"]})
    headline = layout["podmonitor headline"]
    assert headline["T_spec (spectral concentration)"] == ["Multiline", ["^pod/headline/t_spec$"]]
    assert headline["validation loss"] == ["Multiline", ["^val_loss$"]]
    # per-layer runs carry the tag without the layer: every chart of the layout matches exactly one of them
    tags = {k.rsplit("/", 1)[0] for k in layer_scalars(real_reports[0], "layer_00", extra={"max_logit": 1.0})}
    for category, charts in layout.items():
        for title, (kind, regexes) in charts.items():
            if title == "validation loss":
                continue
            assert kind == "Multiline"
            hits = [t for t in tags if any(re.search(r, t) for r in regexes)]
            assert len(hits) <= 1, (category, title)
    assert all(any(re.search(r, t) for r in rs) for t in tags if t.startswith("pod/headline/")
               for rs in [[x for c in headline.values() for x in c[1]]])
    # the run chart has seconds only: no layer count mixed in
    assert all("/cost/" in c[1][0] for c in layout["podmonitor cost"].values())


def test_summary_markdown(real_reports, flagged_reports):
    md = summary_markdown([real_reports[0], flagged_reports["zero_variance"]], ["layer_00", "layer_01"], step=7)
    lines = md.splitlines()
    assert lines[0] == "### podmonitor at step 7"
    assert lines[2].startswith("| layer | status |") and "H*(0.10) [modes]" in lines[2]
    assert "top a* [tokens]" in lines[2]
    assert any(line.startswith("*Legend:*") for line in lines)
    assert lines[4].startswith("| layer_00 | ok | 3.46 |")
    assert lines[5].startswith("| layer_01 | zero_variance |")
    assert "- **layer_01** (zero_variance): all snapshots are identical" in md
    with pytest.raises(ValueError):
        summary_markdown(real_reports, ["a"])


def test_readme_metric_list_is_the_registry():
    from pathlib import Path

    from podmonitor.reporting.metrics import readme_table

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("<!-- metrics:start -->\n", 1)[1].split("\n<!-- metrics:end -->", 1)[0]
    assert block == readme_table()
