"""Measure the smoothness of a trained reference GPT: sigma(n), alpha and R^2 per layer.

Loads a :class:`~podmonitor.models.GPTLightningModule` checkpoint, takes the first validation
windows of the shipped TinyShakespeare data (:class:`~podmonitor.data.CharDataModule`), and
prints a Markdown table: per attention layer, sigma(n) = ||Df(X[:n])||_2 (mean over the
sequences) for n = 16, 32, ..., T, the growth exponent alpha of sigma(n) ~ c n^alpha and its R^2,
the row entropy and ||P||_2 of the attention (METHOD.md section 8).

Usage:
    python examples/measure_smoothness.py --ckpt path/to/model.ckpt [--sequences 4] [--max-len 128]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from podmonitor.data import CharDataModule
from podmonitor.models import GPTLightningModule
from podmonitor.smoothness import LayerSmoothness, measure_module, prefix_grid


def markdown_table(results: dict[str, LayerSmoothness]) -> str:
    """One row per layer: sigma(n) for every n, alpha, R^2, converged, entropy, ||P||_2."""
    lengths = sorted({n for r in results.values() for n in r.lengths})

    def fmt(x: float, spec: str = ".4f") -> str:
        return "n/a" if x is None or not math.isfinite(x) else format(x, spec)

    header = ["layer"] + [f"σ({n})" for n in lengths] + ["alpha", "R²", "monotone", "entropy", "‖P‖₂"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, (name, r) in enumerate(results.items()):
        by_n = dict(zip(r.lengths, r.sigma_mean, strict=True))
        comp = r.companions
        row = [f"{i} (`{name}`)"] + [fmt(by_n.get(n, math.nan)) for n in lengths]
        row += [fmt(r.alpha, ".3f"), fmt(r.r2, ".3f"), "n/a" if r.monotone is None else str(r.monotone).lower(),
                fmt(comp.entropy if comp else math.nan, ".3f"), fmt(comp.p_norm if comp else math.nan, ".3f")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="GPTLightningModule checkpoint (.ckpt)")
    parser.add_argument("--sequences", type=int, default=4, help="validation windows measured (default 4)")
    parser.add_argument("--max-len", type=int, default=128, help="largest prefix n (default 128, clipped to T)")
    parser.add_argument("--min-len", type=int, default=16, help="smallest prefix n (default 16)")
    parser.add_argument("--n-iter", type=int, default=100, help="max power-iteration steps per n")
    parser.add_argument("--tol", type=float, default=1e-5, help="relative stopping tolerance")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model = GPTLightningModule.load_from_checkpoint(args.ckpt, map_location="cpu")
    model.eval()
    cfg = model.config
    dm = CharDataModule(block_size=cfg.block_size, batch_size=args.sequences, max_val_windows=args.sequences)
    dm.setup("validate")
    x, _ = next(iter(dm.val_dataloader()))  # (b, T): the first validation windows
    grid = prefix_grid(min(args.max_len, cfg.block_size), args.min_len)
    t0 = time.perf_counter()
    results = measure_module(model, lambda: model(x), n_sequences=args.sequences, grid=grid,
                             n_iter=args.n_iter, tol=args.tol)
    seconds = time.perf_counter() - t0

    print(f"checkpoint: {args.ckpt}")
    print(f"model: {cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, context {cfg.block_size}, "
          f"attention {cfg.attention}" + (f" ({cfg.ega_gate} gate)" if cfg.attention == "ega" else ""))
    print(f"data: the first {x.shape[0]} validation windows of TinyShakespeare, prefixes n = {grid}")
    print(f"power iteration: at most {args.n_iter} steps, tol {args.tol:g}; {seconds:.1f} s\n")
    print(markdown_table(results))
    not_converged = [name for name, r in results.items() if not all(r.converged)]
    if not_converged:
        print(f"\nnot converged to tol within {args.n_iter} steps (raise --n-iter): {not_converged}")
    print("\nsigma(n) = ||Df(X[:n])||_2 of the attention sub-layer (all heads, output projection, no residual), "
          "mean over the sequences; alpha: OLS slope of ln sigma on ln n.")


if __name__ == "__main__":
    main()
