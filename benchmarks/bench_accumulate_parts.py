"""Where the monitor's "accumulate" time goes at GPT-2-small shape, part by part, in one process.

Usage (from the repository root)::

    python benchmarks/bench_accumulate_parts.py            # L = 1024, 12 heads, batches of 2, 16 sequences
    python benchmarks/bench_accumulate_parts.py --seq-len 256

For one layer it times what ``PODMonitor`` does with every validation batch of (B, H, L, L) float32
causal attention (random softmax maps): the head average; the per-head stability signals
(``StabilityAccumulator.update``), checked, and as the monitor runs them for captures that write
+0 after each query (the reference models' and the SDPA adapter's: ``zeros_above_diagonal=True``);
and the engine's update, four ways (batch by batch with the default float32 moment products; in
groups of ``FEED_BYTES`` of fields, as the monitor queues them, without and with a buffer pool in
use, as the monitor runs it, so that the update's work buffers stay mapped from one call to the
next; and batch by batch with float64 products as before ``PODConfig.moment_dtype``), and the
lag-moment products alone (``LagShear``, float64 and float32). Each time is the best of
``--repeats`` and is also printed scaled to 12 layers and N = 150, the shape of
``bench_validation_run.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine_parts import best_of  # noqa: E402  (the scripts' shared best-of timer)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--batch", type=int, default=2, help="sequences per validation batch")
    ap.add_argument("--batches", type=int, default=8, help="batches timed (one layer)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)

    import torch

    from podmonitor import hugepages
    from podmonitor.callback import FEED_BYTES
    from podmonitor.engine import PODAccumulator, PODConfig
    from podmonitor.engine.lags import LagShear
    from podmonitor.engine.stability import StabilityAccumulator

    torch.set_num_threads(args.threads)
    seq_len, heads, b, nb = args.seq_len, args.heads, args.batch, args.batches
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, heads, seq_len, seq_len, generator=g) * 2
    logits.masked_fill_(torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1), float("-inf"))
    fields = torch.softmax(logits, dim=-1)  # (B, H, L, L) float32, as captured
    del logits
    avg = fields.mean(dim=1)  # (B, L, L)
    n_seq = b * nb
    scale = 12 * 150 / n_seq

    def fresh(cfg: PODConfig) -> PODAccumulator:
        acc = PODAccumulator(cfg)
        acc.update(avg[:1])  # start-up at this length, not timed
        acc.reset()
        return acc

    # PODMonitor queues each layer's head averages and adds them FEED_BYTES at a time, inside its
    # buffer pool (the engine's work buffers then stay mapped from one update to the next)
    group = max(1, FEED_BYTES // (avg[0].numel() * avg.element_size()))
    queued = torch.cat([avg] * nb)  # (nb * b, L, L)
    pool = hugepages.BufferPool()

    def feed(cfg: PODConfig, grouped: bool, pooled: bool = False) -> Callable[[], object]:
        def run() -> None:
            acc = fresh(cfg)
            with hugepages.use_pool(pool) if pooled else contextlib.nullcontext():
                if grouped:
                    for start in range(0, queued.shape[0], group):
                        acc.update(queued[start:start + group])
                else:
                    for _ in range(nb):
                        acc.update(avg)
        return run

    stab = StabilityAccumulator()
    stab.update(fields[:1], causal=True)
    cfg = PODConfig(coherency=False, causal=True)
    f64 = PODConfig(coherency=False, causal=True, moment_dtype=torch.float64)
    parts = {
        "head average": lambda: [fields.mean(dim=1) for _ in range(nb)],
        "stability signals (per head)": lambda: [stab.update(fields, causal=True) for _ in range(nb)],
        "same, zeros above the diagonal promised": lambda: [stab.update(fields, causal=True, zeros_above_diagonal=True)
                                                            for _ in range(nb)],
        "update, batch by batch": feed(cfg, grouped=False),
        f"update, {group} fields at a time": feed(cfg, grouped=True),
        "same, pooled work buffers (as the monitor)": feed(cfg, grouped=True, pooled=True),
        "update, batch by batch, float64 products": feed(f64, grouped=False),
    }
    print(f"one layer, {nb} batches of {b} sequences, H = {heads}, L = {seq_len}, {args.threads} threads, "
          f"best of {args.repeats}")
    print(f"{'part':<45} {'seconds':>9} {'scaled to 12 layers, N = 150':>30}")
    for name, fn in parts.items():
        s = best_of(args.repeats, fn)
        print(f"{name:<45} {s:9.3f} {s * scale:30.1f}")
    for dtype in (torch.float64, torch.float32):
        shear = LagShear(seq_len, 1, dtype, torch.device("cpu"))
        out = torch.zeros(seq_len, seq_len, dtype=dtype)
        shear.load(avg[:1].to(dtype))
        s = best_of(args.repeats, lambda: [shear.add_backward_moment(out) for _ in range(n_seq)])  # noqa: B023
        print(f"{'lag-moment products alone, ' + str(dtype).replace('torch.', ''):<45} {s:9.3f} {s * scale:30.1f}")


if __name__ == "__main__":
    main()
