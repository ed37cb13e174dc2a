"""A small decoder-only GPT (nanoGPT-style) with optional Energy-Gated Attention and
Morlet positional encoding: the reference models of METHOD.md section 9.

The whole forward pass fits on one screen:

    idx (B, T) -> wte(idx) + PE(T) -> dropout
               -> n_layer x [x + attn(ln_1(x)); x + mlp(ln_2(x))]   (pre-LayerNorm)
               -> ln_f -> lm_head (tied to wte) -> logits (B, T, vocab)

Attention has two code paths that compute the same function:

* the fused path, ``F.scaled_dot_product_attention`` (``is_causal=True`` for plain
  softmax attention; for EGA the gate is folded into an additive float mask, since
  ``softmax(s + log g) = A g / sum(A g)`` exactly), used whenever no attention
  probabilities are requested;
* the explicit (math) path, used when ``forward(..., return_attention=True)``: it
  materialises the post-softmax probabilities that multiply V and returns them.

In fp32 and eval mode the two paths agree to about 1e-6 (tested).

Head mask: every attention layer holds a buffer ``head_mask`` (nh,) of ones; each head's
output (B, nh, T, hs) is multiplied by it before the output projection, in both paths, so
``attn.set_head_mask([1, 0, 1, 1])`` silences head 1 (reversibly: ``clear_head_mask()``). It
is the xi of Michel et al. 2019 and what :mod:`podmonitor.pruning` uses to prune heads.

Energy-Gated Attention (EGA), per head h (METHOD.md section 9):

    e_t  = w_h . x_t + b_h                      (x: the layer-normed block input)
    z    = standardised e                       ("causal": prefix statistics; "window": whole window)
    g    = sigmoid(alpha_h (z - tau_h))         (alpha_h = 2, tau_h = 0 at init, both learnable)
    Ahat = A_ij g_ij / sum_k A_ik g_ik          (A: the causal softmax attention)
    out  = Ahat V

With ``ega_gate="causal"`` (default) the statistics of query i use only keys j <= i:
``z_ij = (e_j - mean_{k<=i} e_k) / std_{k<=i} e``, so the gate depends on (i, j).
With ``ega_gate="window"`` (the published form) the statistics are taken over the whole
window, ``z_j = (e_j - mean_k e_k) / std_k e``: this is NON-CAUSAL -- every query sees
statistics of future tokens, so changing a later token changes earlier logits. It is kept
only to reproduce the published numbers.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Literal

import torch
import torch.nn as nn
from torch.nn import functional as F

from podmonitor import hugepages
from podmonitor.capture.reduce import Reduction, current_reduction, step_reduction

AttentionKind = Literal["softmax", "ega"]
EGAGate = Literal["causal", "window"]
PosEncoding = Literal["learned", "mope"]


@dataclass
class GPTConfig:
    """Hyperparameters of :class:`GPT`.

    Defaults are the paper configuration (METHOD.md section 9): 6 layers, 8 heads,
    width 256, context 256, MLP 1024, dropout 0.1, learned absolute positions.

    Args:
        vocab_size: number of symbols (65 for TinyShakespeare).
        block_size: maximum context length T.
        n_layer: number of transformer blocks.
        n_head: number of attention heads per block.
        n_embd: residual width C (must be divisible by ``n_head``; even for MoPE).
        mlp_ratio: MLP hidden width is ``mlp_ratio * n_embd``.
        dropout: dropout on embeddings, attention probabilities, residual branches.
        bias: biases in Linear layers and LayerNorms.
        attention: ``"softmax"`` (plain causal attention) or ``"ega"`` (energy-gated).
        ega_gate: ``"causal"`` (prefix statistics, default) or ``"window"`` (whole-window
            statistics, the published form; NON-CAUSAL, leaks future tokens).
        ega_alpha_init: initial gate sharpness alpha_h (per head, learnable).
        ega_tau_init: initial gate threshold tau_h (per head, learnable).
        ega_eps: added to the variance before the square root when standardising the
            energies; it also makes the std of a 1-element prefix (zero variance) safe:
            z = 0 there, so g = sigmoid(-alpha tau).
        pos_encoding: ``"learned"`` (absolute position embedding) or ``"mope"`` (Morlet).
        mope_omega_sigma_min: lower bound enforced on omega_i * sigma_i (5 in the method).
        scaled_residual_init: GPT-2 init: the residual output projections (``c_proj``)
            get std ``0.02 / sqrt(2 n_layer)`` instead of 0.02.
    """

    vocab_size: int = 65
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 8
    n_embd: int = 256
    mlp_ratio: int = 4
    dropout: float = 0.1
    bias: bool = True
    attention: AttentionKind = "softmax"
    ega_gate: EGAGate = "causal"
    ega_alpha_init: float = 2.0
    ega_tau_init: float = 0.0
    ega_eps: float = 1e-5
    pos_encoding: PosEncoding = "learned"
    mope_omega_sigma_min: float = 5.0
    scaled_residual_init: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.attention not in ("softmax", "ega"):
            raise ValueError(f"attention must be 'softmax' or 'ega', got {self.attention!r}")
        if self.ega_gate not in ("causal", "window"):
            raise ValueError(f"ega_gate must be 'causal' or 'window', got {self.ega_gate!r}")
        if self.pos_encoding not in ("learned", "mope"):
            raise ValueError(f"pos_encoding must be 'learned' or 'mope', got {self.pos_encoding!r}")
        if self.pos_encoding == "mope" and self.n_embd % 2 != 0:
            raise ValueError("MoPE needs an even n_embd (cos/sin pairs)")

    @classmethod
    def paper(cls, **overrides: Any) -> GPTConfig:
        """The paper's model: 6 layers, 8 heads, width 256, context 256, MLP 1024, dropout 0.1."""
        return replace(cls(), **overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> GPTConfig:
        """A CPU-sized model: 4 layers, 4 heads, width 128, context 128, MLP 512, no dropout
        (0.80M parameters).

        Measured with :meth:`GPTLightningModule.tiny <podmonitor.models.lightning.GPTLightningModule.tiny>`
        (AdamW lr 3e-3, 25 warm-up steps, cosine to step 500, clip 1.0) and
        ``CharDataModule(block_size=128, batch_size=16)``, one torch thread, on 2 CPU cores
        shared with other jobs: after 500 steps the validation loss (all 871 windows) was
        2.152 nats/char for softmax attention (392 s) and 2.132 for EGA-causal (486 s);
        below 2.2 between steps 400 and 500 (at step 400: softmax 2.223, EGA 2.192).
        Without contention a step takes about 0.3 s
        (softmax) / 0.45 s (EGA) on one core.
        """
        base = cls(block_size=128, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
        return replace(base, **overrides)


class EnergyGate(nn.Module):
    """The EGA gate of one layer, returned as ``log g`` so it can be added to the scores.

    ``log_gate(x)`` has shape (B, nh, T, T) for the causal gate (g depends on query i and
    key j) and (B, nh, 1, T) for the window gate (one gate per key, shared by all queries).
    Entries above the diagonal are meaningless; the caller masks them.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.mode: EGAGate = config.ega_gate
        self.eps = config.ega_eps
        self.energy = nn.Linear(config.n_embd, config.n_head, bias=True)  # e = w_h . x + b_h
        self.alpha = nn.Parameter(torch.full((config.n_head,), float(config.ega_alpha_init)))
        self.tau = nn.Parameter(torch.full((config.n_head,), float(config.ega_tau_init)))

    def standardised_energy(self, x: torch.Tensor) -> torch.Tensor:
        """z of the method: (B, nh, T, T) [query i, key j] for "causal", (B, nh, 1, T) for "window"."""
        e = self.energy(x).transpose(1, 2)  # (B, nh, T)
        if self.mode == "window":
            mean = e.mean(dim=-1, keepdim=True)  # (B, nh, 1)
            var = e.var(dim=-1, unbiased=False, keepdim=True)  # (B, nh, 1)
            z = (e - mean) / torch.sqrt(var + self.eps)  # (B, nh, T)
            return z.unsqueeze(-2)  # (B, nh, 1, T)
        # causal: running mean / variance over the prefix k <= i, by cumulative sums.
        # Shifting by e_0 (which lies in every prefix, so the shift is causal) leaves the
        # variance unchanged and limits the cancellation in E[c^2] - E[c]^2.
        T = e.size(-1)
        c = e - e[..., :1]  # (B, nh, T)
        n = torch.arange(1, T + 1, device=e.device, dtype=e.dtype)  # (T,)
        mean = c.cumsum(dim=-1) / n  # (B, nh, T)   mean_{k<=i}
        var = (c.square().cumsum(dim=-1) / n - mean.square()).clamp_min(0.0)  # (B, nh, T)
        std = torch.sqrt(var + self.eps)  # (B, nh, T), >= sqrt(eps) (1-element prefix: var = 0)
        return (c.unsqueeze(-2) - mean.unsqueeze(-1)) / std.unsqueeze(-1)  # (B, nh, T_q, T_k)

    def log_gate(self, x: torch.Tensor) -> torch.Tensor:
        """log g = logsigmoid(alpha_h (z - tau_h)); shape as :meth:`standardised_energy`."""
        z = self.standardised_energy(x)
        alpha = self.alpha.view(1, -1, 1, 1)
        tau = self.tau.view(1, -1, 1, 1)
        return F.logsigmoid(alpha * (z - tau))


@lru_cache(maxsize=8)
def _above_diagonal(T: int, device: torch.device) -> torch.Tensor:
    """(T, T) bool, True where the key is later than the query (j > i): what causal attention masks."""
    return torch.ones(T, T, dtype=torch.bool, device=device).triu(1)


def _ordinary(*tensors: torch.Tensor) -> bool:
    """Whether the capture's shortcuts (``out=`` buffers, in-place softmax) must give way to the
    ordinary ops: autograd records, autocast would choose the dtype (it skips ``out=`` calls), or
    ``torch.compile`` is tracing."""
    return (torch.is_grad_enabled() or any(t.requires_grad for t in tensors)
            or torch.is_autocast_enabled(tensors[0].device.type) or torch.compiler.is_compiling())


#: query rows per block of the explicit causal attention (:func:`_causal_attention`)
MASK_ROWS = 128


#: bytes of scores per part of a block in the blocked attention without autograd (see
#: :func:`_causal_attention_blocked`)
SUB_BLOCK_BYTES = 8 * 2**20

#: the fewest rows of such a part
MIN_SUB_ROWS = 16


def _row_blocks(T: int) -> list[tuple[int, int]]:
    """Query rows ``[r0, r1)`` in blocks of :data:`MASK_ROWS`: a block's rows see the keys ``[0, r1)``."""
    return [(r0, min(T, r0 + MASK_ROWS)) for r0 in range(0, T, MASK_ROWS)]


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      log_g: torch.Tensor | None,
                      dropout: nn.Module | None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Causal attention with its probabilities: q, k, v (B, nh, T, hs), log_g broadcastable to
    (B, nh, T, T) ((B, nh, T|1, T)) or None, ``dropout`` the attention dropout when it is active
    (training with p > 0), else None.

    Returns:
        att: (B, nh, T, T) softmax(q k^T * scale (+ log g)), zero where the key is later than the
            query; None when a capture's reduction took it block by block
            (:func:`~podmonitor.capture.reduce.reducing`, without dropout).
        y: (B, nh, T, hs) dropout(att) @ v.

    With autograd, autocast or ``torch.compile`` (:func:`_ordinary`) the probabilities come from
    the ordinary whole-tensor ops. Otherwise the work goes in blocks of :data:`MASK_ROWS` query rows
    in one reused buffer: rows ``[r0, r1)`` take the scores, scaling, gate, diagonal mask and
    softmax of the keys ``[0, r1)`` they can see, and (without dropout) their output while the
    block is in cache; the keys right of ``r1`` are written as zeros. About half the arithmetic
    and memory traffic of whole rows at long contexts, and the same bits: block ends are
    multiples of :data:`MASK_ROWS`, so a row's sums run over the same lanes as whole rows whose
    later keys add exact zeros, and the output is taken by the same blocks on both paths
    (:func:`_causal_product`; tested against the ordinary ops). Where ``out=`` is refused
    (forward-mode AD, vmap) before anything is written, the ordinary ops run.
    """
    if not _ordinary(q, k, v, *(() if log_g is None else (log_g,))):
        try:
            att, y = _causal_attention_blocked(q, k, v if dropout is None else None, scale, log_g)
        except RuntimeError:  # forward-mode AD, vmap: out= is refused before anything is written
            pass
        else:
            if att is None:  # reduced by the capture (no dropout then)
                return None, y
            return att, (y if dropout is None else _causal_product(dropout(att), v))
    scores = (q @ k.transpose(-2, -1)).mul_(scale)  # (B, nh, T, T)
    if log_g is not None:
        scores = scores.add_(log_g)
    scores = scores.masked_fill_(_above_diagonal(q.size(-2), q.device), float("-inf"))
    att = F.softmax(scores, dim=-1)
    return att, _causal_product(att if dropout is None else dropout(att), v)


#: head sizes below this take the product of probabilities and values turned around (:func:`_attend`)
TURN_BELOW_HEAD_SIZE = 16


def _attend(att: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """att @ v: att (..., rows, keys), v (..., keys, hs) -> (..., rows, hs).

    Both causal paths take their outputs through it, so that they agree bit for bit. Below a head
    size of :data:`TURN_BELOW_HEAD_SIZE` it is taken as (v^T att^T)^T (a transposed view): on CPU
    about 3x to 4x faster at head size 8, and 0.92x to 0.98x as fast (the same bits) at head sizes
    16 to 64 (``benchmarks/bench_attend.py``)."""
    if v.size(-1) >= TURN_BELOW_HEAD_SIZE:
        return att @ v
    return (v.transpose(-2, -1) @ att.transpose(-2, -1)).transpose(-2, -1)


def _part_rows(lead: int, T: int, element_size: int) -> int:
    """Rows per part of a :data:`MASK_ROWS`-row block for ``lead`` (B * nh) rows of ``T`` scores:
    at most :data:`SUB_BLOCK_BYTES` of scores, a power of two (the parts of a block are equal), at
    least :data:`MIN_SUB_ROWS`."""
    fit = SUB_BLOCK_BYTES // max(1, lead * T * element_size)
    return MASK_ROWS if fit >= MASK_ROWS else max(MIN_SUB_ROWS, 1 << max(0, fit.bit_length() - 1))


def _parts(T: int, rows_per: int) -> list[tuple[int, int, int]]:
    """``(s0, s1, r1)``: the rows ``[s0, s1)`` of each block of :func:`_row_blocks` in parts of
    ``rows_per``, with ``r1`` the end of their block (the keys they see)."""
    return [(s0, min(r1, s0 + rows_per), r1) for r0, r1 in _row_blocks(T) for s0 in range(r0, r1, rows_per)]


def _causal_product(att: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """att @ v for causal probabilities over the keys each row can see (the keys right of a block
    hold zeros and add nothing), in the parts of rows of :func:`_causal_attention_blocked`
    (:func:`_parts`), so that both give the same bits: att (B, nh, T, T), v (B, nh, T, hs) ->
    (B, nh, T, hs)."""
    T = att.size(-1)
    rows_per = _part_rows(att.shape[:-2].numel(), T, att.element_size())
    return torch.cat([_attend(att[..., s0:s1, :r1], v[..., :r1, :]) for s0, s1, r1 in _parts(T, rows_per)], dim=-2)


def _causal_attention_blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scale: float,
                              log_g: torch.Tensor | None, *, reduce_into: Reduction | None = None,
                              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """:func:`_causal_attention` without autograd, in blocks of query rows (shapes there); the
    output only when ``v`` is given (None: the caller takes it after dropout).

    The probabilities go into a fresh buffer advised as huge pages (:mod:`podmonitor.hugepages`:
    one of the monitor's pool while it captures); a block's scores into a reused work buffer.
    Within a capture's :func:`~podmonitor.capture.reduce.reducing` block (and without dropout),
    each block goes to the capture's reduction instead, and no probabilities are returned (None).
    ``reduce_into``: feed this reduction whether or not ``v`` is given (pass None for ``v``: the
    validation step's own forward keeps its fused output, :meth:`CausalSelfAttention._reduce_in_step`).
    """
    T = q.size(-2)
    lead = q.shape[:-2]  # (B, nh)
    reduction = reduce_into
    if reduction is None and v is not None and len(lead) == 2:
        reduction = current_reduction()
    probs = None if reduction is not None else hugepages.empty((*lead, T, T), q.dtype, q.device)
    layer = None  # the reduction's layer, once a block is formed (out= may be refused before)
    work = hugepages.scratch((lead.numel() * min(T, MASK_ROWS) * T,), q.dtype, q.device)
    # a reduction reads the probabilities and the centred scores they came from (its entropy
    # needs no logarithm per entry, LayerReduction.add): the probabilities go to a second buffer,
    # and the masked keys hold a finite score (their probability is +0 all the same)
    probs_work = None if reduction is None else hugepages.scratch(work.shape, q.dtype, q.device)
    masked = float("-inf") if reduction is None else torch.finfo(q.dtype).min / 2
    upper = _above_diagonal(min(T, MASK_ROWS), q.device)
    # the rows of a block in parts of at most SUB_BLOCK_BYTES of scores, so that each part's passes
    # (scores, softmax, reduction, output) run in cache (at 2 x 12 heads and L = 1024 a block of
    # 128 rows holds 12 MiB); a part's rows see the keys of their block, as the block's own rows
    # (a power of two, so that the parts of a block are equal: the products of a few rows may round
    # differently from those of many; _causal_product takes the same parts, _parts)
    rows_per = _part_rows(lead.numel(), T, q.element_size())
    outputs = []
    for r0, r1 in _row_blocks(T):
        for s0 in range(r0, r1, rows_per):
            s1 = min(r1, s0 + rows_per)
            seen = work[: lead.numel() * (s1 - s0) * r1].view(*lead, s1 - s0, r1)  # keys rows s0..s1-1 can see
            torch.matmul(q[..., s0:s1, :], k[..., :r1, :].transpose(-2, -1), out=seen)
            seen.mul_(scale)
            if log_g is not None:
                seen.add_(log_g[..., :r1] if log_g.size(-2) == 1 else log_g[..., s0:s1, :r1])
            seen[..., r0:r1].masked_fill_(upper[s0 - r0: s1 - r0, : r1 - r0], masked)
            if reduction is not None:
                # less the row maximum first: softmax subtracts the same value, so the same bits
                centred = seen.sub_(seen.amax(dim=-1, keepdim=True))
                seen = torch.softmax(centred, dim=-1, out=probs_work[: centred.numel()].view(centred.shape))
                if layer is None:
                    layer = reduction.layer(lead[0], lead[1], T, True, q.device)
                layer.add(slice(None), s0, seen, centred=centred)  # head average and stability sums, in cache
            else:
                torch.softmax(seen, dim=-1, out=seen)
                probs[..., s0:s1, :r1].copy_(seen)
                probs[..., s0:s1, r1:].zero_()
            if v is not None:
                outputs.append(_attend(seen, v[..., :r1, :]))  # (B, nh, rows, hs), rows of _causal_product's block
    return probs, (torch.cat(outputs, dim=-2) if v is not None else None)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, optionally energy-gated (EGA)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.gate = EnergyGate(config) if config.attention == "ega" else None
        # head mask xi_h (Michel et al. 2019): each head's output is multiplied by it before the
        # output projection. Saved with the model; checkpoints without it load with all ones.
        self.register_buffer("head_mask", torch.ones(config.n_head))  # (nh,)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # checkpoints written before the head mask existed: every head active
        key = prefix + "head_mask"
        if key not in state_dict:
            state_dict[key] = torch.ones_like(self.head_mask)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def set_head_mask(self, mask: torch.Tensor | list[float]) -> None:
        """Set the head mask xi, (nh,): 1 keeps a head, 0 silences it (its output never reaches
        ``c_proj``); values in between scale it. Gradients do not flow into the buffer."""
        mask = torch.as_tensor(mask, dtype=self.head_mask.dtype, device=self.head_mask.device)
        if mask.shape != (self.n_head,):
            raise ValueError(f"head mask must have shape ({self.n_head},), got {tuple(mask.shape)}")
        if not torch.isfinite(mask).all():
            raise ValueError("head mask must be finite")
        self.head_mask.copy_(mask)

    def clear_head_mask(self) -> None:
        """Every head active again (mask of ones)."""
        self.head_mask.fill_(1.0)

    def apply_head_mask(self, y: torch.Tensor) -> torch.Tensor:
        """y (B, nh, T, hs) times the head mask: (nh,) for every sequence, or (B, nh) per sequence
        (the form used to take per-example gradients with respect to xi)."""
        m = self.head_mask
        return y * m.reshape(*m.shape, 1, 1).to(y.dtype)  # (nh, 1, 1) or (B, nh, 1, 1)

    def _reduce_in_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """While a capture reduces the validation step's own forward
        (:func:`~podmonitor.capture.reduce.reducing_in_step`; eval mode, no autograd), form this
        layer's probabilities from the same q and k in row blocks and hand them to the capture's
        reduction, without a second output; the layer's output stays the fused kernel's (what the
        step computes without a capture). With autograd (``v`` is checked too), autocast or
        ``torch.compile`` nothing is formed: the capture then runs its own forward
        (:meth:`GPTLightningModule.attention_maps`)."""
        reduction = step_reduction()
        if reduction is None or self.training or _ordinary(q, k, v):
            return
        t0 = time.perf_counter()
        _causal_attention_blocked(q, k, None, 1.0 / math.sqrt(k.size(-1)), None, reduce_into=reduction)
        reduction.step_seconds += time.perf_counter() - t0

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys, values, each (B, nh, T, hs), from the layer-normed input x (B, T, C)."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        return q, k, v

    def merge_heads(self, y: torch.Tensor) -> torch.Tensor:
        """(B, nh, T, hs) -> output projection of the concatenated heads, (B, T, C)."""
        B, nh, T, hs = y.size()
        y = y.transpose(1, 2).contiguous().view(B, T, nh * hs)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def forward(self, x: torch.Tensor, return_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, C) -> (y (B, T, C), attention (B, nh, T, T) or None).

        The returned attention holds the post-softmax probabilities that multiply V (for
        EGA the gated, renormalised matrix), before attention dropout (which is the
        identity in eval mode). It is only computed when ``return_attention`` is True.
        """
        T = x.size(1)
        q, k, v = self.qkv(x)  # (B, nh, T, hs)
        log_g = self.gate.log_gate(x) if self.gate is not None else None  # (B,nh,T|1,T) or None
        dropout_p = self.dropout if self.training else 0.0

        if not return_attention:
            # fused path (flash / memory-efficient / math kernel, chosen by torch)
            if log_g is None:
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
                self._reduce_in_step(q, k, v)
            else:
                causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()  # (T, T)
                mask = log_g.masked_fill(~causal, float("-inf"))  # (B, nh, T, T): causal + log g
                mask = mask.to(q.dtype)  # the fused kernels want a mask of the query's dtype
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
            return self.merge_heads(self.apply_head_mask(y)), None

        # explicit (math) path: materialise the probabilities,
        # scaled, gated (softmax(s + log g) = A g / sum(A g)) and causally masked
        dropout = self.attn_dropout if self.training and self.dropout > 0 else None
        # att (B, nh, T, T), rows sum to 1; y = dropout(att) @ v (B, nh, T, hs)
        att, y = _causal_attention(q, k, v, 1.0 / math.sqrt(k.size(-1)), log_g, dropout)
        return self.merge_heads(self.apply_head_mask(y)), att


class MLP(nn.Module):
    """Position-wise GELU MLP of hidden width ``mlp_ratio * n_embd``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, return_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        a, att = self.attn(self.ln_1(x), return_attention=return_attention)
        x = x + a  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x, att


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """x with softplus(x) = y, for y > 0."""
    return y + torch.log(-torch.expm1(-y))


class MorletPositionalEncoding(nn.Module):
    """Morlet positional encoding (MoPE) with learnable frequencies and widths.

    For pair i (``n_embd / 2`` pairs) and position t = 0..T-1::

        PE[t, 2i]   = gain * cos(omega_i t) * exp(-t^2 / (2 sigma_i^2))
        PE[t, 2i+1] = gain * sin(omega_i t) * exp(-t^2 / (2 sigma_i^2))

    Parametrisation (all in log space):

    * ``log_omega`` (n_pairs,): omega_i = exp(log_omega_i), in radians per token.
    * ``rho`` (n_pairs,): log sigma_i = log(c / omega_i) + softplus(rho_i), c = 5.
      So omega_i sigma_i = c * exp(softplus(rho_i)) > c for every parameter value: the
      constraint omega sigma >= 5 holds by construction (a smooth softplus
      reparametrisation, not a clamp, so gradients always reach both parameters).
    * ``gain`` (scalar, learnable, init 0.02): scales the encoding to the size of the
      N(0, 0.02) token embeddings so that, after the first pre-LayerNorm, position does
      not drown token identity at init. (Not part of the method's formula; an addition.)

    Initialisation: omega_i log-spaced from 1 rad/token (period ~6.3 tokens, the
    highest frequency of the classic sinusoidal encoding) down to pi / block_size (half
    a period over the context), and sigma_i = max(block_size, 1.05 c / omega_i): the
    envelope is nearly flat over the context at init (exp(-1/2) at t = block_size), so the
    encoding starts close to a sinusoidal one and training may localise it.
    """

    def __init__(self, n_embd: int, block_size: int, omega_sigma_min: float = 5.0) -> None:
        super().__init__()
        if n_embd % 2 != 0:
            raise ValueError("MoPE needs an even n_embd")
        n_pairs = n_embd // 2
        self.c = float(omega_sigma_min)
        omega = torch.logspace(
            math.log10(1.0), math.log10(math.pi / block_size), n_pairs, dtype=torch.float64
        )  # (n_pairs,)
        sigma = torch.clamp(torch.full_like(omega, float(block_size)), min=1.05 * self.c / omega)
        excess = torch.log(sigma * omega / self.c)  # = softplus(rho) > 0
        self.log_omega = nn.Parameter(omega.log().float())
        self.rho = nn.Parameter(_inverse_softplus(excess).float())
        self.gain = nn.Parameter(torch.tensor(0.02))

    def omega_sigma(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(omega, sigma), each (n_pairs,)."""
        omega = self.log_omega.exp()
        log_sigma = math.log(self.c) - self.log_omega + F.softplus(self.rho)
        return omega, log_sigma.exp()

    def forward(self, T: int) -> torch.Tensor:
        """The encoding of positions 0..T-1, (T, n_embd)."""
        omega, sigma = self.omega_sigma()  # (n_pairs,)
        t = torch.arange(T, device=omega.device, dtype=omega.dtype).unsqueeze(1)  # (T, 1)
        phase = t * omega  # (T, n_pairs)
        env = torch.exp(-t.square() / (2.0 * sigma.square()))  # (T, n_pairs)
        pe = torch.stack((torch.cos(phase) * env, torch.sin(phase) * env), dim=-1)  # (T, n_pairs, 2)
        return self.gain * pe.flatten(1)  # (T, n_embd): columns 2i (cos), 2i+1 (sin)


class GPT(nn.Module):
    """Decoder-only GPT with tied embeddings; see the module docstring.

    Example:
        >>> model = GPT(GPTConfig.tiny())
        >>> idx = torch.randint(0, 65, (2, 16))
        >>> logits, loss = model(idx, idx)
        >>> logits, loss, atts = model(idx, return_attention=True)  # atts[l]: (2, 4, 16, 16)
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        if config.pos_encoding == "learned":
            wpe: nn.Module = nn.Embedding(config.block_size, config.n_embd)
        else:
            wpe = MorletPositionalEncoding(config.n_embd, config.block_size, config.mope_omega_sigma_min)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=wpe,
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

        # init: N(0, 0.02) for every Linear / Embedding weight, zero biases; the GPT-2
        # scaled init std 0.02 / sqrt(2 n_layer) for the residual projections (c_proj).
        self.apply(self._init_weights)
        if config.scaled_residual_init:
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; the (tied) token embedding is counted once, positions excluded if asked."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= sum(p.numel() for p in self.transformer.wpe.parameters())
        return n

    def position_encoding(self, T: int, device: torch.device) -> torch.Tensor:
        """(T, C) positional term added to the token embeddings."""
        wpe = self.transformer.wpe
        if isinstance(wpe, MorletPositionalEncoding):
            return wpe(T)
        return wpe(torch.arange(T, dtype=torch.long, device=device))

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        return_attention: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """Run the model.

        Args:
            idx: token ids, (B, T) with T <= block_size.
            targets: next-token ids, (B, T), or None; -1 entries are ignored in the loss.
            return_attention: also return, per layer, the (B, nh, T, T) float32
                post-softmax attention applied to V (explicit math path; same output).

        Returns:
            ``(logits, loss)`` or ``(logits, loss, attentions)``; logits (B, T, vocab),
            loss a scalar (mean cross-entropy in nats) or None.
        """
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        tok = self.transformer.wte(idx)  # (B, T, C)
        pos = self.position_encoding(T, idx.device)  # (T, C)
        x = self.transformer.drop(tok + pos)  # (B, T, C)
        attentions: list[torch.Tensor] = []
        for block in self.transformer.h:
            x, att = block(x, return_attention=return_attention)
            if att is not None:
                attentions.append(att.float())  # (B, nh, T, T)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        if return_attention:
            return logits, loss, attentions
        return logits, loss

    def optim_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """AdamW parameter groups: decay every parameter with dim >= 2 (matmul weights,
        embeddings), none of the biases, LayerNorm weights, EGA alpha/tau, MoPE parameters."""
        params = {name: p for name, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``idx`` (B, T); returns (B, T + max_new_tokens).

        Put the model in eval mode first (``model.eval()``) for dropout-free sampling.
        """
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size :]  # crop to the context
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature  # (B, vocab)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


__all__ = [
    "GPTConfig",
    "GPT",
    "Block",
    "CausalSelfAttention",
    "EnergyGate",
    "MLP",
    "MorletPositionalEncoding",
]
