"""Measured head importance (METHOD.md section 7): gates, forward ablation, greedy drops.

References, all independent of :mod:`podmonitor.pruning.heads`:
* masking by hand: a deep copy of the model whose output projection has head h's input slice
  zeroed in its weight (columns of an ``nn.Linear``, rows of transformers' ``Conv1D``), so the
  head's output cannot reach the residual stream whatever it computes;
* the KL divergence of the two models' next-token distributions, written out with numpy;
* synthetic models whose answer is known: a head with a zero output projection does nothing, and
  in a layer where one head carries the whole signal it is the last head left.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from podmonitor.models.gpt import GPT, GPTConfig
from podmonitor.pruning import HeadGates
from podmonitor.pruning.ablation import Measurer, greedy_drop_order, measured_drop, single_head_damage

V, T, C, H = 17, 12, 32, 4
#: parameter-name parts of the first layer's q/k/v projections, for every model below
FIRST_INPUT_PROJECTIONS = ("blocks.0.attn.c_attn", "blocks.0.attn.qkv", "transformer.h.0.attn.c_attn",
                           "encoder.layer.0.attention.self", "encoder.layers.0.self_attn.in_proj")


# ----------------------------------------------------------------------------- models people write
class NanoAttention(nn.Module):
    """nanoGPT's CausalSelfAttention (flash path): c_attn, F.scaled_dot_product_attention, c_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.n_head = H
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class TimmAttention(nn.Module):
    """timm's Attention written out by hand (fused_attn=False): qkv, softmax(q k^T * scale), proj."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = H
        self.scale = (C // H) ** -0.5
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, H, c // H).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1) * self.scale).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, c))


class TinyLM(nn.Module):
    """Embedding, two pre-LN attention blocks of ``attn_cls``, an LM head: logits (B, T, V)."""

    def __init__(self, attn_cls: type[nn.Module]) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln": nn.LayerNorm(C), "attn": attn_cls()}) for _ in range(2))
        self.head = nn.Linear(C, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for blk in self.blocks:
            x = x + blk["attn"](blk["ln"](x))
        return self.head(x)


class EncoderLM(nn.Module):
    """A causal LM on nn.TransformerEncoder, batch_first, as the PyTorch tutorial writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, C)
        layer = nn.TransformerEncoderLayer(C, H, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(C, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        return self.head(self.encoder(self.wte(idx), mask=mask, is_causal=True))


def reference_gpt() -> nn.Module:
    return GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=H, n_embd=C, dropout=0.0))


def hf_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=C, n_layer=2, n_head=H,
                                  attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def hf_bert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=C, num_hidden_layers=2, num_attention_heads=H,
                                  intermediate_size=64, max_position_embeddings=T, attn_implementation="eager",
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertModel(cfg, add_pooling_layer=False)


def logits_of(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    out = model(idx)
    if isinstance(out, tuple):  # the reference GPT: (logits, loss)
        out = out[0]
    for attr in ("logits", "last_hidden_state"):
        if hasattr(out, attr):
            out = getattr(out, attr)
    return out


def projections(model: nn.Module, kind: str) -> list[tuple[nn.Module, bool]]:
    """Each layer's output projection and whether its input runs along the weight's rows (Conv1D)."""
    if kind == "reference":
        return [(b.attn.c_proj, False) for b in model.transformer.h]
    if kind == "hf_gpt2":
        return [(b.attn.c_proj, True) for b in model.transformer.h]
    if kind == "hf_bert":
        return [(lay.attention.output.dense, False) for lay in model.encoder.layer]
    if kind == "torch_mha":
        return [(lay.self_attn.out_proj, False) for lay in model.encoder.layers]
    return [(b["attn"].c_proj if hasattr(b["attn"], "c_proj") else b["attn"].proj, False) for b in model.blocks]


def masked_by_hand(model: nn.Module, kind: str, heads: dict[int, list[int]]) -> nn.Module:
    """A copy with head h's slice of each named layer's output-projection input zeroed in the weight."""
    twin = copy.deepcopy(model)
    hd = C // H
    with torch.no_grad():
        for i, (proj, rows) in enumerate(projections(twin, kind)):
            for h in heads.get(i, []):
                if rows:
                    proj.weight[h * hd:(h + 1) * hd, :] = 0
                else:
                    proj.weight[:, h * hd:(h + 1) * hd] = 0
    return twin


MODELS = {
    "reference": (reference_gpt, "reference"),
    "hf_gpt2": (hf_gpt2, "huggingface"),
    "hf_bert": (hf_bert, "huggingface"),
    "torch_mha": (EncoderLM, "torch_mha"),
    "sdpa": (lambda: TinyLM(NanoAttention), "sdpa"),
    "projection": (lambda: TinyLM(TimmAttention), "projection"),
}


@pytest.fixture(params=sorted(MODELS))
def model_kind(request):
    torch.manual_seed(0)
    make, gate_kind = MODELS[request.param]
    return make().eval(), request.param, gate_kind


def test_auto_finds_the_kind_and_zeroed_heads_equal_masking_by_hand(model_kind):
    model, name, gate_kind = model_kind
    idx = torch.randint(0, V, (3, T))
    gates = HeadGates(model)
    assert gates.kind == gate_kind
    assert gates.n_heads == [H, H]
    with torch.no_grad():  # (no_grad both times: nn.MultiheadAttention's fast path rounds differently)
        plain = logits_of(model, idx)
    for heads in ({0: [1]}, {1: [0, 3]}, {0: [2], 1: [1]}):
        want = logits_of(masked_by_hand(model, name, heads), idx)
        with torch.no_grad(), gates, gates.zeroed(heads):
            got = logits_of(model, idx)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (got - plain).abs().max() > 1e-4  # the head did matter
    with torch.no_grad():  # outside the gates the model is untouched
        torch.testing.assert_close(logits_of(model, idx), plain, rtol=0, atol=0)


def test_a_masked_head_contributes_nothing_whatever_it_computes(model_kind):
    """Scrambling the masked head's queries, keys and values changes nothing once it is gated."""
    model, name, _ = model_kind
    idx = torch.randint(0, V, (2, T))
    gates = HeadGates(model)
    with torch.no_grad(), gates, gates.zeroed({0: [2]}):
        before = logits_of(model, idx)
    scrambled = copy.deepcopy(model)
    hd = C // H
    with torch.no_grad():
        for p_name, p in scrambled.named_parameters():
            # the input projection of the first layer: q, k and v rows of head 2
            first = any(s in p_name for s in FIRST_INPUT_PROJECTIONS)
            if not first or p.dim() == 0:
                continue
            if name == "hf_gpt2":  # transformers' Conv1D: weight (C, 3C), bias (3C,)
                cols = torch.cat([torch.arange(j * C + 2 * hd, j * C + 3 * hd) for j in range(3)])
                p[..., cols] = torch.randn_like(p[..., cols]) * 3
            elif "encoder.layer.0.attention.self" in p_name:  # BERT query/key/value Linear (C, C)
                p[2 * hd:3 * hd] = torch.randn_like(p[2 * hd:3 * hd]) * 3
            else:  # fused (3C, C) Linear, rows q | k | v, heads of hd rows each
                rows = torch.cat([torch.arange(j * C + 2 * hd, j * C + 3 * hd) for j in range(3)])
                p[rows] = torch.randn_like(p[rows]) * 3
    gates2 = HeadGates(scrambled)
    with torch.no_grad(), gates2, gates2.zeroed({0: [2]}):
        after = logits_of(scrambled, idx)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert (logits_of(scrambled, idx) - logits_of(model, idx)).abs().max() > 1e-3  # the scramble is real


def kl_by_hand(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """(B,) mean over positions of KL(softmax p || softmax q), in numpy float64."""
    def log_softmax(z: np.ndarray) -> np.ndarray:
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))
    lp, lq = log_softmax(p_logits.astype(np.float64)), log_softmax(q_logits.astype(np.float64))
    return (np.exp(lp) * (lp - lq)).sum(-1).mean(-1)


def test_single_head_forward_ablation_equals_kl_of_the_hand_masked_model():
    torch.manual_seed(1)
    model = reference_gpt().eval()
    batches = [torch.randint(0, V, (4, T)) for _ in range(2)]
    gates = HeadGates(model)
    m = Measurer(model, gates, forward=lambda mod, b: mod(b)[0])
    with torch.inference_mode(), gates:
        total, count = single_head_damage(m, batches)
    assert m.cost.forward_passes == 2 * (1 + 2 * H)
    with torch.no_grad():
        for i in range(2):
            for h in range(H):
                twin = masked_by_hand(model, "reference", {i: [h]})
                want = sum(kl_by_hand(model(b)[0].numpy(), twin(b)[0].numpy()).sum() for b in batches)
                assert count[i, h] == 8
                assert math.isclose(float(total[i, h]), float(want), rel_tol=1e-4, abs_tol=1e-9)


def planted_model() -> nn.Module:
    """Reference GPT where layer 0 head 1 has a zero output projection and, in layer 1, head 3
    carries the whole signal (heads 0 to 2 of layer 1 have zero output projections)."""
    torch.manual_seed(2)
    model = reference_gpt().eval()
    hd = C // H
    with torch.no_grad():
        h = model.transformer.h
        h[0].attn.c_proj.weight[:, 1 * hd:2 * hd] = 0
        h[1].attn.c_proj.weight[:, :3 * hd] = 0
        h[1].attn.c_proj.weight[:, 3 * hd:] *= 4
    return model


def test_a_head_with_a_zero_output_projection_ranks_least_important():
    model = planted_model()
    batches = [torch.randint(0, V, (4, T)) for _ in range(2)]
    gates = HeadGates(model)
    m = Measurer(model, gates, forward=lambda mod, b: mod(b)[0])
    with torch.inference_mode(), gates:
        total, count = single_head_damage(m, batches)
        picked, _, _ = measured_drop(m, batches, 1, refine=False)
    damage = total / count
    assert damage[0, 1] == 0 and damage[1, :3].abs().max() == 0
    assert damage[0, [0, 2, 3]].min() > 1e-6 and damage[1, 3] > 1e-6
    assert picked[0] in {(0, 1), (1, 0), (1, 1), (1, 2)}  # zero-damage heads only


def test_the_head_that_carries_the_signal_is_kept_to_the_end():
    model = planted_model()
    batches = [torch.randint(0, V, (4, T)) for _ in range(2)]
    gates = HeadGates(model)
    m = Measurer(model, gates, forward=lambda mod, b: mod(b)[0])
    with torch.inference_mode(), gates:
        steps = greedy_drop_order(m, batches, 2 * H - 2)  # every head but one per layer
        picked, _, _ = measured_drop(m, batches, 2 * H - 2)  # the default advice: greedy in groups
    dropped = [(s.layer, s.head) for s in steps]
    assert (1, 3) not in dropped and (1, 3) not in picked
    assert set(dropped[:4]) == {(0, 1), (1, 0), (1, 1), (1, 2)}  # the four that do nothing go first
    assert [s.set_damage for s in steps[:4]] == [0.0] * 4
    assert len(set(picked)) == 2 * H - 2
