"""Large CPU buffers backed by transparent huge pages where the system allows it.

Every monitored batch materialises fresh (B, H, T, T) attention maps: at T = 1024 that is tens of
MiB per layer. glibc maps buffers above its mmap threshold (which adapts, up to 32 MiB) anew for
each allocation and unmaps them when freed, so the first write faults each one in, 4 KiB page by
4 KiB page; smaller buffers are often reused from the heap, already faulted in, where the advice
changes little. On Linux with transparent huge pages in ``madvise`` (or ``always``) mode,
advising the buffer's interior as ``MADV_HUGEPAGE`` before it is written makes that 2 MiB pages,
512 times fewer faults (``benchmarks/bench_capture.py`` times the capture both ways; on 2 CPU cores
one SDPA call at L = 1024 took 52.3 ms against 61.8 ms, see the CHANGELOG). This is what
PyTorch's own ``THP_MEM_ALLOC_ENABLE=1`` does for every allocation, here only for the buffers
podmonitor fills itself.

The advice is a hint: values are unchanged, and where it is unavailable (not Linux, no libc, a
GPU tensor, a small buffer, THP disabled) :func:`empty` is ``torch.empty``. Where the kernel's
THP ``defrag`` setting is ``madvise`` (a common default) it may compact memory to find a huge
page for an advised buffer; on a machine whose memory is badly fragmented that can cost more than
it saves, and ``podmonitor.hugepages.ENABLED = False`` turns the advice off.

Faulting fresh memory in costs time even with huge pages (the kernel zeroes every page it hands
out). A :class:`BufferPool` keeps the buffers :func:`empty` handed out mapped between uses: while
a pool is in use in a thread (:func:`push_pool`, :func:`use_pool`), :func:`empty` gives out a
buffer of the same size that no tensor refers to any longer, already faulted in, instead of
mapping a new one. PODMonitor uses one during each monitored batch's capture, so that the maps of
the next batch are written into those of the last one once nobody holds them; it drops the pool
when the run takes no more maps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache

import torch

#: False turns the advice off (benchmarks compare both; a user may too)
ENABLED = True

#: huge page size of x86-64 and arm64 Linux (bytes)
HUGE_PAGE = 2 * 2**20

#: buffers at least this large get the advice (smaller ones hold at most one huge page)
MIN_BYTES = 4 * HUGE_PAGE

_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux


@lru_cache(maxsize=1)
def _madvise():  # noqa: ANN202 (a ctypes function or None)
    """libc's ``madvise``, or None where huge pages cannot be advised."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise(t: torch.Tensor) -> bool:
    """Advise the whole huge pages inside ``t``'s memory as ``MADV_HUGEPAGE``; True if advised.

    Only contiguous CPU tensors of at least :data:`MIN_BYTES` (the bytes from ``data_ptr()`` on
    are then exactly the tensor's). Call it before the memory is first written (pages already
    faulted in stay small).
    """
    madvise = _madvise()
    nbytes = t.numel() * t.element_size()
    if not ENABLED or madvise is None or t.device.type != "cpu" or nbytes < MIN_BYTES or not t.is_contiguous():
        return False
    ptr = t.data_ptr()
    start = -(-ptr // HUGE_PAGE) * HUGE_PAGE  # the first huge-page boundary inside
    stop = (ptr + nbytes) // HUGE_PAGE * HUGE_PAGE
    return stop > start and madvise(start, stop - start, _MADV_HUGEPAGE) == 0


def _anonymous_map(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` (MAP_PRIVATE where the platform has it: a shared
    anonymous mapping is shared memory, which huge pages usually do not back)."""
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"):
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mmap.mmap(-1, nbytes)


def _idle_references() -> int:
    """What ``sys.getrefcount`` reads for a buffer held by a list alone (measured, not assumed:
    interpreters differ in what they count)."""
    held = [_anonymous_map(mmap.PAGESIZE)]
    count = sys.getrefcount(held[0])
    held[0].close()
    return count


class BufferPool:
    """Large CPU buffers kept mapped between uses (see the module docstring); not thread-safe: a
    pool serves the thread that uses it (:func:`push_pool`, :func:`use_pool`).

    Each buffer is a private anonymous ``mmap``; the tensors :func:`empty` makes of it hold a
    reference to it (``torch.frombuffer``: the storage holds it, so every view and alias of the
    tensor does), and a buffer is free exactly when only the pool refers to it. Its memory is
    returned to the system when the pool (or :meth:`clear`) drops it and no tensor refers to it
    any more. Pool tensors cannot be resized (``resize_`` raises).

    Example:
        >>> pool = BufferPool()
        >>> with use_pool(pool):
        ...     maps = empty((2, 12, 1024, 1024))  # a new buffer
        >>> del maps
        >>> with use_pool(pool):
        ...     maps = empty((2, 12, 1024, 1024))  # the same memory, already faulted in
    """

    #: ``sys.getrefcount`` of a buffer only the pool's list holds
    IDLE_REFERENCES = _idle_references()

    def __init__(self) -> None:
        self._buffers: list[mmap.mmap] = []

    def take(self, nbytes: int) -> tuple[mmap.mmap, bool]:
        """A buffer of exactly ``nbytes`` that no tensor refers to; ``(buffer, True)`` when it
        is new (not yet written: advise it before the first write)."""
        for i in range(len(self._buffers)):
            if len(self._buffers[i]) == nbytes and sys.getrefcount(self._buffers[i]) <= self.IDLE_REFERENCES:
                return self._buffers[i], False
        buf = _anonymous_map(nbytes)
        self._buffers.append(buf)
        return buf, True

    @property
    def nbytes(self) -> int:
        """Bytes mapped by the pool's buffers, in use or free."""
        return sum(len(b) for b in self._buffers)

    def clear(self) -> None:
        """Drop every buffer (those still in use live on with their tensors)."""
        self._buffers = []


_local = threading.local()


def _stack() -> list[BufferPool]:
    if not hasattr(_local, "pools"):
        _local.pools = []
    return _local.pools


def current_pool() -> BufferPool | None:
    """The pool :func:`empty` uses in this thread (the last one pushed and not removed), or None."""
    pools = _stack()
    return pools[-1] if pools else None


def push_pool(pool: BufferPool) -> None:
    """Make ``pool`` the one :func:`empty` uses in this thread until :func:`remove_pool`."""
    _stack().append(pool)


def remove_pool(pool: BufferPool) -> None:
    """Take ``pool`` out of this thread's pools (its last entry, wherever it lies: two users
    that push and remove in overlapping order each remove their own); nothing if it is absent."""
    pools = _stack()
    for i in range(len(pools) - 1, -1, -1):
        if pools[i] is pool:
            del pools[i]
            return


@contextmanager
def use_pool(pool: BufferPool) -> Iterator[BufferPool]:
    """:func:`push_pool` for the ``with`` block, :func:`remove_pool` after it."""
    push_pool(pool)
    try:
        yield pool
    finally:
        remove_pool(pool)


def empty(shape: Sequence[int], dtype: torch.dtype = torch.float32,
          device: torch.device | str | int | None = None) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, its interior advised as huge pages
    (:func:`advise`) when it is a large CPU buffer; from this thread's pool (:func:`current_pool`)
    when there is one and the buffer is large and on the CPU."""
    pool = current_pool()
    if pool is not None:
        numel = 1
        for n in shape:
            numel *= int(n)
        nbytes = numel * dtype.itemsize
        # (device None: torch's default device, which torch.set_default_device may have changed)
        on_cpu = (torch.device(device) if device is not None else torch.empty(0).device).type == "cpu"
        if nbytes >= MIN_BYTES and on_cpu:
            buf, new = pool.take(nbytes)
            t = torch.frombuffer(buf, dtype=dtype, count=numel).view(tuple(shape))
            if new:
                advise(t)
            return t
    t = torch.empty(tuple(shape), dtype=dtype, device=device)
    advise(t)
    return t


def scratch(shape: Sequence[int], dtype: torch.dtype = torch.float32,
            device: torch.device | str | int | None = None) -> torch.Tensor:
    """A work buffer whose contents are unspecified: :func:`empty` (a buffer of this thread's
    pool, already faulted in) while a pool is in use, else a plain ``torch.empty``. Buffers that
    live for one call and are not reused gain little from the huge-page advice, and on a virtual
    machine that hands freed memory back to its host fresh huge pages can cost more than small
    ones; a pool's buffers are reused, so there the advice pays."""
    if current_pool() is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    return empty(shape, dtype, device)


__all__ = ["ENABLED", "HUGE_PAGE", "MIN_BYTES", "BufferPool", "advise", "current_pool", "empty", "push_pool",
           "remove_pool", "scratch", "use_pool"]
