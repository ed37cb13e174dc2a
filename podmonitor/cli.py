"""The ``podmonitor`` command: LightningCLI over the reference GPT / EGA models and the shipped data.

Usage (from the repository root)::

    podmonitor fit --config examples/configs/gpt_tiny.yaml            # the CPU demo (~5 min)
    podmonitor fit --config examples/configs/ega_tiny.yaml            # EGA counterpart
    podmonitor fit --config examples/configs/gpt_paper.yaml           # the paper model (GPU)
    podmonitor fit --config examples/configs/gpt_tiny.yaml --trainer.max_steps 200 --model.max_steps 200
    podmonitor fit --help                                               # every option

Every option of :class:`~podmonitor.models.GPTLightningModule`, :class:`~podmonitor.data.CharDataModule`,
the Trainer and its callbacks (:class:`~podmonitor.PODMonitor` among them) can be set in the YAML
file or overridden on the command line. ``data.block_size`` is linked to ``model.block_size`` and
the vocabulary size of the data to ``model.vocab_size``, so they cannot disagree.

At the end of ``fit`` the command prints where the logs are, how to open them in TensorBoard, the
final validation loss and, from the last monitored validation run, one line per layer: dominant
scales, T_spec, R^2, H*(0.10), mean attention distance.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.cli import LightningCLI

from .data import CharDataModule
from .models import GPTLightningModule


def fmt_number(x: Any, spec: str = ".3f", missing: str = "-") -> str:
    """``x`` formatted with ``spec``; "nan" for a non-finite value, ``missing`` for a non-number."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return missing
    return format(v, spec) if math.isfinite(v) else "nan"


def layer_table(monitor: Any) -> str:
    """Plain-text per-layer table from a :class:`~podmonitor.PODMonitor`'s last monitored run.

    Columns: layer, status, dominant scales (strongest first), T_spec, R^2, H*(0.10) ("+" when
    saturated, i.e. all modes are needed), mean attention distance (tokens). Empty string when
    the monitor has not analysed a validation run yet.
    """
    from .demo import format_table

    reports = getattr(monitor, "last_reports", {}) or {}
    if not reports:
        return ""
    rows = []
    for name, rep in reports.items():
        h = rep.effective_rank.get(0.1)
        sat = rep.saturated.get(0.1, False)
        rows.append({
            "layer": str(name),
            "status": str(rep.status),
            "dominant scales": ", ".join(f"{a:.1f}" for a in rep.dominant_scales) or "-",
            "T_spec": fmt_number(rep.t_spec),
            "R^2": fmt_number(rep.r2),
            "H*(0.10)": "-" if h is None else f"{h}{'+' if sat else ''}",
            "mean dist": fmt_number(rep.mean_attention_distance, ".1f"),
        })
    return format_table(rows)


class PODMonitorCLI(LightningCLI):
    """LightningCLI with the reference model and data as defaults and an end-of-fit summary."""

    def add_arguments_to_parser(self, parser: Any) -> None:  # noqa: D401 - LightningCLI hook
        parser.link_arguments("data.block_size", "model.block_size")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")

    def after_fit(self) -> None:
        """Print the log location, the TensorBoard command and the per-layer table."""
        from .callback import PODMonitor

        trainer = self.trainer
        log_dir = trainer.log_dir  # a collective in DDP (a broadcast): read on every rank, before the rank test
        if not trainer.is_global_zero:
            return
        lines = [""]
        val = trainer.callback_metrics.get("val_loss")
        if val is not None:
            baseline = ""
            if isinstance(self.datamodule, CharDataModule):
                baseline = f"; unigram baseline {self.datamodule.unigram_cross_entropy():.2f}"
            lines.append(f"final val_loss: {float(val):.4f} nats/char (step {trainer.global_step}{baseline})")
        monitors = [cb for cb in trainer.callbacks if isinstance(cb, PODMonitor)]
        for monitor in monitors:
            table = layer_table(monitor)
            if table:
                step = monitor.history[-1]["step"] if monitor.history else trainer.global_step
                lines.append(f"PODMonitor, last monitored validation run (step {step}):")
                lines.append(table)
                lines.append(f"full reports (JSON lines): {os.path.join(monitor.run_dir(trainer), 'podmonitor.jsonl')}")
        if log_dir:
            root = trainer.logger.save_dir if trainer.logger is not None else log_dir
            lines.append(f"logs: {log_dir}")
            lines.append(f"open them with: tensorboard --logdir {root}   (then http://localhost:6006)")
        ckpt = getattr(trainer.checkpoint_callback, "last_model_path", "") or getattr(
            trainer.checkpoint_callback, "best_model_path", "")
        if ckpt:
            lines.append(f"checkpoint: {ckpt}")
        print("\n".join(lines), flush=True)


def build_cli(args: Sequence[str] | None = None) -> PODMonitorCLI:
    """Parse ``args`` (default: ``sys.argv[1:]``), build the model, data and trainer, and run the
    subcommand; returns the CLI object (``cli.trainer``, ``cli.model``, ``cli.datamodule``)."""
    return PODMonitorCLI(
        GPTLightningModule,
        CharDataModule,
        args=list(args) if args is not None else None,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"default_env": False},
    )


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of the ``podmonitor`` console script (``python -m podmonitor.cli`` works too)."""
    build_cli(args)


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
