"""Gradient-based head importance of Michel, Levy & Neubig 2019 ("Are Sixteen Heads Really Better than One?").

Every head's output is multiplied by a mask variable xi_h (the ``head_mask`` buffer of the
reference GPT's attention layers, :mod:`podmonitor.models.gpt`). The importance of head h is

    I_h = E_x | d L(x) / d xi_h |        at xi = current mask (ones for an unpruned model)

with L(x) the loss of one sequence x (mean next-token cross-entropy, nats) and E_x the mean over
the sequences given. Per-sequence gradients come from one backward per batch: xi is expanded to
one (B, nh) copy per layer, so ``d sum_b L(x_b) / d xi[b, h] = d L(x_b) / d xi_h``. As in the paper
the scores are normalised per layer by their l2 norm before heads are compared across layers.

Example:
    >>> scores = michel_head_importance(model.model, batches)   # (n_layer, n_head)
    >>> heads = lowest_importance_heads(scores, 4)            # {layer index: [head, ...]}
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..models.gpt import CausalSelfAttention


def attention_layers(model: nn.Module) -> list[CausalSelfAttention]:
    """The reference model's attention layers, in model order.

    Raises:
        ValueError: the model has none.
    """
    layers = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no podmonitor.models.gpt.CausalSelfAttention layer")
    return layers


def sequence_losses(model: nn.Module, batch: Any) -> Tensor:
    """(B,) mean next-token cross-entropy per sequence of a batch ``(x, y)`` ((B, T) each).

    Works for :class:`~podmonitor.models.gpt.GPT` and for modules whose forward returns logits
    (B, T, vocab) or a tuple starting with them.
    """
    x, y = batch[0], batch[1]
    out = model(x)
    logits = out[0] if isinstance(out, (tuple, list)) else out  # (B, T, V)
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none", ignore_index=-1)
    ce = ce.view(y.shape)  # (B, T)
    valid = (y != -1).to(ce.dtype)
    return (ce * valid).sum(dim=1) / valid.sum(dim=1).clamp_min(1.0)


def michel_head_importance(model: nn.Module, batches: Iterable[Any], *,
                           loss_fn: Callable[[nn.Module, Any], Tensor] = sequence_losses,
                           normalize: bool = True) -> Tensor:
    """Head importance I (n_layer, n_head) of Michel et al. 2019 (see the module docstring).

    The model runs in eval mode (no dropout) and gets its train/eval mode and head masks back
    afterwards; parameter gradients are not touched (only xi is differentiated).

    Args:
        model: a module containing the reference attention layers (e.g. ``GPT``, or the
            Lightning module holding it).
        batches: ``(x, y)`` batches, (B, T) each, on the model's device.
        loss_fn: ``loss_fn(model, batch) -> (B,)`` per-sequence losses.
        normalize: divide each layer's scores by their l2 norm (the paper's per-layer
            normalisation); False gives the raw E_x |dL/dxi_h|.

    Returns:
        (n_layer, n_head) float64 scores.

    Raises:
        ValueError: no layer, or no batch.
    """
    layers = attention_layers(model)
    saved = [layer.head_mask.detach().clone() for layer in layers]
    modes = {m: m.training for m in model.modules()}
    total = [torch.zeros(layer.n_head, dtype=torch.float64) for layer in layers]
    count = 0
    model.eval()
    try:
        for batch in batches:
            bsz = batch[0].shape[0]
            xis = [m.unsqueeze(0).expand(bsz, -1).clone().requires_grad_(True) for m in saved]  # (B, nh) each
            for layer, xi in zip(layers, xis, strict=True):
                layer._buffers["head_mask"] = xi  # leaf tensor with gradient, (B, nh)
            losses = loss_fn(model, batch)  # (B,)
            grads = torch.autograd.grad(losses.sum(), xis, allow_unused=True)
            for t, g in zip(total, grads, strict=True):
                if g is not None:
                    t += g.detach().abs().sum(dim=0).double().cpu()
            count += bsz
    finally:
        for layer, m in zip(layers, saved, strict=True):
            layer._buffers["head_mask"] = m
        for m, mode in modes.items():
            m.training = mode
    if count == 0:
        raise ValueError("no batch given")
    scores = torch.stack(total) / count  # (n_layer, n_head)
    if normalize:
        scores = scores / scores.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    return scores


def lowest_importance_heads(scores: Tensor, n: int, exclude: dict[int, list[int]] | None = None,
                            min_heads: int = 1) -> dict[int, list[int]]:
    """The ``n`` heads of lowest score over all layers, ``{layer: [heads]}``, each layer keeping at
    least ``min_heads`` active heads (heads in ``exclude``, already pruned, are not counted).

    Raises:
        ValueError: fewer than ``n`` heads can be pruned.
    """
    exclude = exclude or {}
    n_layer, n_head = scores.shape
    left = {layer: n_head - len(exclude.get(layer, [])) for layer in range(n_layer)}
    ranked = sorted((float(scores[layer, h]), layer, h) for layer in range(n_layer) for h in range(n_head)
                     if h not in exclude.get(layer, []))
    out: dict[int, list[int]] = {}
    for _, layer, h in ranked:
        if sum(len(v) for v in out.values()) == n:
            break
        if left[layer] - 1 < min_heads:
            continue
        out.setdefault(layer, []).append(h)
        left[layer] -= 1
    if sum(len(v) for v in out.values()) < n:
        raise ValueError(f"cannot prune {n} heads keeping {min_heads} per layer")
    return {k: sorted(v) for k, v in sorted(out.items())}


__all__ = ["attention_layers", "lowest_importance_heads", "michel_head_importance", "sequence_losses"]
