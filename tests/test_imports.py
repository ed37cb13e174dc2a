"""What importing podmonitor loads: the report classes and the figures without torch (the picture
process draws with them alone), and every public name still where users find it."""

from __future__ import annotations

import subprocess
import sys


def test_the_reports_and_figures_import_without_torch_and_the_public_names_resolve():
    code = """
import sys
import podmonitor
import podmonitor.engine.report
import podmonitor.reporting.figures
import podmonitor.reporting.render_process
assert "torch" not in sys.modules, "torch imported"
assert "lightning" not in sys.modules, "lightning imported"

import inspect
from podmonitor import PODConfig, analyze, PODReport, FrequentDirections, estimate_memory
import podmonitor.engine.config, podmonitor.engine.sketch, podmonitor.engine.budget
assert "torch" in sys.modules
assert PODConfig is podmonitor.engine.config.PODConfig
assert FrequentDirections is podmonitor.engine.sketch.FrequentDirections
assert estimate_memory is podmonitor.engine.budget.estimate_memory
assert PODReport is podmonitor.engine.report.PODReport
assert inspect.isfunction(analyze) and analyze is podmonitor.engine.analyze  # the function, not its module
from podmonitor.engine import PODAccumulator, MemoryBudgetError, default_scales, ScaleReport
from podmonitor.reporting import figure_to_array, sinks_for_loggers, layer_scalars, WandbSink
names = set(dir(podmonitor)) | set(dir(podmonitor.engine)) | set(dir(podmonitor.reporting))
missing = [n for n in podmonitor.engine.__all__ + podmonitor.reporting.__all__ if n not in names]
assert not missing, missing
for module in (podmonitor, podmonitor.engine, podmonitor.reporting):
    try:
        getattr(module, "no_such_name")
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("no AttributeError")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
