"""examples/reproduce_paper.py end to end on a very short budget (slow: two real fits)."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "reproduce_paper.py"


@pytest.mark.slow
def test_reproduce_paper_writes_the_comparison(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("reproduce_paper", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rc = module.main(["--preset", "tiny", "--max-steps", "4", "--out", str(tmp_path / "out"),
                      "--data.max_val_windows", "6", "--trainer.enable_progress_bar", "false"])
    assert rc == 0
    rows = list(csv.DictReader(open(tmp_path / "out" / "comparison.csv")))
    assert [r["model"] for r in rows] == ["gpt"] * 4 + ["ega"] * 4
    assert all(r["status"] == "ok" and r["T_spec"] for r in rows)
    text = (tmp_path / "out" / "comparison.md").read_text()
    assert text.count("| gpt | layer_") == 4 and text.count("| ega | layer_") == 4
    for name in ("layers.png", "scale_organisation_gpt.png", "scale_organisation_ega.png"):
        assert (tmp_path / "out" / name).stat().st_size > 1000
