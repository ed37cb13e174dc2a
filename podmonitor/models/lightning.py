"""Lightning wrapper of :class:`~podmonitor.models.gpt.GPT` with the paper's optimisation.

Optimisation (METHOD.md section 9): AdamW, lr 3e-4, betas (0.9, 0.95), weight decay 0.1
on parameters with dim >= 2 only (matmul weights and embeddings), linear warm-up over
``warmup_steps`` (300) then cosine decay until ``max_steps`` (5000) down to
``min_lr_ratio * lr`` (0.1, as in nanoGPT; the method does not say where the cosine ends;
set 0.0 to decay to zero), constant after ``max_steps``. The schedule is stepped every
optimiser step.

Gradient clipping (1.0 in the paper) is NOT done here: set it on the Trainer,
``Trainer(gradient_clip_val=1.0, gradient_clip_algorithm="norm")``.

Capture protocol used by the podmonitor callback: :meth:`GPTLightningModule.attention_maps`,
:attr:`GPTLightningModule.attention_is_causal` and :attr:`GPTLightningModule.attention_zeros_above_diagonal`.

Example:
    >>> import lightning as L
    >>> from podmonitor.data import CharDataModule
    >>> dm = CharDataModule(block_size=128, batch_size=16)
    >>> model = GPTLightningModule.tiny(vocab_size=dm.vocab_size, attention="ega")
    >>> trainer = L.Trainer(max_steps=model.hparams.max_steps, gradient_clip_val=1.0)
    >>> trainer.fit(model, dm)  # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import lightning as L
import torch

from podmonitor.models.gpt import GPT, GPTConfig


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier at optimiser step ``step`` (0-based).

    Linear warm-up ``(step + 1) / warmup_steps`` for ``step < warmup_steps``, then cosine
    from 1 down to ``min_lr_ratio`` at ``max_steps``, then constant ``min_lr_ratio``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr_ratio
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr_ratio + 0.5 * (1.0 - min_lr_ratio) * (1.0 + math.cos(math.pi * progress))


class GPTLightningModule(L.LightningModule):
    """Character-level GPT (softmax or EGA attention) for training with Lightning.

    Every constructor argument is a plain value, so LightningCLI can build it from YAML
    and ``save_hyperparameters()`` makes checkpoints reload with
    ``GPTLightningModule.load_from_checkpoint(path)``. The model variant is decided by
    ``attention`` ("softmax" | "ega"), ``ega_gate`` ("causal" | "window") and
    ``pos_encoding`` ("learned" | "mope"): there is one class for all variants.

    Args:
        vocab_size, block_size, n_layer, n_head, n_embd, mlp_ratio, dropout, bias,
        attention, ega_gate, ega_alpha_init, ega_tau_init, pos_encoding: see
            :class:`~podmonitor.models.gpt.GPTConfig` (defaults: the paper model).
        lr: peak learning rate.
        beta1, beta2: AdamW betas.
        weight_decay: applied to parameters with dim >= 2 only.
        warmup_steps: linear warm-up length in optimiser steps.
        max_steps: end of the cosine decay (set the Trainer's ``max_steps`` to match).
        min_lr_ratio: final learning rate as a fraction of ``lr``.

    Logs ``train_loss`` (every step) and ``val_loss`` (epoch mean), in nats per token.
    """

    def __init__(
        self,
        vocab_size: int = 65,
        block_size: int = 256,
        n_layer: int = 6,
        n_head: int = 8,
        n_embd: int = 256,
        mlp_ratio: int = 4,
        dropout: float = 0.1,
        bias: bool = True,
        attention: str = "softmax",
        ega_gate: str = "causal",
        ega_alpha_init: float = 2.0,
        ega_tau_init: float = 0.0,
        pos_encoding: str = "learned",
        lr: float = 3e-4,
        beta1: float = 0.9,
        beta2: float = 0.95,
        weight_decay: float = 0.1,
        warmup_steps: int = 300,
        max_steps: int = 5000,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            mlp_ratio=mlp_ratio,
            dropout=dropout,
            bias=bias,
            attention=attention,  # type: ignore[arg-type]
            ega_gate=ega_gate,  # type: ignore[arg-type]
            ega_alpha_init=ega_alpha_init,
            ega_tau_init=ega_tau_init,
            pos_encoding=pos_encoding,  # type: ignore[arg-type]
        )
        self.model = GPT(self.config)

    # ----------------------------------------------------------------- presets
    @classmethod
    def _from_config(cls, config: GPTConfig, **overrides: Any) -> GPTLightningModule:
        fields = asdict(config)
        accepted = {k: v for k, v in fields.items() if k in _CONFIG_ARGS}
        accepted.update(overrides)
        return cls(**accepted)

    @classmethod
    def paper(cls, **overrides: Any) -> GPTLightningModule:
        """The paper model (:meth:`GPTConfig.paper`) with the paper's optimisation."""
        return cls._from_config(GPTConfig.paper(), **overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> GPTLightningModule:
        """:meth:`GPTConfig.tiny` with a CPU-friendly schedule: lr 3e-3, 25 warm-up steps,
        cosine to step 500 (override any of them). With ``CharDataModule(block_size=128,
        batch_size=16)`` and ``Trainer(max_steps=500, gradient_clip_val=1.0)`` it reaches
        about 2.15 nats/char (softmax) / 2.13 (EGA-causal) validation loss in 4-8 minutes
        on 2 shared CPU cores (see :meth:`GPTConfig.tiny`)."""
        defaults: dict[str, Any] = dict(lr=3e-3, warmup_steps=25, max_steps=500)
        defaults.update(overrides)
        return cls._from_config(GPTConfig.tiny(), **defaults)

    # ----------------------------------------------------------------- forward / steps
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids (B, T)."""
        logits, _ = self.model(idx)
        return logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        _, loss = self.model(x, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        _, loss = self.model(x, y)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True, batch_size=x.size(0))
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.model.optim_groups(hp.weight_decay), lr=hp.lr, betas=(hp.beta1, hp.beta2))
        warmup, total, floor = int(hp.warmup_steps), int(hp.max_steps), float(hp.min_lr_ratio)

        def lr_lambda(step: int) -> float:  # a plain function: LambdaLR stores no state for it
            return warmup_cosine(step, warmup, total, floor)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }

    # ----------------------------------------------------------------- capture protocol
    @property
    def attention_is_causal(self) -> bool:
        """True: every returned attention matrix is lower-triangular (query i attends to
        keys j <= i), so lag signals are one-sided (METHOD.md section 2).

        This is about the mask of the matrix, which is causal for every variant. The
        EGA "window" gate additionally lets the matrix depend on future tokens through
        its standardisation statistics (see :attr:`information_is_causal`).
        """
        return True

    @property
    def attention_zeros_above_diagonal(self) -> bool:
        """True: :meth:`attention_maps` writes +0 at every key after its query (the explicit
        path's probabilities; tested), so the monitor's stability signals need not check those
        entries (see :class:`~podmonitor.capture.ProtocolAdapter`)."""
        return True

    @property
    def information_is_causal(self) -> bool:
        """False only for EGA with the non-causal "window" gate (it leaks future tokens)."""
        return not (self.config.attention == "ega" and self.config.ega_gate == "window")

    def attention_maps(self, batch: Any) -> list[torch.Tensor]:
        """Per layer (B, n_head, T, T) float32 post-softmax attention actually applied to V,
        for this validation batch, computed in eval mode without gradients.

        Args:
            batch: ``(x, y)`` as yielded by the validation dataloader (``y`` is ignored),
                or a bare (B, T) tensor of token ids.

        Returns:
            One tensor per layer, on the module's device; for EGA the gated, renormalised
            matrix. The train/eval mode of every submodule is restored afterwards.
        """
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        x = x.to(self.device)
        modes = {m: m.training for m in self.modules()}
        self.eval()
        try:
            with torch.no_grad():
                _, _, attentions = self.model(x, return_attention=True)
        finally:
            for m, mode in modes.items():
                m.training = mode
        return [a.float() for a in attentions]


_CONFIG_ARGS = frozenset(
    [
        "vocab_size",
        "block_size",
        "n_layer",
        "n_head",
        "n_embd",
        "mlp_ratio",
        "dropout",
        "bias",
        "attention",
        "ega_gate",
        "ega_alpha_init",
        "ega_tau_init",
        "pos_encoding",
    ]
)

__all__ = ["GPTLightningModule", "warmup_cosine"]
