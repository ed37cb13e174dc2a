"""Character-level language-modelling data (TinyShakespeare by default).

Split: the first ``1 - val_fraction`` (90%) of the characters for training, the last
10% for validation, as in METHOD.md section 9. The vocabulary is the sorted set of
characters of the WHOLE text (65 symbols for the shipped file), as in nanoGPT.

Training samples: random windows. The training dataset is map-style over every start
offset of a (block_size + 1)-character window; the dataloader draws
``train_samples_per_epoch`` offsets per epoch uniformly WITH replacement through a
``RandomSampler`` driven by a ``torch.Generator`` seeded with ``seed``. The generator is
created in ``train_dataloader()`` and carries on across epochs (new windows every epoch);
it is not part of checkpoints, so a resumed run draws from the start of the sequence again.

Validation samples: FIXED, non-overlapping windows. Window k has input
``val[k*T : k*T + T]`` and target ``val[k*T + 1 : k*T + T + 1]`` (T = block_size): the
inputs tile the validation text without overlap, every validation character after the
first is a target exactly once (up to the incomplete tail, which is dropped), and the
order never changes -- the monitor sees the same snapshots at every validation run.
``max_val_windows`` keeps only the first windows (for speed).
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

DEFAULT_TEXT = "tinyshakespeare.txt"


def read_default_text() -> str:
    """The TinyShakespeare text shipped in ``podmonitor/data``."""
    return importlib.resources.files("podmonitor.data").joinpath(DEFAULT_TEXT).read_text(encoding="utf-8")


class RandomWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item ``o`` is the window starting at offset o: (x, y) = (d[o:o+T], d[o+1:o+T+1])."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        if data.numel() < block_size + 1:
            raise ValueError(f"text of {data.numel()} tokens is shorter than block_size + 1")
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return self.data.numel() - self.block_size

    def __getitem__(self, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[offset : offset + self.block_size + 1]  # (T + 1,)
        return chunk[:-1], chunk[1:]  # (T,), (T,)


class FixedWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows: item k = (d[kT : kT+T], d[kT+1 : kT+T+1])."""

    def __init__(self, data: torch.Tensor, block_size: int, max_windows: int | None = None) -> None:
        n = (data.numel() - 1) // block_size
        if max_windows is not None:
            n = min(n, max_windows)
        if n < 1:
            raise ValueError(f"text of {data.numel()} tokens is shorter than block_size + 1")
        self.data = data
        self.block_size = block_size
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= k < self.n:
            raise IndexError(k)
        start = k * self.block_size
        chunk = self.data[start : start + self.block_size + 1]  # (T + 1,)
        return chunk[:-1], chunk[1:]  # (T,), (T,)


class CharDataModule(L.LightningDataModule):
    """Character-level data module; see the module docstring for the sampling.

    Args:
        path: a UTF-8 text file; None (default) uses the shipped TinyShakespeare.
        block_size: context length T of every sample.
        batch_size: samples per batch (training and validation).
        num_workers: DataLoader workers.
        train_samples_per_epoch: random training windows per epoch; None means
            ``len(train_text) // block_size`` (about one pass over the training tokens).
        max_val_windows: keep only the first validation windows; None keeps all.
        val_fraction: fraction of the text, at the end, used for validation.
        seed: seed of the training sampler's generator.

    Example:
        >>> dm = CharDataModule(block_size=128, batch_size=32)
        >>> dm.vocab_size
        65
        >>> dm.decode(dm.encode("To be"))
        'To be'
    """

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 256,
        batch_size: int = 64,
        num_workers: int = 0,
        train_samples_per_epoch: int | None = None,
        max_val_windows: int | None = None,
        val_fraction: float = 0.1,
        seed: int = 1337,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.save_hyperparameters()
        self.path = path
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.train_samples_per_epoch = train_samples_per_epoch
        self.max_val_windows = max_val_windows
        self.val_fraction = val_fraction
        self.seed = seed
        self._text: str | None = None
        self._stoi: dict[str, int] = {}
        self._itos: list[str] = []
        self.train_data: torch.Tensor | None = None  # (N_train,) int64
        self.val_data: torch.Tensor | None = None  # (N_val,) int64

    # ----------------------------------------------------------------- text and vocabulary
    @property
    def text(self) -> str:
        """The whole text (read once, lazily)."""
        if self._text is None:
            if self.path is None:
                self._text = read_default_text()
            else:
                self._text = Path(self.path).read_text(encoding="utf-8")
            self._itos = sorted(set(self._text))
            self._stoi = {ch: i for i, ch in enumerate(self._itos)}
        return self._text

    @property
    def vocab(self) -> list[str]:
        """The symbols, sorted; symbol i has id i."""
        _ = self.text
        return list(self._itos)

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters (65 for TinyShakespeare)."""
        _ = self.text
        return len(self._itos)

    def encode(self, s: str) -> list[int]:
        """String -> token ids (KeyError for a character outside the vocabulary)."""
        _ = self.text
        return [self._stoi[c] for c in s]

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Token ids (a list or a 1-D tensor) -> string."""
        _ = self.text
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self._itos[i] for i in ids)

    def unigram_cross_entropy(self) -> float:
        """The unigram baseline in nats per character: the cross-entropy on the validation text of
        the training text's character frequencies (add-one smoothed, so unseen symbols stay finite).
        A model that learns anything about context goes below it (3.35 for TinyShakespeare)."""
        train, val = self._require_setup()
        counts = torch.bincount(train, minlength=self.vocab_size).double() + 1.0  # (V,)
        log_p = counts.log() - counts.sum().log()
        return float(-log_p[val].mean())

    # ----------------------------------------------------------------- Lightning hooks
    def setup(self, stage: str | None = None) -> None:
        if self.train_data is not None:
            return
        data = torch.tensor(self.encode(self.text), dtype=torch.long)  # (N,)
        n_train = int(len(data) * (1.0 - self.val_fraction))
        self.train_data = data[:n_train]
        self.val_data = data[n_train:]

    def _require_setup(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.train_data is None or self.val_data is None:
            self.setup()
        assert self.train_data is not None and self.val_data is not None
        return self.train_data, self.val_data

    def train_dataloader(self) -> DataLoader:
        train, _ = self._require_setup()
        dataset = RandomWindows(train, self.block_size)
        n = self.train_samples_per_epoch or max(1, train.numel() // self.block_size)
        generator = torch.Generator().manual_seed(self.seed)
        sampler = RandomSampler(dataset, replacement=True, num_samples=n, generator=generator)
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            drop_last=True,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        _, val = self._require_setup()
        dataset = FixedWindows(val, self.block_size, self.max_val_windows)
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            drop_last=False,
            persistent_workers=self.num_workers > 0,
        )


__all__ = ["CharDataModule", "FixedWindows", "RandomWindows", "read_default_text"]
