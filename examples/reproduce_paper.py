"""Train the baseline GPT and its EGA counterpart on the same data, seeds and snapshot windows,
and write the paper's per-layer comparison (Markdown + CSV table, figures).

Each model is trained by the ``podmonitor fit`` command from its shipped YAML configuration
(examples/configs/<model>_<preset>.yaml) with the same ``seed_everything``; PODMonitor analyses
the same validation windows for both (the first ``n_snapshots`` of the fixed validation
windows). The table compares, per model and layer, from the last monitored validation run:
dominant scales, T_spec (with R^2), H*(0.10), H*(0.01), the fluctuation-scalogram energy (total
and the share of the top dominant scale), mean attention distance, and the final validation loss.

Usage::

    python examples/reproduce_paper.py --preset tiny                 # CPU, ~15 minutes on 2 cores
    python examples/reproduce_paper.py --preset paper --mope         # the paper runs (GPU)
    python examples/reproduce_paper.py --preset tiny --max-steps 200 --out runs/quick

Writes to ``--out`` (default ``runs/reproduce_<preset>``): ``comparison.md``, ``comparison.csv``,
``scale_organisation.png`` (layers x scales heatmap per model), ``layers.png`` (T_spec, H*(0.10)
and top scale per layer for every model), and the TensorBoard logs of every run.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "configs"


def _f(x: Any, spec: str = ".3f") -> str:
    from podmonitor.cli import fmt_number

    return fmt_number(x, spec, missing="")


def train(config: Path, out: Path, name: str, seed: int, extra: list[str]) -> dict[str, Any]:
    """One ``podmonitor fit`` run; returns its final validation loss and last PODMonitor reports."""
    from podmonitor import PODMonitor
    from podmonitor.cli import build_cli

    args = ["fit", "--config", str(config), "--seed_everything", str(seed),
            "--trainer.logger.init_args.save_dir", str(out), "--trainer.logger.init_args.name", name, *extra]
    t0 = time.perf_counter()
    cli = build_cli(args)
    seconds = time.perf_counter() - t0
    trainer = cli.trainer
    monitor = next(cb for cb in trainer.callbacks if isinstance(cb, PODMonitor))
    val = trainer.callback_metrics.get("val_loss")
    return {
        "name": name,
        "val_loss": float(val) if val is not None else math.nan,
        "step": int(trainer.global_step),
        "seconds": seconds,
        "reports": dict(monitor.last_reports),
        "log_dir": trainer.log_dir,
    }


def rows_of(run: dict[str, Any]) -> list[dict[str, str]]:
    rows = []
    for layer, rep in run["reports"].items():
        energy = rep.scale_energy.double()
        total = float(energy.sum())
        top_share = math.nan
        if rep.dominant_scales and total > 0:
            k = int((rep.scales.double() - rep.dominant_scales[0]).abs().argmin())
            top_share = float(energy[k]) / total
        h = rep.effective_rank
        sat = rep.saturated
        rows.append({
            "model": run["name"],
            "layer": layer,
            "status": rep.status,
            "dominant scales": " ".join(f"{a:.1f}" for a in rep.dominant_scales),
            "T_spec": _f(rep.t_spec),
            "R^2": _f(rep.r2),
            "H*(0.10)": "" if h.get(0.1) is None else f"{h[0.1]}{'+' if sat.get(0.1) else ''}",
            "H*(0.01)": "" if h.get(0.01) is None else f"{h[0.01]}{'+' if sat.get(0.01) else ''}",
            "scalogram energy": _f(total, ".4g"),
            "top-scale share": _f(top_share),
            "mean dist": _f(rep.mean_attention_distance, ".1f"),
            "val_loss": _f(run["val_loss"], ".4f"),
        })
    return rows


def markdown(rows: list[dict[str, str]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "|".join("---" for _ in keys) + "|"]
    lines += ["| " + " | ".join(r[k] for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def figures(runs: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from podmonitor.reporting.figures import scale_organisation_figure

    paths = []
    for run in runs:
        names = list(run["reports"])
        fig = scale_organisation_figure([run["reports"][n] for n in names], names,
                                        title=f"{run['name']}: fluctuation energy per layer and scale")
        p = out / f"scale_organisation_{run['name']}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        reps = list(run["reports"].values())
        x = [j + i * width for j in range(len(reps))]
        axes[0].bar(x, [r.t_spec for r in reps], width, label=run["name"])
        axes[1].bar(x, [r.effective_rank.get(0.1) or 0 for r in reps], width, label=run["name"])
        axes[2].bar(x, [r.dominant_scales[0] if r.dominant_scales else 0 for r in reps], width, label=run["name"])
    n_layers = max(len(run["reports"]) for run in runs)
    centres = [j + width * (len(runs) - 1) / 2 for j in range(n_layers)]
    for ax, title in zip(axes, ("T_spec", "H*(0.10)", "top dominant scale (lags)"), strict=True):
        ax.set_xticks(centres, [str(j) for j in range(n_layers)])
        ax.set_title(title)
        ax.set_xlabel("layer")
        ax.legend(fontsize=8)
    fig.tight_layout()
    p = out / "layers.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("tiny", "paper"), default="tiny")
    parser.add_argument("--mope", action="store_true", help="also train EGA with Morlet positional encoding")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--max-steps", type=int, default=None, help="shorter runs (sets trainer and schedule)")
    parser.add_argument("--out", type=Path, default=None)
    args, extra = parser.parse_known_args(argv)
    out: Path = args.out or Path("runs") / f"reproduce_{args.preset}"
    out.mkdir(parents=True, exist_ok=True)
    if args.max_steps is not None:
        extra += ["--trainer.max_steps", str(args.max_steps), "--model.max_steps", str(args.max_steps),
                  "--trainer.val_check_interval", str(max(1, args.max_steps // 4))]
    models = ["gpt", "ega"] + (["ega_mope"] if args.mope else [])
    runs = []
    for model in models:
        config = CONFIGS / f"{model}_{args.preset}.yaml"
        if not config.exists():
            print(f"no configuration {config}", file=sys.stderr)
            return 2
        print(f"== training {model} ({config.name}), seed {args.seed}", flush=True)
        runs.append(train(config, out, model, args.seed, list(extra)))

    rows = [row for run in runs for row in rows_of(run)]
    header = [f"Command: python examples/reproduce_paper.py {' '.join(argv if argv is not None else sys.argv[1:])}",
              "", "| model | steps | val_loss (nats/char) | wall time (s) |", "|---|---|---|---|"]
    header += [f"| {r['name']} | {r['step']} | {r['val_loss']:.4f} | {r['seconds']:.0f} |" for r in runs]
    text = "\n".join(header) + "\n\nPer layer, last monitored validation run:\n\n" + markdown(rows) + "\n"
    (out / "comparison.md").write_text(text)
    with open(out / "comparison.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    pictures = figures(runs, out)
    print()
    print(text)
    print("written:", ", ".join(os.fspath(p) for p in [out / "comparison.md", out / "comparison.csv", *pictures]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
