"""A run's pictures in parts: the same pictures as one drawing, a failing part costs only its own
pictures, and a thread waiting for the outputs draws the parts nobody has started."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from podmonitor.reporting.figures import PICTURES, draw_run_pictures
from podmonitor.reporting.picture_run import PictureRun, picture_parts
from podmonitor.reporting.publish import Publisher
from podmonitor.reporting.render_process import PictureProcess

TREND = {"t_spec": ("T_spec", {"layer_0": [0.2, 0.3], "layer_1": [0.4, 0.5]})}
STEPS = [8, 16]


def _reports(real_reports):
    # a sub-layer (a name with "/") gets its layer pictures but no trend row
    return {"layer_0": real_reports[0], "layer_1": real_reports[1], "layer_1/head_0": real_reports[2]}


def _same(got, want):
    assert list(got) == list(want)  # the same tags, in the same order
    for tag in want:
        assert np.array_equal(got[tag], want[tag]), tag


def test_parts_follow_the_order_of_one_drawing_and_leave_out_empty_ones():
    assert picture_parts(["a", "b"], ("scale_organisation", "spectrum", "scalogram", "trend")) == [
        (["a", "b"], ("scale_organisation",)), (["a"], ("scalogram", "spectrum")), (["b"], ("scalogram", "spectrum")),
        (["a", "b"], ("trend",))]
    assert picture_parts(["a"], ("trend",)) == [(["a"], ("trend",))]
    assert picture_parts([], ("trend", "spectrum")) == []


@pytest.mark.parametrize("which", [None, ("spectrum", "trend"), ("scale_organisation", "modes")])
def test_the_parts_drawn_together_are_one_drawing_of_the_run(real_reports, which):
    reports = _reports(real_reports)
    kwargs = {} if which is None else {"which": which}
    want = draw_run_pictures("pod", reports, list(reports), TREND, STEPS, {"t_spec": ""}, **kwargs)
    run = PictureRun("pod", reports, list(reports), TREND, STEPS, {"t_spec": ""},
                     which if which is not None else PICTURES, lambda err: None)
    _same(run.draw(run.draw_here), want)


def test_a_failing_part_costs_only_its_pictures(real_reports):
    reports = _reports(real_reports)
    errors = []
    run = PictureRun("pod", reports, list(reports), TREND, STEPS, None, PICTURES,
                     errors.append)

    def drawer(part_reports, layers, names):
        if layers == ["layer_1"]:
            raise ValueError("a broken layer (test)")
        return run.draw_here(part_reports, layers, names)

    got = run.draw(drawer)
    want = draw_run_pictures("pod", reports, list(reports), TREND, STEPS)
    assert [type(e) for e in errors] == [ValueError]
    assert not any(t.endswith("/layer_1") for t in got)
    _same(got, {t: a for t, a in want.items() if not t.endswith("/layer_1")})


def test_a_waiting_thread_draws_the_parts_nobody_started_and_the_worker_puts_them_together(real_reports):
    reports = _reports(real_reports)
    run = PictureRun("pod", reports, list(reports), TREND, STEPS, None, PICTURES,
                     lambda err: None)
    entered, released, result = threading.Event(), threading.Event(), {}

    def slow_child(part_reports, layers, names):  # the picture process, busy with its first part
        entered.set()
        assert released.wait(30)
        return run.draw_here(part_reports, layers, names)

    worker = threading.Thread(target=lambda: result.update(run.draw(slow_child)))
    worker.start()
    assert entered.wait(30)
    assert run.help() == len(run.parts) - 1  # everything but the part the worker holds
    released.set()
    worker.join(30)
    _same(result, draw_run_pictures("pod", reports, list(reports), TREND, STEPS))


def test_the_publisher_helps_with_the_pictures_it_waits_for_at_close(tmp_path, real_reports, monkeypatch):
    reports = _reports(real_reports)
    entered, released = threading.Event(), threading.Event()

    class SlowPainter(PictureProcess):
        """A picture process busy with the first part until the publisher has helped with the rest."""

        def draw_run_pictures(self, prefix, part_reports, present, trend=None, steps=(), units=None,
                              which=(), timings=None):
            entered.set()
            assert released.wait(30)
            return draw_run_pictures(prefix, part_reports, present, trend, steps, units, which=which)

    original_help = PictureRun.help
    helped = []

    def help_then_release(self):
        drawn = original_help(self)
        helped.append(drawn)
        released.set()
        return drawn

    monkeypatch.setattr(PictureRun, "help", help_then_release)
    pub = Publisher(str(tmp_path), picture_process=SlowPainter())
    failures, got = [], {}
    run = pub._picture_run(reports, list(reports), failures, TREND, STEPS)
    pub.worker.submit(lambda: got.update(pub._draw_pictures(run)))
    assert entered.wait(30)
    pub.close()
    assert failures == [] and helped == [len(run.parts) - 1]  # one help at close: all but the worker's part
    assert pub.background_seconds()["help_cpu_s"] > 0 and pub._open_runs == []
    _same(got, draw_run_pictures("pod", reports, list(reports), TREND, STEPS, run.units))


def test_an_interrupted_helper_never_leaves_the_worker_waiting(real_reports):
    """A helper stopped by an interrupt (a BaseException) gives up its part; the worker finishes
    the run without it instead of waiting for it forever."""

    class Interrupt(BaseException):
        pass

    reports = _reports(real_reports)
    run = PictureRun("pod", reports, list(reports), TREND, STEPS, None, PICTURES, lambda err: None)

    def interrupted(part_reports, layers, names):
        raise Interrupt

    run.draw_here = interrupted  # the helper's drawer
    with pytest.raises(Interrupt):
        run.help()
    result, done = {}, threading.Event()

    def worker():
        result.update(run.draw(lambda r, layers, names: draw_run_pictures("pod", r, layers, TREND, STEPS,
                                                                          which=names)))
        done.set()

    threading.Thread(target=worker, daemon=True).start()
    assert done.wait(60)
    want = draw_run_pictures("pod", reports, list(reports), TREND, STEPS)
    assert "pod/scale_organisation" not in result  # the interrupted part (the first)
    _same(result, {t: a for t, a in want.items() if t != "pod/scale_organisation"})
