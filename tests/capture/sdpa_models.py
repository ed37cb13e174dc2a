"""Small models that call scaled_dot_product_attention, written the way their authors write them.

nanoGPT (Karpathy's model.py, trimmed), a timm ViT block (``timm.models.vision_transformer``),
litgpt's sliding-window mask, grouped-query attention; used by tests/capture/test_sdpa*.py and
benchmarks/bench_capture.py. Each comes with an independent reference: the same weights, the
attention formed by hand (softmax of q k^T), no SDPA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


# ----------------------------------------------------------------------------- nanoGPT
@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 16
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def gpt_by_hand(gpt: GPT, idx: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits, per-layer (B, H, T, T) attention) of ``gpt`` computed by hand: no SDPA, no hooks."""
    cfg = gpt.config
    b, t = idx.shape
    hs = cfg.n_embd // cfg.n_head
    tr = gpt.transformer
    x = tr.wte.weight[idx] + tr.wpe.weight[:t]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    maps = []
    for block in tr.h:
        h = F.layer_norm(x, (cfg.n_embd,), block.ln_1.weight, block.ln_1.bias)
        qkv = h @ block.attn.c_attn.weight.T + block.attn.c_attn.bias
        q, k, v = (z.reshape(b, t, cfg.n_head, hs).permute(0, 2, 1, 3) for z in qkv.split(cfg.n_embd, dim=-1))
        att = ((q @ k.transpose(-1, -2)) / math.sqrt(hs)).masked_fill(~causal, -math.inf).softmax(-1)
        maps.append(att)
        y = (att @ v).permute(0, 2, 1, 3).reshape(b, t, cfg.n_embd)
        x = x + y @ block.attn.c_proj.weight.T + block.attn.c_proj.bias
        h = F.layer_norm(x, (cfg.n_embd,), block.ln_2.weight, block.ln_2.bias)
        h = F.gelu(h @ block.mlp.c_fc.weight.T + block.mlp.c_fc.bias)
        x = x + h @ block.mlp.c_proj.weight.T + block.mlp.c_proj.bias
    x = F.layer_norm(x, (cfg.n_embd,), tr.ln_f.weight, tr.ln_f.bias)
    return x @ gpt.lm_head.weight.T, maps


def token_data(n: int, seq: int, vocab: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    return TensorDataset(x, (x + 1) % vocab)


class NanoGPTModule(L.LightningModule):
    """A LightningModule around nanoGPT, as users write one; records its training losses."""

    def __init__(self, config: GPTConfig | None = None, n_train: int = 64, n_val: int = 160,
                 batch_size: int = 16) -> None:
        super().__init__()
        self.config = config or GPTConfig()
        self.model = GPT(self.config)
        self.n_train, self.n_val, self.batch_size = n_train, n_val, batch_size
        self.train_losses: list[float] = []
        self.val_losses: list[float] = []

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.train_losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self):
        return DataLoader(token_data(self.n_train, self.config.block_size, self.config.vocab_size, 0),
                          batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(token_data(self.n_val, self.config.block_size, self.config.vocab_size, 1),
                          batch_size=self.batch_size)


class EncoderDecoderGPTModule(NanoGPTModule):
    """nanoGPT whose first block attends both ways, T5-encoder style (timm's bidirectional SDPA
    attention, :class:`Attention`), and whose later blocks stay causal (``is_causal=True``): one
    validation step makes calls of both kinds over the same tokens."""

    def __init__(self, config: GPTConfig | None = None, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.model.transformer.h[0].attn = Attention(self.config.n_embd, num_heads=self.config.n_head, qkv_bias=True)


# ----------------------------------------------------------------------------- timm ViT block
class Attention(nn.Module):
    """timm.models.vision_transformer.Attention (fused path)."""

    fused_attn = True

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, norm_layer: type[nn.Module] = nn.LayerNorm) -> None:
        super().__init__()
        assert dim % num_heads == 0, "dim should be divisible by num_heads"
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class ViTBlock(nn.Module):
    """timm's Block without LayerScale / DropPath (identities at their defaults)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=True, qk_norm=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """Patch embedding, class token, position embedding, timm blocks."""

    def __init__(self, img: int = 16, patch: int = 4, dim: int = 32, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        n = (img // patch) ** 2
        self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, n + 1, dim))
        self.blocks = nn.Sequential(*[ViTBlock(dim, heads) for _ in range(depth)])

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(img).flatten(2).transpose(1, 2)  # (B, N, C)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.blocks(x)


# ----------------------------------------------------------------------------- litgpt-style sliding window
class SlidingWindowAttention(nn.Module):
    """litgpt's CausalSelfAttention mask handling with ``sliding_window_size``: a float additive mask."""

    def __init__(self, dim: int = 16, n_head: int = 2, sliding_window_size: int = 4) -> None:
        super().__init__()
        self.n_head = n_head
        self.sliding_window_size = sliding_window_size
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in self.qkv(x).split(C, -1))
        if mask is None:
            mask = torch.ones(T, T, dtype=q.dtype, device=q.device).triu(diagonal=1)
            mask.masked_fill_(mask.bool(), float("-inf"))
            mask = mask.view(1, 1, *mask.shape)
        sliding_window_bias = torch.ones_like(mask).tril(diagonal=-self.sliding_window_size)
        sliding_window_bias.masked_fill_(sliding_window_bias.bool(), float("-inf"))
        mask = mask + sliding_window_bias
        scale = 1.0 / math.sqrt(C // self.n_head)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale, is_causal=False)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


# ----------------------------------------------------------------------------- grouped-query attention
class GQAAttention(nn.Module):
    """Llama-style grouped-query attention; ``enable_gqa`` or K/V repeated by hand (``repeat_kv``)."""

    def __init__(self, dim: int = 32, n_head: int = 4, n_kv_head: int = 2, use_enable_gqa: bool = True) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, dim // n_head
        self.use_enable_gqa = use_enable_gqa
        self.q_proj = nn.Linear(dim, n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_head * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.use_enable_gqa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            rep = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # repeat_kv
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
