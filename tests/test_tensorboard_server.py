"""The real TensorBoard server, on loopback, serves what PODMonitor logged."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import lightning as L
import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from podmonitor import PODConfig, PODMonitor
from tests.callback_models import TinyGPT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - loopback only
        return resp.read()


@pytest.fixture
def tensorboard_server(tmp_path):
    logdir = tmp_path / "logs"
    logger = TensorBoardLogger(str(logdir), name="run")
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=logger, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[PODMonitor(n_snapshots=16, config=PODConfig(n_dominant=2), images_every_n=1)])
    trainer.fit(TinyGPT())
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        runs = []
        for _ in range(120):  # wait until the server is up and has loaded the run (bounded)
            try:
                runs = json.loads(get(f"{base}/data/runs"))
                if runs:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert runs, "TensorBoard did not come up"
        yield base, runs[0]
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_tensorboard_http_api_serves_scalars_and_images(tensorboard_server):
    base, run = tensorboard_server
    q = urllib.parse.urlencode
    for _ in range(60):  # the first load of the event file can lag behind /data/runs
        tags = json.loads(get(f"{base}/data/plugin/scalars/tags"))
        if "pod/t_spec/layer_00" in tags.get(run, {}):
            break
        time.sleep(0.5)
    assert "pod/t_spec/layer_01" in tags[run]
    query = q({"run": run, "tag": "pod/n_snapshots/layer_00"})
    series = json.loads(get(f"{base}/data/plugin/scalars/scalars?{query}"))
    assert [(step, value) for _, step, value in series] == [(8, 16.0), (16, 16.0)]
    images = json.loads(get(f"{base}/data/plugin/images/images?" + q({"run": run, "tag": "pod/scale_organisation",
                                                                      "sample": 0})))
    assert [im["step"] for im in images] == [8, 16]
    png = get(f"{base}/data/plugin/images/individualImage?{images[-1]['query']}")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    layout = json.loads(get(f"{base}/data/plugin/custom_scalars/layout"))
    charts = [c for cat in layout.get("category", []) for c in cat.get("chart", [])]
    assert any("pod/t_spec/" in r for c in charts for r in c.get("multiline", {}).get("tag", []))
