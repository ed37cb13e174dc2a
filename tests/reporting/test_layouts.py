"""Kept figures draw the pixels of fresh ones (podmonitor.reporting.layouts).

The reference is the same figure function outside ``layouts.reusing``, which builds every figure
from nothing: a kept figure refilled with a report must give exactly its pixels, whatever was drawn
in it before (another layer, a flagged report, a message).
"""

from __future__ import annotations

import numpy as np
import pytest

from podmonitor.reporting import figures, layouts
from podmonitor.reporting.figures import figure_to_array

KINDS = {
    "scalogram": lambda r: figures.scalogram_figure(r, title="layer"),
    "mean_scalogram": lambda r: figures.scalogram_figure(r, "mean", title="layer"),
    "spectrum": lambda r: figures.spectrum_figure(r, title="layer"),
    "modes": lambda r: figures.modes_figure(r, title="layer"),
    "coherency": lambda r: figures.coherency_figure(r, title="layer"),
    "organisation": lambda r: figures.scale_organisation_figure([r, r], ["a", "b"]),
}


def _pixels(draw, report) -> np.ndarray | None:  # noqa: ANN001
    fig = draw(report)
    return None if fig is None else figure_to_array(fig)


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape
                                         and bool(np.array_equal(a, b)))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_kept_figure_draws_the_pixels_of_a_fresh_one(kind, real_reports, flagged_reports):
    draw = KINDS[kind]
    sequence = [real_reports[0], real_reports[3], flagged_reports["partly_nan"], real_reports[1],
                flagged_reports["degenerate_spectrum"], flagged_reports["ok_without_modes"], real_reports[2],
                flagged_reports["zero_size"], real_reports[3]]
    fresh = [_pixels(draw, r) for r in sequence]
    with layouts.reusing() as cache:
        kept = [_pixels(draw, r) for r in sequence]
        assert len(cache) == 1  # one figure of this kind, handed out again and again
    differ = [i for i, (a, b) in enumerate(zip(fresh, kept, strict=True)) if not _same(a, b)]
    assert differ == []
    assert not _same(fresh[0], fresh[1])  # the reports draw different pictures


def test_a_figure_is_handed_out_again_only_after_its_pixels_are_taken(real_reports):
    with layouts.reusing() as cache:
        first = figures.spectrum_figure(real_reports[0])
        second = figures.spectrum_figure(real_reports[1])  # the first is still out: a new one
        assert second is not first
        figure_to_array(first)
        assert figures.spectrum_figure(real_reports[2]) is first
        assert len(cache) == 0  # both out
    outside = [figures.spectrum_figure(real_reports[0]) for _ in range(2)]
    figure_to_array(outside[0])
    assert figures.spectrum_figure(real_reports[0]) is not outside[0]  # outside reusing: always fresh


def test_a_figure_that_showed_a_message_is_not_kept(flagged_reports, real_reports):
    with layouts.reusing() as cache:
        figure_to_array(figures.spectrum_figure(flagged_reports["ok_without_modes"]))  # "no POD spectrum"
        assert len(cache) == 0
        figure_to_array(figures.spectrum_figure(real_reports[0]))
        assert len(cache) == 1


def test_a_failed_figure_is_not_handed_out_again(real_reports):
    with layouts.reusing() as cache:
        fig, _ = layouts.layout("probe", (3.0, 2.0), [(0.5, 0.5, 0.2, 0.2)])
        # the figure function raises here: the figure is never released
        again, _ = layouts.layout("probe", (3.0, 2.0), [(0.5, 0.5, 0.2, 0.2)])
        assert again is not fig
        figure_to_array(again)
        assert len(cache) == 1


def test_run_pictures_with_a_cache_kept_across_runs_are_those_of_fresh_figures(real_reports, flagged_reports):
    names = ["layer_0", "layer_1", "layer_2"]
    steps = [10, 20, 30]
    trend = {"t_spec": ("T_spec", {n: [1.0 + i, 2.0, 3.0 - i] for i, n in enumerate(names)})}
    runs = [dict(zip(names, real_reports[:3], strict=True)),
            dict(zip(names, [real_reports[3], flagged_reports["partly_nan"], real_reports[0]], strict=True))]
    cache = layouts.FigureCache()
    for reports in runs:
        drawn = figures.draw_run_pictures("pod", reports, names, trend, steps, cache=cache)
        reference = {"pod/scale_organisation": figure_to_array(
            figures.scale_organisation_figure([reports[n] for n in names], names))}
        for n in names:
            reference.update(figures.layer_images(reports[n], n, prefix="pod"))
        reference["pod/trend/t_spec"] = figure_to_array(figures.trend_heatmap_figure(
            "T_spec", steps, names, np.array([trend["t_spec"][1][n] for n in names])))
        assert sorted(drawn) == sorted(reference)
        assert [t for t in reference if not np.array_equal(drawn[t], reference[t])] == []
    assert len(cache) >= 6  # a figure per kind kept for the next run
