"""Run these tests on one torch thread.

The models here are tiny: with two intra-op threads every small op becomes an OpenMP
parallel region, and on a machine whose other core is busy each region waits a scheduler
time slice for its second thread (measured: ~8 ms per LayerNorm of a (2, 32, 32) tensor,
a 20x slowdown). One thread is faster for tensors this small and immune to that.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
