"""PODMonitor end to end with the other capture routes: Hugging Face, nn.TransformerEncoder, W&B."""

from __future__ import annotations

import json
import time

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from podmonitor import PODConfig, PODMonitor

FAST = PODConfig(n_dominant=2)


def run(tmp_path, model, monitor, **kw):
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=kw.pop("logger", False),
                        callbacks=[monitor], enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=str(tmp_path), **kw)
    trainer.fit(model)
    return trainer


def jsonl(path):
    return [json.loads(x) for x in open(path).read().splitlines()]


class HFGPT2Module(L.LightningModule):
    """A LightningModule around a tiny randomly initialised GPT-2 (nothing downloaded)."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=40, n_positions=32))

    def _step(self, batch):
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          labels=batch["input_ids"]).loss

    def training_step(self, batch, batch_idx):
        return self._step(batch)

    def validation_step(self, batch, batch_idx):
        return self._step(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def _loader(self, seed, pad_every=0):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 40, (24, 32), generator=g)
        mask = torch.ones_like(ids)
        if pad_every:
            mask[::pad_every, -5:] = 0  # some sequences end in padding
        rows = [{"input_ids": i, "attention_mask": m} for i, m in zip(ids, mask, strict=True)]
        return DataLoader(rows, batch_size=8)

    def train_dataloader(self):
        return self._loader(0)

    def val_dataloader(self):
        return self._loader(1, pad_every=4)


def test_huggingface_gpt2_through_the_callback(tmp_path):
    pytest.importorskip("transformers")
    model = HFGPT2Module()
    impl_before = model.model.config._attn_implementation
    monitor = PODMonitor(n_snapshots=12, config=FAST, log_images=False, output_dir=str(tmp_path / "pm"))
    run(tmp_path, model, monitor)
    rec = jsonl(tmp_path / "pm" / "podmonitor.jsonl")[0]
    assert set(rec["layers"]) == {"layer_00", "layer_01"}
    layer = rec["layers"]["layer_00"]
    assert layer["n_snapshots"] == 12
    assert layer["causal"] is True
    # padded sequences (every 4th) never enter a field: 12 taken from 16 seen, 4 skipped
    assert rec["skipped"]["padding"] == 4
    assert model.model.config._attn_implementation == impl_before
    assert model.model.config.output_attentions is False


class EncoderModule(L.LightningModule):
    """nn.TransformerEncoder (batch_first) with a causal mask."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 20)

    def _loss(self, batch):
        x, y = batch
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = self.encoder(self.emb(x), mask=mask, is_causal=True)
        return nn.functional.cross_entropy(self.head(h).reshape(-1, 20), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        return self._loss(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def _loader(self, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, 20, (24, 24), generator=g)
        return DataLoader(TensorDataset(x, (x + 1) % 20), batch_size=8)

    def train_dataloader(self):
        return self._loader(0)

    def val_dataloader(self):
        return self._loader(1)


def test_transformer_encoder_through_the_callback(tmp_path):
    model = EncoderModule()
    monitor = PODMonitor(n_snapshots=16, config=FAST, log_images=False, output_dir=str(tmp_path / "pm"))
    run(tmp_path, model, monitor)
    rec = jsonl(tmp_path / "pm" / "podmonitor.jsonl")[0]
    assert len(rec["layers"]) == 2
    for layer in rec["layers"].values():
        assert layer["n_snapshots"] == 16 and layer["causal"] is True and layer["status"] == "ok"
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_wandb_offline_run_contains_scalars_and_images(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    from tests.callback_models import TinyGPT

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="podmonitor-test", save_dir=str(tmp_path), offline=True)
    monitor = PODMonitor(n_snapshots=16, config=FAST)
    run(tmp_path, TinyGPT(), monitor, logger=logger)
    from pathlib import Path

    import wandb

    from tests.reporting.test_sinks import _wandb_history

    run_dir = Path(logger.experiment.dir).parent
    logger.experiment.finish()
    wandb.finish()
    # the W&B service writes the offline file asynchronously: wait for the rows to land
    for _ in range(50):
        rows, metrics = _wandb_history(run_dir)
        scal = [r for r in rows if "pod/headline/t_spec/layer_00" in r]
        if scal and any("pod/summary/_type" in r for r in rows):
            break
        time.sleep(0.2)
    assert len(scal) == 1 and scal[0]["pod/step"] == 8  # logged at the trainer's global step
    assert scal[0]["pod/health/n_snapshots/layer_01"] == 16
    # every key is defined against the step metric, the registry's names
    assert metrics["pod/headline/t_spec/layer_00"] == "pod/step"
    assert metrics["pod/headline/effective_rank_90pct/layer_01"] == "pod/step"
    # the summary and the glossary arrive as tables, not HTML; one grouped chart per headline metric
    by_key = {k: r[k] for r in rows for k in r}
    assert by_key["pod/summary/_type"] == "table-file"
    assert by_key["pod/glossary/_type"] == "table-file"
    assert by_key["pod/charts/t_spec_table/_type"] == "table-file"  # wandb.plot.line_series: all layers
    assert "pod/summary/_type" not in metrics or metrics["pod/summary"] == "pod/step"
    images = [r for r in rows if "pod/scale_organisation/path" in r]
    assert len(images) == 1
    assert (run_dir / "files" / images[0]["pod/scale_organisation/path"]).exists()
