"""Cost of the ``sdpa`` capture on a monitored batch: plain forward vs forward under the interception.

Usage::

    python benchmarks/bench_capture.py --threads 2

For L = 128 and L = 1024 it times, alternating the two sides ``--rounds`` times in one process
(after one untimed warm-up of each):

1. one ``scaled_dot_product_attention`` call (B, H, L, E) alone, and the same call intercepted by
   :class:`~podmonitor.capture.SDPAAdapter` (start, call, recompute of A, self-check, collect, stop);
2. the forward of a nanoGPT-style model (tests/capture/sdpa_models.py) under ``torch.no_grad``,
   alone and captured the same way (every layer recomputed and checked).

It prints the medians and their ratio (captured / plain), the captured side again with its maps'
buffers kept from one round to the next (``hugepages.BufferPool``, as PODMonitor keeps them from
one monitored batch to the next: no fresh memory to fault in), the captured side with the
huge-page advice of the captured maps turned off (``podmonitor.hugepages.ENABLED = False``: every
buffer faulted in by 4 KiB pages, as before that advice), and the size of the captured maps. The
capture runs only on monitored validation batches: training steps and other batches pay nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from podmonitor import hugepages  # noqa: E402
from podmonitor.capture import SDPAAdapter  # noqa: E402
from tests.capture.sdpa_models import GPT, GPTConfig  # noqa: E402


def alternate(*fns: Callable[[], object], rounds: int) -> list[float]:
    """Medians (s) of each of ``fns``, run in turn ``rounds`` times after a warm-up each."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, t in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def small_pages(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with the huge-page advice of podmonitor's own buffers turned off."""
    def run() -> object:
        before, hugepages.ENABLED = hugepages.ENABLED, False
        try:
            return fn()
        finally:
            hugepages.ENABLED = before
    return run


def pooled(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with a buffer pool of its own in use (the previous round's maps are free by then)."""
    pool = hugepages.BufferPool()

    def run() -> object:
        with hugepages.use_pool(pool):
            return fn()
    return run


def bench_length(length: int, args: argparse.Namespace) -> None:
    """Print the two rows of one sequence length."""
    b, h, e = args.batch, args.heads, args.head_dim
    rounds = args.rounds or (15 if length <= 256 else 5)
    q, k, v = (torch.randn(b, h, length, e) for _ in range(3))
    adapter = SDPAAdapter()
    holder = torch.nn.Module()

    def call_plain() -> object:
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def call_captured() -> object:
        with torch.no_grad(), adapter.capturing(holder):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            cap = adapter.collect(holder, None, out)
        assert not cap.flagged
        return cap

    tp, tc, tr, ts = alternate(call_plain, call_captured, pooled(call_captured), small_pages(call_captured),
                               rounds=rounds)
    maps = b * h * length * length * 4 / 2**20
    print(f"{length:>5} {'one SDPA call':<22} {1e3 * tp:>10.2f} {1e3 * tc:>12.2f} {tc / tp:>7.2f} "
          f"{1e3 * tr:>10.2f} {1e3 * ts:>14.2f} {maps:>9.1f}")

    gpt = GPT(GPTConfig(block_size=length, vocab_size=256, n_layer=args.layers, n_head=h, n_embd=h * e)).eval()
    idx = torch.randint(0, 256, (b, length))

    def model_plain() -> object:
        with torch.no_grad():
            return gpt(idx)

    def model_captured() -> object:
        with torch.no_grad(), adapter.capturing(gpt):
            out = gpt(idx)
            cap = adapter.collect(gpt, None, out)
        assert not cap.flagged and len(cap.fields) == args.layers
        return cap

    tp, tc, tr, ts = alternate(model_plain, model_captured, pooled(model_captured), small_pages(model_captured),
                               rounds=rounds)
    what = f"nanoGPT forward ({args.layers} l.)"
    print(f"{length:>5} {what:<22} {1e3 * tp:>10.2f} {1e3 * tc:>12.2f} {tc / tp:>7.2f} "
          f"{1e3 * tr:>10.2f} {1e3 * ts:>14.2f} {args.layers * maps:>9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--rounds", type=int, default=0, help="alternations (default: 15 at L <= 256, else 5)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    b, h, e = args.batch, args.heads, args.head_dim
    print(f"torch {torch.__version__}, {args.threads} thread(s); B = {b}, H = {h}, E = {e}, "
          f"{args.layers} layers; medians of alternating runs")
    print(f"{'L':>5} {'what':<22} {'plain ms':>10} {'captured ms':>12} {'ratio':>7} {'pooled ms':>10} "
          f"{'4 KiB pages ms':>14} {'maps MiB':>9}")
    for length in args.lengths:
        bench_length(length, args)


if __name__ == "__main__":
    main()
