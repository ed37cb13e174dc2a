"""Figures: real reports draw what they should, flagged ones say what is wrong, nothing raises."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from matplotlib.figure import Figure

from podmonitor.reporting.figures import (
    PICTURES,
    coherency_figure,
    draw_run_pictures,
    figure_to_array,
    layer_images,
    modes_figure,
    scale_organisation_figure,
    scalogram_figure,
    spectrum_figure,
)

FIGURES = {
    "scalogram": lambda r: scalogram_figure(r, "fluctuation", title="layer_00"),
    "mean_scalogram": lambda r: scalogram_figure(r, "mean"),
    "spectrum": lambda r: spectrum_figure(r, title="layer_00"),
    "modes": lambda r: modes_figure(r, n_modes=4),
    "coherency": coherency_figure,
    "scale_organisation": lambda r: scale_organisation_figure([r], ["layer_00"]),
}
FLAGGED = ["too_few_snapshots", "zero_variance", "no_scales", "nan_arrays", "partly_nan", "zero_size",
           "degenerate_spectrum", "ok_without_modes"]


def _texts(fig: Figure) -> str:
    return "\n".join([t.get_text() for ax in fig.axes for t in ax.texts] + [fig.get_suptitle()])


def _check_image(img: np.ndarray) -> None:
    assert img.ndim == 3 and img.shape[2] == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert img.dtype == np.uint8
    assert img.min() < img.max()  # something was drawn


@pytest.mark.parametrize("name", FIGURES)
def test_figures_real_report(real_reports, name):
    fig = FIGURES[name](real_reports[1])
    assert isinstance(fig, Figure)
    assert fig.axes and not any("status" in t for t in _texts(fig).splitlines())
    _check_image(figure_to_array(fig))


@pytest.mark.parametrize("case", FLAGGED)
def test_figures_flagged_report_never_raise(flagged_reports, case):
    report = flagged_reports[case]
    for name, make in FIGURES.items():
        fig = make(report)
        if fig is None:
            assert name == "coherency" and report.coherency is None
            continue
        assert isinstance(fig, Figure), name
        if report.status not in ("ok", "degenerate", "flat") and name != "scale_organisation":
            assert f"status: {report.status}" in _texts(fig), (name, _texts(fig))
        _check_image(figure_to_array(fig))


def test_figures_flagged_report_say_what_is_wrong(flagged_reports):
    assert "zero everywhere" in _texts(scalogram_figure(flagged_reports["zero_variance"]))
    assert "no finite value" in _texts(scalogram_figure(flagged_reports["nan_arrays"]))
    assert "no scalogram" in _texts(scalogram_figure(flagged_reports["no_scales"]))
    assert "non-finite value(s)" in _texts(scalogram_figure(flagged_reports["partly_nan"]))
    assert "no dominant scale" in _texts(spectrum_figure(flagged_reports["too_few_snapshots"]))
    assert "no positive eigenvalue" in _texts(spectrum_figure(flagged_reports["nan_arrays"]))
    assert "no dominant scale" in _texts(modes_figure(flagged_reports["ok_without_modes"]))
    assert "no mode lag profile" in _texts(modes_figure(flagged_reports["zero_size"]))
    assert "no finite coherency" in _texts(coherency_figure(flagged_reports["nan_arrays"]))
    assert coherency_figure(flagged_reports["too_few_snapshots"]) is None
    org = scale_organisation_figure([flagged_reports[k] for k in ("too_few_snapshots", "zero_variance", "no_scales")],
                                    ["a", "b", "c"])
    assert "b: zero scale energy (status zero_variance)" in _texts(org)
    assert "c: no scale energy (status no_scales)" in _texts(org)
    assert "no report" in _texts(scale_organisation_figure([], []))


def test_scale_organisation_rows_normalised_and_coarsen_with_depth(real_reports):
    names = [f"layer_{i:02d}" for i in range(len(real_reports))]
    fig = scale_organisation_figure(real_reports, names)
    ax = fig.axes[0]
    data = np.ma.filled(ax.images[0].get_array().astype(float), np.nan)
    grid = real_reports[0].scales.numpy()
    assert data.shape == (len(real_reports), grid.size)
    np.testing.assert_allclose(np.nansum(data, axis=1), 1.0, rtol=1e-12)
    peak = np.nanargmax(data, axis=1)
    assert np.all(np.diff(peak) > 0), peak  # the planted scale grows with depth
    # the peak of each row is the report's top dominant scale, and the row is E(a) / sum E
    for row, rep, p in zip(data, real_reports, peak, strict=True):
        assert math.isclose(grid[p], rep.dominant_scales[0])
        e = rep.scale_energy.numpy()
        np.testing.assert_allclose(row, e / e.sum(), rtol=1e-12)
    assert [t.get_text() for t in ax.get_yticklabels()] == names


def test_scale_organisation_mixed_grids(real_reports, flagged_reports):
    short = flagged_reports["too_few_snapshots"]  # L = 8: 4 scales of the 16
    fig = scale_organisation_figure([real_reports[0], short], None)
    data = fig.axes[0].images[0].get_array()
    assert data.shape == (2, real_reports[0].scales.numel())
    assert int(np.ma.count(data[1])) == short.scales.numel()
    np.testing.assert_allclose(data.sum(axis=1), 1.0, rtol=1e-12)
    with pytest.raises(ValueError, match="layer names"):
        scale_organisation_figure(real_reports, ["only one"])


@pytest.mark.parametrize("layer", [0, 3])
def test_spectrum_fit_line_has_slope_minus_beta(real_reports, layer):
    report = real_reports[layer]
    fig = spectrum_figure(report)
    fits = [ln for ln in fig.axes[0].get_lines() if (ln.get_gid() or "").startswith("fit:")]
    assert len(fits) == len(report.per_scale)
    for line, sr in zip(fits, report.per_scale, strict=True):
        k, y = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
        slope, intercept = np.polyfit(np.log(k), np.log(y), 1)
        assert slope == pytest.approx(-sr.beta, rel=1e-9)
        # independent OLS on the eigenvalues: same points, same line
        lam = sr.eigenvalues.numpy()[:30]
        kk = np.arange(1, lam.size + 1)[lam > 1e-12 * lam[0]]
        ref_slope, ref_intercept = np.polyfit(np.log(kk), np.log(lam[kk - 1]), 1)
        np.testing.assert_array_equal(k, kk)
        assert k.size == sr.n_fit
        assert slope == pytest.approx(ref_slope, rel=1e-9)
        assert intercept == pytest.approx(ref_intercept, rel=1e-9)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("T_spec=" in t and "R²=" in t and "ok" in t for t in labels)


def test_spectrum_degenerate_and_flat_fits(flagged_reports):
    fig = spectrum_figure(flagged_reports["degenerate_spectrum"])
    ax = fig.axes[0]
    fits = [ln for ln in ax.get_lines() if (ln.get_gid() or "").startswith("fit:")]
    assert len(fits) == 1  # only the flat one has a finite beta; its line is horizontal
    assert np.allclose(fits[0].get_ydata(), 1.0)
    labels = " ".join(t.get_text() for t in ax.get_legend().get_texts())
    assert "degenerate" in labels and "flat" in labels and "T_spec=inf" in labels


def test_modes_figure_lines_and_energy_fractions(real_reports):
    report = real_reports[2]
    fig = modes_figure(report, n_modes=3)
    ax = fig.axes[0]
    sr = report.per_scale[0]
    lines = [ln for ln in ax.get_lines() if ln.get_label().startswith("φ")]
    assert len(lines) == 3
    np.testing.assert_allclose(lines[0].get_ydata(), sr.mode_lag_profiles[0].numpy())
    np.testing.assert_allclose(lines[0].get_xdata(), sr.lags.numpy())
    assert lines[0].get_label() == f"φ1 ({100 * float(sr.energy_fractions[0]):.1f}%)"
    assert "(top)" in ax.get_title()


def test_figure_to_array_leaves_pyplot_alone(real_reports):
    plt = sys.modules.get("matplotlib.pyplot")
    before = plt.get_fignums() if plt else None
    fig = scalogram_figure(real_reports[0])
    img = figure_to_array(fig)
    assert img.shape == (450, 800, 3)  # 8 x 4.5 inches at 100 dpi
    if plt is not None:
        assert plt.get_fignums() == before


def test_layer_images_tags(real_reports, flagged_reports):
    imgs = layer_images(real_reports[0], "layer_00")
    assert set(imgs) == {f"pod/{n}/layer_00" for n in ("scalogram", "mean_scalogram", "spectrum", "modes",
                                                         "coherency")}
    for img in imgs.values():
        _check_image(img)
    flagged = layer_images(flagged_reports["too_few_snapshots"], "x", prefix="p", which=("spectrum", "coherency"))
    assert set(flagged) == {"p/spectrum/x"}  # no coherency map: left out
    with pytest.raises(ValueError, match="unknown figure"):
        layer_images(real_reports[0], "x", which=("nope",))
    with pytest.raises(ValueError, match="which"):
        scalogram_figure(real_reports[0], "raw")


def test_modes_figure_has_a_fixed_pixel_size_whatever_the_number_of_scales(real_reports):
    import dataclasses

    from podmonitor.reporting.figures import figure_to_array, modes_figure

    one_scale = real_reports[3]
    assert len(one_scale.per_scale) == 1
    three = dataclasses.replace(one_scale, per_scale=one_scale.per_scale * 3)
    none = dataclasses.replace(one_scale, per_scale=[])
    shapes = {figure_to_array(modes_figure(r)).shape for r in (three, one_scale, none)}
    assert len(shapes) == 1  # thumbnails of one layer line up from step to step


def test_causal_coherency_map_is_masked_above_the_diagonal(real_reports):
    import dataclasses

    from podmonitor.reporting.figures import coherency_figure

    rep = real_reports[1]
    assert rep.causal and rep.coherency is not None
    n = rep.coherency.shape[0]
    full = dataclasses.replace(rep, coherency=np.full((n, n), 0.75))  # a map painted everywhere
    fig = coherency_figure(full)
    shown = fig.axes[0].images[0].get_array()
    upper = np.triu(np.ones((n, n), dtype=bool), 1)
    assert np.all(np.ma.getmaskarray(shown)[upper])  # j > i: blank
    assert not np.any(np.ma.getmaskarray(shown)[~upper])  # j <= i: drawn
    assert fig.axes[0].images[0].get_clim() == (0.0, 1.0)  # one colour scale for every layer


def test_trend_heatmap_cells_are_the_values(real_reports):
    from podmonitor.reporting.figures import trend_heatmap_figure

    values = np.array([[1.0, 2.0, np.nan], [3.0, 4.0, 5.0]])
    fig = trend_heatmap_figure("T_spec", [10, 20, 30], ["layer_00", "layer_01"], values)
    shown = fig.axes[0].images[0].get_array()
    np.testing.assert_array_equal(np.ma.filled(shown, -1.0), [[1.0, 2.0, -1.0], [3.0, 4.0, 5.0]])
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["layer_00", "layer_01"]


def test_run_pictures_are_exactly_the_ones_asked_for(real_reports):
    reports = {"layer_00": real_reports[0], "layer_01": real_reports[1]}
    trend = {"t_spec": ("T_spec", {"layer_00": [0.5, 0.6], "layer_01": [0.7, 0.8]})}
    every = draw_run_pictures("pod", reports, list(reports), trend, [8, 16])
    expected = {"pod/scale_organisation", "pod/trend/t_spec"} | {
        f"pod/{kind}/{layer}" for kind in ("scalogram", "mean_scalogram", "spectrum", "modes") for layer in reports}
    assert expected <= set(every) and set(every) - expected <= {f"pod/coherency/{n}" for n in reports}
    some = draw_run_pictures("pod", reports, list(reports), trend, [8, 16], which=("spectrum", "trend"))
    assert set(some) == {"pod/spectrum/layer_00", "pod/spectrum/layer_01", "pod/trend/t_spec"}
    assert all(np.array_equal(some[t], every[t]) for t in some)  # the same pictures, fewer of them
    assert draw_run_pictures("pod", reports, list(reports), trend, [8, 16], which=()) == {}
    with pytest.raises(ValueError, match="unknown picture"):
        draw_run_pictures("pod", reports, list(reports), which=("scalograms",))
    from podmonitor.reporting.publish import Publisher

    with pytest.raises(ValueError, match="unknown picture"):
        Publisher("unused", pictures=("scalograms",))
    assert set(PICTURES) == {"scale_organisation", "scalogram", "mean_scalogram", "spectrum", "modes",
                             "coherency", "trend"}
