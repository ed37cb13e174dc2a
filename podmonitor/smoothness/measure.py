"""Measure one attention sub-layer (sigma(n), alpha, companions) and whole models.

:func:`measure_sublayer` is the unit of work of :class:`~podmonitor.smoothness.SmoothnessMonitor`:
for a :class:`~podmonitor.smoothness.sublayers.BoundSublayer` it computes the companions
(row entropy and ||P||_2, cheap) and, when asked, sigma(n) for every prefix length by power
iteration, the growth exponent alpha and the monotonicity check. :func:`measure_module` does it
for every attention sub-layer of a model from one forward pass (scripts, notebooks).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .companions import AttentionCompanions, attention_companions
from .growth import GrowthFit, growth_exponent, prefix_grid
from .lipschitz import JacobianMode, jacobian_spectral_norm
from .sublayers import BoundSublayer, InputCapture, find_attention_sublayers

__all__ = ["LayerSmoothness", "measure_module", "measure_sublayer", "warm_start"]


@dataclass
class LayerSmoothness:
    """Smoothness of one attention sub-layer on b sequences.

    Attributes:
        name: the sub-layer's module path.
        kind: "gpt", "huggingface" or "torch_mha".
        seq_len: T.
        n_sequences: b.
        causal: whether outputs depend only on earlier inputs (then sigma(n) is non-decreasing).
        prefix_mode: "prefix", "block" or "full" (see :mod:`.sublayers`).
        lengths: prefix lengths n (empty when sigma was not computed in this run).
        sigma: per length, the b per-sequence estimates of ||Df(X[:n])||_2.
        sigma_mean: per length, the mean over sequences (the curve that is fitted and logged).
        sigma_max: per length, the max over sequences.
        n_iter: per length, power-iteration steps taken.
        converged: per length, whether every sequence met the tolerance.
        fit: growth exponent of ``sigma_mean`` (None when sigma was not computed).
        monotone: for causal sub-layers, whether every sequence's sigma(n) is non-decreasing in n
            (to within 10 x tol); None otherwise.
        companions: entropy and ||P||_2 of the full-length attention (None if not computed or the
            module returns no attention).
        seconds: wall time of the measurement.
    """

    name: str
    kind: str
    seq_len: int
    n_sequences: int
    causal: bool
    prefix_mode: str
    lengths: list[int] = field(default_factory=list)
    sigma: list[list[float]] = field(default_factory=list)
    sigma_mean: list[float] = field(default_factory=list)
    sigma_max: list[float] = field(default_factory=list)
    n_iter: list[int] = field(default_factory=list)
    converged: list[bool] = field(default_factory=list)
    fit: GrowthFit | None = None
    monotone: bool | None = None
    companions: AttentionCompanions | None = None
    seconds: float = 0.0

    @property
    def alpha(self) -> float:
        return self.fit.alpha if self.fit is not None else math.nan

    @property
    def r2(self) -> float:
        return self.fit.r2 if self.fit is not None else math.nan

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fit"] = self.fit.to_dict() if self.fit is not None else None
        d["companions"] = self.companions.to_dict() if self.companions is not None else None
        return d


def warm_start(
    n: int,
    shape: tuple[int, int, int],
    previous: Mapping[int, torch.Tensor] | None,
    smaller: tuple[int, torch.Tensor] | None,
    generator: torch.Generator,
    noise: float = 0.05,
) -> torch.Tensor:
    """The start vector of the power iteration at prefix length n, (b, n, C), on the CPU.

    ``previous[n]`` (the vector of the last run at this n) when its shape matches; else the
    vector of the largest smaller prefix of this run, padded with zero rows (for causal
    sub-layers the Jacobian of a prefix is a block of the next one); else Gaussian. A fraction
    ``noise`` of a Gaussian vector is mixed in, so the iteration cannot sit on a vector that is
    no longer the top one.
    """
    b, _, c = shape
    rand = torch.randn(shape, generator=generator)
    base = None
    if previous is not None and n in previous and tuple(previous[n].shape) == tuple(shape):
        base = previous[n].detach().float().cpu()
    elif smaller is not None and smaller[1].shape[0] == b and smaller[1].shape[2] == c and smaller[0] < n:
        m, vec = smaller
        base = torch.zeros(shape)
        base[:, :m] = vec.detach().float().cpu()
    if base is None:
        return rand
    bn = base.flatten(1).norm(dim=1).clamp_min(1e-30).view(-1, 1, 1)
    rn = rand.flatten(1).norm(dim=1).clamp_min(1e-30).view(-1, 1, 1)
    return base / bn + noise * rand / rn


def measure_sublayer(
    bound: BoundSublayer,
    grid: Sequence[int] | None,
    *,
    sigma: bool = True,
    companions: bool = True,
    warm: Mapping[int, torch.Tensor] | None = None,
    n_iter: int = 30,
    tol: float = 1e-3,
    generator: torch.Generator | None = None,
    mode: JacobianMode = "auto",
    min_length: int = 16,
) -> tuple[LayerSmoothness, dict[int, torch.Tensor]]:
    """Measure one bound sub-layer.

    Args:
        bound: the sub-layer with its captured input (b, T, C).
        grid: prefix lengths; default :func:`~.growth.prefix_grid` of T (16, 32, ..., T).
        sigma: compute sigma(n) and alpha (tens of sub-layer passes per length).
        companions: compute entropy and ||P||_2 (one pass).
        warm: n -> (b, n, C) start vectors from the last run.
        n_iter, tol, mode: power iteration settings (:func:`~.lipschitz.jacobian_spectral_norm`).
        generator: random source (a fresh one seeded with 0 by default).
        min_length: smallest prefix of the default grid.

    Returns:
        (the result, n -> (b, n, C) CPU vectors to warm-start the next run).
    """
    t0 = time.perf_counter()
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    res = LayerSmoothness(name=bound.sub.name, kind=bound.sub.kind, seq_len=bound.seq_len,
                          n_sequences=bound.n_sequences, causal=bool(bound.causal), prefix_mode=bound.prefix_mode)
    vectors: dict[int, torch.Tensor] = {}
    with torch.inference_mode(False):
        if companions:
            att = bound.attention()
            if att is not None:
                res.companions = attention_companions(att, causal=bound.mask_causal)
        if sigma:
            lengths = bound.lengths(grid if grid is not None else prefix_grid(bound.seq_len, min_length))
            smaller: tuple[int, torch.Tensor] | None = None
            with bound.calling():
                for n in lengths:
                    x = bound.x[:, :n]
                    v0 = warm_start(n, tuple(x.shape), warm, smaller, gen)  # type: ignore[arg-type]
                    out = jacobian_spectral_norm(bound.function(n), x, v0=v0, n_iter=n_iter, tol=tol, mode=mode)
                    vec = out.vector.cpu()
                    vectors[n] = vec
                    smaller = (n, vec)
                    s = [float(v) for v in out.sigma.cpu()]
                    res.lengths.append(int(n))
                    res.sigma.append(s)
                    res.sigma_mean.append(sum(s) / len(s))
                    res.sigma_max.append(max(s))
                    res.n_iter.append(out.n_iter)
                    res.converged.append(bool(out.converged.all()))
            res.fit = growth_exponent(res.lengths, res.sigma_mean)
            if res.causal and res.prefix_mode != "full" and len(res.lengths) > 1:
                slack = 1.0 - 10.0 * tol
                res.monotone = all(
                    b >= a * slack
                    for k in range(len(res.lengths) - 1)
                    for a, b in zip(res.sigma[k], res.sigma[k + 1], strict=True)
                )
    res.seconds = time.perf_counter() - t0
    return res, vectors


def measure_module(
    module: nn.Module,
    forward: Callable[[], Any],
    *,
    n_sequences: int = 4,
    grid: Sequence[int] | None = None,
    paths: Sequence[str] | None = None,
    keep: torch.Tensor | None = None,
    n_iter: int = 50,
    tol: float = 1e-4,
    mode: JacobianMode = "auto",
    seed: int = 0,
) -> dict[str, LayerSmoothness]:
    """sigma(n), alpha and companions of every attention sub-layer of ``module``.

    Args:
        module: the model (any module the sub-layers belong to).
        forward: runs the model once on a batch (its sub-layer inputs are captured), e.g.
            ``lambda: model(idx)``; run without gradients.
        n_sequences: b, sequences of the batch to measure (the first ones).
        grid: prefix lengths (default 16, 32, ..., T).
        paths: sub-layer module paths (default: :func:`~.sublayers.find_attention_sublayers`).
        keep: (B,) bool, sequences allowed (e.g. without padding).
        n_iter, tol, mode: power iteration settings.
        seed: seed of the start vectors.

    Returns:
        layer name -> :class:`LayerSmoothness`, in model order.

    Raises:
        ValueError: no supported attention sub-layer, or the forward never called one.
    """
    sublayers = find_attention_sublayers(module, paths)
    if not sublayers:
        raise ValueError(f"{type(module).__name__} has no supported attention sub-layer")
    capture = InputCapture(sublayers)
    with torch.no_grad(), _eval(module), capture.capturing():
        forward()
    if not capture.calls:
        raise ValueError("the forward called no attention sub-layer")
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, LayerSmoothness] = {}
    for sub in sublayers:
        call = capture.calls.get(sub.name)
        if call is None:
            continue
        with torch.inference_mode(False):
            bound = sub.bind(call, n_sequences, keep)
        out[sub.name], _ = measure_sublayer(bound, grid, n_iter=n_iter, tol=tol, generator=gen, mode=mode)
    return out


class _eval:
    """Context manager: ``module.eval()``, then every ``training`` flag restored."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.saved: list[tuple[nn.Module, bool]] = []

    def __enter__(self) -> None:
        self.saved = [(m, m.training) for m in self.module.modules()]
        self.module.eval()

    def __exit__(self, *exc: object) -> None:
        for m, mode in self.saved:
            m.training = mode
