"""Sub-layers captured from real models (reference GPT, Hugging Face GPT-2, nn.TransformerEncoder),
against jacrev of the sub-layer called independently; sigma(n) non-decreasing for causal models."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from podmonitor.models.gpt import GPT, GPTConfig
from podmonitor.smoothness import (
    InputCapture,
    exact_jacobian_norm,
    find_attention_sublayers,
    jacobian_spectral_norm,
    measure_module,
    measure_sublayer,
)

from .conftest import TinyHFLM, TinyMHAModel, gpt_attention, gpt_value_output_norm, value_output_norm

REL, ROUND = 1e-3, 1e-5

# the jacrev references run the fused attention kernels, whose vmap rule is missing (a speed warning)
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


def _check(estimate: list[float] | torch.Tensor, exact: torch.Tensor) -> None:
    est = torch.as_tensor(estimate, dtype=torch.float64)
    rel = (est - exact) / exact
    assert bool((rel.abs() <= REL).all()) and bool((rel <= ROUND).all()), rel.tolist()


def _capture(model: nn.Module, forward) -> tuple[list, InputCapture]:
    subs = find_attention_sublayers(model)
    cap = InputCapture(subs)
    with torch.no_grad(), cap.capturing():
        forward()
    return subs, cap


def test_hf_gpt2_block_prefixes_match_jacrev_of_standalone_prefix() -> None:
    lm = TinyHFLM(seq_len=32).eval()
    x = torch.randint(0, 20, (3, 32), generator=torch.Generator().manual_seed(0))
    subs, cap = _capture(lm, lambda: lm.model(input_ids=x))
    assert [s.kind for s in subs] == ["huggingface", "huggingface"]
    assert [s.name for s in subs] == ["model.transformer.h.0.attn", "model.transformer.h.1.attn"]
    for sub in subs:
        bound = sub.bind(cap.calls[sub.name], 2)
        assert bound.prefix_mode == "block" and bound.causal and tuple(bound.x.shape) == (2, 32, 16)
        res, _ = measure_sublayer(bound, [1, 8, 16, 32], n_iter=500, tol=1e-7)
        ref = copy.deepcopy(sub.module).double()  # called alone: GPT-2 applies its own causal mask
        for n, sig in zip(res.lengths, res.sigma, strict=True):
            exact = exact_jacobian_norm(lambda z, r=ref: r(z)[0], bound.x[:, :n].double())
            _check(sig, exact)
        # n = 1: ||W_v W_proj|| (Conv1D weights are (in, out))
        c = 16
        w_v, w_p = sub.module.c_attn.weight[:, 2 * c :], sub.module.c_proj.weight
        assert res.sigma[0] == pytest.approx([value_output_norm(w_v.T, w_p.T)] * 2, rel=1e-4)
        assert res.monotone is True
        assert res.companions is not None and 1.0 <= res.companions.p_norm <= 32**0.5
    assert not any(m._forward_pre_hooks for m in lm.modules())


def test_hf_config_attention_implementation_is_restored() -> None:
    lm = TinyHFLM(seq_len=16).eval()
    before = lm.model.config._attn_implementation
    x = torch.randint(0, 20, (2, 16))
    subs, cap = _capture(lm, lambda: lm.model(input_ids=x))
    bound = subs[0].bind(cap.calls[subs[0].name], 2)
    measure_sublayer(bound, [8, 16], n_iter=5)
    assert lm.model.config._attn_implementation == before


@pytest.mark.parametrize("causal", [True, False])
def test_transformer_encoder_prefixes_match_jacrev(causal: bool) -> None:
    model = TinyMHAModel(seq_len=16, causal=causal).eval()
    x = torch.randint(0, 20, (2, 16), generator=torch.Generator().manual_seed(1))
    fast = torch.backends.mha.get_fastpath_enabled()
    subs, cap = _capture(model, lambda: model(x))
    assert torch.backends.mha.get_fastpath_enabled() == fast
    assert [s.kind for s in subs] == ["torch_mha", "torch_mha"]
    for sub in subs:
        bound = sub.bind(cap.calls[sub.name], 2)
        assert bound.causal is causal and bound.prefix_mode == "prefix"
        res, _ = measure_sublayer(bound, [4, 8, 16], n_iter=500, tol=1e-7)
        ref = copy.deepcopy(sub.module).double()
        for n, sig in zip(res.lengths, res.sigma, strict=True):
            mask = torch.ones(n, n, dtype=torch.bool).triu(1) if causal else None

            def f(z, m=mask, r=ref):
                return r(z, z, z, attn_mask=m, need_weights=False)[0]

            _check(sig, exact_jacobian_norm(f, bound.x[:, :n].double()))
        assert res.monotone is (True if causal else None)


def test_mha_key_padding_sequences_are_skipped() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    holder = nn.Module()
    holder.mha = mha
    x = torch.randn(3, 6, 8)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[0, -1] = True  # sequence 0 has a padding key
    subs, cap = _capture(holder, lambda: mha(x, x, x, key_padding_mask=kpm))
    bound = subs[0].bind(cap.calls[subs[0].name], 5)
    assert bound.index.tolist() == [1, 2]
    torch.testing.assert_close(bound.x, x[1:])


def test_cross_attention_calls_are_not_captured() -> None:
    torch.manual_seed(0)
    holder = nn.Module()
    holder.mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    q, kv = torch.randn(1, 4, 8), torch.randn(1, 5, 8)
    subs, cap = _capture(holder, lambda: holder.mha(q, kv, kv))
    assert cap.calls == {}


@pytest.mark.parametrize("attention", ["softmax", "ega"])
def test_sigma_non_decreasing_for_causal_reference_gpt(attention: str) -> None:
    """Independent cold starts for every n (no warm start linking the lengths)."""
    attn = gpt_attention(attention, gain=4.0, block_size=128, seed=3)
    x = torch.randn(2, 128, 8, generator=torch.Generator().manual_seed(4))
    f = lambda z: attn(z, return_attention=True)[0]  # noqa: E731
    sig = [jacobian_spectral_norm(f, x[:, :n], n_iter=1000, tol=1e-7,
                                  generator=torch.Generator().manual_seed(n)).sigma.double()
           for n in (16, 32, 64, 128)]
    for a, b in zip(sig, sig[1:], strict=False):
        assert bool((b >= a * (1 - 1e-5)).all()), (a.tolist(), b.tolist())
    assert bool((sig[-1] > sig[0] * 1.01).any())  # and not trivially constant
    # the exact Jacobian of a prefix is a block of the next one
    ref = copy.deepcopy(attn).double()
    g = lambda z: ref(z, return_attention=True)[0]  # noqa: E731
    exact = [exact_jacobian_norm(g, x[:1, :n].double()) for n in (2, 4, 8, 16)]
    assert all(float(b) >= float(a) * (1 - 1e-12) for a, b in zip(exact, exact[1:], strict=False))


def test_ega_window_gate_is_not_information_causal() -> None:
    model = GPT(GPTConfig(vocab_size=11, block_size=32, n_layer=1, n_head=2, n_embd=8, dropout=0.0,
                          attention="ega", ega_gate="window")).eval()
    x = torch.randint(0, 11, (2, 32))
    res = measure_module(model, lambda: model(x), n_sequences=2, n_iter=20, tol=1e-4)
    (r,) = res.values()
    assert r.causal is False and r.monotone is None and r.lengths == [16, 32]


def test_measure_module_reference_gpt_and_paths() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=64, n_layer=2, n_head=2, n_embd=16, dropout=0.1)).train()
    x = torch.randint(0, 11, (3, 64))
    res = measure_module(model, lambda: model(x), n_sequences=2, n_iter=200, tol=1e-6)
    assert model.training and all(m.training for m in model.modules())  # modes restored
    assert list(res) == ["transformer.h.0.attn", "transformer.h.1.attn"]
    for r in res.values():
        assert r.lengths == [16, 32, 64] and r.n_sequences == 2 and r.monotone is True
        assert r.fit is not None and r.fit.n_points == 3 and all(r.converged)
    only = find_attention_sublayers(model, ["transformer.h.1.attn"])
    assert [s.name for s in only] == ["transformer.h.1.attn"]
    with pytest.raises(ValueError, match="not a supported"):
        find_attention_sublayers(model, ["transformer.h.1.mlp"])


def test_hf_llama_mask_converted_from_sdpa_matches_jacrev() -> None:
    """Llama's eager attention has no causal mask of its own: the captured (sdpa) mask must be converted."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaModel(cfg).eval()
    before = model.config._attn_implementation
    x = torch.randint(0, 20, (2, 16), generator=torch.Generator().manual_seed(3))
    subs, cap = _capture(model, lambda: model(input_ids=x))
    assert [s.name for s in subs] == ["layers.0.self_attn"]
    call = cap.calls["layers.0.self_attn"]
    bound = subs[0].bind(call, 2)
    assert bound.causal and bound.prefix_mode == "block"
    res, _ = measure_sublayer(bound, [4, 8, 16], n_iter=500, tol=1e-7)
    assert model.config._attn_implementation == before  # eager only around the sub-layer calls
    ref = copy.deepcopy(subs[0].module).double()
    ref.config._attn_implementation = "eager"
    cos, sin = call.kwargs["position_embeddings"]
    for n, sig in zip(res.lengths, res.sigma, strict=True):
        mask = torch.zeros(n, n, dtype=torch.float64).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -1e30)

        def f(z, n=n, mask=mask):
            pe = (cos[:, :n].double(), sin[:, :n].double())
            return ref(z, position_embeddings=pe, attention_mask=mask.expand(z.shape[0], 1, n, n))[0]

        _check(sig, exact_jacobian_norm(f, bound.x[:, :n].double()))
    assert res.monotone is True


def test_fp32_copy_is_cached_and_follows_the_live_weights() -> None:
    """A bf16 sub-layer is measured through one fp32 copy, refreshed from the live weights at each bind."""
    attn = gpt_attention(seed=5).to(torch.bfloat16)
    holder = nn.Module()
    holder.attn = attn
    x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    subs, cap = _capture(holder, lambda: attn(x))
    (sub,) = subs
    call = cap.calls[sub.name]

    def measured() -> tuple[float, torch.Tensor, nn.Module]:
        bound = sub.bind(call, 2)
        res, _ = measure_sublayer(bound, [1, 16], n_iter=500, tol=1e-7)
        with torch.no_grad(), bound.calling():
            y = bound.call(bound.x)[0]
        return res.sigma[0][0], y, bound.module

    def reference(z: torch.Tensor) -> torch.Tensor:  # an fp32 copy of the live sub-layer made now
        with torch.no_grad():
            return copy.deepcopy(attn).float()(z.float(), return_attention=True)[0]

    sigma1, y1, m1 = measured()
    assert m1 is not attn and all(p.dtype == torch.float32 for p in m1.parameters())
    assert sigma1 == pytest.approx(gpt_value_output_norm(attn), rel=1e-4)  # n = 1: ||W_o W_v||
    torch.testing.assert_close(y1, reference(x))
    with torch.no_grad():  # the live weights change (a training step)
        attn.c_proj.weight.mul_(2.0)
        attn.c_attn.weight.copy_(torch.randn(attn.c_attn.weight.shape, generator=torch.Generator().manual_seed(7)))
    sigma2, y2, m2 = measured()
    assert m2 is m1  # the same cached copy, not a new deep copy
    assert all(p.dtype == torch.bfloat16 for p in attn.parameters())  # the live module is untouched
    assert sigma2 == pytest.approx(gpt_value_output_norm(attn), rel=1e-4)
    assert abs(sigma2 - sigma1) > 0.1 * sigma1
    torch.testing.assert_close(y2, reference(x))
