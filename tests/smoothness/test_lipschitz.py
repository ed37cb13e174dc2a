"""Power iteration against the exact Jacobian (torch.func.jacrev, float64) on tiny sizes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from podmonitor.smoothness import exact_jacobian_norm, jacobian_spectral_norm, prefix_lipschitz

from .conftest import gpt_attention

REL = 1e-3  # required accuracy
ROUND = 1e-5  # fp32 rounding allowance above the exact value


def _check(estimate: torch.Tensor, exact: torch.Tensor) -> None:
    rel = (estimate.double() - exact) / exact
    assert bool((rel.abs() <= REL).all()), f"relative errors {rel.tolist()}"
    assert bool((rel <= ROUND).all()), f"estimate above the exact norm: {rel.tolist()}"


@pytest.mark.parametrize("attention,gate", [("softmax", "causal"), ("ega", "causal"), ("ega", "window")])
def test_power_iteration_matches_jacrev_reference_gpt(attention: str, gate: str) -> None:
    attn = gpt_attention(attention, gain=3.0, ega_gate=gate)
    ref = copy.deepcopy(attn).double()
    x = torch.randn(3, 10, 8, generator=torch.Generator().manual_seed(2))
    exact = exact_jacobian_norm(lambda z: ref(z, return_attention=True)[0], x.double())
    res = jacobian_spectral_norm(lambda z: attn(z, return_attention=True)[0], x, n_iter=500, tol=1e-7,
                                 generator=torch.Generator().manual_seed(0))
    assert res.sigma.dtype == torch.float32 and tuple(res.vector.shape) == (3, 10, 8)
    assert bool(res.converged.all())
    _check(res.sigma, exact)


@pytest.mark.parametrize("mode", ["forward", "double_backward"])
def test_jvp_modes_agree_with_jacrev(mode: str) -> None:
    attn = gpt_attention("softmax", gain=3.0, seed=1)
    ref = copy.deepcopy(attn).double()
    x = torch.randn(2, 9, 8, generator=torch.Generator().manual_seed(3))
    exact = exact_jacobian_norm(lambda z: ref(z, return_attention=True)[0], x.double())
    res = jacobian_spectral_norm(lambda z: attn(z, return_attention=True)[0], x, n_iter=500, tol=1e-7, mode=mode)
    assert res.mode == mode
    _check(res.sigma, exact)


def test_every_iterate_is_a_lower_bound() -> None:
    """Stopped after 1, 2, 3, ... steps the estimate never exceeds the exact norm and never decreases."""
    attn = gpt_attention("softmax", gain=3.0, seed=4)
    ref = copy.deepcopy(attn).double()
    x = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(5))
    exact = exact_jacobian_norm(lambda z: ref(z, return_attention=True)[0], x.double())
    previous = torch.zeros(2, dtype=torch.float64)
    for k in range(1, 8):
        res = jacobian_spectral_norm(lambda z: attn(z, return_attention=True)[0], x, n_iter=k, tol=0.0,
                                     generator=torch.Generator().manual_seed(0))
        assert res.n_iter == k
        s = res.sigma.double()
        assert bool((s <= exact * (1 + ROUND)).all())
        assert bool((s >= previous * (1 - ROUND)).all())
        previous = s


def test_power_iteration_matches_jacrev_multihead_attention() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_weight.mul_(4.0)
    ref = copy.deepcopy(mha).double()
    mask = torch.ones(10, 10, dtype=torch.bool).triu(1)

    def f(m: nn.MultiheadAttention):
        return lambda z: m(z, z, z, attn_mask=mask, need_weights=True, average_attn_weights=False)[0]

    x = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(6))
    exact = exact_jacobian_norm(f(ref), x.double())
    res = jacobian_spectral_norm(f(mha), x, n_iter=500, tol=1e-7)
    _check(res.sigma, exact)


def test_batch_sequences_are_independent() -> None:
    """sigma of a sequence does not depend on the other sequences of the batch."""
    attn = gpt_attention("ega", gain=3.0, seed=7)
    f = lambda z: attn(z, return_attention=True)[0]  # noqa: E731
    x = torch.randn(3, 12, 8, generator=torch.Generator().manual_seed(8))
    together = jacobian_spectral_norm(f, x, n_iter=500, tol=1e-7).sigma
    alone = torch.cat([jacobian_spectral_norm(f, x[s : s + 1], n_iter=500, tol=1e-7).sigma for s in range(3)])
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=0.0)


def test_prefix_lipschitz_matches_jacrev_of_prefix() -> None:
    attn = gpt_attention("softmax", gain=3.0, seed=9)
    ref = copy.deepcopy(attn).double()
    x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(10))
    out = prefix_lipschitz(lambda n: (lambda z: attn(z, return_attention=True)[0]), x, [4, 8, 16], n_iter=500,
                           tol=1e-7)
    assert list(out) == [4, 8, 16]
    for n, res in out.items():
        exact = exact_jacobian_norm(lambda z: ref(z, return_attention=True)[0], x[:, :n].double())
        _check(res.sigma, exact)
    # warm start from the converged vectors: the same values in fewer steps than a cold start
    fn = lambda n: (lambda z: attn(z, return_attention=True)[0])  # noqa: E731
    cold = prefix_lipschitz(fn, x, [4, 8, 16], n_iter=500, tol=1e-5)
    warm = prefix_lipschitz(fn, x, [4, 8, 16], n_iter=500, tol=1e-5, warm={n: r.vector for n, r in out.items()})
    for n in out:
        torch.testing.assert_close(warm[n].sigma, out[n].sigma, rtol=1e-5, atol=0.0)
        assert warm[n].n_iter <= 3 and warm[n].n_iter < cold[n].n_iter


def test_bad_shapes_are_rejected() -> None:
    f = lambda z: z  # noqa: E731
    with pytest.raises(ValueError, match=r"\(b, n, C\)"):
        jacobian_spectral_norm(f, torch.randn(4, 4))
    with pytest.raises(ValueError, match="v0"):
        jacobian_spectral_norm(f, torch.randn(1, 4, 2), v0=torch.randn(1, 4, 3))
    with pytest.raises(ValueError, match="keep the shape"):
        jacobian_spectral_norm(lambda z: z[:, :2], torch.randn(1, 4, 2))


def test_works_inside_inference_mode_and_leaves_grads_alone() -> None:
    attn = gpt_attention("softmax", gain=3.0, seed=11)
    x = torch.randn(1, 6, 8)
    with torch.inference_mode():
        xi = x.clone()
        res = jacobian_spectral_norm(lambda z: attn(z, return_attention=True)[0], xi, n_iter=200, tol=1e-7)
    assert all(p.grad is None for p in attn.parameters())
    ref = copy.deepcopy(attn).double()
    exact = exact_jacobian_norm(lambda z: ref(z, return_attention=True)[0], x.double())
    _check(res.sigma, exact)
