"""Wall-time overhead of PODMonitor on a training run, measured side by side.

Usage (from the repository root)::

    python benchmarks/bench_overhead.py                  # tiny reference GPT on TinyShakespeare
    python benchmarks/bench_overhead.py --model encoder  # a causal nn.TransformerEncoder LM
    python benchmarks/bench_overhead.py --epochs 2 --steps 50   # quicker
    python benchmarks/bench_overhead.py --device cuda --threads 16   # on a GPU

It trains the same model (same seed, same data, validation every epoch) with and without the
default ``PODMonitor()`` (N = 150 snapshots, TensorBoard logger), each fit in its own subprocess,
alternating the order over ``--repeats`` pairs (default 3), and prints the ratio of the median
wall times of ``trainer.fit``, each pair's own ratio (a machine that drifts moves both fits of a
pair alike), the monitor's own cost split (capture, accumulate, compute, logging) summed over its
validation runs, what its background worker (pictures, sinks) spent, and what that background
work cost the training: the training steps that overlapped a background job against the fit's
other steps (medians, and the seconds beyond the others' median), a reading free of fit-to-fit
noise. Target: ratio <= 1.02.

With ``--profile`` both sides run under Lightning's ``SimpleProfiler`` and it also prints, per side
(medians over the pairs), where the fit's time went: the training steps (forward, backward and
optimizer, timed by Lightning's ``optimizer_step``), the validation steps, and each ``PODMonitor``
hook. A background job (pictures, sinks) shows as slower training steps while it runs and as
time in ``teardown``, which waits for the last one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET = 1.02


def encoder_lm_class():  # noqa: ANN201 - defined lazily (imports lightning)
    import lightning as L
    import torch
    from torch import nn

    class EncoderLM(L.LightningModule):
        """A causal character LM on nn.TransformerEncoder (4 layers x 4 heads, width 128), written
        as people write one: batch_first, a causal mask, AdamW."""

        def __init__(self, vocab: int, block: int) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, 128)
            self.pos = nn.Parameter(0.02 * torch.randn(block, 128))
            layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True, norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
            self.head = nn.Linear(128, vocab)

        def _loss(self, batch):  # noqa: ANN001, ANN202
            x, y = batch
            t = x.shape[1]
            mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
            h = self.encoder(self.emb(x) + self.pos[:t], mask=mask, is_causal=True)
            logits = self.head(h)
            return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            return self._loss(batch)

        def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            loss = self._loss(batch)
            self.log("val_loss", loss)
            return loss

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    return EncoderLM


def child(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning.pytorch.profilers import SimpleProfiler

    from podmonitor import PODMonitor
    from podmonitor.data import CharDataModule
    from podmonitor.models.lightning import GPTLightningModule

    EncoderLM = encoder_lm_class()  # noqa: N806
    busy = watch_background_jobs()
    steps = step_times()
    torch.set_num_threads(args.threads)
    L.seed_everything(0, verbose=False)
    dm = CharDataModule(block_size=args.block_size, batch_size=args.batch_size,
                        train_samples_per_epoch=args.steps * args.batch_size,
                        max_val_windows=args.val_windows)
    if args.model == "gpt":
        model = GPTLightningModule.tiny(vocab_size=65, block_size=args.block_size, max_steps=args.epochs * args.steps)
    else:
        model = EncoderLM(vocab=65, block=args.block_size)
    callbacks: list[Any] = [PODMonitor(**json.loads(args.monitor_args))] if args.side == "monitor" else []
    profiler = SimpleProfiler(dirpath=args.tmp, filename="profile") if args.profile else None
    trainer = L.Trainer(max_epochs=args.epochs, accelerator=args.device, devices=1, logger=TensorBoardLogger(args.tmp),
                        callbacks=[*callbacks, steps], enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, num_sanity_val_steps=0, gradient_clip_val=1.0,
                        profiler=profiler)
    t0 = time.perf_counter()
    trainer.fit(model, dm)
    wall = time.perf_counter() - t0
    split: dict[str, float] = {}
    background: dict[str, float] = {}
    if callbacks:
        for entry in callbacks[0].history:
            for k, v in entry.get("timings", {}).items():
                split[k] = split.get(k, 0.0) + float(v)
        background = dict(callbacks[0].background_timings)
    print(json.dumps({"wall": wall, "split": split, "background": background,
                      "overlap": overlap(steps.intervals, busy),
                      "val_loss": float(trainer.callback_metrics["val_loss"]),
                      "validations": len(callbacks[0].history) if callbacks else 0,
                      "profile": profile_parts(profiler) if profiler is not None else {}}))


def watch_background_jobs() -> list[tuple[float, float]]:
    """Record the (start, end) perf_counter of every job the monitor's background worker runs
    (benchmark instrumentation: wraps ``BackgroundWorker.submit``)."""
    from podmonitor.reporting import worker

    intervals: list[tuple[float, float]] = []
    submit = worker.BackgroundWorker.submit

    def timed_submit(self: Any, job: Any) -> None:
        def timed() -> None:
            start = time.perf_counter()
            try:
                job()
            finally:
                intervals.append((start, time.perf_counter()))

        submit(self, timed)

    worker.BackgroundWorker.submit = timed_submit  # type: ignore[method-assign]
    return intervals


def step_times() -> Any:
    """A Lightning callback keeping the (start, end) perf_counter of every training step in
    ``.intervals`` (defined lazily: imports lightning)."""
    import lightning as L

    class StepTimes(L.Callback):
        def __init__(self) -> None:
            self.intervals: list[tuple[float, float]] = []
            self._start = 0.0

        def on_train_batch_start(self, *args: Any) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.intervals.append((self._start, time.perf_counter()))

    return StepTimes()


def overlap(steps: list[tuple[float, float]], busy: list[tuple[float, float]]) -> dict[str, float]:
    """Training steps that overlapped a background job against the others, within one fit (free of
    fit-to-fit noise): their count, medians (ms) and the seconds they took beyond the others' median."""
    during = [e - s for s, e in steps if any(s < be and e > bs for bs, be in busy)]
    outside = [e - s for s, e in steps if not any(s < be and e > bs for bs, be in busy)]
    if not during or not outside:
        return {"n_during": float(len(during))}
    base = statistics.median(outside)
    return {"n_during": float(len(during)), "median_during_ms": 1e3 * statistics.median(during),
            "median_outside_ms": 1e3 * base, "extra_s": sum(during) - len(during) * base}


def profile_parts(profiler: Any) -> dict[str, float]:
    """Seconds per part of the fit from a ``SimpleProfiler``: the training and validation steps, and
    each PODMonitor hook (summed over its calls)."""
    parts: dict[str, float] = {}
    for action, durations in profiler.recorded_durations.items():
        if action.endswith(".optimizer_step") and action.startswith("[LightningModule]"):
            key = "training steps (forward, backward, optimizer)"
        elif action.endswith(".validation_step") and action.startswith("[Strategy]"):
            key = "validation steps"
        elif action.startswith("[Callback]PODMonitor"):
            key = "PODMonitor." + action.rsplit(".", 1)[-1]
        else:
            continue
        parts[key] = parts.get(key, 0.0) + float(sum(durations))
    return parts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=150, help="training steps per epoch")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--val-windows", type=int, default=256, help="validation windows per validation run")
    p.add_argument("--repeats", type=int, default=3, help="pairs of runs (order alternates)")
    p.add_argument("--model", choices=["gpt", "encoder"], default="gpt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="Lightning accelerator of both sides, e.g. cuda")
    p.add_argument("--monitor-args", default="{}",
                   help='PODMonitor keyword arguments as JSON, to attribute the cost (default: none, the '
                        'defaults users get), e.g. \'{"log_images": false}\'')
    p.add_argument("--profile", action="store_true",
                   help="run both sides under Lightning's SimpleProfiler and print where the time went")
    p.add_argument("--side", choices=["plain", "monitor"], help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        child(args)
        return
    walls: dict[str, list[float]] = {"plain": [], "monitor": []}
    profiles: dict[str, list[dict[str, float]]] = {"plain": [], "monitor": []}
    split: dict[str, float] = {}
    backgrounds: list[dict[str, float]] = []
    overlaps: list[dict[str, float]] = []
    n_val = 0
    for r in range(args.repeats):
        order = ["plain", "monitor"] if r % 2 == 0 else ["monitor", "plain"]
        for side in order:
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--tmp", tmp,
                       "--epochs", str(args.epochs), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                       "--block-size", str(args.block_size), "--val-windows", str(args.val_windows),
                       "--threads", str(args.threads), "--model", args.model, "--device", args.device,
                       "--monitor-args", args.monitor_args] + (["--profile"] if args.profile else [])
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                res = json.loads(out.strip().splitlines()[-1])
                walls[side].append(res["wall"])
                profiles[side].append(res.get("profile", {}))
                print(f"[{side:7}] fit {res['wall']:.1f} s, val_loss {res['val_loss']:.3f}", flush=True)
                if side == "monitor":
                    split = res["split"]
                    backgrounds.append(res["background"])
                    overlaps.append(res["overlap"])
                    n_val = res["validations"]
    plain, mon = statistics.median(walls["plain"]), statistics.median(walls["monitor"])
    name = "tiny GPT" if args.model == "gpt" else "nn.TransformerEncoder LM"
    print(f"\nconfig: {name}, {args.epochs} epochs x {args.steps} steps (batch {args.batch_size}, "
          f"block {args.block_size}), validation every epoch on {args.val_windows} windows, "
          f"{args.threads} threads, {args.device}, {args.repeats} pair(s), PODMonitor(**{args.monitor_args})")
    print("fit wall times (s): without " + ", ".join(f"{w:.1f}" for w in walls["plain"])
          + "; with " + ", ".join(f"{w:.1f}" for w in walls["monitor"]))
    print(f"fit wall time without monitor: {plain:.1f} s")
    print(f"fit wall time with PODMonitor(): {mon:.1f} s ({n_val} monitored validation runs)")
    print(f"ratio with/without: {mon / plain:.3f}   (target <= {TARGET})")
    # each pair ran back to back in alternating order, so a machine that drifts over the run
    # moves both fits of a pair alike: the pairs' own ratios are the less drift-prone reading
    pairs = [m / p for m, p in zip(walls["monitor"], walls["plain"], strict=True)]
    print("ratio of each pair: " + ", ".join(f"{x:.3f}" for x in pairs)
          + f"; median {statistics.median(pairs):.3f}")
    if split:
        total = sum(split.values())
        print("monitor cost split over its validation runs (last fit): "
              + ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in split.items()) + f" (total {total:.2f} s)")
        wall_bg = statistics.median(b.get("wall_s", 0.0) for b in backgrounds)
        thread_bg = statistics.median(b.get("cpu_s", 0.0) for b in backgrounds)
        picture_bg = statistics.median(b.get("picture_cpu_s", 0.0) for b in backgrounds)
        help_bg = statistics.median(b.get("help_cpu_s", 0.0) for b in backgrounds)
        cpu_bg = thread_bg + picture_bg + help_bg
        print(f"outputs in the background (pictures, sinks; median over fits): the worker {wall_bg:.2f} s busy, "
              f"{thread_bg:.2f} s of its thread's CPU; the picture process {picture_bg:.2f} s of CPU; "
              f"the training process drew parts of the pictures it waited for at the end in {help_bg:.2f} s of CPU")
        print(f"the monitor's accounted work (in-loop total + background CPU): {total + cpu_bg:.2f} s = "
              f"{100 * (total + cpu_bg) / plain:.1f} % of the plain fit (the work done, free of fit-to-fit noise; "
              "not all of it is wall time: the low-priority background work partly fills the training's idle moments; "
              "it leaves out what the capture adds to the validation steps themselves)")
    extra = [o["extra_s"] for o in overlaps if "extra_s" in o]
    if extra:
        print("training steps that overlapped a background job, per monitored fit: "
              + "; ".join(f"{int(o['n_during'])} steps, median {o['median_during_ms']:.0f} ms against "
                          f"{o['median_outside_ms']:.0f} ms at other times ({o['extra_s']:+.2f} s)"
                          for o in overlaps if "extra_s" in o)
              + f"; median {statistics.median(extra):+.2f} s (what the background work cost the training "
              "steps, within each fit)")
    if args.profile:
        keys = sorted({k for side in profiles.values() for prof in side for k in prof},
                      key=lambda k: (not k.startswith("training"), not k.startswith("validation"), k))
        print(f"\nwhere the fit's time went (SimpleProfiler, medians over {args.repeats} fit(s) per side, s)")
        print(f"{'part':<50} {'without':>9} {'with':>9}")
        for key in keys:
            row = [statistics.median(prof.get(key, 0.0) for prof in profiles[side]) if profiles[side] else 0.0
                   for side in ("plain", "monitor")]
            if max(row) < 0.005:  # (hooks that cost nothing)
                continue
            print(f"{key:<50} {row[0]:>9.2f} {row[1]:>9.2f}")


if __name__ == "__main__":
    main()
