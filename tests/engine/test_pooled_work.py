"""The update's work buffers from a buffer pool (as PODMonitor runs it) leave the state as it is
without one, bit for bit, even when every reused buffer still holds garbage from its last use."""

from __future__ import annotations

import pytest
import torch

from podmonitor import PODAccumulator, PODConfig, hugepages
from podmonitor.engine.lags import BLOCKS_FROM
from tests.conftest import random_causal_fields

L = 1024  # (L, L) float64 work buffers of 8 MiB: at least hugepages.MIN_BYTES, so the pool serves them
assert L >= BLOCKS_FROM and L * L * 8 >= hugepages.MIN_BYTES


def _state(acc: PODAccumulator) -> dict[str, object]:
    return {"mean": acc.mean_field, "back": acc.m2_back, "fwd": acc.m2_fwd, "entropy": acc.entropy_sum,
            "band": torch.cat(acc.chunks), "n": acc.n, "negative": acc.n_negative,
            "not_normalised": acc.n_not_normalised, "row_error": acc.max_row_sum_error}


def _same(a: dict[str, object], b: dict[str, object]) -> None:
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.fixture()
def poisoned(monkeypatch) -> list[int]:
    """Every buffer the pool hands out again is first filled with 0xFF bytes (NaN in floats);
    returns the list of the sizes so handed out."""
    reused: list[int] = []
    take = hugepages.BufferPool.take

    def poisoning_take(self, nbytes):
        buf, fresh = take(self, nbytes)
        if not fresh:
            buf[:] = b"\xff" * nbytes
            reused.append(nbytes)
        return buf, fresh

    monkeypatch.setattr(hugepages.BufferPool, "take", poisoning_take)
    return reused


def test_pooled_work_buffers_change_no_bit_of_the_state(poisoned):
    causal32 = random_causal_fields(5, L, seed=1, temperature=0.5).float()
    causal32[2, 7, 3] = -1e-6  # a negative entry: the negativity count reads the step's fields
    causal64 = random_causal_fields(3, L, seed=2, temperature=0.5)
    bidirectional = torch.softmax(torch.randn(3, L, L, generator=torch.Generator().manual_seed(3)), dim=-1)
    runs = [  # (config, batches): each accumulator sees several updates (the between-group term too)
        (PODConfig(), [causal32[:2], causal32[2:4], causal32[4:]]),
        (PODConfig(), [causal64[:2], causal64[2:]]),
        (PODConfig(causal=False), [bidirectional[:2], bidirectional[2:]]),  # after causal users of the pool
        (PODConfig(), [causal32[:3], causal32[3:]]),  # after a bidirectional one
    ]
    pool = hugepages.BufferPool()
    for config, batches in runs:
        plain, pooled = PODAccumulator(config), PODAccumulator(config)
        for batch in batches:
            plain.update(batch)
            with hugepages.use_pool(pool):
                pooled.update(batch)
        _same(_state(plain), _state(pooled))
    assert len(poisoned) >= 20  # the pool did hand buffers out again, garbage and all
    assert hugepages.current_pool() is None
