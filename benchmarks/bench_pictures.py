"""What one picture run costs, picture by picture: the largest part of the monitor's overhead.

Usage (from the repository root)::

    python benchmarks/bench_pictures.py                       # 4 layers, N = 150, L = 128 (the tiny GPT's shape)
    python benchmarks/bench_pictures.py --layers 12 --seq-len 256
    python benchmarks/bench_pictures.py --compare OLD_ROOT --rounds 5   # another tree, alternating

It analyses a synthetic ensemble per layer (``podmonitor.synthetic.layered_ensemble``, the one the
engine benchmarks use) with the default ``PODConfig`` (the coherency map included, as on a
picture run), then draws every picture of one monitored run the way the publisher does
(:func:`podmonitor.reporting.figures.draw_run_pictures`, with a three-step trend) and encodes each
as a PNG the way TensorBoard's image summary does (PIL, default compression). It prints, per kind
of picture, the median milliseconds of building the figure and drawing it to pixels, and of the
PNG encoding, and the whole run (median of ``--repeats``, after one untimed warm-up run that pays
for matplotlib's imports and font cache). The sum is what the background worker spends on the
pictures of one run (``PODMonitor.background_timings``; ``bench_overhead.py`` reports it for a
whole fit). Last, the same run is drawn by a fresh picture process (as the first picture run of a
fit is), and the child's CPU seconds to the end of that run (its start included), the part of them
spent drawing, and its resident memory are printed.

With ``--compare OLD_ROOT`` the whole picture run is timed for OLD_ROOT (a checkout or worktree
of another commit) and for this tree in fresh processes, alternating, ``--rounds`` times, and the
medians and their ratio are printed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def picture_run(args: argparse.Namespace) -> dict[str, object]:
    """Time one picture run of this process's podmonitor; returns the timings as a dict."""
    import numpy as np
    import torch
    from PIL import Image

    from podmonitor import PODConfig, analyze
    from podmonitor.reporting.figures import draw_run_pictures
    from podmonitor.reporting.metrics import registry
    from podmonitor.synthetic import layered_ensemble

    torch.set_num_threads(args.threads)
    names = [f"layer_{i:02d}" for i in range(args.layers)]
    reports = {n: analyze(f, PODConfig()) for n, f in zip(names, layered_ensemble(args.layers, args.n, args.seq_len),
                                                           strict=True)}
    steps = [250, 500, 750]
    rng = np.random.default_rng(0)
    trend = {m.key: (m.title, {n: list(rng.random(len(steps))) for n in names})
             for m in registry() if m.group == "headline"}
    units = {m.key: m.unit for m in registry()}

    def png(arr: np.ndarray) -> int:
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="PNG")
        return buf.tell()

    def kind(tag: str) -> str:
        parts = tag.split("/")
        return parts[1] if len(parts) > 1 else tag

    draw_run_pictures("pod", reports, names, trend, steps, units)  # warm-up: imports, fonts
    totals, draw_ms, png_ms, counts = [], {}, {}, {}
    for _ in range(args.repeats):
        start = time.perf_counter()
        pictures = draw_run_pictures("pod", reports, names, trend, steps, units)
        drawn = time.perf_counter() - start
        for tag, arr in pictures.items():
            t0 = time.perf_counter()
            png(arr)
            png_ms.setdefault(kind(tag), []).append(1e3 * (time.perf_counter() - t0))
        totals.append(time.perf_counter() - start)
        draw_ms.setdefault("(all)", []).append(1e3 * drawn)
        for tag in pictures:
            counts[kind(tag)] = counts.get(kind(tag), 0) + 1
    # per kind: each kind drawn alone, per picture (the run above times them all together)
    from podmonitor.reporting.figures import PICTURES

    for name in PICTURES:
        samples = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = draw_run_pictures("pod", reports, names, trend, steps, units, which=[name])
            if out:
                samples.append(1e3 * (time.perf_counter() - t0) / len(out))
        if samples:
            draw_ms[name] = samples
    import podmonitor

    return {"podmonitor": str(Path(podmonitor.__file__).parent.parent), "total_s": statistics.median(totals),
            "draw_ms": {k: statistics.median(v) for k, v in draw_ms.items()},
            "png_ms": {k: statistics.median(v) for k, v in png_ms.items()},
            "per_run": {k: v // args.repeats for k, v in counts.items()},
            **picture_process_start(reports, names, trend, steps, units)}


def picture_process_start(reports: dict, names: list[str], trend: dict, steps: list[int],
                          units: dict[str, str]) -> dict[str, float]:
    """The same run drawn by a fresh picture process (``PictureProcess``, at niceness 0 here so
    that the timing does not depend on the priority): the child's CPU seconds up to the end of
    its first request, its start included (read from /proc), of which the drawing, and its
    resident memory after it (MiB). NaN where /proc cannot be read."""
    from podmonitor.reporting.render_process import PictureProcess

    painter = PictureProcess(niceness=0)
    timings: dict[str, float] = {}
    try:
        painter.draw_run_pictures("pod", reports, names, trend, steps, units, timings=timings)
        pid = painter.status()["pid"]
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # from field 3 on
            cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
            rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("VmRSS:")) / 1024
        except (OSError, ValueError, StopIteration):
            cpu = rss = float("nan")
    finally:
        painter.close()
    return {"child_first_cpu_s": cpu, "child_draw_cpu_s": timings.get("cpu_s", float("nan")), "child_rss_mib": rss}


def compare(args: argparse.Namespace) -> None:
    roots = {"old": args.compare.resolve(), "new": HERE}
    totals: dict[str, list[float]] = {"old": [], "new": []}
    starts: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for side in (["old", "new"] if r % 2 == 0 else ["new", "old"]):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--repeats", str(args.repeats),
                   "--layers", str(args.layers), "--n", str(args.n), "--seq-len", str(args.seq_len),
                   "--threads", str(args.threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=roots[side],
                                 env={**os.environ, "PYTHONPATH": str(roots[side])}).stdout
            res = json.loads(out.strip().splitlines()[-1])
            totals[side].append(res["total_s"])
            starts[side].append(res["child_first_cpu_s"])
            print(f"[{side}] picture run {totals[side][-1]:.3f} s; {child_line(res)} "
                  f"(podmonitor from {res['podmonitor']})", flush=True)
    old, new = statistics.median(totals["old"]), statistics.median(totals["new"])
    print(f"\nmedians of {args.rounds} rounds: {roots['old']} {old:.3f} s, this tree {new:.3f} s, ratio new/old "
          f"{new / old:.3f}")
    old, new = statistics.median(starts["old"]), statistics.median(starts["new"])
    print(f"a fresh picture process's CPU to the end of its first run: {roots['old']} {old:.2f} s, "
          f"this tree {new:.2f} s")


def child_line(res: dict[str, object]) -> str:
    """The picture-process numbers of one result, as one line."""
    return (f"a fresh picture process: {res['child_first_cpu_s']:.2f} s of CPU to the end of its first run, "
            f"{res['child_draw_cpu_s']:.2f} s of it drawing; {res['child_rss_mib']:.0f} MiB resident")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--n", type=int, default=150, help="snapshots per layer")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="picture runs timed (median)")
    ap.add_argument("--compare", type=Path, metavar="OLD_ROOT", help="time OLD_ROOT and this tree alternately")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of --compare")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compare is not None:
        compare(args)
        return
    res = picture_run(args)
    if args.json:
        print(json.dumps(res))
        return
    print(f"one picture run: {args.layers} layers, N = {args.n}, L = {args.seq_len}, {args.threads} threads "
          f"(medians of {args.repeats})")
    print(f"{'picture':<20} {'per run':>8} {'draw ms':>9} {'png ms':>8}")
    for name, count in res["per_run"].items():
        print(f"{name:<20} {count:>8} {res['draw_ms'].get(name, float('nan')):>9.1f} "
              f"{res['png_ms'].get(name, float('nan')):>8.1f}")
    n_pictures = sum(res["per_run"].values())
    print(f"whole run: {n_pictures} pictures drawn in {res['draw_ms']['(all)'] / 1e3:.3f} s, "
          f"{res['total_s']:.3f} s with their PNG encoding")
    print(child_line(res))


if __name__ == "__main__":
    main()
