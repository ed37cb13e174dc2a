"""Bounded-memory POD: long contexts and large ensembles streamed through PODAccumulator under a budget.

Usage (from the repository root)::

    python benchmarks/bench_bounded.py                          # L = 2048, N = 1000, 4 layers, 2 GB
    python benchmarks/bench_bounded.py --seq-len 512 --n 200 --layers 2 --budget-gb 1
    python benchmarks/bench_bounded.py --check                  # sketch vs exact at N = 1000, L = 512

What it does:

1. ``stream`` (default): one accumulator per layer, each with ``memory_budget_bytes`` = (budget -
   overhead) / layers, in sketch mode (``--mode``); synthetic causal fields with a power-law POD
   spectrum (``--beta``) are generated batch by batch and fed to every layer. Prints the peak RSS
   of the process against the budget, the time per snapshot (all layers) and the time of
   ``compute`` per layer, and per layer the sketch's facts (l, Delta, error bound, resolved rank,
   T_spec, H*). Then the same sizes in exact mode: :func:`podmonitor.estimate_memory` says what
   exact POD would need, and an exact accumulator fed the same stream is refused with
   :class:`podmonitor.MemoryBudgetError` (its message is printed) instead of running out of memory.
2. ``--check``: exact and sketch accumulators side by side on the same N = 1000, L = 512 stream
   (sketch rank 120, a quarter of the exact memory): top-30 eigenvalues, T_spec and H*(0.10).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import numpy as np
import torch

from podmonitor import MemoryBudgetError, PODAccumulator, PODConfig, estimate_memory

GIB = 2**30


def peak_rss_gib() -> float:
    """Peak resident set size of this process (Linux ru_maxrss is in KiB)."""
    scale = 1.0 if sys.platform == "darwin" else 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / GIB


class PowerLawStream:
    """Causal fields ``A_s = base + sum_k c_{s,k} psi_k`` with ``Var c_k ~ k^-beta`` (power-law spectrum).

    The modes psi_k are orthonormal random patterns on the lags below ``n_lags``; the base is the
    uniform causal attention. Batches are generated on demand, so N is not limited by memory.
    """

    def __init__(self, seq_len: int, n_modes: int = 300, beta: float = 2.0, n_lags: int = 48,
                 amplitude: float = 0.05, seed: int = 0, dtype: torch.dtype = torch.float64) -> None:
        self.g = torch.Generator().manual_seed(seed)
        i = torch.arange(seq_len).unsqueeze(1)
        j = torch.arange(seq_len).unsqueeze(0)
        self.support = ((i - j) >= 0) & ((i - j) < n_lags)  # (L, L)
        n_entries = int(self.support.sum())
        psi, _ = torch.linalg.qr(torch.randn(n_entries, n_modes, generator=self.g, dtype=torch.float64))
        self.psi_t = psi.T.to(dtype).contiguous()  # (K, P_s)
        self.sd = (torch.arange(1, n_modes + 1, dtype=torch.float64) ** (-beta / 2) * amplitude).to(dtype)
        self.base = ((1.0 / torch.arange(1, seq_len + 1, dtype=dtype)).unsqueeze(1) * (i >= j)).to(dtype)
        self.dtype = dtype

    def batch(self, b: int) -> torch.Tensor:
        """(b, L, L) fields."""
        c = torch.randn(b, self.sd.numel(), generator=self.g, dtype=torch.float64).to(self.dtype) * self.sd
        x = self.base.expand(b, *self.base.shape).clone()
        x[:, self.support] += c @ self.psi_t
        return x


def fmt_eps(d: dict, bounds: dict | None = None) -> str:
    out = []
    for e, v in d.items():
        s = f"H*({e:g})=" + ("more than R" if v is None else str(v))
        if bounds is not None:
            lo, hi = bounds[e]
            s += f" [{lo}, {'?' if hi is None else hi}]"
        out.append(s)
    return ", ".join(out)


def stream(args: argparse.Namespace) -> None:
    layers, n, seq_len, b = args.layers, args.n, args.seq_len, args.batch
    per_layer = int((args.budget_gb - args.overhead_gb) * GIB / layers)
    dt = getattr(torch, args.dtype)
    sdt = getattr(torch, args.storage)
    base = dict(n_dominant=2, coherency=False, keep_mode_fields=False, dtype=dt, storage_dtype=sdt)
    cfg = PODConfig(mode=args.mode, memory_budget_bytes=per_layer, sketch_rank=args.rank, **base)
    exact_cfg = PODConfig(mode="exact", memory_budget_bytes=per_layer, **base)
    ex = estimate_memory(seq_len, n, exact_cfg)
    sk = estimate_memory(seq_len, n, cfg)
    print(f"L = {seq_len}, N = {n}, {layers} layers, budget {args.budget_gb:g} GiB for the process "
          f"({args.overhead_gb:g} GiB kept for the interpreter and one batch): {per_layer / 2**20:.0f} MiB per layer; "
          f"dtype {args.dtype}, storage {args.storage}, torch threads {torch.get_num_threads()}")
    print(f"exact mode would need per layer: state {ex['state'] / GIB:.2f} GiB + compute "
          f"{ex['compute_extra'] / GIB:.2f} GiB = {ex['total'] / GIB:.2f} GiB "
          f"({layers * ex['total'] / GIB:.2f} GiB for {layers} layers)")
    print(f"{args.mode} mode per layer: state {sk['state'] / 2**20:.0f} MiB + compute "
          f"{sk['compute_extra'] / 2**20:.0f} MiB, sketch rank l = {sk['sketch_rank']}")
    accs = [PODAccumulator(cfg) for _ in range(layers)]
    st = PowerLawStream(seq_len, n_modes=200, beta=args.beta, seed=0, dtype=dt)  # one set of modes, fresh draws
    t_update = 0.0
    t0 = time.perf_counter()
    for start in range(0, n, b):
        bb = min(b, n - start)
        for acc in accs:
            x = st.batch(bb)
            t = time.perf_counter()
            acc.update(x)
            t_update += time.perf_counter() - t
            del x
        if args.progress and (start // b) % max(1, n // b // 10) == 0:
            print(f"  {start + bb}/{n} snapshots, {time.perf_counter() - t0:.0f} s, peak RSS {peak_rss_gib():.2f} GiB",
                  flush=True)
    print(f"streamed {n} snapshots x {layers} layers in {time.perf_counter() - t0:.1f} s; update time "
          f"{1e3 * t_update / n:.1f} ms per snapshot (all layers), {1e3 * t_update / (n * layers):.1f} ms per "
          f"snapshot and layer")
    for k, acc in enumerate(accs):
        t = time.perf_counter()
        rep = acc.compute()
        dt_c = time.perf_counter() - t
        h = rep.headline
        print(f"layer {k}: mode {rep.mode}, state {acc.nbytes() / 2**20:.0f} MiB (budget {per_layer / 2**20:.0f}), "
              f"compute {dt_c:.2f} s, top a* = {rep.dominant_scales[0] if rep.dominant_scales else 'n/a'}")
        if h is not None:
            print(f"   l = {rep.sketch['rank'] if rep.sketch else '-'}, error bound {h.error_bound:.3g} "
                  f"({h.error_bound / float(h.eigenvalues[0]):.2g} of lambda_1), resolved rank R = {h.resolved_rank}, "
                  f"T_spec = {h.t_spec:.4g} on {h.n_fit} points, {fmt_eps(h.effective_rank, h.effective_rank_bounds)}")
        del rep
    peak = peak_rss_gib()
    print(f"peak RSS of the process: {peak:.2f} GiB (budget {args.budget_gb:g} GiB): "
          f"{'within' if peak <= args.budget_gb else 'OVER'} budget")
    del accs
    # the same sizes in exact mode: refused with a clear message, not an out-of-memory crash
    acc = PODAccumulator(exact_cfg)
    try:
        for _ in range(0, n, b):
            acc.update(st.batch(b))
        print("exact mode: not refused (the budget holds the exact state)")
    except MemoryBudgetError as err:
        print(f"exact mode refused after {acc.n} snapshots: MemoryBudgetError: {err}")


def check(args: argparse.Namespace) -> None:
    n, seq_len, rank = 1000, 512, args.rank or 120
    base = dict(n_dominant=2, coherency=False, keep_mode_fields=False)
    exact = PODAccumulator(PODConfig(mode="exact", **base))
    sketch = PODAccumulator(PODConfig(mode="sketch", sketch_rank=rank, **base))
    st = PowerLawStream(seq_len, beta=args.beta, n_modes=600, seed=0)
    t_e = t_s = 0.0
    for _ in range(0, n, 50):
        x = st.batch(50)
        t = time.perf_counter()
        exact.update(x)
        t_e += time.perf_counter() - t
        t = time.perf_counter()
        sketch.update(x)
        t_s += time.perf_counter() - t
    t = time.perf_counter()
    re = exact.compute()
    c_e = time.perf_counter() - t
    t = time.perf_counter()
    rs = sketch.compute()
    c_s = time.perf_counter() - t
    print(f"N = {n}, L = {seq_len}, power-law spectrum beta = {args.beta}, sketch rank l = {rank}")
    print(f"state: exact {exact.nbytes() / 2**20:.0f} MiB, sketch {sketch.nbytes() / 2**20:.0f} MiB "
          f"(ratio {sketch.nbytes() / exact.nbytes():.3f})")
    print(f"update: exact {1e3 * t_e / n:.1f} ms/snapshot, sketch {1e3 * t_s / n:.1f} ms/snapshot; "
          f"compute: exact {c_e:.2f} s, sketch {c_s:.2f} s")
    print(f"dominant scales: exact {re.dominant_scales}, sketch {rs.dominant_scales}")
    for a, b in zip(re.per_scale, rs.per_scale, strict=False):
        la, lb = a.eigenvalues.numpy()[:30], b.eigenvalues.numpy()[:30]
        rel = np.abs(lb / la - 1)
        print(f"a* = {a.scale:.3f}: top-30 eigenvalues max relative error {rel.max():.2e} (lower bounds "
              f"{np.abs(b.eigenvalues_lower.numpy()[:30] / la - 1).max():.2e}); error bound {b.error_bound:.3g} = "
              f"{b.error_bound / la[-1]:.2f} lambda_30; resolved rank R = {b.resolved_rank}")
        print(f"   T_spec exact {a.t_spec:.4f} ({a.n_fit} points), sketch {b.t_spec:.4f} ({b.n_fit} resolved points): "
              f"relative difference {abs(b.t_spec / a.t_spec - 1):.2e}")
        print(f"   exact {fmt_eps(a.effective_rank)}; sketch {fmt_eps(b.effective_rank, b.effective_rank_bounds)}")
        ok = rel.max() <= 0.02 and abs(b.t_spec / a.t_spec - 1) <= 0.05 and (
            b.effective_rank[0.1] == a.effective_rank[0.1]
            or (b.beyond_resolved[0.1] and a.effective_rank[0.1] > b.resolved_rank))
        print("   targets (top-30 within 2%, T_spec within 5%, H*(0.10) equal or beyond R): "
              + ("met" if ok else "NOT met"))
    print(f"memory target (sketch <= 1/4 of exact): {'met' if sketch.nbytes() <= exact.nbytes() / 4 else 'NOT met'}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--budget-gb", type=float, default=2.0, help="memory budget of the whole process (GiB)")
    p.add_argument("--overhead-gb", type=float, default=0.8,
                   help="part of the budget kept for the interpreter, torch and one batch of fields")
    p.add_argument("--mode", default="sketch", choices=["auto", "sketch"])
    p.add_argument("--rank", type=int, default=None, help="sketch rank l (default: from the budget)")
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    p.add_argument("--storage", default="float32", choices=["float64", "float32", "bfloat16", "float16"])
    p.add_argument("--beta", type=float, default=2.0, help="power-law exponent of the synthetic spectrum")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--progress", action="store_true")
    p.add_argument("--check", action="store_true", help="sketch vs exact at N = 1000, L = 512")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
          f"CUDA {'yes' if torch.cuda.is_available() else 'no'}")
    (check if args.check else stream)(args)


if __name__ == "__main__":
    main()
