"""Tests of the Lightning wrapper: capture protocol, schedule, checkpoints, training."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch

from podmonitor.data import CharDataModule
from podmonitor.models.lightning import GPTLightningModule, warmup_cosine

TINY = dict(block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1)


def make_dm(**kw: object) -> CharDataModule:
    args: dict[str, object] = dict(block_size=32, batch_size=8, max_val_windows=16)
    args.update(kw)
    return CharDataModule(**args)  # type: ignore[arg-type]


def make_trainer(max_steps: int, tmp_path: Path, **kw: object) -> L.Trainer:
    args: dict[str, object] = dict(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        default_root_dir=tmp_path,
        gradient_clip_val=1.0,
    )
    args.update(kw)
    return L.Trainer(**args)  # type: ignore[arg-type]


class StepAtStart(L.Callback):
    def __init__(self) -> None:
        self.start_step: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start_step = trainer.global_step


def test_warmup_cosine_schedule() -> None:
    f = lambda s: warmup_cosine(s, warmup_steps=300, max_steps=5000, min_lr_ratio=0.1)  # noqa: E731
    assert f(0) == pytest.approx(1 / 300)
    assert f(299) == pytest.approx(1.0)
    assert f(300) == pytest.approx(1.0)
    assert f(2650) == pytest.approx(0.55)  # half-way through the cosine
    assert f(5000) == pytest.approx(0.1) and f(9000) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(300, 5000, 37))


@pytest.mark.parametrize("attention", ["softmax", "ega"])
def test_attention_maps_protocol(attention: str) -> None:
    torch.manual_seed(0)
    module = GPTLightningModule(**TINY, attention=attention, pos_encoding="mope")
    module.train()
    module.model.transformer.h[1].eval()  # a submodule in its own mode must stay so
    x = torch.randint(0, 65, (3, 32))
    maps = module.attention_maps((x, x))
    assert module.training and not module.model.transformer.h[1].training
    assert module.model.transformer.h[0].training
    assert len(maps) == 2
    for a in maps:
        assert a.shape == (3, 2, 32, 32) and a.dtype == torch.float32
        assert not a.requires_grad
        torch.testing.assert_close(a.sum(-1), torch.ones(3, 2, 32))
    # eval mode, so deterministic despite dropout = 0.1
    again = module.attention_maps(x)
    assert all(torch.equal(a, b) for a, b in zip(maps, again, strict=True))
    assert module.attention_is_causal is True
    assert module.information_is_causal is True
    window = GPTLightningModule(**TINY, attention="ega", ega_gate="window")
    assert window.attention_is_causal and not window.information_is_causal


def test_optimizer_groups_and_hparams() -> None:
    module = GPTLightningModule(**TINY, attention="ega")
    opt_cfg = module.configure_optimizers()
    opt = opt_cfg["optimizer"]
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["lr"] == 3e-4
    wd = {g["weight_decay"] for g in opt.param_groups}
    assert wd == {0.1, 0.0}
    assert module.hparams.attention == "ega" and module.hparams.n_layer == 2
    paper = GPTLightningModule.paper()
    assert paper.hparams.n_layer == 6 and paper.hparams.warmup_steps == 300
    tiny = GPTLightningModule.tiny(attention="ega")
    assert tiny.hparams.n_embd == 128 and tiny.hparams.lr == 3e-3 and tiny.hparams.max_steps == 500


def test_checkpoint_round_trip_and_resume(tmp_path: Path) -> None:
    L.seed_everything(0, verbose=False)
    module = GPTLightningModule(**TINY, attention="ega", pos_encoding="mope", warmup_steps=2, max_steps=8)
    dm = make_dm()
    trainer = make_trainer(5, tmp_path)
    trainer.fit(module, dm)
    assert trainer.global_step == 5
    path = tmp_path / "five.ckpt"
    trainer.save_checkpoint(path)

    # a Lightning checkpoint with plain-value hyperparameters is weights_only-loadable
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["global_step"] == 5
    assert ckpt["hyper_parameters"]["attention"] == "ega"

    loaded = GPTLightningModule.load_from_checkpoint(path, map_location="cpu")
    assert loaded.hparams == module.hparams
    module.eval()
    loaded.eval()
    x = torch.randint(0, 65, (2, 32))
    with torch.no_grad():
        assert torch.equal(module(x), loaded(x))

    # resuming continues at the saved step, with the saved optimiser / scheduler state
    resumed = GPTLightningModule(**TINY, attention="ega", pos_encoding="mope", warmup_steps=2, max_steps=8)
    probe = StepAtStart()
    trainer2 = make_trainer(8, tmp_path, callbacks=[probe])
    trainer2.fit(resumed, make_dm(), ckpt_path=str(path))
    assert probe.start_step == 5
    assert trainer2.global_step == 8
    sched = trainer2.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == 8
    expected = 3e-4 * warmup_cosine(8, 2, 8, 0.1)
    assert trainer2.optimizers[0].param_groups[0]["lr"] == pytest.approx(expected)


def test_short_training_lowers_validation_loss(tmp_path: Path) -> None:
    L.seed_everything(0, verbose=False)
    module = GPTLightningModule(
        block_size=32,
        n_layer=2,
        n_head=2,
        n_embd=64,
        dropout=0.0,
        lr=3e-3,
        warmup_steps=5,
        max_steps=60,
        weight_decay=0.1,
    )
    dm = make_dm(batch_size=32)
    trainer = make_trainer(60, tmp_path, limit_val_batches=1.0)
    before = trainer.validate(module, dm, verbose=False)[0]["val_loss"]
    assert abs(before - math.log(65)) < 0.3
    trainer.fit(module, dm)
    after = trainer.validate(module, dm, verbose=False)[0]["val_loss"]
    assert after < 3.1 and after < before - 1.0, (before, after)  # unigram entropy: 3.31
