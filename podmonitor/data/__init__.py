"""Data modules for the reference models; ships a copy of TinyShakespeare
(``tinyshakespeare.txt``, 1,115,394 characters, 65 symbols)."""

from podmonitor.data.shakespeare import CharDataModule

__all__ = ["CharDataModule"]
