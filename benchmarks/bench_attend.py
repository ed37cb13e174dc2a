"""The reference GPT's product of attention probabilities and values, two ways, on this machine.

Usage (from the repository root)::

    python benchmarks/bench_attend.py --threads 2

For a few shapes (lead = batch x heads, rows of a part, keys, head size) it times ``A @ V`` and
``(V^T A^T)^T`` (the form :func:`podmonitor.models.gpt._attend`, which both causal paths of the
reference GPT use, takes below a head size of ``TURN_BELOW_HEAD_SIZE``) alternately in one
process, and prints the median of each, their ratio, and whether the two give the same bits.
The first shape is a part of ``bench_validation_run.py``'s attention (2 x 12 heads, head size 8,
64 rows of 768 keys); the others have wider heads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def _turned(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(V^T A^T)^T, as ``_attend`` takes it below ``TURN_BELOW_HEAD_SIZE``."""
    return (v.transpose(-2, -1) @ a.transpose(-2, -1)).transpose(-2, -1)


SHAPES = [(24, 64, 768, 8), (24, 128, 1024, 8), (8, 128, 256, 16), (8, 128, 512, 64), (24, 128, 1024, 64)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"{'lead x rows x keys x head size':>32} {'A @ V (us)':>12} {'(V^T A^T)^T (us)':>18} {'ratio':>7} same bits")
    for lead, rows, keys, hs in SHAPES:
        a = torch.softmax(torch.randn(lead, rows, keys, generator=g), dim=-1)
        v = torch.randn(lead, keys, hs, generator=g)
        sides = {"plain": lambda a=a, v=v: a @ v, "turned": lambda a=a, v=v: _turned(a, v)}
        times: dict[str, list[float]] = {k: [] for k in sides}
        for f in sides.values():  # warm-up
            f()
        for _ in range(args.rounds):
            for k, f in sides.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        plain, turned = (statistics.median(times[k]) * 1e6 for k in ("plain", "turned"))
        same = torch.equal(a @ v, _turned(a, v))
        print(f"{f'{lead} x {rows} x {keys} x {hs}':>32} {plain:12.0f} {turned:18.0f} {plain / turned:7.2f} {same}")


if __name__ == "__main__":
    main()
