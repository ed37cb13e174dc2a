"""Reference models of METHOD.md section 9: a nanoGPT-style character GPT with optional
Energy-Gated Attention (EGA) and Morlet positional encoding (MoPE), and its Lightning
wrapper implementing podmonitor's capture protocol (``attention_maps``)."""

from podmonitor.models.gpt import GPT, GPTConfig, MorletPositionalEncoding
from podmonitor.models.lightning import GPTLightningModule

__all__ = ["GPT", "GPTConfig", "GPTLightningModule", "MorletPositionalEncoding"]
