"""Fixtures and small models for the smoothness tests (all on one torch thread)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from podmonitor.models.gpt import CausalSelfAttention, GPTConfig


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def gpt_attention(attention: str = "softmax", n_embd: int = 8, n_head: int = 2, block_size: int = 64,
                  gain: float = 1.0, seed: int = 0, ega_gate: str = "causal") -> CausalSelfAttention:
    """A reference-GPT attention sub-layer in eval mode; ``gain`` scales the query/key/value weights
    (N(0, 0.02) weights make attention nearly uniform: a gain of 10-30 makes it non-trivial)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=11, block_size=block_size, n_layer=1, n_head=n_head, n_embd=n_embd, dropout=0.0,
                    attention=attention, ega_gate=ega_gate)  # type: ignore[arg-type]
    attn = CausalSelfAttention(cfg)
    for p in attn.parameters():
        nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        attn.c_attn.weight.mul_(gain)
    return attn.eval()


def value_output_norm(w_v: torch.Tensor, w_o: torch.Tensor) -> float:
    """||W_o W_v||_2 for torch-Linear weights (out, in): the map x -> W_o W_v x, in float64."""
    return float(torch.linalg.matrix_norm(w_o.detach().double() @ w_v.detach().double(), ord=2))


def gpt_value_output_norm(attn: CausalSelfAttention) -> float:
    c = attn.n_embd
    return value_output_norm(attn.c_attn.weight[2 * c :], attn.c_proj.weight)


class TinyHFLM(L.LightningModule):
    """A Hugging Face GPT-2 built from a small random config (nothing downloaded)."""

    def __init__(self, seq_len: int = 32, vocab: int = 20) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=16, n_layer=2, n_head=2,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.model = GPT2LMHeadModel(cfg)
        self.vocab = vocab

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        out = self.model(input_ids=x, labels=x)
        return out.loss


class TinyMHAModel(L.LightningModule):
    """nn.TransformerEncoder (two layers, causal mask) over embedded tokens."""

    def __init__(self, seq_len: int = 32, vocab: int = 20, dim: int = 16, causal: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.causal = causal
        self.seq_len = seq_len

    def forward(self, x):
        t = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t) if self.causal else None
        return self.head(self.encoder(self.emb(x), mask=mask, is_causal=self.causal))

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        logits = self(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1))


def token_loader(n: int = 8, seq_len: int = 32, vocab: int = 20, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randint(0, vocab, (n, seq_len), generator=g)), batch_size=batch_size)


SQRT = math.sqrt
