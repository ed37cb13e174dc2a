"""Tests of the character-level data module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from podmonitor.data import CharDataModule
from podmonitor.data.shakespeare import FixedWindows, read_default_text

N_CHARS = 1_115_394


@pytest.fixture(scope="module")
def dm() -> CharDataModule:
    dm = CharDataModule(block_size=64, batch_size=8)
    dm.setup("fit")
    return dm


def test_shipped_file_size_and_vocabulary(dm: CharDataModule) -> None:
    text = read_default_text()
    assert len(text) == N_CHARS
    assert dm.vocab_size == 65
    assert dm.vocab == sorted(set(text))
    assert dm.vocab[0] == "\n" and dm.vocab[1] == " "


def test_encode_decode_round_trip(dm: CharDataModule) -> None:
    s = "First Citizen:\nBefore we proceed any further, hear me speak."
    ids = dm.encode(s)
    assert all(0 <= i < 65 for i in ids)
    assert dm.decode(ids) == s
    assert dm.decode(torch.tensor(ids)) == s
    whole = torch.cat([dm.train_data, dm.val_data])
    assert dm.decode(whole) == dm.text


def test_split_sizes(dm: CharDataModule) -> None:
    n_train = int(N_CHARS * 0.9)
    assert dm.train_data.numel() == n_train == 1_003_854
    assert dm.val_data.numel() == N_CHARS - n_train == 111_540
    assert dm.decode(dm.val_data[:20]) == dm.text[n_train : n_train + 20]


def test_validation_windows_fixed_and_non_overlapping(dm: CharDataModule) -> None:
    batches_a = list(dm.val_dataloader())
    batches_b = list(CharDataModule(block_size=64, batch_size=8).val_dataloader())
    assert len(batches_a) == len(batches_b) == -(-((111_540 - 1) // 64) // 8)
    for (xa, ya), (xb, yb) in zip(batches_a, batches_b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    x = torch.cat([b[0] for b in batches_a])  # (n_windows, T)
    y = torch.cat([b[1] for b in batches_a])
    assert x.shape == ((111_540 - 1) // 64, 64)
    # inputs tile the validation text without overlap; targets are shifted by one
    assert torch.equal(x.reshape(-1), dm.val_data[: x.numel()])
    assert torch.equal(y.reshape(-1), dm.val_data[1 : x.numel() + 1])
    # and a second pass of the same loader gives the same windows
    assert torch.equal(next(iter(dm.val_dataloader()))[0], batches_a[0][0])


def test_max_val_windows() -> None:
    dm = CharDataModule(block_size=32, batch_size=4, max_val_windows=10)
    assert len(dm.val_dataloader().dataset) == 10
    with pytest.raises(IndexError):
        FixedWindows(torch.arange(100), 32, max_windows=2)[2]


def test_training_windows_random_seeded_and_shifted(dm: CharDataModule) -> None:
    loader = dm.train_dataloader()
    assert len(loader) == (dm.train_data.numel() // 64) // 8
    x, y = next(iter(loader))
    assert x.shape == y.shape == (8, 64)
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = next(iter(CharDataModule(block_size=64, batch_size=8).train_dataloader()))
    assert torch.equal(x, x2)  # same seed, same windows
    x3, _ = next(iter(CharDataModule(block_size=64, batch_size=8, seed=1).train_dataloader()))
    assert not torch.equal(x, x3)
    it = iter(loader)
    assert not torch.equal(next(it)[0], next(it)[0])


def test_custom_path_and_samples_per_epoch(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("abcabcabd" * 50, encoding="utf-8")
    dm = CharDataModule(path=str(path), block_size=8, batch_size=2, train_samples_per_epoch=6)
    assert dm.vocab_size == 4 and dm.vocab == ["a", "b", "c", "d"]
    dm.setup()
    assert dm.train_data.numel() == 405 and dm.val_data.numel() == 45
    assert len(dm.train_dataloader()) == 3
    assert len(dm.val_dataloader().dataset) == (45 - 1) // 8
    with pytest.raises(ValueError):
        CharDataModule(val_fraction=1.0)


def test_unigram_cross_entropy_is_the_literal_formula() -> None:
    """-mean over validation characters of log((count_train(c) + 1) / (n_train + V)), by counting."""
    import collections
    import math

    dm = CharDataModule(block_size=64, batch_size=4)
    text = dm.text
    n_train = int(len(text) * 0.9)
    counts = collections.Counter(text[:n_train])
    total = n_train + dm.vocab_size
    literal = -sum(math.log((counts[c] + 1) / total) for c in text[n_train:]) / (len(text) - n_train)
    assert dm.unigram_cross_entropy() == pytest.approx(literal, rel=1e-9)
    assert 3.3 < literal < 3.4
