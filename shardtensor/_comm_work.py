"""Work handles that combine or stand in for ``torch.distributed`` works, and how tensors go on the wire (buffer
aliases, dtypes gloo cannot carry, ZeroTensors): nothing here communicates.

Split out of ``_comm`` so that module keeps the collectives themselves; ``_comm`` re-exports every name.
"""

from __future__ import annotations

import atexit
import ctypes
import math
import time
import weakref
from typing import NamedTuple

import torch


class CollectiveError(RuntimeError):
    """A collective failed or did not complete in time: another rank died, skipped a step, or runs another program."""


class _DoneWork:
    """Stands in for a ``Work`` handle when nothing was sent (world size 1)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


# [Note: a work given up on outlives the interpreter]
# A collective that timed out (or failed) may still be queued in gloo's worker thread, holding its tensors. When
# the peer's exit finally ends it, the worker thread drops the work, and with it the last C++ reference to tensors
# that have Python objects: releasing those needs the GIL. If this process is by then finalizing (the
# ``CollectiveError`` ended the script), taking the GIL makes the thread exit through a C++ frame that cannot
# unwind, and the process dies of SIGABRT ("terminate called without an active exception") after printing the
# error. A work given up on is therefore kept referenced for the life of the process: its worker thread never
# releases it last, and the few tensors it holds are freed by the exit itself.
def keep_past_exit(work) -> None:
    """Keep ``work`` (and what it holds) alive until the process ends; see the note above."""
    if work is None or isinstance(work, _DoneWork):
        return
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))  # a module list would be cleared during finalization


# [Note: gloo's worker threads at interpreter exit]
# A work's tensors are often temporaries (a row alias of a buffer handed to an async broadcast) whose Python objects
# the caller dropped at once: torch then keeps each object alive from C++, and the gloo worker thread that
# releases the work after completing it releases the last reference, which needs the GIL.  If the script has
# ended meanwhile and Python is finalizing, taking the GIL ends that thread through a frame that cannot unwind:
# SIGABRT ("terminate called without an active exception") after a run that finished without error (helper Y:
# 5 of 17 torchrun runs at world 4, and the last collectives of any script can hit it).  So before finalization
# (atexit, which runs first) the works still in flight are waited for, a bounded time, and the worker threads get
# a moment with the GIL free to release what they hold; a work that cannot complete (its peer is gone) is kept
# past exit as one given up on.
_TRACKED: "weakref.WeakSet" = weakref.WeakSet()  # works issued (weakly: their callers own them)
P2P_IN_FLIGHT: list = []  # sends and receives, kept until complete (see [Note: a reduce-scatter by sends])
_ISSUED = [False]
EXIT_WAIT_S = 2.0  # the most the interpreter's exit waits for works in flight
EXIT_SETTLE_S = 0.2  # then, for the worker threads to release completed works (measured: 0.2 s, 0 of 16 aborts)


def track_in_flight(work) -> None:
    """Note a work (the caller waits for it, now or later): see [Note: gloo's worker threads at interpreter exit]."""
    _ISSUED[0] = True
    _TRACKED.add(work)


def settle_before_exit() -> None:
    """atexit: wait for the works in flight (all together, a bounded time), then let the worker threads release
    them; one still incomplete is kept past exit."""
    if not _ISSUED[0]:
        return
    deadline = time.monotonic() + EXIT_WAIT_S
    pending = list(_TRACKED) + P2P_IN_FLIGHT
    while pending:
        pending = [work for work in pending if not _completed(work)]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.005)
    for work in pending:
        keep_past_exit(getattr(work, "work", work))
    time.sleep(EXIT_SETTLE_S)


def _completed(work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a broken group at exit: nothing left to wait for
        return True


atexit.register(settle_before_exit)


class CollectiveResult(NamedTuple):
    """A collective's output buffer and the handle to wait on before reading it."""

    buffer: torch.Tensor
    work: object  # dist.Work or _DoneWork


class _WorkList:
    """Several handles waited on as one (a gather made of one broadcast per rank)."""

    __slots__ = ("works",)

    def __init__(self, works: list):
        self.works = works

    def wait(self, timeout=None) -> bool:
        for work in self.works:
            work.wait(timeout=timeout) if timeout is not None else work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


class _CopyOnWait:
    """A work whose result lands in ``src`` (rows of a buffer the collective used as scratch): ``wait`` copies it
    into ``dst`` once, so the caller's buffer can be the small output allocated up front."""

    __slots__ = ("work", "src", "dst")

    def __init__(self, work, src: torch.Tensor, dst: torch.Tensor):
        self.work, self.src, self.dst = work, src, dst

    def wait(self, timeout=None) -> bool:
        self.work.wait(timeout=timeout)
        if self.src is not None:
            self.dst.copy_(self.src)
            self.src = None
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _rows_alias(buffer: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows ``[start, start + rows)`` of a contiguous buffer, sharing its storage without being a view of it:
    gloo's worker thread releases a finished work a moment after ``wait()`` returns, and a view would keep the
    buffer's tensor (and so the caller's Python object) alive until then."""
    row_numel = math.prod(buffer.shape[1:])
    alias = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
    return alias.set_(buffer.untyped_storage(), buffer.storage_offset() + start * row_numel,
                      (rows, *buffer.shape[1:]))


# gloo has no kernels for these dtypes; a gather only copies bits, so it moves them as a dtype of the same width
# (``w.short()`` on a sharded parameter is a shard-wise int16 tensor whose gather would otherwise fail).
_WIRE_DTYPE = {torch.int16: torch.float16, torch.uint16: torch.float16, torch.uint32: torch.int32,
               torch.uint64: torch.int64}


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """A collective's input as a real buffer: autograd hands an efficient ZeroTensor as the gradient of ops whose
    derivative is zero (``torch.sgn`` of a real tensor), and gloo aborts the process on one."""
    if tensor._is_zerotensor():
        return torch.zeros(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return tensor


def _reducible(tensor: torch.Tensor, what: str) -> None:
    if tensor._is_zerotensor():
        raise TypeError(f"{what}: the tensor is an immutable ZeroTensor (a zero gradient autograd did not "
                        "materialise); gloo aborts on one and an in-place collective cannot write into it. "
                        "Fix: pass torch.zeros_like(tensor) (a dense copy).")
    if tensor.dtype in _WIRE_DTYPE:
        raise TypeError(f"{what}: gloo/NCCL have no reduction for {tensor.dtype}. Fix: reduce in a supported dtype "
                        "(e.g. tensor.to(torch.int32)) and cast back.")
