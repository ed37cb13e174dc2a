"""The picture process: the same pixels as drawing in the training process, at low priority, in
another process, and a fallback that loses nothing when the process goes away."""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import pytest

from podmonitor.reporting import render_process
from podmonitor.reporting.figures import draw_run_pictures
from podmonitor.reporting.publish import Publisher
from podmonitor.reporting.render_process import PictureProcess, RenderProcessError


@pytest.fixture(autouse=True)
def _bounded_wait(monkeypatch):
    """A child that hangs fails the test after 120 s instead of stalling the suite."""
    monkeypatch.setattr(render_process, "DRAW_TIMEOUT_S", 120.0)

NAMES = ["layer_00", "layer_01", "layer_02", "layer_03"]


def _inputs(real_reports):
    reports = dict(zip(NAMES, real_reports, strict=True))
    trend = {"t_spec": ("spectral concentration T_spec", {n: [0.5, float(r.t_spec)]
                                                         for n, r in reports.items()})}
    return reports, trend, [100, 200]


def test_process_draws_the_pixels_drawn_here_at_low_priority(real_reports):
    reports, trend, steps = _inputs(real_reports)
    units = {"t_spec": ""}
    here = draw_run_pictures("pod", reports, NAMES, trend, steps, units)  # the reference: this process
    pictures = PictureProcess()
    try:
        there = pictures.draw("pod", reports, NAMES, trend, steps, units)
        child = pictures._proc
        assert child is not None and child.pid != os.getpid()
        if hasattr(os, "getpriority"):  # POSIX: the child runs 19 niceness levels below us (capped at 19)
            assert os.getpriority(os.PRIO_PROCESS, child.pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 19)
        again = pictures.draw("pod", reports, NAMES[:2], None, [], units)  # the same child answers again
        assert pictures._proc is child
    finally:
        pictures.close()
    assert sorted(there) == sorted(here)
    assert "pod/scale_organisation" in there and "pod/trend/t_spec" in there
    assert {f"pod/{kind}/layer_02" for kind in ("scalogram", "spectrum", "modes")} <= set(there)
    for tag, pixels in here.items():
        assert there[tag].dtype == np.uint8 and there[tag].shape == pixels.shape, tag
        assert np.array_equal(there[tag], pixels), tag
    assert sorted(again) == sorted(draw_run_pictures("pod", reports, NAMES[:2], None, [], units))


def test_a_dead_process_is_given_up_and_reported(real_reports):
    reports, trend, steps = _inputs(real_reports)
    pictures = PictureProcess()
    pictures.draw("pod", reports, NAMES[:1], None, [])
    assert pictures._proc is not None
    pictures._proc.kill()
    pictures._proc.wait()
    with pytest.raises(RenderProcessError, match="ended"):
        pictures.draw("pod", reports, NAMES[:1], None, [])
    assert pictures.broken is not None and pictures._proc is None
    with pytest.raises(RenderProcessError):  # not restarted
        pictures.draw("pod", reports, NAMES[:1], None, [])


def test_publisher_falls_back_to_drawing_here_without_losing_pictures(real_reports, tmp_path, monkeypatch):
    """A child that cannot start (here: a Python that does not exist): one warning naming the picture
    process, and the run's pictures still reach the sink, drawn in this process."""
    reports, _, _ = _inputs(real_reports)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    publisher = Publisher(str(tmp_path))
    assert publisher.pictures is not None
    failures: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drawn = publisher._pictures(reports, NAMES, [reports[n] for n in NAMES], failures)
    publisher.close()
    assert publisher.pictures.broken is not None
    assert any("picture process" in str(w.message) for w in caught)
    assert failures and "picture process" in failures[0]
    assert sorted(drawn) == sorted(draw_run_pictures("pod", reports, NAMES, None, []))


def test_strict_publisher_draws_inline_without_a_process(tmp_path):
    assert Publisher(str(tmp_path), strict=True).pictures is None
    assert Publisher(str(tmp_path), picture_process=False).pictures is None
