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


def test_hstar_strategy_prunes_the_monitors_first_drops_and_the_advice_is_logged(tmp_path):
    model = small_model()
    monitor = PODMonitor(n_snapshots=16, config=FAST, per_head=True, images_every_n=1,
                         output_dir=str(tmp_path / "pm"))
    pruning = HeadPruning(n_heads=2, at_step=4, strategy="hstar")
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    tr = trainer(tmp_path, [monitor, pruning], logger=logger, val_check_interval=4, max_steps=8)
    tr.fit(model, *loaders())
    first = monitor.history[0]["head_allocation"]
    expected: dict[int, list[int]] = {}
    for d in first["drop_order"][:2]:
        expected.setdefault(d["layer_index"], []).append(d["head"])
    assert pruning.masker.pruned == {k: sorted(v) for k, v in expected.items()}
    assert "H*-based allocation (a hypothesis" in pruning.actions[0]["evidence"]
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


@pytest.mark.parametrize("strategy", ["hstar", "random"])
def test_a_failing_selection_is_attempted_once_per_validation_not_once_per_batch(tmp_path, strategy):
    # "hstar" without any advice yet; "random" asked for more heads than can go (2 layers x 3 heads)
    stub = SimpleNamespace(readiness=None, last_advice=None, history=[], run_dir=lambda trainer: str(tmp_path))
    pruning = HeadPruning(n_heads=5, strategy=strategy, at_step=1, monitor=stub)
    attempts: list[int] = []
    select = pruning.select

    def counting_select(trainer, pl_module, masker):
        attempts.append(trainer.global_step)
        return select(trainer, pl_module, masker)

    pruning.select = counting_select
    validations: list[int] = []
    counter = L.Callback()
    counter.on_validation_end = lambda trainer, pl_module: validations.append(trainer.global_step)
    model = small_model()
    tr = trainer(tmp_path, [pruning, counter], val_check_interval=2, limit_val_batches=1, max_steps=8)
    with pytest.warns(Warning) as record:
        tr.fit(model, *loaders())
    assert validations == [2, 4, 6, 8]
    # the first batch at or after at_step, then once after each validation run followed by a batch
    assert attempts == [1, 2, 4, 6]
    pruning_warnings = [w for w in record if "HeadPruning: choosing heads failed" in str(w.message)]
    assert len(pruning_warnings) == len(attempts)
    assert not pruning.done and pruning.actions == [] and masks(model) == [[1.0] * 3, [1.0] * 3]


class _FakeStrategy:
    """Stands in for a DDP strategy on one process: records the collectives, answers as rank 0 would."""

    def __init__(self, ready_on_rank0: bool, others_able: bool = True) -> None:
        self.calls: list[str] = []
        self.ready_on_rank0 = ready_on_rank0
        self.others_able = others_able

    def broadcast(self, obj, src=0):
        self.calls.append("broadcast")
        if isinstance(obj, bool):
            return self.ready_on_rank0
        return {0: [1]}, "explicit heads"  # rank 0's choice

    def reduce_boolean_decision(self, decision, all=True):
        self.calls.append("reduce")
        return bool(decision) and self.others_able


def _fake_ddp_trainer(tmp_path, strategy: _FakeStrategy, rank: int) -> SimpleNamespace:
    return SimpleNamespace(world_size=2, global_rank=rank, sanity_checking=False, global_step=0, current_epoch=0,
                           strategy=strategy, callbacks=[], loggers=[], log_dir=None,
                           default_root_dir=str(tmp_path))


def test_readiness_is_broadcast_once_per_validation_and_the_decision_to_prune_is_collective(tmp_path):
    stub = SimpleNamespace(readiness=SimpleNamespace(stable=False), last_advice=None, history=[],
                           run_dir=lambda trainer: str(tmp_path / "pm"))
    # rank 1: its own monitor (never stable there) does not decide; rank 0's broadcast readiness does
    model = small_model()
    strat = _FakeStrategy(ready_on_rank0=True)
    tr = _fake_ddp_trainer(tmp_path, strat, rank=1)
    pruning = HeadPruning(strategy={0: [1]}, when_ready=True, monitor=stub)
    pruning.setup(tr, model, "fit")
    pruning.on_train_start(tr, model)
    assert strat.calls == ["reduce"]
    for step in range(5):  # not ready yet: no collective in the training batches
        tr.global_step = step
        pruning.on_train_batch_start(tr, model, None, step)
    assert strat.calls == ["reduce"] and not pruning.done
    pruning.on_validation_end(tr, model)
    assert strat.calls == ["reduce", "broadcast", "reduce"]
    tr.global_step = 5
    pruning.on_train_batch_start(tr, model, None, 5)  # prunes: rank 0's heads are broadcast
    assert pruning.done and masks(model)[0] == [1.0, 0.0, 1.0]
    assert strat.calls == ["reduce", "broadcast", "reduce", "broadcast"]
    for step in range(6, 10):
        tr.global_step = step
        pruning.on_train_batch_start(tr, model, None, step)
    assert strat.calls == ["reduce", "broadcast", "reduce", "broadcast"]

    # another rank cannot prune (no masker there): nobody enters the pruning collective
    model2 = small_model()
    strat2 = _FakeStrategy(ready_on_rank0=True, others_able=False)
    tr2 = _fake_ddp_trainer(tmp_path, strat2, rank=0)
    stub.readiness.stable = True
    pruning2 = HeadPruning(strategy={0: [1]}, when_ready=True, monitor=stub)
    pruning2.setup(tr2, model2, "fit")
    pruning2.on_train_start(tr2, model2)
    pruning2.on_validation_end(tr2, model2)
    for step in range(5):
        tr2.global_step = step
        pruning2.on_train_batch_start(tr2, model2, None, step)
    assert strat2.calls == ["reduce", "broadcast", "reduce"]
    assert not pruning2.done and masks(model2)[0] == [1.0, 1.0, 1.0]
