"""Tiny LightningModules for the callback tests (fast on 2 CPU cores)."""

from __future__ import annotations

import math

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyCausalAttention(nn.Module):
    """Explicit causal self-attention that can return its probabilities."""

    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, H, T, hs)
        scores = q @ k.transpose(-1, -2) / math.sqrt(c // self.n_head)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # (B, H, T, T)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y), att


class TinyGPT(L.LightningModule):
    """Two attention layers over random tokens; implements the capture protocol."""

    def __init__(self, vocab: int = 16, dim: int = 16, n_head: int = 2, n_layer: int = 2, seq_len: int = 32,
                 n_train: int = 64, n_val: int = 48, batch_size: int = 8, nan_layer: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(seq_len, dim))
        self.layers = nn.ModuleList(TinyCausalAttention(dim, n_head) for _ in range(n_layer))
        self.head = nn.Linear(dim, vocab)
        self.attention_calls = 0

    def forward(self, idx: torch.Tensor, return_attention: bool = False):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        atts = []
        for layer in self.layers:
            y, att = layer(x)
            x = x + y
            atts.append(att)
        logits = self.head(x)
        return (logits, atts) if return_attention else logits

    def _loss(self, batch):
        x, y = batch
        logits = self(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", loss)
        return loss

    def attention_maps(self, batch) -> list[torch.Tensor]:
        self.attention_calls += 1
        was_training = self.training
        self.eval()
        with torch.no_grad():
            _, atts = self(batch[0], return_attention=True)
        self.train(was_training)
        atts = [a.float() for a in atts]
        if self.hparams.nan_layer is not None:
            atts[self.hparams.nan_layer][0, 0, 3, 1] = float("nan")  # first sequence of every batch
        return atts

    @property
    def attention_is_causal(self) -> bool:
        return True

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def _data(self, n: int, seed: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        # a learnable sequence: next token = (token + 1) mod vocab, with noise
        x = torch.randint(0, self.hparams.vocab, (n, self.hparams.seq_len), generator=g)
        y = (x + 1) % self.hparams.vocab
        return DataLoader(TensorDataset(x, y), batch_size=self.hparams.batch_size)

    def train_dataloader(self):
        return self._data(self.hparams.n_train, 0)

    def val_dataloader(self):
        return self._data(self.hparams.n_val, 1)
