"""Faults and bad input: outputs fail alone, nothing is lost silently, every case says what happened.

Single-process runs with the real Trainer on the tiny protocol model; the DDP cases are in
tests/test_ddp_defaults.py. The tests run as root on the development machines, where a folder
without write bits is still writable, so an unwritable output folder is a path that runs through
a regular file (``mkdir`` then fails with NotADirectoryError, as a read-only mount fails with
EROFS): the same code path, an OSError at the first write.
"""

from __future__ import annotations

import json
import os
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from podmonitor import PODConfig, PODMonitor, PODMonitorWarning
from podmonitor.reporting.sinks import TensorBoardSink
from tests.callback_models import TinyGPT
from tests.tb_events import all_scalar_series

FAST = PODConfig(n_dominant=2)


def make_trainer(tmp_path, callbacks, logger=False, **kw):
    args = dict(max_epochs=2, accelerator="cpu", devices=1, logger=logger, callbacks=callbacks,
                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                default_root_dir=str(tmp_path))
    args.update(kw)
    return L.Trainer(**args)


def read_jsonl(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def tb_scalars(log_dir) -> dict[str, list[int]]:
    """{tag (with /<layer> for the per-layer runs): [steps]} under log_dir."""
    return {tag: [step for step, _ in series] for tag, series in all_scalar_series(str(log_dir)).items()}


def unwritable(tmp_path) -> str:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    return str(blocker / "podmonitor")


def pod_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, PODMonitorWarning)]


# ------------------------------------------------------------------------------------------ sinks
def test_sink_that_raises_on_write_costs_only_that_sink(tmp_path, monkeypatch):
    def broken(self, images, step):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TensorBoardSink, "log_images", broken)
    monitor = PODMonitor(n_snapshots=8, config=FAST, images_every_n=1)
    loggers = [TensorBoardLogger(str(tmp_path), name="tb"), CSVLogger(str(tmp_path), name="csv")]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [monitor], logger=loggers).fit(TinyGPT())
    msgs = [m for m in pod_warnings(rec) if "TensorBoard" in m]
    assert len(msgs) == 1  # one warning, not one per validation run
    assert "No space left on device" in msgs[0] and "other outputs are unaffected" in msgs[0]
    # the history, the JSON lines and the PNG sink (CSV logger) hold both validation runs
    assert [h["step"] for h in monitor.history] == [8, 16]
    assert all(h["output_failures"] for h in monitor.history)
    records = [r for r in read_jsonl(monitor.run_dir() + "/podmonitor.jsonl") if r["kind"] == "report"]
    assert [r["step"] for r in records] == [8, 16]
    assert all(r["layers"]["layer_00"]["status"] == "ok" for r in records)
    png_steps = sorted({int(d) for d in os.listdir(os.path.join(monitor.run_dir(), "images")) if d.isdigit()})
    assert png_steps == [8, 16]  # the PNG sink drew the pictures TensorBoard could not take
    # TensorBoard still took the scalars it was given before the pictures failed
    assert tb_scalars(tmp_path / "tb")["pod/headline/t_spec/layer_00"] == [8, 16]


def test_unwritable_output_folder_keeps_tensorboard_and_history(tmp_path):
    monitor = PODMonitor(n_snapshots=8, config=FAST, log_images=False, output_dir=unwritable(tmp_path))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [monitor], logger=TensorBoardLogger(str(tmp_path), name="tb")).fit(TinyGPT())
    msgs = pod_warnings(rec)
    assert len([m for m in msgs if "JSON lines" in m]) == 1
    assert not any("analysing or logging failed" in m or "logging failed" in m for m in msgs)
    assert [h["step"] for h in monitor.history] == [8, 16]
    tags = tb_scalars(tmp_path / "tb")
    assert tags["pod/headline/t_spec/layer_00"] == [8, 16] and tags["pod/headline/t_spec/layer_01"] == [8, 16]


def test_unwritable_output_folder_without_logger_keeps_history(tmp_path):
    monitor = PODMonitor(n_snapshots=8, config=FAST, output_dir=unwritable(tmp_path))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [monitor]).fit(TinyGPT())
    msgs = pod_warnings(rec)
    assert any("JSON lines" in m for m in msgs) and any("PNG files" in m for m in msgs)
    assert len(monitor.history) == 2 and monitor.history[-1]["layers"]["layer_00"]["status"] == "ok"


def test_smoothness_unwritable_output_folder_keeps_tensorboard(tmp_path):
    from podmonitor import SmoothnessMonitor, SmoothnessMonitorWarning

    monitor = SmoothnessMonitor(output_dir=unwritable(tmp_path), n_iter=20)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [monitor], logger=TensorBoardLogger(str(tmp_path), name="tb"),
                     max_epochs=1).fit(_mha_model())
    msgs = [str(w.message) for w in rec if issubclass(w.category, SmoothnessMonitorWarning)]
    assert len([m for m in msgs if "JSON lines" in m]) == 1
    assert len(monitor.history) == 1
    assert any(t.startswith("smooth/") for t in tb_scalars(tmp_path / "tb"))


def _mha_model() -> L.LightningModule:
    from tests.test_callback_adapters import EncoderModule

    return EncoderModule()


# --------------------------------------------------------------------------------------- padding
class PaddedGPT2(L.LightningModule):
    """Hugging Face GPT-2 on (x, y, attention_mask) batches, every validation sequence padded."""

    def __init__(self, side: str) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=16, n_positions=32)
        self.model = transformers.GPT2LMHeadModel(cfg)
        self.side = side

    def _loss(self, batch):
        x, y, mask = batch
        logits = self.model(input_ids=x, attention_mask=mask).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 16), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        return self._loss(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def _loader(self, pad: bool):
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 16, (32, 32), generator=g)
        mask = torch.ones_like(x)
        if pad:
            if self.side == "left":
                mask[:, :4] = 0
            else:
                mask[:, -4:] = 0
        return DataLoader(TensorDataset(x, (x + 1) % 16, mask), batch_size=8)

    def train_dataloader(self):
        return self._loader(False)

    def val_dataloader(self):
        return self._loader(True)


@pytest.mark.parametrize("side", ["left", "right"])
def test_all_padded_validation_warns_once_saying_why(tmp_path, side):
    monitor = PODMonitor(n_snapshots=8, config=FAST, log_images=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [monitor], max_epochs=2).fit(PaddedGPT2(side))
    msgs = [m for m in pod_warnings(rec) if "sequences were usable" in m]
    assert len(msgs) == 1  # once, not at every validation run
    assert "only 0 of the requested 8" in msgs[0] and "32 had padding" in msgs[0]
    assert "without padding" in msgs[0]  # what to do
    records = [r for r in read_jsonl(monitor.run_dir() + "/podmonitor.jsonl") if r["kind"] == "report"]
    assert len(records) == 2
    for r in records:
        assert r["n_taken"] == 0 and r["skipped"]["padding"] == 32
        assert any("sequences were usable" in e for e in r["errors"])  # every run's record says so


# ---------------------------------------------------------------------------------------- budget
def test_budget_exceeded_by_the_first_batch_is_a_clean_refusal(tmp_path):
    config = PODConfig(n_dominant=2, memory_budget_bytes=1024, mode="exact")
    monitor = PODMonitor(n_snapshots=8, config=config, log_images=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [monitor], max_epochs=1).fit(TinyGPT())
    msgs = pod_warnings(rec)
    assert any("memory budget" in m.lower() or "MemoryBudgetError" in m for m in msgs)
    assert not any("AttributeError" in m for m in msgs)
    (record,) = [r for r in read_jsonl(monitor.run_dir() + "/podmonitor.jsonl") if r["kind"] == "report"]
    assert record["skipped"]["budget"] == 8 and record["n_taken"] == 0


# --------------------------------------------------------------------------------- normalisation
def test_fields_whose_rows_do_not_sum_to_one_are_flagged(tmp_path):
    def raw_scores(module, batch):  # heads summed instead of kept apart: rows sum to H = 2
        maps = module.attention_maps(batch)
        return [m.sum(dim=1, keepdim=True) for m in maps]

    monitor = PODMonitor(n_snapshots=8, config=FAST, log_images=False, capture=raw_scores)
    make_trainer(tmp_path, [monitor], max_epochs=1).fit(TinyGPT())
    (record,) = [r for r in read_jsonl(monitor.run_dir() + "/podmonitor.jsonl") if r["kind"] == "report"]
    for layer in record["layers"].values():
        assert layer["status"] != "ok"
        assert layer["n_not_normalised"] == 8
        assert layer["max_row_sum_error"] == pytest.approx(1.0, rel=1e-5)  # rows sum to 2
        assert any("sum to 1" in m or "normalis" in m for m in layer["messages"])


# ---------------------------------------------------------------------------------------- resume
def test_resume_from_an_older_checkpoint_marks_and_never_duplicates_silently(tmp_path):
    out = str(tmp_path / "pm")
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1,
                           filename="{epoch}")
    first = PODMonitor(n_snapshots=8, config=FAST, log_images=False, output_dir=out)
    make_trainer(tmp_path, [first, ckpt], max_epochs=3, enable_checkpointing=True).fit(TinyGPT())
    # resume from the end of epoch 0 (step 8): steps 16 and 24 are measured again
    second = PODMonitor(n_snapshots=8, config=FAST, log_images=False, output_dir=out)
    make_trainer(tmp_path, [second], max_epochs=3).fit(TinyGPT(), ckpt_path=str(tmp_path / "ckpt" / "epoch=0.ckpt"))
    records = read_jsonl(out + "/podmonitor.jsonl")
    kinds = [(r["kind"], r["step"]) for r in records]
    assert kinds == [("report", 8), ("report", 16), ("report", 24), ("resume", 8), ("report", 16), ("report", 24)]
    marker = records[3]
    assert marker["previous_run_id"] == first.run_id and marker["run_id"] == second.run_id
    assert marker["superseded_steps"] == [16, 24]
    seen: dict[tuple[int, str], str] = {}
    for r in records:
        if r["kind"] != "report":
            continue
        key = (r["step"], r["stage"])
        if key in seen:  # a second record of a step and stage always says so
            assert r["repeats"] == seen[key]
        else:
            assert "repeats" not in r
        seen[key] = r["run_id"]
    assert {r["run_id"] for r in records[4:]} == {second.run_id}


def test_validate_after_fit_has_its_own_stage(tmp_path):
    monitor = PODMonitor(n_snapshots=8, config=FAST, log_images=False)
    model = TinyGPT()
    trainer = make_trainer(tmp_path, [monitor], max_epochs=1)
    trainer.fit(model)
    trainer.validate(model)
    records = [r for r in read_jsonl(monitor.run_dir() + "/podmonitor.jsonl") if r["kind"] == "report"]
    assert [(r["stage"], r["step"]) for r in records] == [("fit", 8), ("validate", 8)]
    assert "repeats" not in records[1]  # another stage: no collision
    assert len({r["run_id"] for r in records}) == 1


# ------------------------------------------------------------------------------ several loaders
class TwoLoaderGPT(TinyGPT):
    """Two validation loaders: 32 windows of 32 tokens, then 32 windows of 16 tokens."""

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        loss = self._loss(batch)
        self.log("val_loss", loss)
        return loss

    def val_dataloader(self):
        g = torch.Generator().manual_seed(3)
        x = torch.randint(0, self.hparams.vocab, (32, 16), generator=g)
        return [self._data(32, 1), DataLoader(TensorDataset(x, (x + 1) % self.hparams.vocab), batch_size=8)]


def test_first_validation_loader_is_monitored_and_the_others_named(tmp_path):
    monitor = PODMonitor(n_snapshots=24, config=FAST, log_images=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [monitor], max_epochs=2).fit(TwoLoaderGPT())
    msgs = [m for m in pod_warnings(rec) if "loader" in m]
    assert len(msgs) == 1 and "loader 0 of 2" in msgs[0] and "dataloader_idx" in msgs[0]
    record = [r for r in read_jsonl(monitor.run_dir() + "/podmonitor.jsonl") if r["kind"] == "report"][-1]
    assert record["layers"]["layer_00"]["n_snapshots"] == 24 and record["layers"]["layer_00"]["seq_len"] == 32
    assert record["skipped"]["length"] == 0  # the other loader is not mixed in, not skipped as "length"


def test_dataloader_idx_chooses_the_loader(tmp_path):
    monitor = PODMonitor(n_snapshots=24, config=FAST, log_images=False, dataloader_idx=1)
    make_trainer(tmp_path, [monitor], max_epochs=1).fit(TwoLoaderGPT())
    (record,) = [r for r in read_jsonl(monitor.run_dir() + "/podmonitor.jsonl") if r["kind"] == "report"]
    assert record["layers"]["layer_00"]["seq_len"] == 16 and record["n_taken"] == 24


def test_dataloader_idx_out_of_range_warns_and_training_goes_on(tmp_path):
    monitor = PODMonitor(n_snapshots=8, config=FAST, log_images=False, dataloader_idx=3)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [monitor], max_epochs=1).fit(TinyGPT())
    assert any("dataloader_idx=3" in m for m in pod_warnings(rec))
