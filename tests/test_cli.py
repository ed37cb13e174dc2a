"""The ``podmonitor`` command (LightningCLI) and its shipped YAML configurations."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from podmonitor import PODMonitor
from podmonitor.cli import PODMonitorCLI, build_cli, layer_table
from podmonitor.data import CharDataModule
from podmonitor.models import GPTLightningModule

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
ALL_CONFIGS = sorted(CONFIGS.glob("*.yaml"))


def _parse_only(config: Path, *overrides: str) -> PODMonitorCLI:
    """Build model, data and trainer from a config without running anything."""
    return PODMonitorCLI(GPTLightningModule, CharDataModule, run=False,
                         args=["--config", str(config), *overrides], parser_kwargs={"default_env": False})


def test_configs_are_shipped() -> None:
    names = {p.name for p in ALL_CONFIGS}
    assert {"gpt_tiny.yaml", "ega_tiny.yaml", "gpt_paper.yaml", "ega_paper.yaml"} <= names


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda p: p.name)
def test_every_config_builds_a_consistent_run(config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load(config.read_text())
    cli = _parse_only(config)
    model, data, trainer = cli.model, cli.datamodule, cli.trainer
    # the values written in the YAML file reach the objects
    for key, value in raw["model"].items():
        assert model.hparams[key] == value, key
    assert data.block_size == raw["data"]["block_size"] == model.hparams.block_size
    assert model.hparams.vocab_size == data.vocab_size == 65
    # the cosine decay ends where training ends
    assert trainer.max_steps == model.hparams.max_steps
    assert trainer.gradient_clip_val == 1.0
    assert sum(isinstance(cb, PODMonitor) for cb in trainer.callbacks) == 1
    if "ega" in config.name:
        assert model.config.attention == "ega" and model.config.ega_gate == "causal"
    else:
        assert model.config.attention == "softmax"
    if "mope" in config.name:
        assert model.config.pos_encoding == "mope"


def test_paper_configs_match_the_method(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """METHOD.md section 9: 6 layers, 8 heads, width 256, context 256, dropout 0.1, lr 3e-4,
    300 warm-up steps, cosine to 5000, batch 64."""
    monkeypatch.chdir(tmp_path)
    for name in ("gpt_paper.yaml", "ega_paper.yaml"):
        cli = _parse_only(CONFIGS / name)
        hp, data = cli.model.hparams, cli.datamodule
        assert (hp.n_layer, hp.n_head, hp.n_embd, hp.block_size) == (6, 8, 256, 256)
        assert (hp.dropout, hp.lr, hp.warmup_steps, hp.max_steps) == (0.1, 3e-4, 300, 5000)
        assert (hp.beta1, hp.beta2, hp.weight_decay) == (0.9, 0.95, 0.1)
        assert data.batch_size == 64 and cli.trainer.max_steps == 5000


def test_command_line_overrides_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cli = _parse_only(CONFIGS / "gpt_tiny.yaml", "--model.attention", "ega", "--data.block_size", "64",
                      "--trainer.max_steps", "7", "--model.max_steps", "7")
    assert cli.model.config.attention == "ega"
    assert cli.model.hparams.block_size == 64 == cli.datamodule.block_size  # linked
    assert cli.trainer.max_steps == 7


def test_fit_prints_layer_table_and_log_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A short real fit through the command: training, a monitored validation, the end summary,
    and a checkpoint that resumes."""
    monkeypatch.chdir(tmp_path)
    short = ["--trainer.max_steps", "6", "--model.max_steps", "6", "--trainer.val_check_interval", "3",
             "--data.max_val_windows", "8", "--data.batch_size", "4", "--trainer.enable_progress_bar", "false",
             "--trainer.enable_model_summary", "false"]
    build_cli(["fit", "--config", str(CONFIGS / "gpt_tiny.yaml"), *short])
    out = capsys.readouterr().out
    assert "final val_loss:" in out
    for layer in range(4):
        assert f"layer_{layer:02d}" in out
    assert "tensorboard --logdir runs" in out
    run_dir = tmp_path / "runs" / "gpt_tiny" / "version_0"
    records = [json.loads(line) for line in (run_dir / "podmonitor" / "podmonitor.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 6]
    assert all(r["layers"]["layer_00"]["n_snapshots"] == 8 for r in records)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(run_dir))
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    assert ckpt.exists()
    # resume from the checkpoint for 3 more steps
    build_cli(["fit", "--config", str(CONFIGS / "gpt_tiny.yaml"), *short, "--trainer.max_steps", "9",
               "--ckpt_path", str(ckpt)])
    out = capsys.readouterr().out
    assert "(step 9)" in out


def test_layer_table_without_a_monitored_run_is_empty() -> None:
    assert layer_table(PODMonitor()) == ""
