"""Host buffers for optimizer state: transparent huge pages where the kernel offers them.

Why: an AdamW step streams every state tensor once (28 bytes per parameter) and is bound by memory bandwidth;
with 4 KiB pages a 100 MB tensor spans 25,000 pages, and the TLB misses of that walk cost a few percent of the
step.  Linux hands out 2 MiB pages to anonymous private mappings that ask for them (``MADV_HUGEPAGE``) when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``; glibc's ``malloc`` (behind
``torch.empty``) never asks, so under the common ``madvise`` setting torch's own state tensors get small pages.
Measured on the 2-core CI machine: torch's fused AdamW kernel runs 1-4% faster when ``exp_avg``/``exp_avg_sq``
live in huge pages (``benchmarks/bench_cpu_adam.py``).

The buffer is an ``mmap`` aligned to 2 MiB; the tensor's storage is exactly the requested bytes (``torch.save``
writes no padding) and keeps the mapping alive; freeing the tensor unmaps it, so the memory leaves the process.
Pinned buffers (CUDA hosts) keep ``torch.empty(pin_memory=True)``: pinning is what matters there.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

import torch

__all__ = ["empty_host", "huge_pages_available"]

_HUGE_PAGE = 2 << 20
_MIN_BYTES = 4 * _HUGE_PAGE  # below this the alignment slack outweighs the TLB saving
_available: bool | None = None


def huge_pages_available() -> bool:
    """True when this kernel gives 2 MiB pages to mappings that ask (THP ``always`` or ``madvise``)."""
    global _available
    if _available is None:
        try:
            with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
                mode = f.read()
            _available = sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in mode
        except OSError:
            _available = False
    return _available


def empty_host(shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32,
               pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor, in huge pages when it is large, unpinned and the kernel allows it."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if pin_memory or nbytes < _MIN_BYTES or not huge_pages_available():
        return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
    size = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE + _HUGE_PAGE  # room to start on a 2 MiB boundary
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: shared maps are shmem
    buf.madvise(mmap.MADV_HUGEPAGE)
    view = ctypes.c_char.from_buffer(buf)
    offset = -ctypes.addressof(view) % _HUGE_PAGE
    del view  # an exported pointer would keep the map from closing
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).view(shape)
