"""Where the engine's time goes at the paper's size, and how fast this machine multiplies matrices.

Usage::

    python benchmarks/bench_engine_parts.py --threads 2
    python benchmarks/bench_engine_parts.py --threads 2 --coherency-memory
    # an older engine, side by side: check the commit out elsewhere, then point --root at it
    git worktree add /tmp/podmonitor-old 2a9b44d
    python benchmarks/bench_engine_parts.py --threads 2 --root /tmp/podmonitor-old

It prints:

1. the float64 matrix-product rate of this machine (one thread and ``--threads``): the ceiling
   of the engine's two heaviest parts, the lag moments and the cross-coherency transform;
2. the floating-point work of the cross-coherency transform at this size (N L rows, each
   against the (L, 2L) real and imaginary transform of its causal keys, in row blocks of L / 8);
3. per layer, the time of ``update`` and of ``compute`` with the default configuration, and of
   ``compute`` without the coherency map (best of ``--repeats``); the difference is the
   coherency's share;
4. the time of ``analyze`` on all layers, best of ``--repeats`` runs in one process (warm), and the
   time of ``update`` at L = 1024, N = 150 (three batches of 50, one layer; float64 fields, and float32
   fields as a capture hands them over; ``--skip-long`` to skip), and of one POD at lag scale 64 of
   those float32 snapshots (``compute`` does one per dominant scale);
   ``--compare OLD_ROOT --rounds R`` instead times both in fresh processes for OLD_ROOT and this
   tree, alternating R times, and prints the medians;
5. with ``--digest``: the numbers, for comparing two engines (``--root``) digit for digit: per
   layer the dominant scales, T_spec (all digits) and SHA-256 digests of the eigenvalues, scalogram
   and coherency bytes, under the default configuration and several others (no coherency, batched
   updates, a checkpoint round trip, a merge, sketch and auto modes under a budget, the band
   window, float32, bidirectional fields); and at L = 1024 the digest of the lag moments of an update;
6. with ``--coherency-memory``: the peak-RSS growth of computing the coherency map at
   L = 256 to 2048, three fresh processes each, in units of L^2 values (``estimate_memory`` counts
   10 L^2 values plus 12 MiB; the growth varies with the allocator's reuse of freed memory).

The ensemble is ``podmonitor.synthetic.layered_ensemble`` (the one ``bench_engine.py`` uses).
Timings on shared machines drift; compare numbers from one run.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def matmul_rate(threads: int) -> float:
    """GFlop/s of a (2048, 512) x (512, 2048) float64 product, best of 5."""
    import torch

    torch.set_num_threads(threads)
    a = torch.rand(2048, 512, dtype=torch.float64)
    b = torch.rand(512, 2048, dtype=torch.float64)
    a @ b
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048 * 512 * 2048 / best / 1e9


def coherency_gflop(n: int, seq_len: int) -> float:
    """Multiply-adds x 2 of the causal coherency transform: rows of block [start, stop) use stop keys."""
    block = max(1, math.ceil(seq_len / 8))
    work = 0
    for start in range(0, seq_len, block):
        stop = min(seq_len, start + block)
        work += (stop - start) * stop * 2 * seq_len * 2
    return n * work / 1e9


def best_of(repeats: int, fn) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM: unlike ru_maxrss it is not inherited across exec)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def coherency_memory(seq_len: int) -> None:
    """Child: peak-RSS growth of one coherency map at length L, printed in units of L^2 float64."""
    import torch

    from podmonitor import PODAccumulator, PODConfig

    torch.set_num_threads(2)
    acc = PODAccumulator(PODConfig(coherency=False))
    logits = torch.randn(4, seq_len, seq_len, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    acc.update(torch.softmax(logits.masked_fill(~causal, -torch.inf), dim=-1))  # 4 causal fields
    del logits
    before = peak_rss_mib()
    acc.store.coherency(8.0, causal=True).compute()  # the map the report would carry, at a fixed scale
    grown = peak_rss_mib() - before
    unit = seq_len * seq_len * 8 / 2**20
    print(f"  L = {seq_len:5d}: peak RSS grew {grown:7.1f} MiB = {grown / unit:4.1f} L^2 values")


def _sha(t) -> str:
    import hashlib

    import torch

    if t is None:
        return "none"
    return hashlib.sha256(t.detach().to(torch.float64).contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def digest(layers, seq_len: int) -> None:
    """Print the numbers of several configurations, for a digit-for-digit comparison of two engines."""
    import torch

    from podmonitor import PODAccumulator, PODConfig, analyze
    from podmonitor.synthetic import layered_ensemble

    def line(label: str, report) -> None:
        eig = torch.cat([sc.eigenvalues.double() for sc in report.per_scale]) if report.per_scale else None
        print(f"  {label:<22} {report.status:<15} scales {[round(a, 4) for a in report.dominant_scales]} "
              f"T_spec {report.t_spec!r} lam1 {float(eig[0]) if eig is not None else None!r} eig {_sha(eig)} "
              f"scalogram {_sha(report.scalogram)} coherency {_sha(report.coherency)} "
              f"entropy {_sha(report.entropy_profile)} distance {report.mean_attention_distance!r}")

    print("\ndigest (identical lines = identical numbers)")
    for k, fields in enumerate(layers):
        line(f"layer {k} default", analyze(fields))
    f0 = layers[0]
    n = f0.shape[0]
    line("layer 0 no coherency", analyze(f0, PODConfig(coherency=False)))
    acc = PODAccumulator(PODConfig())
    for lo in range(0, n, 25):
        acc.update(f0[lo:lo + 25])
    line("layer 0 batches of 25", acc.compute())
    restored = PODAccumulator(PODConfig())
    restored.load_state_dict(acc.state_dict())
    line("layer 0 checkpoint", restored.compute())
    a, b = PODAccumulator(PODConfig()), PODAccumulator(PODConfig())
    a.update(f0[: n // 2])
    b.update(f0[n // 2:])
    line("layer 0 merge", a.merge(b).compute())
    line("layer 0 sketch l=24", analyze(f0, PODConfig(mode="sketch", sketch_rank=24, coherency_scale=4.0)))
    budget = int(0.6 * n * seq_len * (seq_len + 1) / 2 * 8) + 4 * seq_len * seq_len * 8
    auto = PODAccumulator(PODConfig(memory_budget_bytes=budget, coherency=False, k_fit=8))
    for lo in range(0, n, 25):
        auto.update(f0[lo:lo + 25])
    line(f"layer 0 auto ({auto.mode})", auto.compute())
    line("layer 0 band window", analyze(f0, PODConfig(window="band", coherency=False)))
    line("layer 0 float32", analyze(f0, PODConfig(dtype=torch.float32)))
    bidir = f0 + f0.transpose(1, 2)
    bidir = bidir / bidir.sum(-1, keepdim=True)  # rows sum to 1 over all keys
    line("layer 0 bidirectional", analyze(bidir, PODConfig(causal=False)))
    big = layered_ensemble(1, 8, 1024, seed=1)[0].to(torch.float64)
    acc = PODAccumulator(PODConfig(coherency=False))
    acc.update(big)
    print(f"  {'L = 1024 update':<22} lag moment {_sha(acc.m2_back)} mean field {_sha(acc.mean_field)} "
          f"entropy {_sha(acc.entropy_sum)}")


def long_update_seconds(seq_len: int = 1024, n: int = 150, batch: int = 50, dtype: str = "float64") -> float:
    """Seconds of ``PODAccumulator.update`` for N snapshots of length L, fed in batches (one layer,
    default configuration) in ``dtype`` ("float32": what a capture hands over); the batches are
    generated first, the first call at this length is not timed."""
    import torch

    from podmonitor import PODAccumulator, PODConfig
    from podmonitor.synthetic import layered_ensemble

    batches = [layered_ensemble(1, min(batch, n - lo), seq_len, seed=lo)[0].to(getattr(torch, dtype))
               for lo in range(0, n, batch)]
    acc = PODAccumulator(PODConfig())
    acc.update(batches[0][:2])  # start-up at this length, not timed
    acc.reset()
    t0 = time.perf_counter()
    for b in batches:
        acc.update(b)
    elapsed = time.perf_counter() - t0
    return elapsed


def long_pod_seconds(scale: float = 64.0, seq_len: int = 1024, n: int = 150, batch: int = 50) -> float:
    """Seconds of one POD at lag scale ``scale`` (``analysis.analyse_at_scale``, best of 2) of N
    float32 snapshots of length L: what ``compute`` spends per dominant scale (and per reference
    scale), most at coarse scales, whose lag window holds the most entries."""
    import torch

    from podmonitor import PODAccumulator, PODConfig
    from podmonitor.engine.analysis import analyse_at_scale
    from podmonitor.synthetic import layered_ensemble

    acc = PODAccumulator(PODConfig(coherency=False))
    for lo in range(0, n, batch):
        acc.update(layered_ensemble(1, min(batch, n - lo), seq_len, seed=lo)[0].to(torch.float32))
    return best_of(2, lambda: analyse_at_scale(acc, scale))


def timing_child(args) -> dict:
    """Child of --compare: analyze on all layers (best of --repeats) and the long update, as JSON."""
    import numpy as np
    import torch

    from podmonitor import analyze
    from podmonitor.synthetic import layered_ensemble

    torch.set_num_threads(args.threads)
    layers = [torch.from_numpy(np.ascontiguousarray(t.numpy(), dtype=np.float64))
              for t in layered_ensemble(args.layers, args.n, args.seq_len, seed=0)]
    analyze(layers[0][:8, :32, :32].contiguous())  # start-up
    total = best_of(args.repeats, lambda: [analyze(f) for f in layers])
    return {"analyze_all_s": total, "long_update_s": long_update_seconds(),
            "long_update_f32_s": long_update_seconds(dtype="float32"), "long_pod_s": long_pod_seconds()}


def compare(args) -> None:
    """Time ``args.compare`` and this tree in fresh processes, alternating, and print the medians."""
    import json
    import statistics

    roots = [args.compare.resolve(), REPO]
    runs: dict[Path, list[dict]] = {r: [] for r in roots}
    for k in range(args.rounds):
        for root in roots:
            out = subprocess.run([sys.executable, __file__, "--root", str(root), "--timing-json",
                                  "--threads", str(args.threads), "--layers", str(args.layers), "--n", str(args.n),
                                  "--seq-len", str(args.seq_len), "--repeats", str(args.repeats)],
                                 check=True, capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": str(root)})
            runs[root].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  round {k + 1}, {root}: {runs[root][-1]}", flush=True)
    print(f"\nmedians of {args.rounds} alternating rounds (fresh process each), {args.threads} threads")
    keys = ("analyze_all_s", "long_update_s", "long_update_f32_s", "long_pod_s")
    print(f"{'tree':<40} {'analyze, all layers (s)':>24} {'update L=1024 N=150 (s)':>24} "
          f"{'same, float32 fields (s)':>24} {'POD at a = 64, L = 1024 (s)':>24}")
    med = {}
    for root in roots:
        med[root] = {k: statistics.median(r[k] for r in runs[root]) for k in keys}
        print(f"{str(root):<40} " + " ".join(f"{med[root][k]:>24.3f}" for k in keys))
    old, new = med[roots[0]], med[roots[1]]
    print(f"{'old / new':<40} " + " ".join(f"{old[k] / new[k]:>24.2f}" for k in keys))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--n", type=int, default=150)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--root", type=Path, default=REPO, help="the podmonitor tree to time (default: this one)")
    ap.add_argument("--coherency-memory", action="store_true")
    ap.add_argument("--digest", action="store_true", help="print the numbers of several configurations")
    ap.add_argument("--digest-only", action="store_true", help="only the digest (no timings)")
    ap.add_argument("--skip-long", action="store_true", help="skip the update at L = 1024")
    ap.add_argument("--compare", type=Path, default=None, metavar="OLD_ROOT",
                    help="time OLD_ROOT and this tree alternately in fresh processes, print medians")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of --compare")
    ap.add_argument("--timing-json", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-memory", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(args.root.resolve()))

    if args.child_memory is not None:
        coherency_memory(args.child_memory)
        return 0
    if args.timing_json:
        import json

        print(json.dumps(timing_child(args)))
        return 0
    if args.compare is not None:
        compare(args)
        return 0

    import numpy as np
    import torch

    import podmonitor
    from podmonitor import PODAccumulator, PODConfig, analyze
    from podmonitor.synthetic import layered_ensemble

    print(f"podmonitor from {Path(podmonitor.__file__).parent}")
    if args.digest_only:
        torch.set_num_threads(args.threads)
        digest([torch.from_numpy(np.ascontiguousarray(t.numpy(), dtype=np.float64))
                for t in layered_ensemble(args.layers, args.n, args.seq_len, seed=0)], args.seq_len)
        return 0
    print(f"float64 matrix product: {matmul_rate(1):.1f} GFlop/s on 1 thread, "
          f"{matmul_rate(args.threads):.1f} GFlop/s on {args.threads}")
    torch.set_num_threads(args.threads)
    gflop = coherency_gflop(args.n, args.seq_len)
    print(f"cross-coherency transform at N = {args.n}, L = {args.seq_len}: {gflop:.2f} GFlop per layer")

    layers = [torch.from_numpy(np.ascontiguousarray(t.numpy(), dtype=np.float64))
              for t in layered_ensemble(args.layers, args.n, args.seq_len, seed=0)]
    analyze(layers[0][:8, :32, :32].contiguous())  # start-up
    print(f"\nper layer, best of {args.repeats} (s)")
    print(f"{'layer':>5} {'update':>8} {'compute':>8} {'compute w/o coherency':>22} {'coherency':>10}")
    for k, fields in enumerate(layers):
        timing = {}
        for label, config in (("full", PODConfig()), ("plain", PODConfig(coherency=False))):
            acc = PODAccumulator(config)

            def feed(acc=acc, fields=fields):
                acc.reset()
                acc.update(fields)

            timing[f"{label}_update"] = best_of(args.repeats, feed)
            timing[f"{label}_compute"] = best_of(args.repeats, acc.compute)
        print(f"{k:>5} {timing['full_update']:>8.3f} {timing['full_compute']:>8.3f} "
              f"{timing['plain_compute']:>22.3f} {timing['full_compute'] - timing['plain_compute']:>10.3f}")

    total = best_of(args.repeats, lambda: [analyze(f) for f in layers])
    print(f"\nanalyze on all {args.layers} layers, best of {args.repeats} in one process: {total:.3f} s")
    if not args.skip_long:
        print(f"update at L = 1024, N = 150 (three batches of 50, one layer): {long_update_seconds():.3f} s "
              f"(float64 fields), {long_update_seconds(dtype='float32'):.3f} s (float32 fields, as captured)")
        print(f"one POD at lag scale 64 of those float32 snapshots (analyse_at_scale, best of 2): "
              f"{long_pod_seconds():.3f} s")

    if args.digest:
        digest(layers, args.seq_len)

    if args.coherency_memory:
        print("\ncoherency map, peak-RSS growth (three fresh processes each):")
        for seq_len in (256, 512, 1024, 2048):
            for _ in range(3):
                subprocess.run([sys.executable, __file__, "--root", str(args.root), "--child-memory", str(seq_len)],
                               check=True, env={**os.environ, "PYTHONPATH": str(args.root.resolve())})
    return 0


if __name__ == "__main__":
    sys.exit(main())
