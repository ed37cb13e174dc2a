"""What one monitored run's JSON-lines record costs: the reports' ``to_dict`` and the strict-JSON line.

Usage (from the repository root)::

    python benchmarks/bench_record.py                          # 12 layers at L = 1024 (GPT-2-small's shape)
    python benchmarks/bench_record.py --layers 4 --seq-len 128 # the tiny GPT's
    python benchmarks/bench_record.py --compare OLD_ROOT --rounds 5   # another tree, alternating

The record is written inside the validation loop (``PODMonitor``'s "logging" time): every layer's
report as a dict (its scalograms, spectra and mode profiles as lists) and one strict-JSON line,
flushed and fsynced, in ``podmonitor.jsonl``. The report is a real analysis of a synthetic causal
ensemble (``podmonitor.synthetic.layered_ensemble``, N = 20 snapshots: the record's size depends on
L and the scale grid, not on N), repeated for every layer. It prints the median seconds of building
the dicts and of writing the line over ``--repeats``, and the line's size; ``--compare`` runs both
trees in fresh processes, alternating, and prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Time this process's podmonitor: median seconds of the dicts and of the line."""
    import torch

    from podmonitor import PODConfig, analyze
    from podmonitor.reporting.sinks import JSONLinesWriter
    from podmonitor.synthetic import layered_ensemble

    torch.set_num_threads(args.threads)
    report = analyze(layered_ensemble(1, 20, args.seq_len)[0], PODConfig())
    names = [f"layer_{i:02d}" for i in range(args.layers)]
    dicts, lines = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "podmonitor.jsonl"
        with JSONLinesWriter(path) as out:
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                record = {"kind": "report", "step": 0, "layers": {n: report.to_dict() for n in names}}
                t1 = time.perf_counter()
                out.append(record)
                t2 = time.perf_counter()
                dicts.append(t1 - t0)
                lines.append(t2 - t1)
        size = path.stat().st_size / args.repeats
    return {"to_dict_s": statistics.median(dicts), "line_s": statistics.median(lines), "line_mib": size / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compare", metavar="OLD_ROOT", help="another podmonitor tree, timed alternately")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    if not args.compare:
        res = measure(args)
        print(f"{args.layers} layers at L = {args.seq_len}: the reports as dicts {res['to_dict_s']:.3f} s, "
              f"the strict-JSON line {res['line_s']:.3f} s ({res['line_mib']:.1f} MiB), medians of {args.repeats}")
        return
    roots = {"old": Path(args.compare).resolve(), "new": HERE}
    totals: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for side in (["old", "new"] if r % 2 == 0 else ["new", "old"]):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--layers", str(args.layers),
                   "--seq-len", str(args.seq_len), "--repeats", str(args.repeats), "--threads", str(args.threads)]
            env = {**os.environ, "PYTHONPATH": str(roots[side])}
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=roots[side]).stdout
            res = json.loads(out.strip().splitlines()[-1])
            totals[side].append(res["to_dict_s"] + res["line_s"])
            print(f"[{side}] dicts {res['to_dict_s']:.3f} s, line {res['line_s']:.3f} s ({res['line_mib']:.1f} MiB)",
                  flush=True)
    old, new = statistics.median(totals["old"]), statistics.median(totals["new"])
    print(f"\nmedians of {args.rounds} rounds, dicts + line: {roots['old']} {old:.3f} s, this tree {new:.3f} s, "
          f"ratio new/old {new / old:.3f}")


if __name__ == "__main__":
    main()
