"""Michel et al. head importance against per-sequence autograd and finite differences."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from podmonitor.models.gpt import GPT, GPTConfig
from podmonitor.pruning import lowest_importance_heads, michel_head_importance


def tiny_gpt(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=11, block_size=12, n_layer=2, n_head=3, n_embd=12, dropout=0.1)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg)).double()


def batches(n: int = 2, b: int = 3, t: int = 12, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 11, (b, t), generator=g), torch.randint(0, 11, (b, t), generator=g)) for _ in range(n)]


def reference_importance(model: GPT, data) -> torch.Tensor:
    """E_x |dL(x)/dxi_h| with one (nh,) leaf xi per layer and one backward per sequence."""
    layers = [blk.attn for blk in model.transformer.h]
    model.eval()
    total = torch.zeros(len(layers), layers[0].n_head, dtype=torch.float64)
    count = 0
    for x, y in data:
        for b in range(x.shape[0]):
            xis = [torch.ones(m.n_head, dtype=torch.float64, requires_grad=True) for m in layers]
            for m, xi in zip(layers, xis, strict=True):
                m._buffers["head_mask"] = xi
            logits, _ = model(x[b:b + 1])
            loss = F.cross_entropy(logits[0], y[b])
            grads = torch.autograd.grad(loss, xis)
            total += torch.stack([g.abs() for g in grads])
            count += 1
    for m in layers:
        m._buffers["head_mask"] = torch.ones(m.n_head, dtype=torch.float64)
    return total / count


@pytest.mark.parametrize("attention", ["softmax", "ega"])
def test_michel_importance_equals_per_sequence_autograd(attention):
    model = tiny_gpt(attention=attention)
    model.train()
    data = batches()
    got = michel_head_importance(model, data, normalize=False)
    ref = reference_importance(tiny_gpt(attention=attention), data)
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
    assert model.training  # mode restored
    assert all(torch.equal(blk.attn.head_mask, torch.ones(3, dtype=torch.float64)) for blk in model.transformer.h)
    normed = michel_head_importance(model, data)
    torch.testing.assert_close(normed.norm(dim=1), torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(normed, ref / ref.norm(dim=1, keepdim=True))


def test_michel_gradient_matches_central_difference_of_the_loss():
    model = tiny_gpt(seed=3).eval()
    x, y = batches(1, 1)[0]
    got = michel_head_importance(model, [(x, y)], normalize=False)
    attn, h, d = model.transformer.h[1].attn, 2, 1e-5

    def loss_at(value: float) -> float:
        mask = torch.ones(3, dtype=torch.float64)
        mask[h] = value
        attn.set_head_mask(mask)
        with torch.no_grad():
            return float(model(x, y)[1])

    fd = (loss_at(1 + d) - loss_at(1 - d)) / (2 * d)
    attn.clear_head_mask()
    assert got[1, h].item() == pytest.approx(abs(fd), rel=1e-6)


def test_lowest_importance_heads_keeps_min_heads_and_skips_pruned():
    scores = torch.tensor([[0.1, 0.2, 0.3], [0.9, 0.05, 0.8]], dtype=torch.float64)
    assert lowest_importance_heads(scores, 2) == {0: [0], 1: [1]}
    assert lowest_importance_heads(scores, 3) == {0: [0, 1], 1: [1]}
    assert lowest_importance_heads(scores, 4) == {0: [0, 1], 1: [1, 2]}  # layer 0 keeps one head
    assert lowest_importance_heads(scores, 2, exclude={1: [1]}) == {0: [0, 1]}
    with pytest.raises(ValueError, match="cannot prune 5"):
        lowest_importance_heads(scores, 5)
