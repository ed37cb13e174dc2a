"""podmonitor.hugepages: large buffers advised as transparent huge pages, checked in the kernel's
own accounting (/proc/self/smaps), and left alone where the advice does not apply."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from podmonitor import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
LINUX_THP = sys.platform.startswith("linux") and THP.exists() and "[never]" not in THP.read_text()


def anon_huge_kib(ptr: int) -> int:
    """AnonHugePages (KiB) of the mapping of /proc/self/smaps that holds address ``ptr``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def thp_fallbacks() -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


def thp_disabled_for_this_process() -> bool:
    """THP turned off for this process (prctl PR_SET_THP_DISABLE, some container set-ups)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("THP_enabled:"):
            return line.split()[1] == "0"
    return False


@pytest.mark.skipif(not LINUX_THP, reason="needs Linux with transparent huge pages not set to never")
def test_a_large_buffer_is_faulted_in_by_huge_pages_and_holds_what_is_written():
    if thp_disabled_for_this_process():
        pytest.skip("transparent huge pages are disabled for this process")
    before = thp_fallbacks()
    # 64 MiB: above glibc's largest mmap threshold, so freshly mapped (not reused heap memory)
    t = hugepages.empty((16, 1024, 1024), torch.float32)
    assert hugepages.advise(t)  # (again: harmless)
    t.fill_(0.25)
    # (the advice splits the mapping: the interior from the first 2 MiB boundary is its own)
    huge = anon_huge_kib(-(-t.data_ptr() // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE)
    if huge == 0 and thp_fallbacks() > before:
        pytest.skip("the kernel had no free huge page to give")
    assert huge >= 2048  # at least one 2 MiB page backs the buffer
    assert bool((t == 0.25).all())

    hugepages.ENABLED = False
    try:
        small = hugepages.empty((8, 1024, 1024), torch.float32)
        assert not hugepages.advise(small)
    finally:
        hugepages.ENABLED = True


def test_small_buffers_and_other_devices_are_plain_empty_tensors():
    t = hugepages.empty((3, 5), torch.float64)
    assert t.shape == (3, 5) and t.dtype == torch.float64
    assert not hugepages.advise(t)  # below MIN_BYTES
    meta = torch.empty(64, 1024, 1024, device="meta")
    assert not hugepages.advise(meta)
    strided = torch.empty(1024, 4096)[:, ::2]  # 8 MiB of values spread over 16 MiB: not advised
    assert not hugepages.advise(strided)


SHAPE = (4, 1024, 1024)  # 16 MiB of float32: at least MIN_BYTES, so the pool serves it


def test_a_pool_reuses_a_buffer_only_once_no_tensor_refers_to_it():
    pool = hugepages.BufferPool()
    with hugepages.use_pool(pool):
        a = hugepages.empty(SHAPE)
        a.fill_(1.0)
        ptr = a.data_ptr()
        view = a[1]  # a view of the buffer outlives the tensor it came from
        del a
        b = hugepages.empty(SHAPE)
        assert b.data_ptr() != ptr
        b.fill_(2.0)
        assert bool((view == 1.0).all())  # what a holder of the old maps sees is left alone
        del view
        c = hugepages.empty(SHAPE)
        assert c.data_ptr() == ptr  # nobody refers to it any more: the same memory again
        assert tuple(c.shape) == SHAPE and c.dtype == torch.float32 and c.is_contiguous()
        del c
        wide = hugepages.empty((3, 1024, 1024), torch.float32)  # another size (12 MiB): another buffer
        assert wide.data_ptr() not in (ptr, b.data_ptr())
        c = hugepages.empty((2, 1024, 1024), torch.float64)  # 16 MiB of float64: the free buffer
        assert c.data_ptr() == ptr and c.dtype == torch.float64
        small = hugepages.empty((8, 8))  # below MIN_BYTES: an ordinary tensor, not the pool's
        meta = hugepages.empty(SHAPE, device="meta")  # not on the CPU: not the pool's
    assert pool.nbytes == 2 * 16 * 2**20 + 12 * 2**20 and small.numel() == 64 and meta.is_meta
    outside = hugepages.empty(SHAPE)  # after the block: no pool
    assert outside.data_ptr() not in (ptr, b.data_ptr())
    pool.clear()
    assert pool.nbytes == 0
    c.fill_(3.0)  # a tensor still in use keeps its memory after the pool dropped it
    assert bool((c == 3.0).all()) and bool((b == 2.0).all())


def test_a_pool_serves_only_the_thread_that_set_it_and_pools_are_removed_by_identity():
    import threading

    pool, inner = hugepages.BufferPool(), hugepages.BufferPool()
    with hugepages.use_pool(pool):
        made: list[torch.Tensor] = []
        worker = threading.Thread(target=lambda: made.append(hugepages.empty(SHAPE)))
        worker.start()
        worker.join()
        assert made and pool.nbytes == 0  # the other thread had no pool
        with hugepages.use_pool(inner):
            hugepages.empty(SHAPE)
        hugepages.empty(SHAPE)
    assert inner.nbytes == pool.nbytes == 16 * 2**20
    assert hugepages.current_pool() is None  # nothing left in use in this thread
    # two users whose uses overlap (pushed a, b; removed a, b): each removes its own
    a, b = hugepages.BufferPool(), hugepages.BufferPool()
    hugepages.push_pool(a)
    hugepages.push_pool(b)
    hugepages.remove_pool(a)
    assert hugepages.current_pool() is b
    hugepages.remove_pool(b)
    assert hugepages.current_pool() is None


@pytest.mark.skipif(not LINUX_THP, reason="needs Linux with transparent huge pages not set to never")
def test_a_pool_buffer_is_faulted_in_by_huge_pages():
    """The pool's buffers are private anonymous mappings (a shared one would be shared memory,
    which transparent huge pages usually do not back)."""
    if thp_disabled_for_this_process():
        pytest.skip("transparent huge pages are disabled for this process")
    before = thp_fallbacks()
    with hugepages.use_pool(hugepages.BufferPool()):
        t = hugepages.empty((16, 1024, 1024), torch.float32)
    t.fill_(0.5)
    huge = anon_huge_kib(-(-t.data_ptr() // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE)
    if huge == 0 and thp_fallbacks() > before:
        pytest.skip("the kernel had no free huge page to give")
    assert huge >= 2048
    assert bool((t == 0.5).all())
