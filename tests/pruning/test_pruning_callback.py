"""HeadPruning and PODMonitor(per_head=True) with a real Trainer on a small reference GPT."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from podmonitor import PODConfig, PODMonitor
from podmonitor.models.lightning import GPTLightningModule
from podmonitor.pruning import HeadPruning
from podmonitor.reporting.sinks import WandbSink

FAST = PODConfig(n_dominant=1, coherency=False)


def small_model() -> GPTLightningModule:
    torch.manual_seed(0)
    return GPTLightningModule(vocab_size=11, block_size=16, n_layer=2, n_head=3, n_embd=12, dropout=0.0,
                              lr=1e-2, warmup_steps=1, max_steps=40)


def loaders(n_train: int = 32, n_val: int = 16) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)

    def data(n: int) -> DataLoader:
        x = torch.randint(0, 11, (n, 16), generator=g)
        return DataLoader(TensorDataset(x, (x + 1) % 11), batch_size=8)

    return data(n_train), data(n_val)


def trainer(tmp_path, callbacks, **kw) -> L.Trainer:
    defaults = dict(max_steps=8, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                    num_sanity_val_steps=0, callbacks=callbacks)
    defaults.update(kw)
    return L.Trainer(**defaults)


def masks(model: GPTLightningModule) -> list[list[float]]:
    return [blk.attn.head_mask.tolist() for blk in model.model.transformer.h]


def test_head_pruning_at_step_masks_logs_and_trains_on(tmp_path):
    model = small_model()
    pruning = HeadPruning(strategy={1: [0, 2]}, at_step=3, output_dir=str(tmp_path / "pm"))
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    tr = trainer(tmp_path, [pruning], logger=logger, limit_val_batches=0)
    tr.fit(model, *loaders())
    assert tr.global_step == 8
    assert masks(model) == [[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]]
    (action,) = pruning.actions
    assert action["step"] == 3 and action["heads"] == {"1": [0, 2]} and action["n_pruned"] == 2
    with open(tmp_path / "pm" / "pruning.jsonl") as f:
        assert json.loads(f.readline())["heads"] == {"1": [0, 2]}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logger.log_dir)
    acc.Reload()
    assert "pod/pruning/text_summary" in acc.Tags()["tensors"]
    assert [e.value for e in acc.Scalars("pod/heads_active/layer_01")] == [1.0]


def test_advice_strategy_prunes_the_monitors_first_drops_and_the_advice_is_logged(tmp_path):
    model = small_model()
    monitor = PODMonitor(n_snapshots=16, config=FAST, per_head=True, images_every_n=1,
                         output_dir=str(tmp_path / "pm"))
    pruning = HeadPruning(n_heads=2, at_step=4)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    tr = trainer(tmp_path, [monitor, pruning], logger=logger, val_check_interval=4, max_steps=8)
    tr.fit(model, *loaders())
    first = monitor.history[0]["head_allocation"]
    expected: dict[int, list[int]] = {}
    for d in first["drop_order"][:2]:
        expected.setdefault(d["layer_index"], []).append(d["head"])
    assert pruning.masker.pruned == {k: sorted(v) for k, v in expected.items()}
    assert "podmonitor advice" in pruning.actions[0]["evidence"]
    # the second run's advice counts only the active heads
    second = monitor.history[1]["head_allocation"]
    assert sum(r["heads_now"] for r in second["layers"]) == 6 - 2
    with open(tmp_path / "pm" / "podmonitor.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert {"head_allocation", "head_redundancy", "readiness"} <= set(records[0])
    assert records[0]["readiness"]["stable"] is False
    assert len(records[0]["head_redundancy"]["layer_00"]["similarity"]) == 3
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    acc.Reload()
    tags = acc.Tags()
    assert "pod/head_allocation" in tags["images"]
    assert "pod/head_allocation/text_summary" in tags["tensors"]
    assert [e.value for e in acc.Scalars("pod/heads_recommended/layer_00")][0] >= 1.0
    assert len(acc.Scalars("pod/subspace_drift/layer_01")) == 2


def test_when_ready_prunes_after_a_stable_validation_run(tmp_path):
    stub = SimpleNamespace(readiness=SimpleNamespace(stable=False), last_advice=None, history=[],
                           run_dir=lambda trainer: str(tmp_path / "pm"))
    pruning = HeadPruning(strategy={0: [1]}, when_ready=True, monitor=stub)
    model = small_model()
    tr = trainer(tmp_path, [pruning], val_check_interval=2, max_steps=4)
    tr.fit(model, *loaders())
    assert pruning.actions == [] and masks(model)[0] == [1.0, 1.0, 1.0]
    stub.readiness.stable = True
    tr = trainer(tmp_path, [pruning], val_check_interval=2, max_steps=4)
    tr.fit(model, *loaders())
    assert pruning.actions[0]["trigger"] == "readiness: stable"
    assert pruning.actions[0]["step"] == 2  # the first batch after the first (stable) validation run
    assert masks(model)[0] == [1.0, 0.0, 1.0]


def test_checkpoint_resume_reapplies_the_mask_and_restore_still_works(tmp_path):
    model = small_model()
    original = model.model.transformer.h[0].attn.c_attn.weight.detach().clone()
    pruning = HeadPruning(strategy={0: [2]}, at_step=1, output_dir=str(tmp_path / "pm"))
    tr = trainer(tmp_path, [pruning], limit_val_batches=0, max_steps=4)
    tr.fit(model, *loaders())
    ckpt = tmp_path / "p.ckpt"
    tr.save_checkpoint(ckpt)
    resumed_model = small_model()
    resumed = HeadPruning(strategy={0: [2]}, at_step=1, output_dir=str(tmp_path / "pm"))
    tr2 = trainer(tmp_path, [resumed], limit_val_batches=0, max_steps=6)
    tr2.fit(resumed_model, *loaders(), ckpt_path=str(ckpt))
    assert resumed.done and len(resumed.actions) == 1  # not pruned twice
    assert masks(resumed_model)[0] == [1.0, 1.0, 0.0]
    resumed.restore()
    assert masks(resumed_model)[0] == [1.0, 1.0, 1.0]
    hs, C = 4, 12
    w = resumed_model.model.transformer.h[0].attn.c_attn.weight
    for part in range(3):  # the head's q, k, v rows are those it had when it was pruned (step 1)
        rows = slice(part * C + 2 * hs, part * C + 3 * hs)
        assert not torch.equal(w[rows], original[rows])  # the first optimiser step had moved them
    stash = pruning.masker.state_dict()["stash"]["0:2"]
    torch.testing.assert_close(w[2 * hs:3 * hs], stash[0])


def test_michel_strategy_and_bad_arguments(tmp_path):
    model = small_model()
    pruning = HeadPruning(n_heads=2, strategy="michel", at_step=2, importance_batches=1)
    tr = trainer(tmp_path, [pruning], max_steps=3, limit_val_batches=1)
    tr.fit(model, *loaders())
    assert sum(len(v) for v in pruning.masker.pruned.values()) == 2
    assert pruning.actions[0]["evidence"].startswith("michel importance")
    with pytest.raises(ValueError, match="at_step"):
        HeadPruning(n_heads=1)
    with pytest.raises(ValueError, match="strategy"):
        HeadPruning(n_heads=1, at_step=1, strategy="largest")
    with pytest.raises(ValueError, match="n_heads"):
        HeadPruning(n_heads=0, at_step=1)


def test_wandb_sink_logs_the_advice_as_a_table():
    pytest.importorskip("wandb")
    import wandb

    logged = []
    run = SimpleNamespace(log=logged.append, define_metric=lambda *a, **k: None)
    WandbSink(run).log_table("pod/head_allocation_table", ["layer", "recommended", "T_spec"],
                             [["layer_00", 2, float("nan")], ["layer_01", 6, 1.5]], step=7)
    (payload,) = logged
    table = payload["pod/head_allocation_table"]
    assert isinstance(table, wandb.Table) and payload["pod/step"] == 7
    assert table.columns == ["layer", "recommended", "T_spec"]
    assert table.data == [["layer_00", 2, None], ["layer_01", 6, 1.5]]


def test_png_sink_writes_the_table_as_csv(tmp_path):
    from podmonitor.reporting.sinks import PNGSink

    PNGSink(tmp_path).log_table("pod/head_allocation_table", ["a", "b"], [[1, None]], step=3)
    assert (tmp_path / "3" / "pod_head_allocation_table.csv").read_text().splitlines() == ["a,b", "1,"]
    assert os.path.exists(tmp_path / "3")
