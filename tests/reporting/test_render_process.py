"""Pictures drawn in a child process: the same pixels, a low priority, and failures that cost nothing."""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import pytest
import torch

from podmonitor.reporting.figures import draw_run_pictures
from podmonitor.reporting.publish import Publisher
from podmonitor.reporting.render_process import PictureProcess, PictureProcessError, shared_picture_process


@pytest.fixture(scope="module")
def painter():
    p = PictureProcess()
    yield p
    p.close()


def test_the_child_draws_the_same_pixels_as_this_process(painter, real_reports, flagged_reports):
    """Every picture of a run, for real and flagged reports (NaN arrays, zero variance, no scales,
    empty arrays...), with a trend: the child's arrays equal drawing here, bit for bit."""
    reports = {f"layer_{i}": r for i, r in enumerate(real_reports)}
    reports.update(flagged_reports)
    present = list(reports)
    steps = [100, 200, 300]
    trend = {"t_spec": ("T_spec", {n: [1.0, float(i), float("nan")] for i, n in enumerate(present)})}
    units = {"t_spec": ""}
    here = draw_run_pictures("pod", reports, present, trend, steps, units)
    there = painter.draw_run_pictures("pod", reports, present, trend, steps, units)
    assert sorted(there) == sorted(here) and len(here) > 5 * len(reports) - 10
    for tag, image in here.items():
        assert there[tag].dtype == np.uint8 and there[tag].shape == image.shape, tag
        assert np.array_equal(there[tag], image), tag
    # a chosen subset, as PODMonitor(log_images=[...]) asks for
    sub = painter.draw_run_pictures("pod", reports, present[:2], which=["spectrum"])
    assert sorted(sub) == [f"pod/spectrum/{n}" for n in present[:2]]


def test_reports_with_mode_fields_and_on_another_device_go_without_them(painter, real_reports):
    """What no picture reads (mean field, (k, L, L) modes, coefficients) stays home; a tensor that
    needs grad is sent detached. The pictures are unchanged."""
    import dataclasses

    rep = real_reports[1]
    head = rep.per_scale[0]
    n_modes, length = head.mode_lag_profiles.shape[0], rep.mean_field.shape[-1]
    heavy = dataclasses.replace(
        rep, scalogram=rep.scalogram.clone().requires_grad_(True),
        per_scale=[dataclasses.replace(head, modes=torch.randn(n_modes, length, length),
                                       coefficients=torch.randn(40, n_modes))])
    here = draw_run_pictures("pod", {"a": rep}, ["a"])
    there = painter.draw_run_pictures("pod", {"a": heavy}, ["a"])
    assert all(np.array_equal(there[t], here[t]) for t in here)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_child_runs_at_the_lowest_priority_with_one_thread(painter):
    status = painter.status()
    assert status["pid"] == painter.pid != os.getpid()
    stat = open(f"/proc/{status['pid']}/stat").read()
    fields = stat[stat.rindex(")") + 2:].split()  # from field 3 on
    assert int(fields[16]) == 19  # field 19: nice, as the kernel reports it
    environ = open(f"/proc/{status['pid']}/environ", "rb").read().split(b"\0")
    assert b"OMP_NUM_THREADS=1" in environ and b"CUDA_VISIBLE_DEVICES=" in environ


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_child_draws_reports_without_ever_loading_torch(painter, real_reports, flagged_reports):
    """Reports hold tensors; the child gets them as float64 arrays and never imports torch (its
    start would cost about 2 s of CPU more, at the lowest priority on cores the training keeps
    busy). Checked from outside too: no torch library is mapped into the child's memory."""
    reports = {f"layer_{i}": r for i, r in enumerate(real_reports)}
    reports.update(flagged_reports)
    pictures = painter.draw_run_pictures("pod", reports, list(reports))
    assert len(pictures) > 5 * len(reports) - 10
    status = painter.status()
    assert status["torch_imported"] is False
    maps = open(f"/proc/{status['pid']}/maps").read()
    assert "libtorch" not in maps and "matplotlib" in maps  # (the maps name the loaded libraries)


def test_a_drawing_error_in_the_child_comes_back_as_an_error_and_the_child_goes_on(painter, real_reports):
    with pytest.raises(ValueError, match="unknown picture.*raised in the picture process"):
        painter.draw_run_pictures("pod", {"a": real_reports[0]}, ["a"], which=["no_such_picture"])
    assert painter.draw_run_pictures("pod", {"a": real_reports[0]}, ["a"], which=["spectrum"])


def test_a_killed_child_raises_and_the_next_request_starts_a_new_one(real_reports):
    p = PictureProcess()
    try:
        first = p.status()["pid"]
        os.kill(first, 9)
        with pytest.raises(PictureProcessError, match="stopped answering"):
            p.status()
        assert p.status()["pid"] != first
    finally:
        p.close()
    assert p.pid is None


def test_a_child_that_takes_too_long_is_stopped(real_reports):
    p = PictureProcess(timeout_s=0.05)  # shorter than the child's start
    with pytest.raises(PictureProcessError, match="took longer than 0.05 s"):
        p.draw_run_pictures("pod", {"a": real_reports[0]}, ["a"])
    assert p.pid is None
    with pytest.raises(ValueError):
        PictureProcess(niceness=20)


def test_the_publisher_falls_back_to_this_process_and_warns_once(tmp_path, real_reports):
    """A child that cannot draw costs no picture: the publisher warns once and draws in its own
    process; the pictures logged are those drawn here."""

    class Broken(PictureProcess):
        calls = 0

        def _ask(self, request):
            Broken.calls += 1
            raise PictureProcessError("the picture process could not start (test)")

    pub = Publisher(str(tmp_path), picture_process=Broken())
    reports = {"layer_0": real_reports[0], "layer_1": real_reports[1]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pictures = pub._draw_pictures(pub._picture_run(reports, list(reports), []))
        again = pub._draw_pictures(pub._picture_run(reports, list(reports), []))
    assert Broken.calls == 1 and pub.painter is None
    assert sum("drawn in the training process" in str(w.message) for w in caught) == 1
    here = draw_run_pictures("pod", reports, list(reports))
    assert sorted(pictures) == sorted(here) == sorted(again)
    assert all(np.array_equal(pictures[t], here[t]) for t in here)
    pub.close()


def test_publishers_share_one_child_unless_told_otherwise(tmp_path):
    assert Publisher(str(tmp_path)).painter is shared_picture_process()
    assert Publisher(str(tmp_path), picture_process=False).painter is None
    assert Publisher(str(tmp_path), strict=True).painter is None  # strict: outputs inline, in this process
    assert Publisher(str(tmp_path), background=False).painter is None
