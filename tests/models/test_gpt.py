"""Tests of the reference GPT: the monitored (explicit) path against the fused path,
the materialised attention against the layer output, causality, MoPE, generation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from podmonitor.models.gpt import GPT, GPTConfig, MorletPositionalEncoding

VARIANTS = [
    dict(attention="softmax", pos_encoding="learned"),
    dict(attention="softmax", pos_encoding="mope"),
    dict(attention="ega", ega_gate="causal", pos_encoding="learned"),
    dict(attention="ega", ega_gate="causal", pos_encoding="mope"),
    dict(attention="ega", ega_gate="window", pos_encoding="learned"),
    dict(attention="ega", ega_gate="window", pos_encoding="mope"),
]
IDS = ["-".join(str(v) for v in d.values()) for d in VARIANTS]


def small_config(**kw: object) -> GPTConfig:
    base: dict[str, object] = dict(vocab_size=65, block_size=32, n_layer=3, n_head=4, n_embd=32, dropout=0.1)
    base.update(kw)
    return GPTConfig(**base)  # type: ignore[arg-type]


def perturbed(model: GPT, scale: float = 0.5, seed: int = 0) -> GPT:
    """Move every parameter away from its (near-symmetric) init so attention is far from
    uniform and EGA gates differ between keys; keeps MoPE's constrained parametrisation."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gain"):
                p.fill_(0.5)
            elif p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * scale / math.sqrt(p.shape[-1]))
            else:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def make_model(seed: int = 0, **kw: object) -> GPT:
    torch.manual_seed(seed)
    return perturbed(GPT(small_config(**kw)), seed=seed).eval()


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_monitored_forward_equals_fused(variant: dict) -> None:
    model = make_model(**variant)
    idx = torch.randint(0, 65, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, loss = model(idx, idx)
        logits_m, loss_m, atts = model(idx, idx, return_attention=True)
    torch.testing.assert_close(logits_m, logits, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(loss_m, loss, atol=1e-6, rtol=1e-6)
    assert len(atts) == model.config.n_layer
    for a in atts:
        assert a.dtype == torch.float32
        assert a.shape == (3, 4, 32, 32)


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_monitored_forward_equals_fused_float64(variant: dict) -> None:
    """In float64 the two paths agree to rounding: they compute the same function."""
    model = make_model(**variant).double()
    idx = torch.randint(0, 65, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, _ = model(idx)
        logits_m, _, _ = model(idx, return_attention=True)
    torch.testing.assert_close(logits_m, logits, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_attention_reproduces_fused_output(variant: dict) -> None:
    """Recompute each layer's attention output as A @ V from the RETURNED attention and
    the layer's own V, and compare with the fused-path output of an unmonitored forward."""
    model = make_model(**variant)
    idx = torch.randint(0, 65, (2, 32), generator=torch.Generator().manual_seed(3))
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    hooks = []
    for l, block in enumerate(model.transformer.h):

        def hook(mod, args, out, l=l):  # noqa: ANN001
            inputs[l] = args[0].detach()
            outputs[l] = out[0].detach()

        hooks.append(block.attn.register_forward_hook(hook))
    with torch.no_grad():
        model(idx)  # fused path: hooks record each layer's input and output
        fused_in, fused_out = dict(inputs), dict(outputs)
        _, _, atts = model(idx, return_attention=True)
    for h in hooks:
        h.remove()
    T = idx.size(1)
    upper = torch.ones(T, T, dtype=torch.bool).triu(1)
    for l, (block, a) in enumerate(zip(model.transformer.h, atts, strict=True)):
        torch.testing.assert_close(inputs[l], fused_in[l], atol=1e-6, rtol=1e-5)
        _, _, v = block.attn.qkv(fused_in[l])  # (B, nh, T, hs)
        y = block.attn.merge_heads(a @ v)  # (B, T, C)
        torch.testing.assert_close(y, fused_out[l], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]), atol=1e-6, rtol=0)
        assert torch.all(a[..., upper] == 0)
        assert torch.all(a >= 0)


def test_attention_is_not_trivial() -> None:
    """Guard for the test above: the perturbed model's attention is neither uniform nor
    the identity, so A @ V == fused output is a real check."""
    model = make_model()
    idx = torch.randint(0, 65, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, _, atts = model(idx, return_attention=True)
    a = atts[0][0, 0]  # (T, T)
    uniform = torch.ones(32, 32).tril() / torch.arange(1, 33).unsqueeze(1)
    assert (a - uniform).abs().max() > 0.05
    assert (a - torch.eye(32)).abs().max() > 0.05


def test_attention_matches_naive_reference() -> None:
    """Layer 0's returned attention equals a per-head loop written from the definition."""
    model = make_model()
    idx = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, _, atts = model(idx, return_attention=True)
        block = model.transformer.h[0]
        x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(16))
        x = block.ln_1(x)
        W, b = block.attn.c_attn.weight, block.attn.c_attn.bias
        C, nh = 32, 4
        hs = C // nh
        for bi in range(2):
            for h in range(nh):
                q = x[bi] @ W[h * hs : (h + 1) * hs].T + b[h * hs : (h + 1) * hs]
                k = x[bi] @ W[C + h * hs : C + (h + 1) * hs].T + b[C + h * hs : C + (h + 1) * hs]
                for i in range(16):
                    s = torch.tensor([q[i] @ k[j] / math.sqrt(hs) for j in range(i + 1)])
                    p = torch.exp(s - s.max())
                    p = p / p.sum()
                    torch.testing.assert_close(atts[0][bi, h, i, : i + 1], p, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("pos_encoding", ["learned", "mope"])
def test_future_token_does_not_change_past_logits(pos_encoding: str) -> None:
    model = make_model(pos_encoding=pos_encoding)
    idx = torch.randint(0, 65, (2, 32), generator=torch.Generator().manual_seed(5))
    t = 20
    idx2 = idx.clone()
    idx2[:, t] = (idx[:, t] + 7) % 65
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(idx2)
    torch.testing.assert_close(a[:, :t], b[:, :t], atol=1e-6, rtol=0)
    assert (a[:, t:] - b[:, t:]).abs().max() > 1e-3  # the change does propagate forward


def test_init_loss_is_log_vocab_and_weights_tied() -> None:
    torch.manual_seed(0)
    model = GPT(small_config(dropout=0.0)).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    idx = torch.randint(0, 65, (4, 32))
    targets = torch.randint(0, 65, (4, 32))
    with torch.no_grad():
        _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(65)) < 0.05
    w = model.transformer.h[0].mlp.c_fc.weight
    assert abs(w.std().item() - 0.02) < 0.002
    w = model.transformer.h[0].mlp.c_proj.weight
    assert abs(w.std().item() - 0.02 / math.sqrt(2 * 3)) < 0.002


def test_optim_groups_decay_only_matrices() -> None:
    model = GPT(small_config(attention="ega", pos_encoding="mope"))
    decay, no_decay = model.optim_groups(0.1)
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    n = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert n == sum(p.numel() for p in model.parameters())  # tied weight counted once


def test_presets() -> None:
    paper = GPTConfig.paper()
    assert (paper.n_layer, paper.n_head, paper.n_embd, paper.block_size) == (6, 8, 256, 256)
    assert paper.mlp_ratio * paper.n_embd == 1024 and paper.dropout == 0.1
    tiny = GPTConfig.tiny(attention="ega")
    assert tiny.attention == "ega" and tiny.n_layer == 4
    with pytest.raises(ValueError):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError):
        GPTConfig(attention="linear")  # type: ignore[arg-type]


def test_mope_constraint_holds_under_adversarial_optimisation() -> None:
    """Gradient steps that push omega * sigma down (and omega up) cannot break
    omega_i sigma_i >= 5."""
    pe = MorletPositionalEncoding(n_embd=32, block_size=64)
    omega, sigma = pe.omega_sigma()
    assert torch.all(omega * sigma >= 5.0 * (1 - 1e-6))
    opt = torch.optim.Adam(pe.parameters(), lr=0.5)
    for _ in range(50):
        omega, sigma = pe.omega_sigma()
        loss = (omega * sigma).sum() + sigma.sum() - omega.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    omega, sigma = pe.omega_sigma()
    assert torch.all(torch.isfinite(omega)) and torch.all(torch.isfinite(sigma))
    assert torch.all(omega * sigma >= 5.0 * (1 - 1e-6))
    assert (omega * sigma).min() < 5.01  # the optimiser did reach the bound


def test_mope_encoding_formula() -> None:
    pe = MorletPositionalEncoding(n_embd=8, block_size=16)
    with torch.no_grad():
        pe.gain.fill_(1.0)
        out = pe(16)  # (T, C)
        omega, sigma = pe.omega_sigma()
    assert out.shape == (16, 8)
    t = torch.arange(16.0)
    for i in range(4):
        env = torch.exp(-(t**2) / (2 * sigma[i] ** 2))
        torch.testing.assert_close(out[:, 2 * i], torch.cos(omega[i] * t) * env)
        torch.testing.assert_close(out[:, 2 * i + 1], torch.sin(omega[i] * t) * env)
    # log-spaced initial frequencies from 1 rad/token down to pi / block_size
    torch.testing.assert_close(omega[0], torch.tensor(1.0))
    torch.testing.assert_close(omega[-1], torch.tensor(math.pi / 16))


def test_generate_shapes_and_range() -> None:
    model = make_model()
    idx = torch.zeros(2, 5, dtype=torch.long)
    out = model.generate(idx, max_new_tokens=40, temperature=0.8, top_k=10)  # > block_size total
    assert out.shape == (2, 45)
    assert torch.equal(out[:, :5], idx)
    assert out.min() >= 0 and out.max() < 65


def test_training_mode_uses_dropout_and_grads_flow() -> None:
    model = make_model(attention="ega", pos_encoding="mope").train()
    idx = torch.randint(0, 65, (2, 32))
    _, loss = model(idx, idx)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # dropout active: two training forwards differ
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(idx)
    assert not torch.allclose(a, b)
    # the cross-entropy helper is the plain mean over tokens
    model.eval()
    with torch.no_grad():
        logits, loss = model(idx, idx)
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 65), idx.reshape(-1)))


@pytest.mark.parametrize("variant", VARIANTS[:3], ids=IDS[:3])
def test_attention_without_gradients_is_the_same_as_with_them(variant: dict) -> None:
    """Without autograd the softmax runs in place (less memory to fault in); the maps are the
    same bits as those of the ordinary softmax taken while gradients are recorded, and forward-mode
    AD under ``no_grad`` (which cannot write in place) still gets its tangent."""
    model = make_model(**variant)
    idx = torch.randint(0, 65, (2, 32), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        _, _, fast = model(idx, return_attention=True)
    _, _, plain = model(idx, return_attention=True)  # gradients on: the out-of-place softmax
    assert plain[0].requires_grad
    for a, b in zip(fast, plain, strict=True):
        assert torch.equal(a, b.detach())

    attn = model.transformer.h[0].attn
    x = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(7))
    v = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        out_ng, tan_ng = torch.func.jvp(lambda z: attn(z, return_attention=True)[1], (x,), (v,))
    out_g, tan_g = torch.func.jvp(lambda z: attn(z, return_attention=True)[1], (x,), (v,))
    assert torch.equal(out_ng, out_g) and torch.equal(tan_ng, tan_g)
    assert tan_g.abs().max() > 0  # a real tangent


@pytest.mark.parametrize("parts", ["whole blocks", "blocks in parts"])
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_blocked_masking_without_gradients_gives_the_ordinary_maps(variant: dict, parts: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Longer than one block of query rows (MASK_ROWS), and not a multiple of it: without autograd
    the probabilities are computed block by block on the keys each block can see (scores, scale,
    gate, mask and softmax; keys right of a block only written as zeros); the maps are the same
    bits as those of the whole-tensor ops that run while gradients are recorded (so are the
    layer outputs: the second layer's maps agree too), and every row is a causal distribution.
    "blocks in parts": the rows of each block in parts of MIN_SUB_ROWS rows (what a long context
    with many heads gets, where a block's scores would not stay in cache)."""
    from podmonitor.models import gpt


    # several blocks, the last one partial; eight blocks for one plain and one gated variant (there
    # the whole-map product of the probabilities with V rounds differently from the blocks')
    t = (8 if variant in (VARIANTS[0], VARIANTS[3]) else 2) * gpt.MASK_ROWS + 37
    model = make_model(block_size=t, n_layer=2, **variant)
    if parts == "blocks in parts":  # the scores of 2 sequences x 4 heads x 24 rows of t keys: parts of 16 rows
        monkeypatch.setattr(gpt, "SUB_BLOCK_BYTES", 2 * 4 * 24 * t * 4)
        calls = []
        real_softmax = torch.softmax

        def counting_softmax(x, *a, **kw):
            calls.append(x.shape[-2])
            return real_softmax(x, *a, **kw)

        monkeypatch.setattr(torch, "softmax", counting_softmax)
    idx = torch.randint(0, 65, (2, t), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        fast_logits, _, fast = model(idx, return_attention=True)
    plain_logits, _, plain = model(idx, return_attention=True)
    assert torch.equal(fast_logits, plain_logits.detach())
    if parts == "blocks in parts":
        assert set(calls) == {gpt.MIN_SUB_ROWS, 37 % gpt.MIN_SUB_ROWS}  # (the last block: 37 rows)
        monkeypatch.setattr(torch, "softmax", real_softmax)
    for a, b in zip(fast, plain, strict=True):
        assert torch.equal(a, b.detach())
        assert torch.count_nonzero(a.triu(1)) == 0
        torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]), rtol=0, atol=1e-5)

    # one layer's output against the literal product of its probabilities with V, and, in
    # training mode with attention dropout, the same dropped-out output on both paths
    attn = model.transformer.h[0].attn
    x = torch.randn(2, t, 32, generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        y, att = attn(x, return_attention=True)
        q, k, v = attn.qkv(x)
        literal = attn.merge_heads(attn.apply_head_mask(att @ v))
    torch.testing.assert_close(y, literal, rtol=1e-5, atol=1e-6)
    attn.train()
    attn.dropout = attn.attn_dropout.p = 0.3
    torch.manual_seed(13)
    with torch.no_grad():
        y_fast, att_fast = attn(x, return_attention=True)
    torch.manual_seed(13)
    y_plain, att_plain = attn(x, return_attention=True)
    assert torch.equal(att_fast, att_plain.detach()) and torch.equal(y_fast, y_plain.detach())
    attn.eval()
    with torch.no_grad():
        assert not torch.allclose(y_fast, attn(x, return_attention=True)[0])  # the dropout acted


def test_attention_under_autocast_vmap_and_compile_is_what_the_ordinary_ops_give() -> None:
    """The capture's shortcuts (out= buffers, in-place softmax) give way where they would change
    the result or fail: under autocast (which skips out= calls; on CUDA it would run the softmax
    in float32, not run here) the maps are those of the ordinary ops; vmap and a full-graph
    torch.compile without gradients (which cannot trace the huge-page set-up) work and agree with
    the eager maps."""
    model = make_model()
    attn = model.transformer.h[0].attn
    x = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            fast = attn(x, return_attention=True)[1]
        plain = attn(x, return_attention=True)[1].detach()  # gradients on: the ordinary ops
    assert fast.dtype == plain.dtype == torch.bfloat16
    assert torch.equal(fast, plain)

    with torch.no_grad():
        eager = attn(x, return_attention=True)[1]
        mapped = torch.func.vmap(lambda z: attn(z.unsqueeze(0), return_attention=True)[1].squeeze(0))(x)
        compiled = torch.compile(lambda z: attn(z, return_attention=True)[1], backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(mapped, eager, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)
