"""A new per-layer metric with running state takes 3 files (docs/architecture.md, "Adding a metric").

The test makes that edit in a scratch copy of the package: one ``Running`` row in
``engine/running.py``, one registry entry in ``reporting/metrics.py`` and one test file, and runs
that test, which checks the throwaway metric (the mean of ``A[i, i]``) against its literal formula
through the report, its record, the registry, a merge and a checkpoint round trip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import podmonitor

ROW_ANCHOR = '    Running("n_skipped_nonfinite",'
ROW = '''    Running("self_mass_sum", "float", "sum", "sum over snapshots of the mean attention of a query on itself",
            step=lambda s: float(s.part.diagonal(dim1=-2, dim2=-1).double().mean(-1).sum()),
            result=lambda v, n: v / n if n else float("nan")),
'''
ENTRY_ANCHOR = '        Metric("reference_scale",'
ENTRY = '''        Metric("self_mass", "attention on the token itself [0 to 1]", "",
               "A[i, i] averaged over queries and snapshots.", "headline", running_value("self_mass")),
'''
NEW_TEST = '''
import torch

import podmonitor
from podmonitor import PODAccumulator, PODConfig
from podmonitor.reporting.metrics import registry


def test_self_mass_is_the_mean_diagonal():
    assert podmonitor.__file__.startswith(%(root)r), podmonitor.__file__  # the scratch copy
    torch.manual_seed(0)
    causal = torch.ones(16, 16).triu(1).bool()
    a = torch.softmax(torch.randn(10, 16, 16).masked_fill(causal, -torch.inf), -1)  # (N, L, L)
    want = float(a.diagonal(dim1=-2, dim2=-1).double().mean())
    cfg = PODConfig(n_dominant=1, coherency=False)
    acc = PODAccumulator(cfg)
    acc.update(a[:4])
    acc.update(a[4:])
    r = acc.compute()
    assert abs(r.running["self_mass"] - want) < 1e-12
    assert abs(r.to_dict()["self_mass"] - want) < 1e-12
    metric = {m.key: m for m in registry()}["self_mass"]
    assert abs(metric.value(r) - want) < 1e-12
    loaded = PODAccumulator(cfg)
    loaded.load_state_dict(acc.state_dict())
    assert abs(loaded.compute().running["self_mass"] - want) < 1e-12
    first, second = PODAccumulator(cfg), PODAccumulator(cfg)
    first.update(a[:4])
    second.update(a[4:])
    assert abs(first.merge(second).compute().running["self_mass"] - want) < 1e-12
'''


def insert_before(path: Path, anchor: str, text: str) -> None:
    src = path.read_text()
    assert src.count(anchor) == 1, f"{anchor!r} not found once in {path}"
    path.write_text(src.replace(anchor, text + anchor))


def test_a_metric_with_running_state_takes_three_files(tmp_path: Path) -> None:
    package = Path(podmonitor.__file__).parent
    shutil.copytree(package, tmp_path / "podmonitor", ignore=shutil.ignore_patterns("__pycache__"))
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*.py")}

    insert_before(tmp_path / "podmonitor/engine/running.py", ROW_ANCHOR, ROW)
    insert_before(tmp_path / "podmonitor/reporting/metrics.py", ENTRY_ANCHOR, ENTRY)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_self_mass.py").write_text(NEW_TEST % {"root": str(tmp_path)})

    after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*.py")}
    touched = {p for p in after if before.get(p) != after[p]}
    assert touched == {Path("podmonitor/engine/running.py"), Path("podmonitor/reporting/metrics.py"),
                       Path("tests/test_self_mass.py")}

    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_self_mass.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 passed" in proc.stdout
