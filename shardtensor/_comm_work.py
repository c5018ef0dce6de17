"""Work handles that combine or stand in for ``torch.distributed`` works (no communication of their own).

Split out of ``_comm`` so that module keeps the collectives themselves; ``_comm`` re-exports every name.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class _DoneWork:
    """Stands in for a ``Work`` handle when nothing was sent (world size 1)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


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
