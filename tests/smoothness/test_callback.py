"""SmoothnessMonitor in real Trainers (reference GPT, Hugging Face GPT-2, nn.TransformerEncoder) and by hand."""

from __future__ import annotations

import glob
import math
import os
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from podmonitor.models import GPTLightningModule
from podmonitor.reporting.sinks import read_json_lines
from podmonitor.smoothness import SmoothnessMonitor, SmoothnessMonitorWarning

from .conftest import TinyHFLM, TinyMHAModel, token_loader

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:lightning", "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning",
    "ignore:.*does not have many workers.*", "ignore:.*LeafSpec.*:DeprecationWarning")

SEQ = 32


def _gpt(attention: str = "softmax") -> GPTLightningModule:
    torch.manual_seed(0)
    return GPTLightningModule(vocab_size=11, block_size=SEQ, n_layer=2, n_head=2, n_embd=16, dropout=0.1,
                              attention=attention, warmup_steps=1, max_steps=10)


def _loaders(n: int = 8) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 11, (n, SEQ + 1), generator=g)
    ds = TensorDataset(data[:, :-1], data[:, 1:])
    return DataLoader(ds, batch_size=4), DataLoader(ds, batch_size=4)


def _trainer(tmp_path, callbacks, **kw) -> L.Trainer:
    args = dict(default_root_dir=str(tmp_path), enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, accelerator="cpu", devices=1)
    args.update(kw)
    return L.Trainer(callbacks=callbacks, **args)


@pytest.mark.parametrize("attention", ["softmax", "ega"])
def test_smoothness_monitor_reference_gpt_logs_everything(tmp_path, attention: str) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = _gpt(attention)
    cb = SmoothnessMonitor(every_n_validations=2, n_sequences=2, strict=True)
    trainer = _trainer(tmp_path, [cb], max_steps=4, val_check_interval=2, limit_val_batches=1,
                       num_sanity_val_steps=1, logger=TensorBoardLogger(str(tmp_path), name="tb"))
    train, val = _loaders()
    trainer.fit(model, train, val)

    assert cb.validation_count == 2  # the sanity check is not counted
    records = read_json_lines(os.path.join(trainer.log_dir, "podmonitor", "smoothness.jsonl"))
    assert [r["sigma_computed"] for r in records] == [True, False]
    names = ["model.transformer.h.0.attn", "model.transformer.h.1.attn"]
    for name in names:
        first, second = records[0]["layers"][name], records[1]["layers"][name]
        assert first["lengths"] == [16, 32] and len(first["sigma"][0]) == 2
        assert all(s > 0 for row in first["sigma"] for s in row)
        assert first["monotone"] is True and first["fit"]["status"] == "degenerate"  # 2 points: no alpha
        assert second["lengths"] == [] and 0.0 < second["companions"]["entropy"] <= 1.0
        assert 1.0 <= second["companions"]["p_norm"] <= math.sqrt(SEQ) + 1e-6
        assert {tuple(v.shape) for v in cb.warm[name].values()} == {(2, 16, 16), (2, 32, 16)}
    assert len(cb.history) == 2

    acc = EventAccumulator(trainer.log_dir, size_guidance={"images": 0, "scalars": 0}).Reload()
    scalars, images = set(acc.Tags()["scalars"]), set(acc.Tags()["images"])
    for name in names:
        for metric in ("sigma_n16", "sigma_n32", "entropy", "p_norm", "monotone"):
            assert f"smooth/{metric}/{name}" in scalars
        assert f"smooth/sigma_vs_n/{name}" in images
    assert "smooth/sigma_vs_n_layers" in images
    assert len(acc.Scalars(f"smooth/entropy/{names[0]}")) == 2  # companions on both runs
    assert len(acc.Scalars(f"smooth/sigma_n16/{names[0]}")) == 1  # sigma on the first only


def test_smoothness_monitor_alpha_with_three_lengths(tmp_path) -> None:
    model = _gpt()
    cb = SmoothnessMonitor(n_sequences=2, prefix_lengths=[8, 16, 32], output_dir=str(tmp_path / "out"), strict=True)
    trainer = _trainer(tmp_path, [cb], logger=False, limit_val_batches=1)
    trainer.validate(model, _loaders()[1], verbose=False)
    (rec,) = read_json_lines(tmp_path / "out" / "smoothness.jsonl")
    for layer in rec["layers"].values():
        assert layer["lengths"] == [8, 16, 32]
        assert layer["fit"]["status"] in ("ok", "constant") and math.isfinite(layer["fit"]["alpha"])
    assert glob.glob(str(tmp_path / "out" / "images" / "*" / "smooth_sigma_vs_n_*.png"))
    assert (tmp_path / "out" / "images" / "scalars.csv").exists()


def test_smoothness_monitor_leaves_model_state_alone(tmp_path) -> None:
    """By hand, as Lightning calls it: train mode, gradients and the global RNG are left as they were."""
    model = _gpt()
    x, y = next(iter(_loaders()[1]))
    model.train()
    _, loss = model.model(x, y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.model.transformer.h[1].eval()  # a mixed state must survive too
    modes = {n: m.training for n, m in model.named_modules()}
    torch.manual_seed(5)
    with torch.inference_mode():
        model.model(x, y)  # layer 0 is in train mode: its dropout draws from the global RNG
    rng = torch.get_rng_state()  # what the forward alone leaves
    torch.manual_seed(5)

    cb = SmoothnessMonitor(n_sequences=2, output_dir=str(tmp_path), strict=True)
    trainer = SimpleNamespace(sanity_checking=False, global_rank=0, global_step=3, current_epoch=0, loggers=[],
                              log_dir=None, default_root_dir=str(tmp_path), callbacks=[cb])
    cb.setup(trainer, model, "fit")
    cb.on_validation_epoch_start(trainer, model)
    with torch.inference_mode():
        cb.on_validation_batch_start(trainer, model, (x, y), 0)
        model.model(x, y)
        cb.on_validation_batch_end(trainer, model, None, (x, y), 0)
        cb.on_validation_epoch_end(trainer, model)

    assert set(cb.last_results) == {"model.transformer.h.0.attn", "model.transformer.h.1.attn"}
    assert all(r.lengths == [16, 32] for r in cb.last_results.values())
    assert {n: m.training for n, m in model.named_modules()} == modes
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n
    assert torch.equal(torch.get_rng_state(), rng)
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_smoothness_monitor_errors_become_warnings(tmp_path, monkeypatch) -> None:
    import podmonitor.smoothness.callback as cbmod

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(cbmod, "measure_sublayer", boom)
    model = _gpt()
    cb = SmoothnessMonitor(n_sequences=2, output_dir=str(tmp_path))
    trainer = _trainer(tmp_path, [cb], logger=False, limit_val_batches=1)
    with pytest.warns(SmoothnessMonitorWarning, match="boom"):
        trainer.validate(model, _loaders()[1], verbose=False)
    assert cb.last_results == {}

    strict = SmoothnessMonitor(n_sequences=2, output_dir=str(tmp_path), strict=True)
    trainer = _trainer(tmp_path, [strict], logger=False, limit_val_batches=1)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.validate(model, _loaders()[1], verbose=False)


def test_smoothness_monitor_no_attention_warns(tmp_path) -> None:
    class NoAttention(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def validation_step(self, batch, batch_idx):
            return self.lin(batch[0]).sum()

    cb = SmoothnessMonitor(output_dir=str(tmp_path))
    trainer = _trainer(tmp_path, [cb], logger=False, limit_val_batches=1)
    with pytest.warns(SmoothnessMonitorWarning, match="no supported attention"):
        trainer.validate(NoAttention(), DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=2), verbose=False)


def test_smoothness_monitor_state_dict_round_trip_and_warm_start(tmp_path) -> None:
    model = _gpt()
    val = _loaders()[1]
    cold = SmoothnessMonitor(1, n_sequences=2, output_dir=str(tmp_path / "a"), strict=True, tol=1e-4, n_iter=200)
    _trainer(tmp_path, [cold], logger=False, limit_val_batches=1).validate(model, val, verbose=False)
    torch.save(cold.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)  # plain data only: loads safely
    assert state["validation_count"] == 1 and len(state["history"]) == 1

    warm = SmoothnessMonitor(1, n_sequences=2, output_dir=str(tmp_path / "b"), strict=True, tol=1e-4, n_iter=200)
    warm.load_state_dict(state)
    assert warm.validation_count == 1 and warm.history == cold.history
    for layer, vecs in cold.warm.items():
        assert all(torch.equal(vecs[n], warm.warm[layer][n]) for n in vecs)
    _trainer(tmp_path, [warm], logger=False, limit_val_batches=1).validate(model, val, verbose=False)
    assert warm.validation_count == 2
    for name, r_cold in cold.last_results.items():
        r_warm = warm.last_results[name]
        assert r_warm.sigma_mean == pytest.approx(r_cold.sigma_mean, rel=1e-3)  # same model, same input
        assert sum(r_warm.n_iter) < sum(r_cold.n_iter)


def test_smoothness_monitor_hugging_face_gpt2(tmp_path) -> None:
    model = TinyHFLM(seq_len=32)
    before = model.model.config._attn_implementation
    cb = SmoothnessMonitor(n_sequences=2, output_dir=str(tmp_path), strict=True)
    _trainer(tmp_path, [cb], logger=False, limit_val_batches=1).validate(model, token_loader(), verbose=False)
    assert model.model.config._attn_implementation == before
    assert set(cb.last_results) == {"model.transformer.h.0.attn", "model.transformer.h.1.attn"}
    for r in cb.last_results.values():
        assert r.kind == "huggingface" and r.prefix_mode == "block" and r.lengths == [16, 32]
        assert r.monotone is True and r.companions is not None


def test_smoothness_monitor_transformer_encoder(tmp_path) -> None:
    model = TinyMHAModel(seq_len=32, causal=True)
    cb = SmoothnessMonitor(n_sequences=2, output_dir=str(tmp_path), strict=True)
    _trainer(tmp_path, [cb], logger=False, limit_val_batches=1).validate(model, token_loader(), verbose=False)
    assert set(cb.last_results) == {"encoder.layers.0.self_attn", "encoder.layers.1.self_attn"}
    for r in cb.last_results.values():
        assert r.kind == "torch_mha" and r.causal and r.lengths == [16, 32] and r.monotone is True


def test_smoothness_monitor_defers_layout_to_pod_monitor(tmp_path) -> None:
    from podmonitor import PODMonitor

    alone = SmoothnessMonitor()
    _trainer(tmp_path, [alone], logger=False).strategy  # noqa: B018
    alone.setup(_trainer(tmp_path, [alone], logger=False), _gpt(), "fit")
    assert alone._write_layout is True
    both = SmoothnessMonitor()
    both.setup(_trainer(tmp_path, [PODMonitor(), both], logger=False), _gpt(), "fit")
    assert both._write_layout is False


def test_smoothness_monitor_rejects_bad_arguments() -> None:
    for kwargs in ({"every_n_validations": 0}, {"n_sequences": 0}, {"prefix_lengths": []}, {"n_iter": 0},
                   {"tol": -1.0}, {"mode": "magic"}, {"min_prefix": 0}):
        with pytest.raises(ValueError):
            SmoothnessMonitor(**kwargs)
