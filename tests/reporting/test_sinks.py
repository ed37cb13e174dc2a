"""Sinks write what they are given, at the steps given, in a form that reads back."""

from __future__ import annotations

import csv
import io
import json
import math
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread
from PIL import Image

from podmonitor.reporting.figures import figure_to_array, scalogram_figure
from podmonitor.reporting.sinks import (
    JSONLinesWriter,
    PNGSink,
    TensorBoardSink,
    WandbSink,
    read_json_lines,
    safe_filename,
    sinks_for_loggers,
)


def _images(step: int) -> dict[str, np.ndarray]:
    """Two small, distinct RGB images per step (exact pixel values survive PNG)."""
    rng = np.random.default_rng(step)
    return {"pod/scalogram/layer_00": rng.integers(0, 256, (24, 32, 3), dtype=np.uint8),
            "pod/spectrum/layer_01": rng.integers(0, 256, (18, 20, 3), dtype=np.uint8)}


def _scalars(step: int) -> dict[str, float]:
    return {"pod/t_spec/layer_00": 0.5 + step, "pod/t_spec/layer_01": math.nan, "pod/h_eps_0.10/layer_00": 3.0 * step}


def _reject(name: str) -> None:
    raise ValueError(f"not strict JSON: {name}")


# --------------------------------------------------------------------------------------------
# TensorBoard


def _read_events(logdir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _layout(acc):
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.util import tensor_util

    (event,) = acc.Tensors("custom_scalars__config__")  # written once
    layout = layout_pb2.Layout()
    layout.ParseFromString(tensor_util.make_ndarray(event.tensor_proto).item())
    return {c.title: {ch.title: list(ch.multiline.tag) for ch in c.chart} for c in layout.category}


def test_tensorboard_sink_scalars_images_layout(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    sink = TensorBoardSink(writer)
    for step in (10, 20):
        sink.log_scalars(_scalars(step), step)
        sink.log_images(_images(step), step)
    sink.log_text("pod/summary", "| a |\n|---|\n| 1 |", 20)
    sink.close()
    assert writer.all_writers is not None  # the sink did not close a writer it does not own
    writer.close()

    acc = _read_events(tmp_path)
    t0 = acc.Scalars("pod/t_spec/layer_00")
    assert [(e.step, e.value) for e in t0] == [(10, 10.5), (20, 20.5)]
    assert [e.step for e in acc.Scalars("pod/t_spec/layer_01")] == [10, 20]
    assert all(math.isnan(e.value) for e in acc.Scalars("pod/t_spec/layer_01"))
    assert [e.value for e in acc.Scalars("pod/h_eps_0.10/layer_00")] == [30.0, 60.0]
    for tag, img in _images(10).items():
        events = acc.Images(tag)
        assert [e.step for e in events] == [10, 20]
        assert (events[0].height, events[0].width) == img.shape[:2]
        decoded = np.asarray(Image.open(io.BytesIO(events[0].encoded_image_string)).convert("RGB"))
        np.testing.assert_array_equal(decoded, img)
    text = acc.Tensors("pod/summary/text_summary")
    assert text[0].step == 20 and text[0].tensor_proto.string_val[0].decode().startswith("| a |")
    layout = _layout(acc)
    assert layout["podmonitor headline"]["T_spec (spectral concentration)"] == ["^pod/headline/t_spec$"]
    assert layout["podmonitor headline"]["validation loss"] == ["^val_loss$"]


def test_tensorboard_sink_layers_are_runs_and_tags_carry_the_registry_description(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from podmonitor.reporting.metrics import by_key
    from podmonitor.reporting.scalars import metric_tags
    from tests.tb_events import scalar_series, summary_metadata

    writer = SummaryWriter(str(tmp_path))
    described = {tag: (m.title, m.description) for tag, m in metric_tags().items()}
    sink = TensorBoardSink(writer, descriptions=described)
    for step in (10, 20):
        sink.log_layer_scalars({"layer_00": {"pod/headline/t_spec": step + 0.5},
                                "blocks.1.attn": {"pod/headline/t_spec": step + 1.5}}, step)
    sink.close()
    writer.close()
    for layer, offset in (("layer_00", 0.5), ("blocks.1.attn", 1.5)):
        run = str(tmp_path / "podmonitor_layers" / layer)
        assert scalar_series(run)["pod/headline/t_spec"] == [(10, 10 + offset), (20, 20 + offset)]
        meta = summary_metadata(run, "pod/headline/t_spec")
        assert meta.summary_description == by_key()["t_spec"].description
        assert meta.display_name == by_key()["t_spec"].title


def test_tensorboard_sink_from_lightning_logger_and_bad_image(tmp_path):
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    sinks = sinks_for_loggers([logger, CSVLogger(str(tmp_path))], fallback_dir=tmp_path / "png")
    assert [type(s) for s in sinks] == [TensorBoardSink, PNGSink]
    assert sinks[0].writer is logger.experiment
    with pytest.raises(ValueError, match=r"\(H, W, 3\) uint8"):
        sinks[0].log_images({"x": np.zeros((4, 4, 3), np.float32)}, 0)
    with pytest.raises(ValueError, match=r"\(H, W, 3\) uint8"):
        sinks[1].log_images({"x": np.zeros((4, 4), np.uint8)}, 0)
    with pytest.raises(TypeError, match="step"):
        sinks[0].log_scalars({"x": 1.0}, 1.5)
    sinks[0].log_scalars({"pod/beta/layer_00": 2.0}, 5)
    sinks[0].flush()
    acc = _read_events(Path(logger.log_dir))
    owner = TensorBoardSink(logger.experiment, owns_writer=True)
    owner.close()
    assert logger.experiment.all_writers is None
    assert [(e.step, e.value) for e in acc.Scalars("pod/beta/layer_00")] == [(5, 2.0)]


def test_sinks_for_loggers_fallback(tmp_path):
    assert [type(s) for s in sinks_for_loggers([], tmp_path / "a")] == [PNGSink]
    assert [type(s) for s in sinks_for_loggers(None, tmp_path / "b")] == [PNGSink]
    (png,) = sinks_for_loggers([object(), object()], tmp_path / "c")
    assert type(png) is PNGSink
    assert not (tmp_path / "c").exists()  # made at the first write, so a read-only place costs only that sink
    png.log_scalars({"pod/x": 1.0}, step=1)
    assert (tmp_path / "c" / "scalars.csv").read_text().splitlines() == ["step,tag,value", "1,pod/x,1.0"]


# --------------------------------------------------------------------------------------------
# Weights & Biases (offline)


def _wandb_records(run_dir: Path):
    """Records of an offline run's ``run-<id>.wandb`` file (W&B's LevelDB-style log of protobufs).

    Format: a 7-byte header (":W&B", magic 0xBEE1, version), then 32 KiB blocks of records, each
    with a 7-byte header (CRC32, length, type: 1 full, 2 first, 3 middle, 4 last chunk).
    """
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending + chunk)
            pending = b""
            yield record
        elif kind in (2, 3):
            pending += chunk


def _finished_records(run_dir: Path, timeout: float = 60.0) -> list:
    """All records, once the run's "exit" record is on disk.

    ``run.finish()`` can return before wandb-core has written the offline transaction log (seen:
    a 7-byte file, header only, filled a moment later), so wait for the exit record.
    """
    deadline = time.monotonic() + timeout
    while True:
        records = list(_wandb_records(run_dir))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def _wandb_history(run_dir: Path) -> tuple[list[dict], dict[str, str]]:
    """(history rows as {key: decoded value}, {metric: step_metric} of define_metric records)."""
    rows, metrics = [], {}
    records = _finished_records(run_dir)
    assert any(r.WhichOneof("record_type") == "exit" for r in records), "the offline run was never finished"
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)  # W&B writes NaN as the bare token NaN
            rows.append(row)
        elif kind == "metric":
            metrics[rec.metric.name or rec.metric.glob_name] = rec.metric.step_metric
    return rows, metrics


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    return wandb


def test_wandb_sink_offline_run(wandb_offline, tmp_path):
    wandb = wandb_offline
    run = wandb.init(mode="offline", dir=str(tmp_path), project="podmonitor-test",
                     settings=wandb.Settings(console="off"))
    run_dir = Path(run.dir).parent
    sink = WandbSink(run, owns_run=True)
    for step in (10, 20):
        sink.log_scalars(_scalars(step), step)
        sink.log_images(_images(step), step)
    sink.log_text("pod/summary", "| a |\n|---|\n| <1> |", 20)
    sink.close()  # owns the run: finishes it

    rows, metrics = _wandb_history(run_dir)
    pod_rows = [r for r in rows if "pod/step" in r]
    assert [r["pod/step"] for r in pod_rows] == [10, 10, 20, 20, 20]
    scal = [r for r in pod_rows if "pod/t_spec/layer_00" in r]
    assert [(r["pod/step"], r["pod/t_spec/layer_00"], r["pod/h_eps_0.10/layer_00"]) for r in scal] == [
        (10, 10.5, 30.0), (20, 20.5, 60.0)]
    assert all(math.isnan(r["pod/t_spec/layer_01"]) for r in scal)
    for key in ("pod/t_spec/layer_00", "pod/scalogram/layer_00", "pod/summary"):
        assert metrics[key] == "pod/step"
    imgs = [r for r in pod_rows if "pod/scalogram/layer_00/path" in r]
    assert [r["pod/step"] for r in imgs] == [10, 20]
    for r, step in zip(imgs, (10, 20), strict=True):
        assert r["pod/scalogram/layer_00/_type"] == "image-file"
        media = run_dir / "files" / r["pod/scalogram/layer_00/path"]
        decoded = (imread(media)[..., :3] * 255).round().astype(np.uint8)
        np.testing.assert_array_equal(decoded, _images(step)["pod/scalogram/layer_00"])
        assert (r["pod/spectrum/layer_01/height"], r["pod/spectrum/layer_01/width"]) == (18, 20)
    text = [r for r in pod_rows if "pod/summary/path" in r]
    assert text and (run_dir / "files" / text[0]["pod/summary/path"]).read_text().count("&lt;1&gt;") == 1


def test_wandb_sink_with_lightning_logger_steps_in_any_order(wandb_offline, tmp_path):
    """Lightning logs with its own step; podmonitor's rows go back in step: nothing is dropped."""
    from lightning.pytorch.loggers import WandbLogger

    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="podmonitor-test")
    (sink,) = sinks_for_loggers([logger], fallback_dir=tmp_path / "png")
    assert isinstance(sink, WandbSink) and sink.run is logger.experiment
    logger.log_metrics({"train_loss": 2.0}, step=100)
    sink.log_scalars({"pod/beta/layer_00": 1.5}, step=50)  # behind Lightning's step
    logger.log_metrics({"train_loss": 1.0}, step=200)
    sink.log_scalars({"pod/beta/layer_00": 1.25}, step=150)
    sink.close()  # does not finish a run it does not own
    run_dir = Path(logger.experiment.dir).parent
    logger.experiment.finish()

    rows, metrics = _wandb_history(run_dir)
    assert [(r["pod/step"], r["pod/beta/layer_00"]) for r in rows if "pod/beta/layer_00" in r] == [
        (50, 1.5), (150, 1.25)]
    assert [(r["trainer/global_step"], r["train_loss"]) for r in rows if "train_loss" in r] == [
        (100, 2.0), (200, 1.0)]
    assert metrics["pod/beta/layer_00"] == "pod/step"
    assert metrics["*"] == "trainer/global_step"  # Lightning's glob; the explicit definition wins


# --------------------------------------------------------------------------------------------
# PNG files


def test_png_sink_files(tmp_path, real_reports):
    sink = PNGSink(tmp_path / "out")
    real = {"pod/scalogram/layer_00": figure_to_array(scalogram_figure(real_reports[0]))}
    for step in (0, 7):
        sink.log_scalars(_scalars(step), step)
        sink.log_images({**_images(step), **real}, step)
    sink.log_text("pod/summary", "# hi", 7)
    sink.close()
    for step in (0, 7):
        for tag, img in {**_images(step), **real}.items():
            path = tmp_path / "out" / str(step) / f"{safe_filename(tag)}.png"
            decoded = imread(path)
            assert decoded.shape[:2] == img.shape[:2] and decoded.shape[2] in (3, 4)
            np.testing.assert_array_equal((decoded[..., :3] * 255).round().astype(np.uint8), img)
    assert (tmp_path / "out" / "7" / "pod_summary.md").read_text() == "# hi"
    with open(tmp_path / "out" / "scalars.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "tag", "value"]
    assert sum(r == ["step", "tag", "value"] for r in rows) == 1
    assert rows[1:4] == [["0", "pod/t_spec/layer_00", "0.5"], ["0", "pod/t_spec/layer_01", "nan"],
                         ["0", "pod/h_eps_0.10/layer_00", "0.0"]]
    assert len(rows) == 7
    PNGSink(tmp_path / "out").log_scalars({"a": 1.0}, 9)  # a new sink appends, no second header
    assert (tmp_path / "out" / "scalars.csv").read_text().count("step,tag,value") == 1


def test_safe_filename():
    assert safe_filename("pod/scalogram/layer_00") == "pod_scalogram_layer_00"
    assert safe_filename("../../etc/passwd") == "_.._etc_passwd"
    assert safe_filename("blocks.0.attn: h/3") == "blocks.0.attn_h_3"
    assert safe_filename("...") == "untitled"
    assert safe_filename("") == "untitled"


# --------------------------------------------------------------------------------------------
# JSON lines


def test_json_lines_writer_strict_and_complete_after_each_append(tmp_path, real_reports, flagged_reports):
    path = tmp_path / "logs" / "pod.jsonl"
    writer = JSONLinesWriter(path)
    records = [
        {"step": 1, "layer": "layer_00", "report": real_reports[0].to_dict()},
        {"step": 1, "layer": "layer_01", "report": flagged_reports["nan_arrays"].to_dict()},
        {"step": 2, "raw": {"nan": math.nan, "inf": -math.inf, "arr": np.array([1.0, np.nan]),
                            "np": np.float32(0.5), "int": np.int64(3)}},
        {"step": 3, "report": flagged_reports["too_few_snapshots"]},  # a PODReport: via to_dict()
    ]
    for i, rec in enumerate(records):
        writer.append(rec)
        lines = path.read_text().splitlines()  # read back before closing
        assert len(lines) == i + 1
        parsed = [json.loads(line, parse_constant=_reject) for line in lines]
        assert parsed[-1]["step"] == rec["step"]
    writer.close()
    back = read_json_lines(path)
    assert back[0]["report"]["t_spec"] == pytest.approx(real_reports[0].t_spec)
    assert back[0]["report"]["dominant_scales"] == pytest.approx(real_reports[0].dominant_scales)
    assert back[1]["report"]["t_spec"] is None and back[1]["report"]["scale_centroid"] is None
    assert back[2]["raw"] == {"nan": None, "inf": None, "arr": [1.0, None], "np": 0.5, "int": 3}
    assert back[3]["report"]["status"] == "too_few_snapshots"
    with pytest.raises(ValueError, match="closed"):
        writer.append({"x": 1})
    with JSONLinesWriter(path) as again:  # appends to the existing file
        again.append({"step": 4})
    assert [r["step"] for r in read_json_lines(path)] == [1, 1, 2, 3, 4]
    with pytest.raises(TypeError):
        JSONLinesWriter(tmp_path / "x.jsonl").append({"obj": object()})
    path.write_text(path.read_text() + '{"bad": NaN}\n')
    with pytest.raises(ValueError, match="NaN"):
        read_json_lines(path)
