"""Cost of the reference GPT's explicit attention path: what PODMonitor's capture runs on it.

Usage (from the repository root)::

    python benchmarks/bench_reference_capture.py                 # GPT-2-small attention shape
    git worktree add /tmp/podmonitor-old 36aea83
    python benchmarks/bench_reference_capture.py --compare /tmp/podmonitor-old

The reference models (``podmonitor.models.gpt``) hand their attention maps over through
``GPT.forward(idx, return_attention=True)`` without gradients; ``GPTLightningModule.attention_maps``,
which the monitor calls on every monitored validation batch, runs exactly that. This script times
that forward at the shape of ``bench_validation_run.py`` (12 layers x 12 heads, L = 1024, width 96,
batches of 2) with a buffer pool in use, as the monitor keeps the maps' memory from one batch to the
next. It prints the median of ``--rounds`` forwards and, with ``--compare OLD_ROOT``, the same for
the ``podmonitor/models/gpt.py`` of another checkout, loaded into this process with the same
weights and timed alternately with this tree's (two untimed warm-ups each), their ratio, and whether
both give the same bits (logits and every layer's maps).

It then times, for this tree, the monitor's whole per-batch work on that forward both ways, in
alternating rounds: with the maps (the forward above, then each layer's head average and per-head
stability pass, as the monitor runs them when an ``on_attention`` extra or ``per_head`` needs the
maps) and reduced (the forward under :func:`podmonitor.capture.reduce.reducing`, each layer reduced
to its head average and stability sums as it is formed: what the monitor runs by default); with the
memory each way holds for one batch (all layers' maps or head averages), and whether the head
averages are the same bits.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from podmonitor import hugepages  # noqa: E402


def load_gpt(root: Path, name: str) -> ModuleType:
    """``podmonitor/models/gpt.py`` of the checkout at ``root`` as a module named ``name`` (it
    imports this tree's ``podmonitor.hugepages``)."""
    spec = importlib.util.spec_from_file_location(name, root / "podmonitor" / "models" / "gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=96)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--compare", type=Path, default=None, metavar="OLD_ROOT",
                    help="a checkout whose models/gpt.py is timed alternately with this tree's")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    sides = {"this tree": load_gpt(REPO, "gpt_this")}
    if args.compare is not None:
        sides[f"{args.compare}"] = load_gpt(args.compare.resolve(), "gpt_compared")
    config = dict(vocab_size=65, block_size=args.seq_len, n_layer=args.layers, n_head=args.heads,
                  n_embd=args.n_embd, dropout=0.0)
    torch.manual_seed(0)
    models = {}
    for label, gpt in sides.items():
        models[label] = gpt.GPT(gpt.GPTConfig(**config)).eval()
        models[label].load_state_dict(next(iter(models.values())).state_dict())
    idx = torch.randint(0, 65, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1))
    pool = hugepages.BufferPool()

    def forward(model: torch.nn.Module) -> tuple[float, tuple]:
        with hugepages.use_pool(pool), torch.no_grad():
            t0 = time.perf_counter()
            out = model(idx, return_attention=True)
            return time.perf_counter() - t0, out

    outputs = [forward(m)[1] for m in models.values()]  # warm-up, untimed (twice: each side's
    for model in models.values():                       # buffers then stay in the pool)
        forward(model)
    same = None
    if len(outputs) == 2:
        (la, _, ma), (lb, _, mb) = outputs
        same = torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(ma, mb, strict=True))
    del outputs
    times: dict[str, list[float]] = {label: [] for label in models}
    for _ in range(args.rounds):
        for label, model in models.items():
            times[label].append(forward(model)[0])
    print(f"reference GPT, return_attention=True without gradients: {args.layers} layers x {args.heads} heads, "
          f"L = {args.seq_len}, width {args.n_embd}, batch {args.batch}, {args.threads} threads, "
          f"buffer pool in use; {args.rounds} alternating rounds")
    for label, ts in times.items():
        print(f"{label:>30}: median {statistics.median(ts):.3f} s per forward  "
              f"(rounds {', '.join(f'{t:.3f}' for t in ts)})")
    if len(times) == 2:
        this, other = (statistics.median(ts) for ts in times.values())
        print(f"ratio this tree / compared: {this / other:.3f}; same bits (logits and maps): {same}")
    monitor_work(models["this tree"], idx, pool, args.rounds)


def monitor_work(model: torch.nn.Module, idx: torch.Tensor, pool: hugepages.BufferPool, rounds: int) -> None:
    """The monitor's per-batch work with the maps and reduced, alternating (see the module docstring)."""
    from podmonitor.capture.reduce import Reduction, reducing
    from podmonitor.engine.stability import StabilityAccumulator

    def with_maps() -> tuple[float, list[torch.Tensor], int]:
        with hugepages.use_pool(pool), torch.no_grad():
            t0 = time.perf_counter()
            _, _, maps = model(idx, return_attention=True)
            averages = []
            for att in maps:
                averages.append(torch.mean(att, dim=1, out=hugepages.scratch(
                    (att.shape[0], *att.shape[2:]), att.dtype, att.device)))
                StabilityAccumulator().update(att, causal=True, zeros_above_diagonal=True)
            held = sum(a.numel() * a.element_size() for a in maps) + sum(a.numel() * 4 for a in averages)
            return time.perf_counter() - t0, averages, held

    def reduced() -> tuple[float, list[torch.Tensor], int]:
        with hugepages.use_pool(pool), torch.no_grad():
            t0 = time.perf_counter()
            reduction = Reduction()
            with reducing(reduction):
                model(idx, return_attention=True)
            layers = [layer.result() for layer in reduction.layers]
            for layer in layers:
                StabilityAccumulator().add_sums(layer.stability)
            held = sum(layer.average.numel() * 4 for layer in layers)
            return time.perf_counter() - t0, [layer.average for layer in layers], held

    ways = {"with the maps": with_maps, "reduced (default)": reduced}
    results = {label: way() for label, way in ways.items()}  # warm-up, untimed
    same = all(torch.equal(a, b) for a, b in zip(*(r[1] for r in results.values()), strict=True))
    held = {label: r[2] for label, r in results.items()}
    del results
    times: dict[str, list[float]] = {label: [] for label in ways}
    for _ in range(rounds):
        for label, way in ways.items():
            times[label].append(way()[0])
    print("the monitor's per-batch work on that forward (capture, head averages, per-head stability signals), "
          f"this tree, {rounds} alternating rounds")
    for label, ts in times.items():
        print(f"{label:>30}: median {statistics.median(ts):.3f} s per batch, holding {held[label] / 2**20:.0f} MiB "
              f"(rounds {', '.join(f'{t:.3f}' for t in ts)})")
    a, b = (statistics.median(ts) for ts in times.values())
    print(f"ratio reduced / with the maps: {b / a:.3f}; head averages the same bits: {same}")


if __name__ == "__main__":
    main()
