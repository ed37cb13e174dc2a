"""PODMonitor under Lightning DDP on 2 CPU processes: snapshots from both ranks count, no hangs."""

from __future__ import annotations

import json

import lightning as L

from podmonitor import PODConfig, PODMonitor
from tests.callback_models import TinyGPT


def test_ddp_snapshots_from_all_ranks_count_and_rank_zero_writes(tmp_path):
    out = tmp_path / "pm"
    monitor = PODMonitor(n_snapshots=24, config=PODConfig(n_dominant=2), log_images=False, output_dir=str(out))
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        logger=False,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(TinyGPT(n_val=48))
    lines = [json.loads(x) for x in (out / "podmonitor.jsonl").read_text().splitlines()]
    # one record per monitored validation run (rank zero alone writes), steps of one rank
    assert [r["epoch"] for r in lines] == [0, 1]
    for rec in lines:
        for layer in ("layer_00", "layer_01"):
            # 12 sequences from each of the two ranks (each rank sees half the validation set)
            assert rec["layers"][layer]["n_snapshots"] == 24
            assert rec["layers"][layer]["status"] == "ok"
        assert rec["errors"] == []


def test_ddp_per_head_analysis_merges_the_head_redundancy_of_both_ranks(tmp_path):
    out = tmp_path / "pm"
    monitor = PODMonitor(n_snapshots=24, config=PODConfig(n_dominant=2), per_head=True, log_images=False,
                         output_dir=str(out))
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False,
                        callbacks=[monitor], enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=str(tmp_path))
    trainer.fit(TinyGPT(n_val=48))
    (rec,) = [json.loads(x) for x in (out / "podmonitor.jsonl").read_text().splitlines()]
    assert rec["errors"] == []
    for layer in ("layer_00", "layer_01"):
        # the sums of the two ranks' 12 sequences each, sent as state dicts and merged on rank zero
        assert rec["head_redundancy"][layer]["n_snapshots"] == 24
        assert rec["layers"][f"{layer}/head_00"]["n_snapshots"] == 24
    assert [row["layer"] for row in rec["head_allocation"]["layers"]] == ["layer_00", "layer_01"]
    assert monitor.history[0]["readiness"]["stable"] is False  # handed over to the main process
    assert monitor.readiness is not None and len(monitor.readiness.history) == 1
