"""The monitor's default capture reduces each layer as it is formed, and reports what the maps give.

Under default arguments nothing needs per-head maps, so the reference models and the ``sdpa``
adapter hand over head averages and stability sums instead of (B, H, T, T) maps. The reference
GPT forms them during the validation step's own forward (no second forward; checked against the
literal softmax of that forward's q and k). These tests run
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


def _validate(tmp_path, monitor: PODMonitor, head_mask: list[float] | None = None,
              model_class: type[GPTLightningModule] = GPTLightningModule,
              n: int = 20, **model_kw) -> tuple[GPTLightningModule, torch.Tensor, dict]:
    """A 2-layer, 3-head reference GPT validated on ``n`` random sequences of 150 in batches of 4;
    the model, the sequences and the metrics."""
    torch.manual_seed(0)
    model = model_class(vocab_size=11, block_size=150, n_layer=2, n_head=3, n_embd=12, dropout=0.0, **model_kw)
    if head_mask is not None:
        model.model.transformer.h[1].attn.set_head_mask(head_mask)
    x = torch.randint(0, 11, (n, 150), generator=torch.Generator().manual_seed(1))
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                        callbacks=[monitor])
    (metrics,) = trainer.validate(model, DataLoader(TensorDataset(x, x), batch_size=4), verbose=False)
    return model, x, metrics


@pytest.mark.parametrize("head_mask", [None, [1.0, 0.0, 1.0]])
def test_default_capture_is_reduced_and_reports_what_the_maps_give(tmp_path, monkeypatch, head_mask):
    # the capture's own forward (attention_maps), as for EGA or a step that ran the model twice: the
    # same forward as the maps path's, so the same fields bit for bit (the default takes the
    # validation step's own forward instead: next test)
    monkeypatch.setattr(ProtocolAdapter, "start", lambda self, module: None)
    kinds: list[type] = []
    collect = ProtocolAdapter.collect
    monkeypatch.setattr(ProtocolAdapter, "collect", lambda self, *a: kinds.append(type(r := collect(self, *a))) or r)
    reduced = PODMonitor(n_snapshots=18)  # default arguments otherwise
    _validate(tmp_path / "a", reduced, head_mask)
    assert kinds and set(kinds) == {ReducedAttention}
    # default outputs (pictures, record) went to the background worker, and their cost is reported
    assert reduced.background_timings["cpu_s"] > 0 and reduced.background_timings["wall_s"] > 0
    assert reduced.background_timings["picture_cpu_s"] > 0  # drawn in the picture process
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


def _literal_step_fields(n: int) -> tuple[list[torch.Tensor], float]:
    """Per layer, the (n, T, T) float64 head averages of softmax(q k^T / sqrt(d)) (causal) of the
    validation step's own (fused) forward, written out from each layer's q and k (forward hooks on
    ``c_attn``, the same batches of 4 as :func:`_validate`), and the plain validation loss."""
    torch.manual_seed(0)
    model = GPTLightningModule(vocab_size=11, block_size=150, n_layer=2, n_head=3, n_embd=12, dropout=0.0)
    x = torch.randint(0, 11, (20, 150), generator=torch.Generator().manual_seed(1))
    qkv: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    handles = [block.attn.c_attn.register_forward_hook(lambda m, a, out, i=i: qkv[i].append(out.detach().clone()))
               for i, block in enumerate(model.model.transformer.h)]
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    (metrics,) = trainer.validate(model, DataLoader(TensorDataset(x, x), batch_size=4), verbose=False)
    for h in handles:
        h.remove()
    fields = []
    for i in (0, 1):
        out = torch.cat(qkv[i]).double()  # (20, T, 3C)
        b, t, _ = out.shape
        q, k, _ = out.split(12, dim=2)
        q = q.view(b, t, 3, 4).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(b, t, 3, 4).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / 2.0  # sqrt(hs) = 2
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        fields.append(torch.softmax(scores, dim=-1).mean(dim=1)[:n])  # (n, T, T)
    return fields, float(metrics["val_loss"])


def test_the_default_capture_takes_the_validation_steps_own_forward(tmp_path, monkeypatch):
    """The reference GPT needs no second forward: during the validation step each layer's
    probabilities are formed from the step's own q and k and reduced; the step's loss is the one
    without a monitor (the layer outputs stay the fused kernel's)."""
    from podmonitor import analyze

    calls: list[int] = []
    maps = GPTLightningModule.attention_maps
    monkeypatch.setattr(GPTLightningModule, "attention_maps", lambda self, batch: calls.append(1) or maps(self, batch))
    monitor = PODMonitor(n_snapshots=18)
    _, _, metrics = _validate(tmp_path, monitor)
    assert calls == []  # no forward of the capture's own
    fields, plain_loss = _literal_step_fields(18)
    assert float(metrics["val_loss"]) == plain_loss
    for name, ref_fields in zip(("layer_00", "layer_01"), fields, strict=True):
        got, ref = monitor.last_reports[name], analyze(ref_fields)
        assert got.n_snapshots == ref.n_snapshots == 18
        assert got.dominant_scales == pytest.approx(ref.dominant_scales, rel=1e-12)
        assert got.t_spec == pytest.approx(ref.t_spec, rel=1e-5)  # float32 probabilities against float64
        for g, r in zip(got.per_scale, ref.per_scale, strict=True):
            torch.testing.assert_close(g.eigenvalues, r.eigenvalues, rtol=1e-5, atol=1e-5 * float(r.eigenvalues[0]))


class TwoForwards(GPTLightningModule):
    """A validation step that runs the model twice (e.g. a second metric): the reductions of its
    forward do not match the layers one-to-one, so the capture runs its own forward."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.model(x, y)
        return super().validation_step(batch, batch_idx)


@pytest.mark.parametrize(("model_class", "model_kw"), [(TwoForwards, {}), (GPTLightningModule, {"attention": "ega"})],
                         ids=["two-forwards", "ega"])
def test_where_the_step_cannot_reduce_the_capture_runs_its_own_forward(tmp_path, monkeypatch, model_class, model_kw):
    # a step that runs the model twice (its reductions do not match the layers one-to-one), and EGA
    # (its gated fused path forms no probabilities)
    calls: list[int] = []
    maps = GPTLightningModule.attention_maps
    monkeypatch.setattr(GPTLightningModule, "attention_maps", lambda self, batch: calls.append(1) or maps(self, batch))
    monitor = PODMonitor(n_snapshots=8)
    _validate(tmp_path, monitor, model_class=model_class, n=8, **model_kw)
    assert calls == [1, 1]  # one forward of the capture's own per monitored batch
    assert sorted(monitor.last_reports) == ["layer_00", "layer_01"]
    assert all(r.n_snapshots == 8 and r.status == "ok" for r in monitor.last_reports.values())


class FirstLayerOnly(GPTLightningModule):
    """A user's own ``attention_maps`` that keeps one layer of the reference GPT's maps: the
    capture cannot follow such a selection, so it must hand over exactly what the method returns."""

    def attention_maps(self, batch):
        return super().attention_maps(batch)[:1]


def test_a_users_own_attention_maps_gets_exactly_what_it_returns(tmp_path):
    monitor = PODMonitor(n_snapshots=8)
    model, x, _ = _validate(tmp_path, monitor, model_class=FirstLayerOnly, n=8)
    assert sorted(monitor.last_reports) == ["layer_00"]
    # the literal head average of that layer, formed by hand from the model's maps
    from podmonitor import analyze

    fields = torch.cat([GPTLightningModule.attention_maps(model, (x[i:i + 4],))[0] for i in (0, 4)]).mean(dim=1)
    ref = analyze(fields.double(), monitor.config)
    assert monitor.last_reports["layer_00"].t_spec == pytest.approx(ref.t_spec, rel=1e-6)


def _scores_by_hand(qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None, h: torch.Tensor, n_head: int,
                    causal: bool) -> torch.Tensor:
    """(B, H, T, T) softmax of the (masked) scores of a fused q/k/v projection, formed literally:
    q and k are the first two thirds of ``h W^T + b``, head by head."""
    b, t, c = h.shape
    qkv = h @ qkv_weight.T + (0 if qkv_bias is None else qkv_bias)
    q, k = (z.reshape(b, t, n_head, c // n_head).transpose(1, 2) for z in qkv.split(c, dim=-1)[:2])
    scores = q @ k.transpose(-1, -2) / (c // n_head) ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(dim=-1)


class EncoderDecoderLM(L.LightningModule):
    """A T5-style model: an encoder block with timm's (bidirectional) SDPA attention and a decoder
    block with nanoGPT's (``is_causal=True``) SDPA attention over the same tokens, so one validation
    step makes one call of each kind."""

    def __init__(self, vocab: int = 11, width: int = 12, n_head: int = 3) -> None:
        super().__init__()
        from tests.capture.sdpa_models import Attention, CausalSelfAttention, GPTConfig

        self.n_head = n_head
        self.emb = torch.nn.Embedding(vocab, width)
        self.encoder = Attention(width, num_heads=n_head, qkv_bias=True)
        self.decoder = CausalSelfAttention(GPTConfig(n_embd=width, n_head=n_head))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.encoder(h)
        return self.head(h + self.decoder(h))

    def probabilities_by_hand(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Both layers' (B, H, T, T) probabilities, without SDPA."""
        h = self.emb(x)
        enc = _scores_by_hand(self.encoder.qkv.weight, self.encoder.qkv.bias, h, self.n_head, causal=False)
        h = h + self.encoder(h)
        dec = _scores_by_hand(self.decoder.c_attn.weight, self.decoder.c_attn.bias, h, self.n_head, causal=True)
        return [enc, dec]

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("val_loss", loss)
        return loss


def _entropy_by_hand(a: torch.Tensor, causal: bool) -> float:
    """Mean normalised row entropy of (B, H, T, T) probabilities: -sum_j p log p / log(n_i),
    n_i = i + 1 visible keys (causal, rows with n_i >= 2) or T."""
    a = a.double()
    t = a.shape[-1]
    plogp = torch.where(a > 0, a * a.clamp_min(1e-300).log(), torch.zeros_like(a))
    n = torch.arange(1, t + 1, dtype=torch.float64) if causal else torch.full((t,), float(t), dtype=torch.float64)
    ent = -plogp.sum(-1) / n.log()  # (B, H, T)
    return float((ent[..., 1:] if causal else ent).mean())


def test_a_model_mixing_causal_and_bidirectional_sdpa_calls_gets_each_layer_analysed_as_it_is(tmp_path):
    torch.manual_seed(0)
    model = EncoderDecoderLM()
    x = torch.randint(0, 11, (20, 150), generator=torch.Generator().manual_seed(1))
    monitors = {"reduced": PODMonitor(n_snapshots=18), "maps": PODMonitor(n_snapshots=18, extras=[WantsMaps()])}
    for side, monitor in monitors.items():
        L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  enable_checkpointing=False, default_root_dir=str(tmp_path / side), callbacks=[monitor]).validate(
            model, DataLoader(TensorDataset(x, x), batch_size=4), verbose=False)
    from podmonitor import analyze

    with torch.no_grad():
        by_hand = [torch.cat(z) for z in zip(*[model.probabilities_by_hand(x[i:i + 4]) for i in range(0, 20, 4)],
                                             strict=True)]
    for (name, causal), probs in zip((("encoder", False), ("decoder", True)), by_hand, strict=True):
        ref = analyze(probs[:18].mean(dim=1).double())  # the quota's 18 sequences, analysed alone
        assert ref.causal is causal
        for side, monitor in monitors.items():
            assert sorted(monitor.last_reports) == ["decoder", "encoder"], sorted(monitor.last_reports)
            got = monitor.last_reports[name]
            assert got.causal is causal, (side, name)
            assert got.dominant_scales == ref.dominant_scales, (side, name)
            assert got.t_spec == pytest.approx(ref.t_spec, rel=1e-5), (side, name)
            for g, r in zip(got.per_scale, ref.per_scale, strict=True):
                torch.testing.assert_close(g.eigenvalues, r.eigenvalues, rtol=1e-4, atol=1e-10)
            entropy = monitor.last_stability_reports[name].to_dict()["entropy_mean"]
            assert entropy == pytest.approx(_entropy_by_hand(probs[:18], causal), rel=1e-5), (side, name)
