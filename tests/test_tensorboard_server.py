"""The real TensorBoard server, on loopback, serves what PODMonitor logged."""

from __future__ import annotations

import html
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
        for _ in range(60):  # the per-layer runs appear as their event files are found
            if sum("podmonitor_layers" in r for r in runs) >= 2:
                break
            time.sleep(0.5)
            runs = json.loads(get(f"{base}/data/runs"))
        yield base, runs
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_tensorboard_http_api_serves_scalars_and_images(tensorboard_server):
    from podmonitor.reporting.scalars import metric_tags

    base, runs = tensorboard_server
    run = next(r for r in runs if "podmonitor_layers" not in r)
    layer_runs = {r.rsplit("/", 1)[-1]: r for r in runs if "podmonitor_layers" in r}
    q = urllib.parse.urlencode
    for _ in range(60):  # the first load of the event files can lag behind /data/runs
        tags = json.loads(get(f"{base}/data/plugin/scalars/tags"))
        if all("pod/headline/t_spec" in tags.get(r, {}) for r in layer_runs.values()) and layer_runs:
            break
        time.sleep(0.5)
    # every layer is a run of its own (a colour and a legend entry each), one tag per metric
    assert sorted(layer_runs) == ["layer_00", "layer_01"]
    registry = metric_tags()
    for layer_run in layer_runs.values():
        served = tags[layer_run]
        assert "pod/headline/t_spec" in served
        for tag, info in served.items():  # names, groups, titles and descriptions come from the registry
            metric = registry[tag]
            assert tag == f"pod/{metric.group}/{metric.key}"
            assert info["displayName"] == metric.title
            # served as HTML rendered from the description's markdown
            assert metric.description.split(";")[0].split(" ~ ")[0] in html.unescape(info["description"])
    for tag, info in tags[run].items():  # run-level podmonitor tags are described too
        if tag.startswith("pod/"):
            assert info["displayName"] == registry[tag].title
    query = q({"run": layer_runs["layer_00"], "tag": "pod/health/n_snapshots"})
    series = json.loads(get(f"{base}/data/plugin/scalars/scalars?{query}"))
    assert [(step, value) for _, step, value in series] == [(8, 16.0)]  # constant: logged once
    query = q({"run": layer_runs["layer_01"], "tag": "pod/headline/t_spec"})
    assert [step for _, step, _ in json.loads(get(f"{base}/data/plugin/scalars/scalars?{query}"))] == [8, 16]
    images = json.loads(get(f"{base}/data/plugin/images/images?" + q({"run": run, "tag": "pod/scale_organisation",
                                                                      "sample": 0})))
    assert [im["step"] for im in images] == [8, 16]
    png = get(f"{base}/data/plugin/images/individualImage?{images[-1]['query']}")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    layout = json.loads(get(f"{base}/data/plugin/custom_scalars/layout"))
    charts = [c for cat in layout.get("category", []) for c in cat.get("chart", [])]
    assert any("^pod/headline/t_spec$" in c.get("multiline", {}).get("tag", []) for c in charts)
