"""Print the memory the engine needs, by sequence length L and snapshots N, in exact and sketch mode.

Usage: python benchmarks/memory_table.py [--dtype float64|float32] [--storage float16|...]
       [--rank 120] [--layers 4]

The numbers are :func:`podmonitor.estimate_memory` (state kept between updates, plus what
``compute`` allocates on top), for one layer and for ``--layers`` layers;
``test_memory_budget_refuses_without_losing_data`` and
``test_auto_mode_is_exact_within_the_budget_then_sketches`` check that the state estimates equal
the bytes the accumulator really holds.
"""

from __future__ import annotations

import argparse

import torch

from podmonitor import PODConfig, estimate_memory


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    p.add_argument("--storage", default=None, choices=[None, "float64", "float32", "float16", "bfloat16"])
    p.add_argument("--rank", type=int, default=120, help="sketch rank l for the sketch table")
    p.add_argument("--layers", type=int, default=4, help="layers for the last column of the sketch table")
    args = p.parse_args()
    cfg = PODConfig(dtype=getattr(torch, args.dtype),
                    storage_dtype=None if args.storage is None else getattr(torch, args.storage))
    print(f"exact engine, one causal layer, dtype {args.dtype}, snapshot storage {args.storage or args.dtype}, "
          f"default scale grid (lag band from the largest scale, 64 tokens)")
    ns = (150, 500, 1000, 4000)
    print("| L \\ N | " + " | ".join(f"N = {n}" for n in ns) + " |")
    print("|---|" + "---|" * len(ns))
    for seq_len in (128, 256, 512, 1024, 2048, 4096):
        cells = []
        for n in ns:
            est = estimate_memory(seq_len, n, cfg)
            cells.append(f"{human(est['total'])} ({human(est['state'])} kept)")
        print(f"| {seq_len} | " + " | ".join(cells) + " |")
    sk = PODConfig(dtype=cfg.dtype, storage_dtype=cfg.storage_dtype, mode="sketch", sketch_rank=args.rank,
                   coherency=False)
    print()
    print(f"sketch mode, l = {args.rank} (buffer of {2 * args.rank} rows), any N; one layer, and {args.layers} layers "
          "(coherency off; a fixed coherency_scale adds 3 L^2 per layer)")
    print(f"| L | state (1 layer) | compute extra | total (1 layer) | total ({args.layers} layers) |")
    print("|---|---|---|---|---|")
    for seq_len in (128, 256, 512, 1024, 2048, 4096, 8192):
        est = estimate_memory(seq_len, 10**6, sk)
        print(f"| {seq_len} | {human(est['state'])} | {human(est['compute_extra'])} | {human(est['total'])} | "
              f"{human(args.layers * est['total'])} |")


if __name__ == "__main__":
    main()
