"""The raw I/O of the swap layer, run on its I/O threads: aligned reusable buffers, whole-file writes and reads.

Kept apart from ``swap.py`` (which owns the bookkeeping and the locks) because these functions take no lock of
ours: raw reads and writes are ``os.preadv`` / ``os.pwritev`` into page-aligned ``mmap`` buffers and the
tensor <-> buffer copies are torch ops, which all release the GIL, so an I/O thread never waits for a Python
thread that waits for it.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
from typing import Callable

import torch

Writer = Callable[[int, list, int], int]  # os.pwritev(fd, buffers, offset) -> bytes written
Reader = Callable[[int, list, int], int]  # os.preadv(fd, buffers, offset) -> bytes read


class Buffers:
    """Fixed-size, page-aligned, reusable I/O buffers (``mmap`` is page-aligned), one per I/O thread."""

    def __init__(self, count: int, nbytes: int):
        self._free: queue.Queue = queue.Queue()
        self._all = []
        for _ in range(count):
            mm = mmap.mmap(-1, nbytes)
            self._all.append(mm)
            self._free.put((mm, torch.frombuffer(mm, dtype=torch.uint8)))

    def get(self):
        # Never blocks for long: as many buffers as threads, and each request holds one buffer at a time.
        return self._free.get(timeout=60.0)

    def put(self, item) -> None:
        self._free.put(item)


def _open(path: str, flags: int, direct: bool) -> int:
    if direct:
        flags |= os.O_DIRECT
    return os.open(path, flags, 0o600)


def write_file(path: str, src: torch.Tensor, buffers: Buffers, writer: Writer, align: int, buffer_bytes: int,
               direct: bool, durable: bool) -> None:
    """Tensor bytes (uint8) -> aligned buffer -> file, chunk by chunk; durable before the buffer is reused."""
    nbytes = src.numel()
    mm, buf = buffers.get()
    fd = -1
    try:
        fd = _open(path, os.O_WRONLY | os.O_CREAT, direct)
        view = memoryview(mm)
        offset = 0
        while offset < nbytes:
            n = min(buffer_bytes, nbytes - offset)
            buf[:n].copy_(src[offset : offset + n])  # a torch copy: releases the GIL
            padded = -(-n // align) * align
            if padded > n:
                buf[n:padded].zero_()
            done = 0
            while done < padded:  # a short write is retried from where it stopped
                wrote = writer(fd, [view[done:padded]], offset + done)
                if wrote <= 0:
                    raise OSError(errno.EIO, f"pwritev wrote {wrote} bytes at offset {offset + done}")
                done += wrote
            offset += n
        if durable:
            os.fdatasync(fd)
    finally:
        if fd >= 0:
            os.close(fd)
        buffers.put((mm, buf))  # only now: pwritev (and fdatasync) are done with it


def read_file(path: str, dst: torch.Tensor, buffers: Buffers, reader: Reader, align: int, buffer_bytes: int,
              direct: bool) -> None:
    """File -> aligned buffer -> tensor bytes (uint8), chunk by chunk; a short file or read is an error."""
    nbytes = dst.numel()
    mm, buf = buffers.get()
    fd = -1
    try:
        fd = _open(path, os.O_RDONLY, direct)
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise OSError(errno.EIO, f"short file: {size} bytes on disk, {nbytes} expected")
        view = memoryview(mm)
        offset = 0
        while offset < nbytes:
            n = min(buffer_bytes, nbytes - offset)
            padded = min(-(-n // align) * align, buffer_bytes)
            got = reader(fd, [view[:padded]], offset)
            if got < n:
                raise OSError(errno.EIO, f"short read: {got} of {n} bytes at offset {offset}")
            dst[offset : offset + n].copy_(buf[:n])
            offset += n
    finally:
        if fd >= 0:
            os.close(fd)
        buffers.put((mm, buf))
