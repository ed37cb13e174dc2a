"""Is podmonitor's head pruning advice any good? Prune the same heads budget three ways and compare.

Trains the reference GPT (``GPTLightningModule.tiny()``, 4 layers x 4 heads, on TinyShakespeare
with ``CharDataModule(block_size=128, batch_size=16)``) to a mid-training step with
``PODMonitor(per_head=True)`` watching, checkpoints it, then branches from that checkpoint. In
every branch the same number of heads is masked at the same step, chosen

* (a) by podmonitor's advice (the first heads of the drop order of the last monitored run),
* (b) at random (several seeds),
* (c) by the gradient-based head importance of Michel et al. 2019 (I_h = E_x |dL/dxi_h| on
  training windows, normalised per layer, lowest pruned),

plus an unpruned branch as the reference. For each branch it prints the validation loss right
after pruning and after the same number of further training steps (identical data order in
every branch: the branches differ only in the masked heads).

Usage (one torch thread; about 15 minutes on 2 shared CPU cores with the defaults)::

    OMP_NUM_THREADS=1 .venv/bin/python examples/pruning_experiment.py
    OMP_NUM_THREADS=1 .venv/bin/python examples/pruning_experiment.py --mid-step 200 --extra-steps 100 \\
        --n-prune 4 --seeds 0 1 2 --out runs/pruning_experiment
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import time
import warnings
from typing import Any

import torch


def evaluate(model: Any, loader: Any) -> float:
    """Mean validation loss (nats/char) of the model in eval mode over every batch of the loader."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            _, loss = model.model(x, y)
            total += float(loss) * x.numel()
            count += x.numel()
    model.train(was)
    return total / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mid-step", type=int, default=200, help="optimiser steps before pruning")
    ap.add_argument("--extra-steps", type=int, default=100, help="training steps after pruning")
    ap.add_argument("--n-prune", type=int, default=4, help="heads to prune (of 16)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the random branches")
    ap.add_argument("--val-every", type=int, default=50, help="steps between monitored validation runs")
    ap.add_argument("--n-snapshots", type=int, default=64, help="sequences the monitor analyses per run")
    ap.add_argument("--importance-batches", type=int, default=4, help="training batches of 16 for Michel")
    ap.add_argument("--val-windows", type=int, default=None, help="validation windows to evaluate (all: 871)")
    ap.add_argument("--out", default="runs/pruning_experiment")
    args = ap.parse_args()

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*callbacks used to create the checkpoint.*")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import lightning as L

    from podmonitor import PODConfig, PODMonitor
    from podmonitor.data import CharDataModule
    from podmonitor.models.lightning import GPTLightningModule
    from podmonitor.pruning import HeadMasker, lowest_importance_heads, michel_head_importance
    from podmonitor.pruning.callback import HeadPruning, advice_heads, random_heads

    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    trainer_kw: dict[str, Any] = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                                      enable_model_summary=False, enable_checkpointing=False,
                                      gradient_clip_val=1.0, default_root_dir=args.out)

    # ---------------------------------------------------------------- phase 1: train to the mid step
    L.seed_everything(0, workers=True, verbose=False)
    dm = CharDataModule(block_size=128, batch_size=16, max_val_windows=args.val_windows)
    dm.setup()
    model = GPTLightningModule.tiny(vocab_size=dm.vocab_size)
    monitor = PODMonitor(n_snapshots=args.n_snapshots, config=PODConfig(n_dominant=2, coherency=False),
                         per_head=True, log_images=False, output_dir=os.path.join(args.out, "podmonitor"))
    trainer = L.Trainer(max_steps=args.mid_step, val_check_interval=args.val_every, limit_val_batches=16,
                        num_sanity_val_steps=0, callbacks=[monitor], **trainer_kw)
    trainer.fit(model, dm)
    ckpt = os.path.join(args.out, f"mid_step_{args.mid_step}.ckpt")
    trainer.save_checkpoint(ckpt)
    t_mid = time.perf_counter() - t_start
    print(f"trained to step {trainer.global_step} in {t_mid:.0f} s; checkpoint {ckpt}")
    advice = monitor.last_advice
    assert advice is not None, "the monitor gave no advice"
    print()
    print(advice.markdown())
    print("readiness at each monitored run:")
    for rec in monitor.readiness.history:  # type: ignore[union-attr]
        drift = rec["max_subspace_drift"]
        print(f"  step {rec['step']}: max subspace drift {'n/a' if math.isnan(drift) else f'{drift:.2f}'}, "
              f"{rec['reason']}")
    print()

    # ---------------------------------------------------------------- choose the heads of each branch
    val_loader = dm.val_dataloader()
    base = GPTLightningModule.load_from_checkpoint(ckpt)
    n_heads = HeadMasker(base).n_heads
    branches: dict[str, dict[int, list[int]]] = {"none": {}}
    branches["advice"] = advice_heads(advice, args.n_prune)
    for s in args.seeds:
        branches[f"random_{s}"] = random_heads(n_heads, args.n_prune, seed=s)
    torch.manual_seed(0)
    train_iter = iter(dm.train_dataloader())
    imp_batches = [next(train_iter) for _ in range(args.importance_batches)]
    scores = michel_head_importance(base, imp_batches)
    branches["michel"] = lowest_importance_heads(scores, args.n_prune)
    print("Michel importance (per-layer l2-normalised), rows = layers:")
    for i, row in enumerate(scores.tolist()):
        print(f"  layer {i}: " + " ".join(f"{v:.3f}" for v in row))
    print()
    loss_mid = evaluate(base, val_loader)

    # ---------------------------------------------------------------- branch: prune, evaluate, train on
    results: dict[str, dict[str, Any]] = {}
    for name, heads in branches.items():
        t0 = time.perf_counter()
        model = GPTLightningModule.load_from_checkpoint(ckpt)
        masker = HeadMasker(model)
        masker.apply(heads)
        right_after = evaluate(model, val_loader)
        masker.restore()  # the callback prunes again at the same step inside the resumed fit
        L.seed_everything(1234, workers=True, verbose=False)
        dm_branch = CharDataModule(block_size=128, batch_size=16, max_val_windows=args.val_windows, seed=4242)
        callbacks = [HeadPruning(strategy=heads, at_step=args.mid_step, output_dir=os.path.join(args.out, name))] \
            if heads else []
        tr = L.Trainer(max_steps=args.mid_step + args.extra_steps, limit_val_batches=0, num_sanity_val_steps=0,
                       callbacks=callbacks, **trainer_kw)
        tr.fit(model, dm_branch, ckpt_path=ckpt)
        if heads:
            pruned = callbacks[0].masker.pruned  # type: ignore[union-attr]
            assert pruned == heads, (pruned, heads)
        after = evaluate(model, val_loader)
        results[name] = {"heads": heads, "right_after": right_after, "after": after, "seconds":
                         time.perf_counter() - t0}
        print(f"branch {name:9s} heads {heads}: right after {right_after:.4f}, after +{args.extra_steps} steps "
              f"{after:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)

    # ---------------------------------------------------------------- table
    ref_after = results["none"]["after"]
    print()
    print(f"validation loss (nats/char, {len(val_loader.dataset)} windows of 128); pruned {args.n_prune} of "
          f"{sum(n_heads)} heads at step {args.mid_step}; unpruned model at step {args.mid_step}: {loss_mid:.4f}")
    print()
    print(f"| strategy | heads pruned {{layer: [heads]}} | right after | change | after +{args.extra_steps} steps "
          f"| vs unpruned |")
    print("|---|---|---|---|---|---|")

    def line(name: str, heads: Any, ra: float, af: float, extra: str = "") -> None:
        print(f"| {name} | {heads} | {ra:.4f}{extra} | {ra - loss_mid:+.4f} | {af:.4f} | {af - ref_after:+.4f} |")

    for name in ("none", "advice", "michel"):
        r = results[name]
        line({"none": "no pruning", "advice": "(a) podmonitor advice", "michel": "(c) Michel et al."}[name],
             r["heads"] or "-", r["right_after"], r["after"])
    rand = [results[f"random_{s}"] for s in args.seeds]
    for s, r in zip(args.seeds, rand, strict=True):
        line(f"(b) random, seed {s}", r["heads"], r["right_after"], r["after"])
    ra = [r["right_after"] for r in rand]
    af = [r["after"] for r in rand]

    def sd(v: list[float]) -> float:
        return statistics.stdev(v) if len(v) > 1 else 0.0

    print(f"| (b) random, mean ± sd of {len(rand)} | | {statistics.mean(ra):.4f} ± {sd(ra):.4f} | "
          f"{statistics.mean(ra) - loss_mid:+.4f} | {statistics.mean(af):.4f} ± {sd(af):.4f} | "
          f"{statistics.mean(af) - ref_after:+.4f} |")
    total = time.perf_counter() - t_start
    print()
    print(f"total run time {total:.0f} s (phase 1: {t_mid:.0f} s)")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "loss_mid": loss_mid, "results": results, "advice": advice.to_dict(),
                   "michel_scores": scores.tolist(), "readiness": monitor.readiness.history,  # type: ignore[union-attr]
                   "seconds": total}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
