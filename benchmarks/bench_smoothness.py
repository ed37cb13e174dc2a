"""Cost of SmoothnessMonitor per validation run, relative to a plain validation pass, side by side.

Usage (from the repository root)::

    OMP_NUM_THREADS=1 python benchmarks/bench_smoothness.py            # tiny reference GPT, 3 rounds
    python benchmarks/bench_smoothness.py --ckpt model.ckpt --val-windows 0   # a trained model, every window

Model: ``GPTLightningModule.tiny()`` (4 layers, 4 heads, width 128, context 128) or ``--ckpt``;
data: ``CharDataModule(block_size=128, batch_size=16)``, the validation windows of TinyShakespeare.
Each round: ``--train-steps`` optimiser steps (so the warm start meets a model that moved, as in
training), then a plain validation pass (the model's forward on every validation batch, eval mode,
inference mode) and the monitor's work for one validation run, timed in the same process one
after the other:

- "sigma run": capture on the first batch + companions + sigma(n) for n = 16, 32, 64, 128 on
  ``--sequences`` sequences, every layer, + logging (PNG sink: scalars, pictures, table, JSON line);
  the first round starts cold, the next ones warm-started from the previous round;
- "companions run": capture + entropy and ||P||_2 only (the runs between two sigma runs).

It prints the times, the ratios to the plain validation pass and the amortised cost per
validation run for ``every_n_validations = --every``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from types import SimpleNamespace


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default=None, help="GPTLightningModule checkpoint (default: tiny(), random init)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=20, help="optimiser steps before every round")
    parser.add_argument("--sequences", type=int, default=4, help="SmoothnessMonitor(n_sequences=...)")
    parser.add_argument("--every", type=int, default=5, help="every_n_validations for the amortised cost")
    parser.add_argument("--val-windows", type=int, default=0,
                        help="validation windows per pass (0: all 871 of TinyShakespeare)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import lightning as L
    import torch

    from podmonitor.data import CharDataModule
    from podmonitor.models import GPTLightningModule
    from podmonitor.smoothness import SmoothnessMonitor

    torch.set_num_threads(args.threads)
    L.seed_everything(0, verbose=False)
    dm = CharDataModule(block_size=128, batch_size=16, max_val_windows=args.val_windows or None)
    dm.setup("fit")
    if args.ckpt:
        model = GPTLightningModule.load_from_checkpoint(args.ckpt, map_location="cpu")
    else:
        model = GPTLightningModule.tiny(vocab_size=dm.vocab_size)
    val_batches = list(dm.val_dataloader())
    train_iter = iter(dm.train_dataloader())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    out_dir = tempfile.mkdtemp(prefix="bench_smoothness_")
    sigma_cb = SmoothnessMonitor(every_n_validations=1, n_sequences=args.sequences, output_dir=out_dir, strict=True)
    comp_cb = SmoothnessMonitor(every_n_validations=10**9, n_sequences=args.sequences, output_dir=out_dir,
                                strict=True)
    trainer = SimpleNamespace(sanity_checking=False, global_rank=0, global_step=0, current_epoch=0, loggers=[],
                              log_dir=None, default_root_dir=out_dir, callbacks=[])
    for cb in (sigma_cb, comp_cb):
        cb.setup(trainer, model, "fit")
    comp_cb.validation_count = 1  # its next run is not a sigma run

    def train(steps: int) -> None:
        model.train()
        for _ in range(steps):
            x, y = next(train_iter)
            _, loss = model.model(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            trainer.global_step += 1

    def plain_validation() -> float:
        model.eval()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for x, y in val_batches:
                model.model(x, y)
        return time.perf_counter() - t0

    def monitor_run(cb: SmoothnessMonitor) -> tuple[float, float]:
        """(seconds spent in the callback's hooks, seconds of its measurement alone)."""
        model.eval()
        x, y = val_batches[0]
        spent = 0.0
        with torch.inference_mode():
            t0 = time.perf_counter()
            cb.on_validation_epoch_start(trainer, model)
            cb.on_validation_batch_start(trainer, model, (x, y), 0)
            spent += time.perf_counter() - t0
            model.model(x, y)  # the validation forward itself belongs to the plain pass
            t0 = time.perf_counter()
            cb.on_validation_batch_end(trainer, model, None, (x, y), 0)
            cb.on_validation_epoch_end(trainer, model)
            spent += time.perf_counter() - t0
        return spent, cb.history[-1]["seconds"]

    print(f"model: {'checkpoint ' + args.ckpt if args.ckpt else 'GPTLightningModule.tiny(), random init'}; "
          f"validation: {len(val_batches)} batches of 16 x 128 tokens; {args.sequences} sequences measured; "
          f"torch threads {torch.get_num_threads()}")
    rows = []
    for r in range(args.rounds):
        train(args.train_steps)
        t_val = plain_validation()
        t_sigma, t_sigma_measure = monitor_run(sigma_cb)
        t_comp, _ = monitor_run(comp_cb)
        iters = sum(sum(layer["n_iter"]) for layer in _last_record(out_dir, sigma=True)["layers"].values())
        rows.append((t_val, t_sigma, t_comp, iters))
        start = "cold" if r == 0 else "warm"
        print(f"round {r + 1} ({start}, after {trainer.global_step} training steps): plain validation {t_val:.2f} s"
              f" | sigma run {t_sigma:.2f} s (measurement {t_sigma_measure:.2f} s, {iters} power-iteration steps) = "
              f"{t_sigma / t_val:.2f}x | companions run {t_comp:.3f} s = {t_comp / t_val:.3f}x")
    warm = rows[1:] or rows
    ratio_sigma = statistics.median(t_s / t_v for t_v, t_s, _, _ in warm)
    ratio_comp = statistics.median(t_c / t_v for t_v, _, t_c, _ in rows)
    amortised = (ratio_sigma + (args.every - 1) * ratio_comp) / args.every
    print(f"\ncold sigma run / plain validation: {rows[0][1] / rows[0][0]:.2f}x")
    print(f"warm sigma run / plain validation (median): {ratio_sigma:.2f}x")
    print(f"companions run / plain validation (median): {ratio_comp:.3f}x")
    print(f"amortised cost per validation run with every_n_validations={args.every}: {amortised:.2f}x "
          "of a plain validation pass")
    for cb in (sigma_cb, comp_cb):
        cb.teardown(trainer, model, "fit")


def _last_record(out_dir: str, sigma: bool) -> dict:
    import os

    from podmonitor.reporting.sinks import read_json_lines

    records = read_json_lines(os.path.join(out_dir, "smoothness.jsonl"))
    return [r for r in records if r["sigma_computed"] == sigma][-1]


if __name__ == "__main__":
    main()
