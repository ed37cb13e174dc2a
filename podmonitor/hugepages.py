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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Sequence
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


def empty(shape: Sequence[int], dtype: torch.dtype = torch.float32,
          device: torch.device | str | None = None) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, its interior advised as huge pages
    (:func:`advise`) when it is a large CPU buffer."""
    t = torch.empty(tuple(shape), dtype=dtype, device=device)
    advise(t)
    return t


__all__ = ["ENABLED", "HUGE_PAGE", "MIN_BYTES", "advise", "empty"]
