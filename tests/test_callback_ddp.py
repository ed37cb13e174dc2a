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
