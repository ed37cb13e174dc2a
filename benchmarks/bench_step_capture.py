"""What a monitored validation run of the reference GPT costs, with and without a second forward.

Usage (from the repository root)::

    python benchmarks/bench_step_capture.py                 # tiny GPT, 7 rounds, 2 threads
    python benchmarks/bench_step_capture.py --rounds 3 --val-windows 128

The reference GPT (``GPTLightningModule.tiny``, softmax attention, random weights) is validated on
TinyShakespeare windows of 128 characters (``--val-windows``, batches of 32) by the real Trainer,
three ways, alternating in one process ``--rounds`` times:

- ``plain``: no monitor;
- ``own forward``: ``PODMonitor(log_images=False)`` with the capture running
  ``attention_maps(batch)``, a forward of its own, on each monitored batch (what the protocol
  capture does for models other than the reference GPT with softmax attention, and did for it
  before);
- ``in step``: the default, the probabilities formed during the validation step's own forward.

It prints the median wall time of ``trainer.validate`` for each, what the monitor added on each of
the two monitored sides (median minus the plain median), and the validation losses (the same on
all three: the step's outputs do not change).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--val-windows", type=int, default=256)
    args = p.parse_args()

    import lightning as L
    import torch

    from podmonitor import PODMonitor
    from podmonitor.capture.protocol import ProtocolAdapter
    from podmonitor.data import CharDataModule
    from podmonitor.models.lightning import GPTLightningModule

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    L.seed_everything(0, verbose=False)
    dm = CharDataModule(block_size=128, batch_size=32, train_samples_per_epoch=32, max_val_windows=args.val_windows)
    model = GPTLightningModule.tiny(vocab_size=65, block_size=128, max_steps=10)
    in_step_start = ProtocolAdapter.start

    def validate(monitor: PODMonitor | None) -> tuple[float, float]:
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[monitor] if monitor else [],
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            default_root_dir=tempfile.mkdtemp())
        t0 = time.perf_counter()
        (metrics,) = trainer.validate(model, dm, verbose=False)
        return time.perf_counter() - t0, float(metrics["val_loss"])

    sides = ("plain", "own forward", "in step")
    walls: dict[str, list[float]] = {s: [] for s in sides}
    losses: dict[str, float] = {}
    try:
        for _ in range(args.rounds):
            for side in sides:
                # the capture's own forward: the protocol capture without its in-step start
                ProtocolAdapter.start = (lambda self, module: None) if side == "own forward" else in_step_start
                wall, loss = validate(None if side == "plain" else PODMonitor(log_images=False))
                walls[side].append(wall)
                losses[side] = loss
    finally:
        ProtocolAdapter.start = in_step_start
    med = {s: statistics.median(v) for s, v in walls.items()}
    print(f"tiny reference GPT, {args.val_windows} validation windows of 128, {args.threads} threads, "
          f"{args.rounds} alternating rounds (medians of trainer.validate)")
    for side in sides:
        extra = "" if side == "plain" else f"   monitor added {med[side] - med['plain']:.3f} s"
        print(f"{side:<12} {med[side]:7.3f} s{extra}   val_loss {losses[side]:.6f}")


if __name__ == "__main__":
    main()
