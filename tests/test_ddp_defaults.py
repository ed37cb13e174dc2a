"""The three callbacks under DDP (2 CPU processes, ddp_spawn) with their default settings.

No ``output_dir``: the run directory comes from ``trainer.log_dir``, a collective in Lightning,
which used to be reached from rank-zero-only code and hung the run. Each scenario runs in its own
process group under a timeout (tests/distributed.py): a hang fails that test only.

PODMonitor runs with both models (the reference GPT, captured through its protocol, and a Hugging
Face GPT-2) and both loggers (TensorBoard and none), in all four pairs. The smoothness monitor and
the head pruning, which add their own hooks and records to the same capture and logger paths, run
in two pairs each, so that across the two every pair of model and logger occurs (pairwise: each
callback with each logger and with each model), which halves the time of those eight scenarios.
"""

from __future__ import annotations

import math

import pytest

from tests.distributed import run_scenario

pytest.importorskip("transformers")

TIMEOUT = 180

LOGGERS = ["tb", "none"]
MODELS = ["ref", "hf"]


def _reports(records):
    return [r for r in records if r.get("kind") == "report"]


def _assert_group_destroyed_at_exit(res):
    """Each rank's process group was destroyed by podmonitor's exit handler before interpreter
    finalisation (a gloo group left alive can abort a rank at exit; see
    podmonitor.distributed.destroy_gloo_group_at_exit)."""
    assert sorted(p["rank"] for p in res["exit_probes"]) == [0, 1]
    assert not any(p["initialized"] for p in res["exit_probes"])


def _close(a, b, rel=1e-9):
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


@pytest.mark.parametrize("logger", LOGGERS)
@pytest.mark.parametrize("model", MODELS)
def test_ddp_podmonitor_defaults_finish_take_n_and_match_one_process(tmp_path, model, logger):
    res = run_scenario(f"tests.ddp_scenarios:pod:{model}:{logger}", tmp_path, timeout=TIMEOUT)
    reports = _reports(res["records"])
    assert [r["stage"] for r in reports] == ["fit"]  # rank zero alone writes, one record per run
    (rec,) = reports
    assert rec["errors"] == []
    assert rec["n_taken"] == rec["n_requested"] == 150
    for layer in rec["layers"].values():
        assert layer["n_snapshots"] == 150  # summed over the two ranks: the requested N
        assert layer["status"] == "ok"
    # rank zero's numbers equal one process analysing the same sequences with the same weights
    (single,) = _reports(res["single"])
    assert single["stage"] == "validate"
    assert sorted(single["layers"]) == sorted(rec["layers"])
    for name, layer in rec["layers"].items():
        ref = single["layers"][name]
        assert layer["n_snapshots"] == ref["n_snapshots"]
        assert layer["dominant_scales"] == pytest.approx(ref["dominant_scales"], rel=1e-9)
        assert _close(layer["t_spec"], ref["t_spec"]) and _close(layer["entropy"], ref["entropy"])
        assert layer["effective_rank"] == ref["effective_rank"]
        top_d, top_s = layer["per_scale"][0], ref["per_scale"][0]
        assert top_d["eigenvalues"] == pytest.approx(top_s["eigenvalues"], rel=1e-7, abs=1e-15)
    # after ddp_spawn the main process's history is rank zero's
    assert len(res["main_history"]) == 1 and res["main_history"][0]["step"] == rec["step"]
    if logger == "tb":
        assert "pod/headline/t_spec" in res["tags"]  # the layers are runs of their own
    _assert_group_destroyed_at_exit(res)


@pytest.mark.parametrize(("model", "logger"), [("ref", "tb"), ("hf", "none")])
def test_ddp_smoothness_monitor_defaults_finish_and_write(tmp_path, model, logger):
    res = run_scenario(f"tests.ddp_scenarios:smooth:{model}:{logger}", tmp_path, timeout=TIMEOUT)
    recs = res["records"]
    assert len(recs) == 1 and recs[0]["sigma_computed"] and recs[0]["errors"] == []
    assert len(recs[0]["layers"]) == 2
    for layer in recs[0]["layers"].values():
        assert all(s > 0 for s in layer["sigma_mean"])
    assert len(res["main_history"]) == 1
    if logger == "tb":
        assert any(t.startswith("smooth/") for t in res["tags"])
    _assert_group_destroyed_at_exit(res)


@pytest.mark.parametrize(("model", "logger"), [("ref", "none"), ("hf", "tb")])
def test_ddp_head_pruning_defaults_finish_and_record(tmp_path, model, logger):
    res = run_scenario(f"tests.ddp_scenarios:prune:{model}:{logger}", tmp_path, timeout=TIMEOUT)
    (action,) = res["records"]
    assert action["action"] == "prune" and action["n_pruned"] == 1 and action["step"] == 1
    assert len(res["main_history"]) == 1 and res["main_history"][0]["heads"] == action["heads"]
    (pod,) = _reports(res["pod_records"])
    assert pod["n_taken"] == 150
    if logger == "tb":
        assert "pod/pruning/n_pruned" in res["tags"]
    _assert_group_destroyed_at_exit(res)


def test_ddp_quota_rebalanced_when_one_rank_has_only_padded_sequences(tmp_path):
    res = run_scenario("tests.ddp_scenarios:padded_rank", tmp_path, timeout=TIMEOUT)
    (rec,) = _reports(res["records"])
    # rank 1 holds the 80 odd-indexed (padded) sequences: rank 0 supplies all 60
    assert rec["n_taken"] == 60
    assert rec["skipped"]["padding"] > 0
    for layer in rec["layers"].values():
        assert layer["n_snapshots"] == 60
