"""What drawing pictures in the background costs the training steps, for each way of drawing them.

Usage (from the repository root)::

    python benchmarks/bench_background.py                 # every variant, 2 and 1 training threads
    python benchmarks/bench_background.py --variants process --threads 2 --rounds 10

One process trains the tiny reference GPT (4 layers x 4 heads, width 128, batch 32 of 128
tokens: forward, backward, gradient clipping, AdamW) in segments of ``--steps`` steps, alternately
with a picture run being drawn in the background (the 26 pictures of one monitored run at the tiny
GPT's shape, over and over) and without (after waiting for the last picture run to end), for
``--rounds`` pairs of segments in alternating order, so that a machine that drifts moves both sides
alike. It prints the median time of a training step in each state and the median of the pairs'
ratios (with / without), per variant:

* ``thread``: the pictures drawn on a thread of the training process at the normal priority (how
  podmonitor drew them before its picture process);
* ``thread_nice``: the same thread at niceness 19 (Linux);
* ``process``: drawn in :class:`~podmonitor.reporting.render_process.PictureProcess` (a child
  Python at niceness 19, its own interpreter lock), what ``PODMonitor()`` does by default.

``--threads 2`` on 2 cores is a CPU run that keeps every core busy; ``--threads 1`` leaves a core
free, as a GPU run leaves the CPU's cores mostly free: what is left there is the contention for the
interpreter lock. No timed assertion is made: the numbers are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("thread", "thread_nice", "process")


def child(variant: str, threads: int, rounds: int, steps: int) -> dict[str, object]:
    """Run one variant in this process; returns the medians and ratios."""
    sys.path.insert(0, str(REPO))
    import torch

    torch.set_num_threads(threads)
    from podmonitor import PODConfig, analyze
    from podmonitor.models.lightning import GPTLightningModule
    from podmonitor.reporting.figures import draw_run_pictures
    from podmonitor.reporting.render_process import PictureProcess
    from podmonitor.synthetic import layered_ensemble

    names = [f"layer_{i:02d}" for i in range(4)]
    reports = {n: analyze(f, PODConfig()) for n, f in zip(names, layered_ensemble(4, 150, 128), strict=True)}
    model = GPTLightningModule.tiny(vocab_size=65, block_size=128, max_steps=100).model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 65, (32, 128), generator=g), torch.randint(0, 65, (32, 128), generator=g)

    def train_step() -> None:
        loss = model(x, y)[1]
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    painter = PictureProcess() if variant == "process" else None
    if painter is not None:
        painter.status()  # started before timing (a monitor starts it at its first picture run)

    def picture_run() -> None:
        if painter is not None:
            painter.draw_run_pictures("pod", reports, names)
        else:
            draw_run_pictures("pod", reports, names)

    drawing, idle, done = threading.Event(), threading.Event(), threading.Event()
    idle.set()
    runs = [0]

    def background() -> None:
        if variant == "thread_nice" and hasattr(os, "setpriority"):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while not done.is_set():
            if not drawing.wait(0.05):
                continue
            idle.clear()
            picture_run()
            runs[0] += 1
            idle.set()

    worker = threading.Thread(target=background, daemon=True)
    worker.start()
    for _ in range(3):
        train_step()
    seconds: dict[str, list[float]] = {"with": [], "without": []}
    for r in range(rounds):
        for state in (("with", "without") if r % 2 == 0 else ("without", "with")):
            if state == "with":
                drawing.set()
            else:
                drawing.clear()
                idle.wait()  # the last picture run ends first (not timed)
            start = time.perf_counter()
            for _ in range(steps):
                train_step()
            seconds[state].append((time.perf_counter() - start) / steps)
    drawing.clear()
    idle.wait()
    done.set()
    if painter is not None:
        painter.close()
    ratios = [a / b for a, b in zip(seconds["with"], seconds["without"], strict=True)]
    return {"variant": variant, "threads": threads, "with_ms": 1e3 * statistics.median(seconds["with"]),
            "without_ms": 1e3 * statistics.median(seconds["without"]), "ratio": statistics.median(ratios),
            "ratios": ratios, "picture_runs": runs[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--threads", nargs="+", type=int, default=[2, 1], help="training threads (one run each)")
    p.add_argument("--rounds", type=int, default=6, help="pairs of segments")
    p.add_argument("--steps", type=int, default=12, help="training steps per segment")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.rounds, args.steps)))
        return
    print(f"training steps of the tiny GPT (batch 32 x 128), {args.rounds} pairs of {args.steps}-step segments "
          f"with / without a picture run drawn in the background (26 pictures, drawn over and over)")
    print(f"{'variant':<12} {'threads':>7} {'with ms':>8} {'without ms':>10} {'ratio':>6}  pairs' ratios, picture runs")
    for threads in args.threads:
        for variant in args.variants:  # each variant in a fresh process
            out = subprocess.run([sys.executable, __file__, "--child", variant, str(threads), "--rounds",
                                  str(args.rounds), "--steps", str(args.steps)],
                                 check=True, capture_output=True, text=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            print(f"{res['variant']:<12} {res['threads']:>7} {res['with_ms']:>8.0f} {res['without_ms']:>10.0f} "
                  f"{res['ratio']:>6.2f}  {', '.join(f'{v:.2f}' for v in res['ratios'])}; {res['picture_runs']}",
                  flush=True)


if __name__ == "__main__":
    main()
