"""PODMonitor with a real Trainer on a tiny model: what gets logged, where, and when."""

from __future__ import annotations

import json
import os
import warnings

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from podmonitor import PODConfig, PODMonitor, PODMonitorWarning, analyze
from tests.callback_models import TinyGPT
from tests.tb_events import scalar_series

FAST = PODConfig(n_dominant=2)


def make_trainer(tmp_path, monitor, logger=False, **kw):
    defaults = dict(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=2,
    )
    defaults.update(kw)
    return L.Trainer(**defaults)


def read_jsonl(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def test_tensorboard_event_files_hold_scalars_and_images_at_validation_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor = PODMonitor(n_snapshots=24, config=FAST, images_every_n=1)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = make_trainer(tmp_path, monitor, logger=logger)
    model = TinyGPT()
    trainer.fit(model)
    steps_per_epoch = 64 // 8
    expected_steps = [steps_per_epoch, 2 * steps_per_epoch]
    acc = EventAccumulator(logger.log_dir, size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    layer_series = {}
    for layer in ("layer_00", "layer_01"):  # each layer is a TensorBoard run of its own
        series = scalar_series(os.path.join(logger.log_dir, "podmonitor_layers", layer))
        layer_series[layer] = series
        for tag in ("pod/headline/t_spec", "pod/fit/r2", "pod/headline/effective_rank_90pct",
                    "pod/headline/top_scale", "pod/cost/analysis_seconds"):
            assert [step for step, _ in series[tag]] == expected_steps, (tag, layer)
        # a constant health counter is logged once (when it changes), not at every run
        assert series["pod/health/n_snapshots"] == [(expected_steps[0], 24.0)]
        assert "pod/health/n_skipped_nonfinite" not in series  # 0: not logged
    # the logged T_spec is the engine's value on the same snapshots (independent recomputation)
    fields = []
    model.eval()
    for x, y in list(model.val_dataloader())[:3]:
        fields.append(torch.stack(model.attention_maps((x, y))).mean(2))  # (layers, B, T, T)
    ref = analyze(torch.cat(fields, dim=1)[0], FAST)
    logged = layer_series["layer_00"]["pod/headline/t_spec"][-1][1]
    assert logged == pytest.approx(ref.t_spec, rel=1e-5)
    image_tags = set(tags["images"])
    for name in ("pod/scale_organisation", "pod/scalogram/layer_00", "pod/mean_scalogram/layer_01",
                 "pod/spectrum/layer_00", "pod/modes/layer_01"):
        assert name in image_tags
        assert [e.step for e in acc.Images(name)] == expected_steps
    # sanity check never monitored: 2 monitored validation runs, each wrote one JSON line
    lines = read_jsonl(os.path.join(logger.log_dir, "podmonitor", "podmonitor.jsonl"))
    assert [r["step"] for r in lines] == expected_steps
    assert lines[0]["layers"]["layer_00"]["n_snapshots"] == 24
    assert len(monitor.history) == 2


def test_no_logger_writes_png_and_jsonl(tmp_path):
    monitor = PODMonitor(n_snapshots=16, config=FAST, output_dir=str(tmp_path / "pm"))
    trainer = make_trainer(tmp_path, monitor, max_epochs=1)
    trainer.fit(TinyGPT())
    lines = read_jsonl(tmp_path / "pm" / "podmonitor.jsonl")
    assert len(lines) == 1
    layer = lines[0]["layers"]["layer_01"]
    assert layer["status"] == "ok" and layer["n_snapshots"] == 16
    pngs = list((tmp_path / "pm" / "images").rglob("*.png"))
    assert any("scale_organisation" in p.name for p in pngs)
    assert len(pngs) >= 1 + 2 * 4
    csv = (tmp_path / "pm" / "images" / "scalars.csv").read_text()
    assert "pod/headline/t_spec/layer_00" in csv
    # the pictures were drawn in the picture process and the files written in the background, and
    # that cost is reported
    assert 0 < monitor.background_timings["cpu_s"] and 0 < monitor.background_timings["wall_s"]
    assert monitor.background_timings["picture_cpu_s"] > 0.1  # (each picture takes tens of ms)


def test_csv_logger_falls_back_to_png(tmp_path):
    monitor = PODMonitor(n_snapshots=16, config=FAST)
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = make_trainer(tmp_path, monitor, logger=logger, max_epochs=1)
    trainer.fit(TinyGPT())
    run_dir = os.path.join(logger.log_dir, "podmonitor")
    assert os.path.exists(os.path.join(run_dir, "podmonitor.jsonl"))
    assert any(f.endswith(".png") for _, _, fs in os.walk(run_dir) for f in fs)


def test_every_n_validations_and_sanity_check(tmp_path):
    monitor = PODMonitor(n_snapshots=8, config=FAST, every_n_validations=2, log_images=False,
                         output_dir=str(tmp_path / "pm"))
    model = TinyGPT()
    trainer = make_trainer(tmp_path, monitor, max_epochs=3)
    trainer.fit(model)
    lines = read_jsonl(tmp_path / "pm" / "podmonitor.jsonl")
    assert [r["epoch"] for r in lines] == [0, 2]
    # capture ran only on monitored validation batches: 1 batch of 8 per monitored run
    assert model.attention_calls == 2


def test_monitor_error_becomes_warning_and_training_completes(tmp_path):
    def broken(module, batch):
        raise RuntimeError("capture exploded")

    monitor = PODMonitor(n_snapshots=8, capture=broken, output_dir=str(tmp_path / "pm"))
    trainer = make_trainer(tmp_path, monitor, max_epochs=2)
    with pytest.warns(PODMonitorWarning, match="capture exploded"):
        trainer.fit(TinyGPT())
    assert trainer.current_epoch == 2  # training finished
    lines = read_jsonl(tmp_path / "pm" / "podmonitor.jsonl")
    assert all("capture exploded" in " ".join(r["errors"]) for r in lines)


def test_strict_mode_reraises(tmp_path):
    def broken(module, batch):
        raise RuntimeError("capture exploded")

    trainer = make_trainer(tmp_path, PODMonitor(n_snapshots=8, capture=broken, strict=True), max_epochs=1)
    with pytest.raises(RuntimeError, match="capture exploded"):
        trainer.fit(TinyGPT())


def test_nan_attention_is_skipped_and_counted(tmp_path):
    monitor = PODMonitor(n_snapshots=16, config=FAST, log_images=False, output_dir=str(tmp_path / "pm"))
    trainer = make_trainer(tmp_path, monitor, max_epochs=1)
    trainer.fit(TinyGPT(nan_layer=1))
    rec = read_jsonl(tmp_path / "pm" / "podmonitor.jsonl")[0]
    bad, good = rec["layers"]["layer_01"], rec["layers"]["layer_00"]
    assert bad["n_skipped_nonfinite"] == 2  # first sequence of each of the 2 captured batches
    assert bad["n_snapshots"] == 14 and good["n_snapshots"] == 16
    assert bad["status"] == "ok"


def test_no_hooks_outside_monitored_batches(tmp_path):
    # the protocol adapter runs an extra forward only on monitored batches; training steps and
    # the remaining validation batches pay nothing
    model = TinyGPT(n_val=48)
    monitor = PODMonitor(n_snapshots=8, config=FAST, log_images=False, output_dir=str(tmp_path / "pm"))
    trainer = make_trainer(tmp_path, monitor, max_epochs=2)
    trainer.fit(model)
    assert model.attention_calls == 2  # one batch of 8 per validation run, none in sanity check
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_checkpoint_resume_keeps_history(tmp_path):
    monitor = PODMonitor(n_snapshots=8, config=FAST, log_images=False, output_dir=str(tmp_path / "pm"))
    trainer = make_trainer(tmp_path, monitor, max_epochs=1)
    trainer.fit(TinyGPT())
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    assert len(monitor.history) == 1
    resumed = PODMonitor(n_snapshots=8, config=FAST, log_images=False, output_dir=str(tmp_path / "pm"))
    trainer2 = make_trainer(tmp_path, resumed, max_epochs=2)
    trainer2.fit(TinyGPT(), ckpt_path=str(ckpt))
    assert len(resumed.history) == 2
    assert resumed.history[0] == monitor.history[0]
    assert resumed.validation_count == 2
    records = read_jsonl(tmp_path / "pm" / "podmonitor.jsonl")
    # report of epoch 0, the resume marker (resumed at the checkpoint's step: nothing superseded), report of epoch 1
    assert [r["kind"] for r in records] == ["report", "resume", "report"]
    assert [r["epoch"] for r in records if r["kind"] == "report"] == [0, 1]
    assert records[1]["previous_run_id"] == monitor.run_id and records[1]["superseded_steps"] == []
    assert records[1]["step"] == records[0]["step"]


def test_invalid_arguments_are_rejected_at_construction():
    with pytest.raises(ValueError, match="n_snapshots"):
        PODMonitor(n_snapshots=2)
    with pytest.raises(ValueError, match="every_n_validations"):
        PODMonitor(every_n_validations=0)
    with pytest.raises(ValueError, match="config"):
        PODMonitor(config={"n_dominant": 2})
    with pytest.raises(ValueError, match=r"unknown picture\(s\) \['scalograms'\]; choose from"):
        PODMonitor(log_images=["scalogram", "scalograms"])
    with pytest.raises(ValueError, match="log_images must be"):
        PODMonitor(log_images="scalogram")  # a string is not a list of names
    with pytest.raises(ValueError, match="unknown picture"):
        PODMonitor(log_images=[["scalogram"]])
    # flags keep their meaning: all pictures, or none
    assert PODMonitor(log_images=np.bool_(True)).pictures is None
    assert PODMonitor(log_images=None).log_images is False
    assert PODMonitor(log_images={"spectrum", "trend"}).log_images is True


def test_model_without_attention_warns_once_and_trains(tmp_path):
    class NoAttention(TinyGPT):
        attention_maps = None

    monitor = PODMonitor(n_snapshots=8)
    trainer = make_trainer(tmp_path, monitor, max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(NoAttention())
    msgs = [str(w.message) for w in caught if issubclass(w.category, PODMonitorWarning)]
    assert len(msgs) == 1 and "capture" in msgs[0]
    assert trainer.current_epoch == 1


def test_sequences_shorter_than_smallest_scale_are_flagged_not_fatal(tmp_path):
    monitor = PODMonitor(n_snapshots=8, log_images=True, output_dir=str(tmp_path / "pm"))
    trainer = make_trainer(tmp_path, monitor, max_epochs=1)
    trainer.fit(TinyGPT(seq_len=3))
    rec = read_jsonl(tmp_path / "pm" / "podmonitor.jsonl")[0]
    assert rec["layers"]["layer_00"]["status"] == "no_scales"
    assert rec["layers"]["layer_00"]["t_spec"] is None  # NaN in strict JSON
    assert trainer.current_epoch == 1


def test_per_head_analysis_adds_one_report_per_head(tmp_path):
    monitor = PODMonitor(n_snapshots=8, config=FAST, per_head=True, log_images=False, output_dir=str(tmp_path / "pm"))
    trainer = make_trainer(tmp_path, monitor, max_epochs=1)
    model = TinyGPT()
    trainer.fit(model)
    rec = read_jsonl(tmp_path / "pm" / "podmonitor.jsonl")[0]
    assert set(rec["layers"]) == {"layer_00", "layer_01", "layer_00/head_00", "layer_00/head_01",
                                  "layer_01/head_00", "layer_01/head_01"}
    # a head's mean field is that head's average attention over the same 8 sequences
    x, y = next(iter(model.val_dataloader()))
    head = model.attention_maps((x, y))[1][:, 1]  # (B, T, T)
    ref = analyze(head, FAST)
    got = monitor.last_reports["layer_01/head_01"].mean_field.numpy()
    assert got == pytest.approx(ref.mean_field.numpy(), abs=1e-6)


def test_memory_budget_stops_capture_with_a_logged_status(tmp_path):
    from podmonitor import estimate_memory

    # the captured fields are float32 and stored as such: a budget of the state of 10 float32
    # snapshots holds 8 of them (with the eigenproblem of compute), not 16
    budget = estimate_memory(32, 10, PODConfig(n_dominant=2, storage_dtype=torch.float32))["state"]
    cfg = PODConfig(n_dominant=2, memory_budget_bytes=budget)
    monitor = PODMonitor(n_snapshots=24, config=cfg, log_images=False, output_dir=str(tmp_path / "pm"))
    trainer = make_trainer(tmp_path, monitor, max_epochs=1)
    with pytest.warns(PODMonitorWarning, match="budget"):
        trainer.fit(TinyGPT())
    rec = read_jsonl(tmp_path / "pm" / "podmonitor.jsonl")[0]
    assert rec["layers"]["layer_00"]["n_snapshots"] == 8  # the first batch fit, the second did not
    assert any("memory budget" in e for e in rec["errors"])
    assert rec["skipped"]["budget"] == 8


def test_custom_capture_function(tmp_path):
    calls = []

    def capture(module, batch):
        calls.append(len(batch[0]))
        _, atts = module(batch[0], return_attention=True)
        return [a.detach() for a in atts]

    model = TinyGPT()
    monitor = PODMonitor(n_snapshots=12, config=FAST, capture=capture, log_images=False,
                         output_dir=str(tmp_path / "pm"))
    trainer = make_trainer(tmp_path, monitor, max_epochs=1)
    trainer.fit(model)
    assert calls == [8, 8]  # two monitored batches, then the monitor has its 12 sequences
    assert model.attention_calls == 0  # the protocol method was not used
    rec = read_jsonl(tmp_path / "pm" / "podmonitor.jsonl")[0]
    assert rec["layers"]["layer_00"]["n_snapshots"] == 12
    assert rec["layers"]["layer_00"]["causal"] is True


def test_coherency_only_on_picture_runs_at_one_scale_and_last_run_pictured(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # default images_every_n=2: runs 1 and 3 draw pictures; run 2 is the last one and gets them at fit end
    monitor = PODMonitor(n_snapshots=8)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    make_trainer(tmp_path, monitor, logger=logger, max_epochs=2).fit(TinyGPT())
    records = read_jsonl(os.path.join(logger.log_dir, "podmonitor", "podmonitor.jsonl"))
    first, second = records
    for layer in first["layers"].values():  # picture run: the map, at the one shared scale
        assert layer["coherency_scale"] == pytest.approx(2 ** (1 + 5 * 4 / 19))
    for layer in second["layers"].values():  # no picture: the costly map is skipped
        assert layer["coherency_scale"] is None
    acc = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("pod/scale_organisation")] == [8, 16]  # the last run too
    assert [e.step for e in acc.Images("pod/trend/t_spec")] == [8, 16]
    assert [e.step for e in acc.Images("pod/coherency/layer_00")] == [8]


def test_chosen_pictures_are_the_only_ones_logged_and_the_map_is_computed_only_when_drawn(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    chosen = ("scalogram", "trend")
    monitor = PODMonitor(n_snapshots=8, log_images=list(chosen))
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    L.seed_everything(0, verbose=False)
    make_trainer(tmp_path, monitor, logger=logger, max_epochs=2).fit(TinyGPT())
    acc = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    acc.Reload()
    images = set(acc.Tags()["images"])
    layers = ("layer_00", "layer_01")
    # the first run and the last one (at fit end) draw exactly the chosen pictures
    assert {f"pod/scalogram/{n}" for n in layers} <= images
    assert {t for t in images if t.startswith("pod/trend/")}, images
    assert all(t.startswith(("pod/scalogram/", "pod/trend/")) for t in images), images
    assert [e.step for e in acc.Images("pod/scalogram/layer_00")] == [8, 16]
    # the coherency map is not drawn, so not computed on the picture run either
    records = read_jsonl(os.path.join(logger.log_dir, "podmonitor", "podmonitor.jsonl"))
    assert all(layer["coherency_scale"] is None for r in records for layer in r["layers"].values())
    # the numbers do not depend on the pictures: the same T_spec as with every picture
    full = PODMonitor(n_snapshots=8, log_images=True)
    L.seed_everything(0, verbose=False)
    make_trainer(tmp_path / "full", full, max_epochs=2).fit(TinyGPT())
    assert [h["layers"]["layer_00"]["t_spec"] for h in monitor.history] == \
        [h["layers"]["layer_00"]["t_spec"] for h in full.history]


def test_reference_scale_is_fixed_at_the_first_run_and_its_values_match_analyze(tmp_path, monkeypatch):
    from podmonitor.engine import analysis

    extra_pods = []  # a second POD only where the reference scale is not one of the run's dominant scales
    original = analysis.analyse_at_scale
    monkeypatch.setattr(analysis, "analyse_at_scale", lambda acc, a: extra_pods.append(a) or original(acc, a))
    monitor = PODMonitor(n_snapshots=16, config=FAST, log_images=False)
    model = TinyGPT()
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    make_trainer(tmp_path, monitor, logger=logger, max_epochs=2).fit(model)
    first, second = read_jsonl(os.path.join(logger.log_dir, "podmonitor", "podmonitor.jsonl"))
    assert extra_pods == [r["reference"][n]["scale"] for r in (first, second) for n in ("layer_00", "layer_01")
                          if r["reference"][n]["scale"] not in r["layers"][n]["dominant_scales"]]
    for layer in ("layer_00", "layer_01"):
        a_ref = first["layers"][layer]["dominant_scales"][0]
        assert first["reference"][layer]["scale"] == a_ref == second["reference"][layer]["scale"]
        assert monitor.reference_scales[layer] == a_ref
    # the second run's value at the fixed scale, recomputed by analyze() on the same snapshots with
    # a one-scale grid (an independent path through the engine)
    model.eval()
    maps = [torch.stack(model.attention_maps(b)).mean(2) for b in list(model.val_dataloader())[:2]]
    fields = torch.cat(maps, dim=1)  # (layers, 16, T, T)
    for i, layer in enumerate(("layer_00", "layer_01")):
        a_ref = monitor.reference_scales[layer]
        ref = analyze(fields[i], PODConfig(scales=(a_ref,), n_dominant=1, dominant_method="top", coherency=False))
        assert second["reference"][layer]["t_spec"] == pytest.approx(ref.t_spec, rel=1e-6)
        assert second["reference"][layer]["effective_rank"] == ref.effective_rank[0.1]
    series = scalar_series(os.path.join(logger.log_dir, "podmonitor_layers", "layer_00"))
    assert [s for s, _ in series["pod/reference/t_spec_at_ref"]] == [8, 16]
    assert series["pod/reference/reference_scale"] == [(8, pytest.approx(monitor.reference_scales["layer_00"]))]
    # kept in the checkpoint
    again = PODMonitor(n_snapshots=16, config=FAST)
    again.load_state_dict(monitor.state_dict())
    assert again.reference_scales == monitor.reference_scales


def test_stability_signals_reach_the_record_and_match_literal_formulas(tmp_path):
    monitor = PODMonitor(n_snapshots=8, config=FAST, log_images=False)
    model = TinyGPT()
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    make_trainer(tmp_path, monitor, logger=logger, max_epochs=1).fit(model)
    (record,) = read_jsonl(os.path.join(logger.log_dir, "podmonitor", "podmonitor.jsonl"))
    model.eval()
    x, y = next(iter(model.val_dataloader()))
    maps = [a.double().numpy() for a in model.attention_maps((x, y))]  # (8, H, T, T) per layer
    for i, layer in enumerate(("layer_00", "layer_01")):
        a = maps[i]
        t = a.shape[-1]
        # literal: sink mass = mean over sequences, heads and queries i >= 1 of A[i, 0]
        sink = a[:, :, 1:, 0].mean()
        # literal: per head, mean over rows i >= 1 of -sum p log p / log(i + 1); the layer's lowest head
        ent = []
        for h in range(a.shape[1]):
            rows = []
            for s_ in range(a.shape[0]):
                for q in range(1, t):
                    p = a[s_, h, q, : q + 1]
                    p = p[p > 0]
                    rows.append(float(-(p * np.log(p)).sum() / np.log(q + 1)))
            ent.append(np.mean(rows))
        stab = record["stability"][layer]
        assert stab["sink_mass_mean"] == pytest.approx(sink, rel=1e-5)
        assert stab["entropy_min"] == pytest.approx(min(ent), rel=1e-5)
        assert stab["max_logit_layer"] is None  # the protocol adapter gives probabilities only
        series = scalar_series(os.path.join(logger.log_dir, "podmonitor_layers", layer))
        assert series["pod/stability/sink_mass"][0][1] == pytest.approx(sink, rel=1e-5)


@pytest.mark.parametrize("feed_bytes", [1, 2 * 8 * 32 * 32 * 4, None])
def test_fields_grouped_on_their_way_to_the_engine_give_the_analysis_of_every_snapshot(tmp_path, monkeypatch,
                                                                                      feed_bytes):
    """Head-averaged fields are queued and added in groups (every batch: 1 byte; two batches of 8
    float32 32 x 32 fields; the default: the whole run at its end): the report equals analyze() of
    the hand-captured maps of the same sequences."""
    import podmonitor.callback as callback_module

    if feed_bytes is not None:
        monkeypatch.setattr(callback_module, "FEED_BYTES", feed_bytes)
    updates = []
    real_update = callback_module.PODAccumulator.update

    def counting_update(self, fields):
        updates.append((id(self), int(fields.shape[0])))
        return real_update(self, fields)

    monkeypatch.setattr(callback_module.PODAccumulator, "update", counting_update)
    monitor = PODMonitor(n_snapshots=40, config=FAST, log_images=False, output_dir=str(tmp_path / "pm"))
    model = TinyGPT()
    make_trainer(tmp_path, monitor, max_epochs=1, num_sanity_val_steps=0).fit(model)
    rec = read_jsonl(tmp_path / "pm" / "podmonitor.jsonl")[0]
    # per layer: 5 batches of 8, in groups of 1, 2 (2, 2, 1) or all 5
    expected = {1: [8] * 5, 2 * 8 * 32 * 32 * 4: [16, 16, 8], None: [40]}[feed_bytes]
    per_layer = {}
    for acc, n in updates:
        per_layer.setdefault(acc, []).append(n)
    assert list(per_layer.values()) == [expected, expected]
    model.eval()
    maps = [torch.stack(model.attention_maps(b)).mean(2) for b in list(model.val_dataloader())[:5]]
    fields = torch.cat(maps, dim=1)  # (layers, 40, T, T)
    for i, layer in enumerate(("layer_00", "layer_01")):
        ref = analyze(fields[i], FAST)
        got = rec["layers"][layer]
        assert got["n_snapshots"] == 40
        assert got["dominant_scales"] == pytest.approx(ref.dominant_scales, rel=1e-12)
        assert got["t_spec"] == pytest.approx(ref.t_spec, rel=1e-6)
        assert got["entropy"] == pytest.approx(ref.entropy, rel=1e-6)


def test_the_stability_pass_checks_zeros_above_the_diagonal_unless_the_capture_wrote_them(tmp_path, monkeypatch):
    """A model whose ``attention_maps`` promises +0 above the diagonal (as the reference GPT does)
    is not checked there by the stability pass; one that only says it is causal is, on every
    monitored batch. The records are the same either way."""
    import podmonitor.engine.stability as stability

    calls = []
    check = stability._right_of_blocks_zero
    monkeypatch.setattr(stability, "_right_of_blocks_zero", lambda *a: calls.append(1) or check(*a))

    class Promising(TinyGPT):
        attention_zeros_above_diagonal = True

    reports = []
    for cls in (TinyGPT, Promising):
        calls.clear()
        monitor = PODMonitor(n_snapshots=12, log_images=False)
        L.seed_everything(0)
        make_trainer(tmp_path / cls.__name__, monitor, max_epochs=1).fit(cls())
        reports.append({k: v.to_dict() for k, v in monitor.last_stability_reports.items()})
        assert len(calls) == (0 if cls is Promising else 2 * 2)  # two monitored batches, two layers
    assert sorted(reports[0]) == ["layer_00", "layer_01"] and reports[0] == reports[1]
