"""The monitor's default capture reduces each layer as it is formed, and reports what the maps give.

Under default arguments nothing needs per-head maps, so the reference models and the ``sdpa``
adapter hand over head averages and stability sums instead of (B, H, T, T) maps. These tests run
the real Trainer twice on the same model and data: once with the defaults (reduced), once with an
extra that asks for the maps (an ``on_attention`` hook), and compare the records.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from podmonitor import PODMonitor
from podmonitor.capture import ProtocolAdapter
from podmonitor.capture.reduce import ReducedAttention
from podmonitor.extras import MonitorExtra
from podmonitor.models.lightning import GPTLightningModule


class WantsMaps(MonitorExtra):
    """An extra that reads the per-head maps: the monitor must then hand them over."""

    name = "wants_maps"

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def on_attention(self, layer: str, fields: torch.Tensor) -> None:
        self.shapes.append(tuple(fields.shape))


def _validate(tmp_path, monitor: PODMonitor, head_mask: list[float] | None) -> None:
    torch.manual_seed(0)
    model = GPTLightningModule(vocab_size=11, block_size=150, n_layer=2, n_head=3, n_embd=12, dropout=0.0)
    if head_mask is not None:
        model.model.transformer.h[1].attn.set_head_mask(head_mask)
    x = torch.randint(0, 11, (20, 150), generator=torch.Generator().manual_seed(1))
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                        callbacks=[monitor])
    trainer.validate(model, DataLoader(TensorDataset(x, x), batch_size=4), verbose=False)


@pytest.mark.parametrize("head_mask", [None, [1.0, 0.0, 1.0]])
def test_default_capture_is_reduced_and_reports_what_the_maps_give(tmp_path, monkeypatch, head_mask):
    kinds: list[type] = []
    collect = ProtocolAdapter.collect
    monkeypatch.setattr(ProtocolAdapter, "collect", lambda self, *a: kinds.append(type(r := collect(self, *a))) or r)
    reduced = PODMonitor(n_snapshots=18)  # default arguments otherwise
    _validate(tmp_path / "a", reduced, head_mask)
    assert kinds and set(kinds) == {ReducedAttention}
    kinds.clear()
    extra = WantsMaps()
    maps = PODMonitor(n_snapshots=18, extras=[extra])
    _validate(tmp_path / "b", maps, head_mask)
    assert kinds and ReducedAttention not in kinds and extra.shapes[0] == (4, 3, 150, 150)
    assert sorted(reduced.last_reports) == sorted(maps.last_reports) == ["layer_00", "layer_01"]
    for name, ref in maps.last_reports.items():
        got = reduced.last_reports[name]
        assert got.n_snapshots == ref.n_snapshots == 18  # the quota cuts the fifth batch: a selection
        assert got.t_spec == ref.t_spec and got.dominant_scales == ref.dominant_scales  # the same fields
        for g, r in zip(got.per_scale, ref.per_scale, strict=True):
            assert torch.equal(g.eigenvalues, r.eigenvalues)
        stab, stab_ref = reduced.last_stability_reports[name].to_dict(), maps.last_stability_reports[name].to_dict()
        assert stab["n_snapshots"] == stab_ref["n_snapshots"] == 18
        for key in ("entropy", "sink_mass", "mean_row_max", "max_prob"):
            assert stab[key] == pytest.approx(stab_ref[key], rel=1e-6), key


class FirstLayerOnly(GPTLightningModule):
    """A user's own ``attention_maps`` that keeps one layer of the reference GPT's maps: the
    capture cannot follow such a selection, so it must hand over exactly what the method returns."""

    def attention_maps(self, batch):
        return super().attention_maps(batch)[:1]


def test_a_users_own_attention_maps_gets_exactly_what_it_returns(tmp_path):
    torch.manual_seed(0)
    model = FirstLayerOnly(vocab_size=11, block_size=150, n_layer=2, n_head=3, n_embd=12, dropout=0.0)
    x = torch.randint(0, 11, (8, 150), generator=torch.Generator().manual_seed(1))
    monitor = PODMonitor(n_snapshots=8)
    L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False, default_root_dir=str(tmp_path), callbacks=[monitor]).validate(
        model, DataLoader(TensorDataset(x, x), batch_size=4), verbose=False)
    assert sorted(monitor.last_reports) == ["layer_00"]
    # the literal head average of that layer, formed by hand from the model's maps
    from podmonitor import analyze

    fields = torch.cat([GPTLightningModule.attention_maps(model, (x[i:i + 4],))[0] for i in (0, 4)]).mean(dim=1)
    ref = analyze(fields.double(), monitor.config)
    assert monitor.last_reports["layer_00"].t_spec == pytest.approx(ref.t_spec, rel=1e-6)
