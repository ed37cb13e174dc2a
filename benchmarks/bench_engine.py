"""Side-by-side benchmark: naive numpy reference vs the podmonitor engine.

Usage (from the repository root)::

    python benchmarks/bench_engine.py                      # paper size + large engine run
    python benchmarks/bench_engine.py --n 20 --seq-len 64 --layers 2 --skip-large
    python benchmarks/bench_engine.py --threads 2 --json benchmarks/results/bench.json

What it does:

1. A ``generate`` subprocess builds one synthetic causal attention ensemble per
   layer (default: paper size, N = 150 snapshots, L = 256, 6 layers) and saves
   it as ``.npy`` files in a temporary directory created once.
2. A ``naive`` subprocess runs ``tests/naive_reference.py`` (numpy only) on every layer;
   an ``engine`` subprocess runs ``podmonitor.analyze`` on the same files. Each
   first analyses a small ensemble of another length, untimed (one-time start-up), then
   measures its wall time over all layers and its memory: peak RSS
   (``getrusage(RUSAGE_SELF).ru_maxrss`` at the end) and the increment over the
   RSS measured right after its imports and data load. Each writes its results
   (dominant scales, eigenvalues per dominant scale, T_spec) as JSON.
3. The parent (which loads nothing large itself, so that no child inherits a
   large high-water mark) compares the two and prints the table and the targets:
   speed ratio >= 30, lower memory, eigenvalues within 1e-6 relative.
   Like for like, both sides run with the coherency map and both without it (``--coherency``
   both, the default; or only "with" / "without"), and ``--rounds R`` repeats every side R times,
   alternating (naive with, engine with, naive without, engine without, then again), and reports
   medians: on a shared machine single timings drift.
4. ``--large`` (default on): the engine alone at N = 1000, L = 1024, one layer,
   fed in batches of 50 snapshots through ``PODAccumulator`` (``analyze`` on the
   whole ensemble if there is no accumulator), generated batch by batch.

Both sides get the same thread settings (``--threads``: OMP/MKL/OpenBLAS
environment variables and ``torch.set_num_threads``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

TARGET_SPEEDUP = 30.0
TARGET_EIG_REL = 1e-6
EIG_COMPARE_FLOOR = 1e-10  # compare eigenvalues > this * lambda_1
LARGE_BATCH = 50


# ---------------------------------------------------------------------------
# Memory and timing helpers
# ---------------------------------------------------------------------------


def _kib_to_mib(value: float) -> float:
    """ru_maxrss is in KiB on Linux and bytes on macOS."""
    return value / (1024.0 * 1024.0) if sys.platform == "darwin" else value / 1024.0


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (ru_maxrss), MiB."""
    return _kib_to_mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def current_rss_mib() -> float:
    """Current resident set size (VmRSS from /proc), MiB; falls back to the peak."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return float(line.split()[1]) / 1024.0
    except OSError:
        pass
    return peak_rss_mib()


def set_threads(threads: int | None) -> None:
    """Apply the thread setting inside a child (torch, if it is imported)."""
    if threads is None:
        return
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(threads)


def child_env(threads: int | None) -> dict[str, str]:
    """Environment of a child process: same thread limits for every side."""
    env = dict(os.environ)
    if threads is not None:
        for var in (
            "OMP_NUM_THREADS",
            "MKL_NUM_THREADS",
            "OPENBLAS_NUM_THREADS",
            "NUMEXPR_NUM_THREADS",
            "VECLIB_MAXIMUM_THREADS",
        ):
            env[var] = str(threads)
    paths = [str(REPO), str(HERE)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


# ---------------------------------------------------------------------------
# Synthetic ensemble (fallback when podmonitor.synthetic is absent; always used
# for the large run, because it can generate batch by batch)
# ---------------------------------------------------------------------------


def layer_parameters(layer: int, n_layers: int) -> dict[str, float]:
    """Planted lag structure of one layer: a bump at a lag that grows with depth.

    Layer 0 looks ~2 tokens back, the last layer ~48; the oscillation period
    grows too, so every layer has its own dominant scales.
    """
    depth = layer / max(n_layers - 1, 1)  # 0 .. 1
    mu = 2.0 * 24.0**depth  # 2 .. 48 tokens back
    return {
        "mu": mu,  # bump centre (lag)
        "sigma": 1.0 + 0.4 * mu,  # bump width
        "gain": 4.0,  # bump height in the score
        "period": 6.0 + 4.0 * layer,  # oscillation period in the lag
        "osc_amp": 0.8,  # oscillation amplitude in the score
        "recency": 1.5 * (1.0 - depth),  # early layers favour the previous token
        "key_noise": 0.6,  # per-snapshot key salience (content)
        "pair_noise": 0.15,  # iid score noise per (i, j)
    }


def synthetic_snapshots(
    layer: int, n_layers: int, n: int, seq_len: int, rng: Any, dtype: Any = None
) -> Any:
    """Causal attention snapshots of one layer: softmax over j <= i of a lag score.

    score_s(i, j) = g_s exp(-(tau - mu_s)^2 / (2 sigma^2)) + c_s cos(2 pi tau / P + phi_s)
                    + r exp(-tau / 2) + k_s(j) + e_s(i, j),   tau = i - j >= 0,
    with per-snapshot jitter of the bump gain and position, a random oscillation
    amplitude and phase, random key salience k_s and small iid noise e_s.

    Args:
        layer: layer index (sets the planted structure).
        n_layers: number of layers (depth fraction).
        n: snapshots to generate.
        seq_len: L.
        rng: numpy Generator.
        dtype: numpy float dtype of the computation (float64 default; float32 for
            memory-frugal large runs).

    Returns:
        fields: (n, L, L) array of dtype, rows sum to 1, zero above the diagonal.
    """
    import numpy as np

    dtype = np.float64 if dtype is None else dtype
    p = layer_parameters(layer, n_layers)
    L = seq_len
    tau = (np.arange(L)[:, None] - np.arange(L)[None, :]).astype(dtype)  # (L, L)
    causal = tau >= 0
    gain = (p["gain"] * (1.0 + 0.3 * rng.standard_normal(n))).astype(dtype)  # (n,)
    mu = (p["mu"] * np.exp(0.2 * rng.standard_normal(n))).astype(dtype)  # (n,)
    amp = (p["osc_amp"] * rng.uniform(0.0, 1.0, n)).astype(dtype)  # (n,)
    phase = rng.uniform(0.0, 2.0 * np.pi, n).astype(dtype)  # (n,)
    key = (p["key_noise"] * rng.standard_normal((n, 1, L))).astype(dtype)  # (n, 1, L)

    score = rng.standard_normal((n, L, L), dtype=np.float32).astype(dtype, copy=False)
    score *= p["pair_noise"]
    score += key
    score += (p["recency"] * np.exp(-np.maximum(tau, 0) / 2.0)).astype(dtype)
    for s in range(n):  # per snapshot keeps the temporaries at (L, L)
        bump = np.exp(-((tau - mu[s]) ** 2) / (2.0 * p["sigma"] ** 2))
        score[s] += gain[s] * bump + amp[s] * np.cos(2.0 * np.pi * tau / p["period"] + phase[s])
    score[:, ~causal] = -np.inf
    score -= score.max(axis=-1, keepdims=True)
    np.exp(score, out=score)
    score /= score.sum(axis=-1, keepdims=True)
    return score


def own_layered_ensemble(n_layers: int, n_snapshots: int, seq_len: int, seed: int = 0) -> list[Any]:
    """Fallback of ``podmonitor.synthetic.layered_ensemble``: list of (N, L, L) float64 arrays."""
    import numpy as np

    out = []
    for layer in range(n_layers):
        rng = np.random.default_rng([seed, layer])
        out.append(synthetic_snapshots(layer, n_layers, n_snapshots, seq_len, rng))
    return out


# ---------------------------------------------------------------------------
# Child sides
# ---------------------------------------------------------------------------


def side_generate(args: argparse.Namespace) -> None:
    """Write layer_<l>.npy (N, L, L) float64 and generator.json into args.tmp."""
    import numpy as np

    tmp = Path(args.tmp)
    source = "benchmarks/bench_engine.py (own generator)"
    layers: list[Any]
    try:
        if args.generator == "own":
            raise ImportError("own generator requested")
        from podmonitor.synthetic import layered_ensemble  # type: ignore[import-not-found]

        layers = [
            t.detach().cpu().numpy()
            for t in layered_ensemble(args.layers, args.n, args.seq_len, seed=args.seed)
        ]
        source = "podmonitor.synthetic.layered_ensemble"
    except ImportError:
        layers = own_layered_ensemble(args.layers, args.n, args.seq_len, seed=args.seed)
    for layer, fields in enumerate(layers):
        fields = np.ascontiguousarray(fields, dtype=np.float64)
        assert fields.shape == (args.n, args.seq_len, args.seq_len), fields.shape
        np.save(tmp / f"layer_{layer}.npy", fields)
    (tmp / "generator.json").write_text(json.dumps({"source": source}))


def _load_layers(tmp: Path, n_layers: int) -> list[Any]:
    import numpy as np

    return [np.load(tmp / f"layer_{layer}.npy") for layer in range(n_layers)]


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def side_naive(args: argparse.Namespace) -> None:
    """Run the naive reference on every layer; write results_naive.json."""
    from tests import naive_reference as naive  # (tests/__init__.py imports nothing: numpy only)

    set_threads(args.threads)
    tmp = Path(args.tmp)
    layers = _load_layers(tmp, args.layers)
    t0 = time.perf_counter()
    with_coherency = args.coherency == "with"
    naive.analyze_naive(_warmup_fields(), with_coherency=with_coherency)  # one-time start-up, not timed
    warmup = time.perf_counter() - t0
    rss_base = current_rss_mib()

    results, times = [], []
    t_all = time.perf_counter()
    for fields in layers:
        t0 = time.perf_counter()
        out = naive.analyze_naive(fields, with_coherency=with_coherency)
        times.append(time.perf_counter() - t0)
        results.append(
            {
                "dominant_scales": [float(a) for a in out["dominant_scales"]],
                "per_scale": [
                    {
                        "scale": e["scale"],
                        "eigenvalues": [float(v) for v in e["eigenvalues"]],
                        "t_spec": _finite(e["t_spec"]),
                    }
                    for e in out["per_scale"]
                ],
                "t_spec": _finite(out["per_scale"][0]["t_spec"]) if out["per_scale"] else None,
            }
        )
    wall = time.perf_counter() - t_all
    _write_side(tmp / f"results_naive_{args.coherency}.json", results, times, wall, rss_base, warmup)


def side_engine(args: argparse.Namespace) -> None:
    """Run podmonitor.analyze on every layer; write results_engine.json."""
    import torch

    from podmonitor import PODConfig, analyze

    set_threads(args.threads)
    tmp = Path(args.tmp)
    device = torch.device(args.device)
    # on an accelerator the fields are there already (as in training): the copy is not timed
    layers = [torch.from_numpy(a).to(device) for a in _load_layers(tmp, args.layers)]  # CPU: shares memory
    rss_base = current_rss_mib()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    config = PODConfig(coherency=args.coherency == "with")
    analyze(torch.from_numpy(_warmup_fields()).to(device), config=config)  # start-up, not timed
    sync()
    warmup = time.perf_counter() - t0
    results, times = [], []
    sync()
    t_all = time.perf_counter()
    for fields in layers:
        t0 = time.perf_counter()
        report = analyze(fields, config=config)
        sync()
        times.append(time.perf_counter() - t0)
        results.append(
            {
                "dominant_scales": [float(a) for a in report.dominant_scales],
                "per_scale": [
                    {
                        "scale": float(e.scale),
                        "eigenvalues": [float(v) for v in e.eigenvalues.double().tolist()],
                        "t_spec": _finite(float(getattr(e, "t_spec", math.nan))),
                    }
                    for e in report.per_scale
                ],
                "t_spec": _finite(float(report.t_spec)),
                "status": str(getattr(report, "status", "")),
            }
        )
    wall = time.perf_counter() - t_all
    _write_side(tmp / f"results_engine_{args.coherency}.json", results, times, wall, rss_base, warmup)


def _write_side(
    path: Path, results: list[dict[str, Any]], times: list[float], wall: float, rss_base: float,
    warmup: float,
) -> None:
    peak = peak_rss_mib()
    path.write_text(
        json.dumps(
            {
                "layers": results,
                "layer_times_s": times,
                "wall_s": wall,
                "warmup_s": warmup,
                "rss_base_mib": rss_base,
                "peak_rss_mib": peak,
                "increment_mib": peak - rss_base,
            }
        )
    )


def _warmup_fields() -> Any:
    """A small causal ensemble (8 snapshots, L = 32) that each side analyses once, untimed, before
    the timed run: it pays one-time start-up costs (library initialisation, thread pools, lazy
    kernels) that a monitor called at every validation pays once per process. Its length differs
    from the timed runs', so nothing length-specific is prepared by it."""
    import numpy as np

    return synthetic_snapshots(0, 6, 8, 32, np.random.default_rng(12345))


def side_large(args: argparse.Namespace) -> None:
    """Engine alone at N = large_n, L = large_seq_len, fed in batches; write results_large.json."""
    import numpy as np
    import torch

    import podmonitor
    from podmonitor import PODConfig

    set_threads(args.threads)
    tmp = Path(args.tmp)
    n, L, batch = args.large_n, args.large_seq_len, args.batch
    rss_base = current_rss_mib()
    accumulator_cls = getattr(podmonitor, "PODAccumulator", None)
    mode = "PODAccumulator" if accumulator_cls is not None else "analyze"

    gen_time = 0.0
    t_all = time.perf_counter()
    if accumulator_cls is not None:
        acc = accumulator_cls(PODConfig())
        for b, start in enumerate(range(0, n, batch)):
            t0 = time.perf_counter()
            rng = np.random.default_rng([args.seed, 1000, b])
            chunk = synthetic_snapshots(3, 6, min(batch, n - start), L, rng, dtype=np.float32)
            chunk_t = torch.from_numpy(chunk).to(device=args.device, dtype=torch.float64)
            del chunk
            gen_time += time.perf_counter() - t0
            acc.update(chunk_t)
            del chunk_t
        report = acc.compute()
        if torch.device(args.device).type == "cuda":
            torch.cuda.synchronize()
    else:
        need = n * L * L * 8
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > 0.3 * total:
            raise MemoryError(
                f"no PODAccumulator, and analyze on the whole ensemble needs {need / 2**30:.1f} "
                f"GiB of input alone (machine: {total / 2**30:.1f} GiB): skipped"
            )
        t0 = time.perf_counter()
        fields = torch.empty((n, L, L), dtype=torch.float64)
        for b, start in enumerate(range(0, n, batch)):
            rng = np.random.default_rng([args.seed, 1000, b])
            stop = min(start + batch, n)
            chunk = synthetic_snapshots(3, 6, stop - start, L, rng, dtype=np.float32)
            fields[start:stop] = torch.from_numpy(chunk)
            del chunk
        gen_time += time.perf_counter() - t0
        report = podmonitor.analyze(fields, config=PODConfig())
    total_wall = time.perf_counter() - t_all
    peak = peak_rss_mib()
    (tmp / "results_large.json").write_text(
        json.dumps(
            {
                "mode": mode,
                "n": n,
                "seq_len": L,
                "batch": batch,
                "engine_s": total_wall - gen_time,
                "generation_s": gen_time,
                "rss_base_mib": rss_base,
                "peak_rss_mib": peak,
                "increment_mib": peak - rss_base,
                "batch_input_mib": min(batch, n) * L * L * 8 / 2**20,
                "dominant_scales": [float(a) for a in report.dominant_scales],
                "t_spec": _finite(float(report.t_spec)),
                "status": str(getattr(report, "status", "")),
            }
        )
    )


# ---------------------------------------------------------------------------
# Parent: orchestrate, compare, print
# ---------------------------------------------------------------------------


def run_child(side: str, args: argparse.Namespace, tmp: Path, coherency: str = "with") -> tuple[bool, str]:
    """Re-invoke this script for one side (with or without the coherency map); returns (ok, error text)."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--side",
        side,
        "--tmp",
        str(tmp),
        "--layers",
        str(args.layers),
        "--n",
        str(args.n),
        "--seq-len",
        str(args.seq_len),
        "--seed",
        str(args.seed),
        "--generator",
        args.generator,
        "--large-n",
        str(args.large_n),
        "--large-seq-len",
        str(args.large_seq_len),
        "--batch",
        str(args.batch),
        "--coherency",
        coherency,
    ]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    cmd += ["--device", args.device]
    label = f"{side} side" + ("" if side in ("generate", "large") else f" ({coherency} coherency)")
    print(f"[bench] running {label} ...", flush=True)
    try:
        proc = subprocess.run(
            cmd, env=child_env(args.threads), capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return False, f"timed out after {args.timeout} s"
    if proc.returncode != 0:
        return False, (proc.stderr or proc.stdout).strip()[-3000:]
    return True, ""


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One side's results over alternating rounds: the first round's numbers, with the median wall
    time, the per-layer median times and the largest memory figures."""
    if not runs:
        return None
    import statistics

    out = dict(runs[0])
    out["wall_s"] = statistics.median(r["wall_s"] for r in runs)
    out["layer_times_s"] = [statistics.median(t) for t in zip(*(r["layer_times_s"] for r in runs), strict=True)]
    for key in ("peak_rss_mib", "increment_mib"):
        out[key] = max(r[key] for r in runs)
    out["numbers_identical_across_rounds"] = all(r["layers"] == runs[0]["layers"] for r in runs)
    return out


def _same_scale(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def compare_layer(naive: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
    """Dominant-scale agreement, max relative eigenvalue difference, max |dT_spec| of one layer.

    Eigenvalues are compared at every dominant scale the two sides share,
    over the naive eigenvalues > EIG_COMPARE_FLOOR * lambda_1, relative to each.
    """
    import numpy as np

    dn, de = naive["dominant_scales"], engine["dominant_scales"]
    agree = len(dn) == len(de) and all(_same_scale(a, b) for a, b in zip(dn, de, strict=False))
    max_rel, max_dt, n_shared = 0.0, 0.0, 0
    for entry_n in naive["per_scale"]:
        match = [e for e in engine["per_scale"] if _same_scale(e["scale"], entry_n["scale"])]
        if not match:
            continue
        n_shared += 1
        entry_e = match[0]
        lam_n = np.asarray(entry_n["eigenvalues"])
        lam_e = np.asarray(entry_e["eigenvalues"])
        if len(lam_n) and lam_n[0] > 0:
            keep = lam_n > EIG_COMPARE_FLOOR * lam_n[0]
            k = int(keep.sum())
            if len(lam_e) < k:
                max_rel = math.inf
            else:
                rel = np.abs(lam_e[:k] - lam_n[:k]) / lam_n[:k]
                max_rel = max(max_rel, float(rel.max()))
        tn, te = entry_n["t_spec"], entry_e["t_spec"]
        if tn is None and te is None:
            continue
        dt = math.inf if (tn is None or te is None) else abs(tn - te)
        max_dt = max(max_dt, dt)
    if n_shared == 0:
        max_rel = max_dt = math.nan
    return {"agree": agree, "max_rel": max_rel, "max_dt": max_dt, "n_shared": n_shared}


def _fmt(x: float | None, spec: str = ".3g") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return format(x, spec)


def print_comparison(
    naive: dict[str, Any] | None, engine: dict[str, Any] | None, errors: dict[str, str]
) -> dict[str, Any]:
    """Print the side-by-side table and the targets; returns the summary dict."""
    summary: dict[str, Any] = {"errors": errors}
    for side, res in (("naive", naive), ("engine", engine)):
        if res is None:
            print(f"\n{side} side FAILED:\n{errors.get(side, '')}")
    if naive is None or engine is None:
        return summary

    pairs = zip(naive["layers"], engine["layers"], strict=True)
    rows = [compare_layer(n, e) for n, e in pairs]
    print("\nper layer")
    header = (
        f"{'layer':>5} {'naive s':>9} {'engine s':>9} {'ratio':>7}  {'dominant scales (naive)':<30}"
        f" {'agree':>5} {'max rel eig':>11} {'|dT_spec|':>9} {'T_spec n':>8} {'T_spec e':>8}"
    )
    print(header)
    print("-" * len(header))
    for layer, (row, n, e) in enumerate(zip(rows, naive["layers"], engine["layers"], strict=False)):
        tn, te = naive["layer_times_s"][layer], engine["layer_times_s"][layer]
        scales = ", ".join(f"{a:.3g}" for a in n["dominant_scales"])
        print(
            f"{layer:>5} {tn:>9.3f} {te:>9.3f} {tn / te:>7.1f}  {scales:<30}"
            f" {'yes' if row['agree'] else 'NO':>5} {_fmt(row['max_rel'], '.2e'):>11}"
            f" {_fmt(row['max_dt'], '.2e'):>9} {_fmt(n['t_spec'], '.4f'):>8}"
            f" {_fmt(e['t_spec'], '.4f'):>8}"
        )
        if not row["agree"]:
            print(f"      engine dominant scales: {[round(a, 4) for a in e['dominant_scales']]}")

    speed = naive["wall_s"] / engine["wall_s"]
    mem_peak = engine["peak_rss_mib"] / naive["peak_rss_mib"]
    mem_inc = engine["increment_mib"] / max(naive["increment_mib"], 1e-9)
    all_agree = all(r["agree"] for r in rows)
    max_rel = max(r["max_rel"] for r in rows)
    max_dt = max(r["max_dt"] for r in rows)

    print("\ntotals (all layers; each side first analysed a small untimed warm-up ensemble: "
          f"naive {naive.get('warmup_s', math.nan):.2f} s, engine {engine.get('warmup_s', math.nan):.2f} s)")
    print(f"  {'':28} {'naive':>12} {'engine':>12} {'engine/naive':>13}")
    print(
        f"  {'wall time (s)':28} {naive['wall_s']:>12.3f} {engine['wall_s']:>12.3f}"
        f" {engine['wall_s'] / naive['wall_s']:>13.4f}"
    )
    print(
        f"  {'peak RSS (MiB)':28} {naive['peak_rss_mib']:>12.1f} {engine['peak_rss_mib']:>12.1f}"
        f" {mem_peak:>13.3f}"
    )
    print(
        f"  {'RSS after imports+load (MiB)':28} {naive['rss_base_mib']:>12.1f}"
        f" {engine['rss_base_mib']:>12.1f}"
    )
    print(
        f"  {'peak increment (MiB)':28} {naive['increment_mib']:>12.1f}"
        f" {engine['increment_mib']:>12.1f} {mem_inc:>13.3f}"
    )

    ok_speed = speed >= TARGET_SPEEDUP
    ok_mem = engine["increment_mib"] < naive["increment_mib"]
    ok_eig = max_rel <= TARGET_EIG_REL
    print("\ntargets")
    print(
        f"  speed ratio naive/engine = {speed:.1f}  (target >= {TARGET_SPEEDUP:g}): "
        f"{'PASS' if ok_speed else 'FAIL'}"
    )
    print(
        f"  peak memory increment engine/naive = {mem_inc:.3f}  (target < 1): "
        f"{'PASS' if ok_mem else 'FAIL'}   [absolute peak RSS ratio {mem_peak:.3f}; "
        "the engine side also holds torch]"
    )
    print(
        f"  max relative eigenvalue difference = {_fmt(max_rel, '.2e')}  "
        f"(target <= {TARGET_EIG_REL:g}, eigenvalues > {EIG_COMPARE_FLOOR:g} lambda_1): "
        f"{'PASS' if ok_eig else 'FAIL'}"
    )
    print(f"  dominant scales agree on every layer: {'yes' if all_agree else 'NO'}")
    print(f"  max |T_spec difference| = {_fmt(max_dt, '.2e')}")
    summary.update(
        {
            "naive": {
                k: naive[k]
                for k in (
                    "wall_s",
                    "layer_times_s",
                    "peak_rss_mib",
                    "rss_base_mib",
                    "increment_mib",
                )
            },
            "engine": {
                k: engine[k]
                for k in (
                    "wall_s",
                    "layer_times_s",
                    "peak_rss_mib",
                    "rss_base_mib",
                    "increment_mib",
                )
            },
            "per_layer": rows,
            "speed_ratio": speed,
            "peak_rss_ratio": mem_peak,
            "increment_ratio": mem_inc,
            "dominant_scales_agree": all_agree,
            "max_rel_eig_diff": max_rel,
            "max_abs_t_spec_diff": max_dt,
            "targets_met": {"speed": ok_speed, "memory": ok_mem, "eigenvalues": ok_eig},
        }
    )
    return summary


def print_large(large: dict[str, Any] | None, error: str) -> None:
    print("\nlarge run: engine alone")
    if large is None:
        print(f"  FAILED or skipped:\n{error}")
        return
    print(
        f"  N = {large['n']}, L = {large['seq_len']}, 1 layer, fed via {large['mode']}"
        f" in batches of {large['batch']}"
    )
    print(
        f"  engine time      {large['engine_s']:.2f} s  (+ {large['generation_s']:.2f} s "
        "generating the snapshots, not counted)"
    )
    print(
        f"  peak RSS         {large['peak_rss_mib']:.1f} MiB  (after imports "
        f"{large['rss_base_mib']:.1f} MiB; increment {large['increment_mib']:.1f} MiB, of "
        f"which ~{large['batch_input_mib']:.0f} MiB is one float64 input batch)"
    )
    scales = [round(a, 3) for a in large["dominant_scales"]]
    print(
        f"  status {large['status']!r}, dominant scales {scales}, "
        f"T_spec {_fmt(large['t_spec'], '.4f')}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=6, help="layers (default 6)")
    ap.add_argument("--n", type=int, default=150, help="snapshots per layer (default 150)")
    ap.add_argument("--seq-len", type=int, default=256, help="sequence length L (default 256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--generator",
        choices=["auto", "own"],
        default="auto",
        help="auto: podmonitor.synthetic.layered_ensemble if importable, else this script's own",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for both sides (OMP/MKL/OpenBLAS env and torch)",
    )
    ap.add_argument(
        "--large",
        dest="large",
        action="store_true",
        default=True,
        help="run the large engine-only section (default)",
    )
    ap.add_argument(
        "--skip-large",
        dest="large",
        action="store_false",
        help="skip the large engine-only section",
    )
    ap.add_argument("--device", default="cpu",
                    help="device of the engine side, e.g. cuda (the naive side is numpy, on the CPU)")
    ap.add_argument("--large-n", type=int, default=1000)
    ap.add_argument("--large-seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=LARGE_BATCH, help="snapshots per update (large)")
    ap.add_argument("--coherency", choices=["with", "without", "both"], default="both",
                    help="compare both sides with the coherency map, without it, or both ways (default)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every side this many times, alternating, and report medians (default 1)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per side")
    ap.add_argument("--json", type=Path, default=None, help="also write the summary here")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temporary directory")
    ap.add_argument(
        "--side",
        choices=["generate", "naive", "engine", "large"],
        default=None,
        help=argparse.SUPPRESS,
    )
    ap.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side is not None:  # child process
        sys.path[:0] = [str(REPO), str(HERE)]
        sides = {
            "generate": side_generate,
            "naive": side_naive,
            "engine": side_engine,
            "large": side_large,
        }
        try:
            sides[args.side](args)
        except Exception:
            traceback.print_exc()
            return 1
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="podmonitor-bench-"))
    print(
        f"[bench] N = {args.n}, L = {args.seq_len}, {args.layers} layers, threads = "
        f"{args.threads if args.threads is not None else 'default'}; engine on {args.device}; tmp = {tmp}"
    )
    errors: dict[str, str] = {}
    try:
        ok, err = run_child("generate", args, tmp)
        if not ok:
            print(f"[bench] generating the ensemble failed:\n{err}")
            return 1
        source = json.loads((tmp / "generator.json").read_text())["source"]
        print(f"[bench] ensemble from {source}")
        modes = ["with", "without"] if args.coherency == "both" else [args.coherency]
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for _ in range(max(1, args.rounds)):  # alternate sides and modes, so that drift hits all alike
            for mode in modes:
                for side in ("naive", "engine"):
                    ok, err = run_child(side, args, tmp, mode)
                    if ok:
                        runs.setdefault((side, mode), []).append(
                            json.loads((tmp / f"results_{side}_{mode}.json").read_text()))
                    else:
                        errors[f"{side} ({mode} coherency)"] = err
        summary: dict[str, Any] = {}
        ratios: dict[str, list[float]] = {}
        for mode in modes:
            print(f"\n=== both sides {mode} the coherency map"
                  + (f" (medians of {args.rounds} alternating rounds)" if args.rounds > 1 else "") + " ===")
            naive_runs, engine_runs = runs.get(("naive", mode), []), runs.get(("engine", mode), [])
            results = {"naive": median_run(naive_runs), "engine": median_run(engine_runs)}
            results = {k: v for k, v in results.items() if v is not None}
            part = print_comparison(results.get("naive"), results.get("engine"),
                                    {k: v for k, v in errors.items() if mode in k})
            ratios[mode] = [n["wall_s"] / e["wall_s"] for n, e in zip(naive_runs, engine_runs, strict=False)]
            if len(ratios[mode]) > 1:
                print(f"  speed ratio of each round: {', '.join(f'{r:.1f}' for r in ratios[mode])}")
            summary[f"{mode}_coherency"] = part
            if mode == modes[0]:
                summary.update(part)  # the first mode also at the top level, as before
        if len(modes) == 2 and all(ratios.get(m) for m in modes):
            print("\nlike for like, speed ratio naive/engine (median wall times): "
                  + "; ".join(f"{m} coherency {summary[f'{m}_coherency']['speed_ratio']:.1f}" for m in modes)
                  + f"  (target >= {TARGET_SPEEDUP:g})")
        summary["errors"] = errors
        summary["config"] = {
            "n": args.n,
            "seq_len": args.seq_len,
            "layers": args.layers,
            "threads": args.threads,
            "generator": source,
            "coherency": modes,
            "rounds": args.rounds,
        }
        if args.large:
            ok, err = run_child("large", args, tmp)
            large = json.loads((tmp / "results_large.json").read_text()) if ok else None
            print_large(large, err)
            summary["large"] = large
            if not ok:
                errors["large"] = err
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(summary, indent=2, default=str))
            print(f"\n[bench] summary written to {args.json}")
    finally:
        if args.keep_tmp:
            print(f"[bench] kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0 if all(runs.get((side, mode)) for side in ("naive", "engine") for mode in modes) else 1


if __name__ == "__main__":
    sys.exit(main())
