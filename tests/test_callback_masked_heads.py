"""A layer's monitored field is the mean over the heads that are not masked (pruned)."""

from __future__ import annotations

import lightning as L
import torch

from podmonitor import PODConfig, PODMonitor, analyze
from tests.pruning.test_pruning_callback import loaders, small_model

FAST = PODConfig(n_dominant=1, coherency=False)


def _validate(model, tmp_path) -> PODMonitor:
    monitor = PODMonitor(n_snapshots=16, config=FAST, log_images=False, strict=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                        callbacks=[monitor])
    _, val = loaders()
    trainer.validate(model, val, verbose=False)
    return monitor


def test_masked_heads_are_left_out_of_the_layer_field(tmp_path) -> None:
    model = small_model()
    model.model.transformer.h[0].attn.set_head_mask([1.0, 0.0, 1.0])
    monitor = _validate(model, tmp_path)
    _, val = loaders()
    maps = [model.attention_maps(batch) for batch in val]  # per batch: per layer (B, 3, T, T)
    layer0 = torch.cat([m[0] for m in maps])  # (16, 3, T, T)
    layer1 = torch.cat([m[1] for m in maps])
    active0 = layer0[:, [0, 2]].mean(dim=1).double()  # the literal mean over the active heads
    all0 = layer0.mean(dim=1).double()
    rep0 = monitor.last_reports["layer_00"]
    expected = analyze(active0, FAST)
    assert abs(rep0.mean_attention_distance - expected.mean_attention_distance) < 1e-6
    assert abs(rep0.mean_attention_distance - analyze(all0, FAST).mean_attention_distance) > 1e-4
    torch.testing.assert_close(rep0.per_scale[0].eigenvalues[:5], expected.per_scale[0].eigenvalues[:5],
                               rtol=1e-4, atol=1e-10)
    # the unmasked layer keeps the mean over all heads
    rep1 = monitor.last_reports["layer_01"]
    ref1 = analyze(layer1.mean(dim=1).double(), FAST)
    assert abs(rep1.mean_attention_distance - ref1.mean_attention_distance) < 1e-6
