"""Where CPUAdam's moments live: a small strategy, so that NVMe offload plugs in without touching the optimizer.

``CPUAdam`` decides *when* a parameter steps and ``_adam_math`` *how*; a ``StateStore`` decides *where*
``exp_avg`` / ``exp_avg_sq`` are and makes them resident around each use.  The optimizer calls only the methods
below, always with the parameter's index in param-group order as the key:

- ``new_moments(key, shape)`` when a parameter's state is first created (a store may make room first);
- ``track(key, state)`` once per slot, with the optimizer's per-parameter state dict (fresh or loaded); the store
  may replace the moment tensors in it (the swap layer needs pageable, resizable storage), and returns the dict
  the optimizer keeps as that parameter's state (``NVMeOffload``'s makes the moments resident when read);
- ``resident(keys)`` around a worker job on one parameter, ``chunks(keys)`` around batched steps and rollbacks
  (each yielded chunk is resident while the caller's loop body runs; a store may read the next one ahead);
- ``export(key)`` for ``state_dict()``: in-memory copies of moments whose live tensors may be swapped out;
- ``end_step(group)`` at the end of every ``step()``, on every rank of the optimizer's process group: the place
  to raise, deterministically and on every rank, what the store's background I/O hit during the step (the
  optimizer's state is consistent by then; a failure on one rank only would leave the ranks' step counts apart);
- ``reset()`` before a ``load_state_dict()``.

``HostStore`` is the default: plain host tensors (pinned on CUDA machines, so the device-to-host copies are
asynchronous), always resident.  For 2 MiB pages under THP's ``madvise`` mode, set ``THP_MEM_ALLOC_ENABLE=1``:
torch's CPU allocator then aligns and ``madvise``s large allocations, for these moments and torch's alike (a
hand-written huge-page allocator bought 0-8% here, within the noise of a loaded 2-core machine).  ``shardtensor.offload.NVMeOffload`` is the other implementation.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, Optional, Protocol, runtime_checkable

import torch

__all__ = ["StateStore", "HostStore", "MOMENTS"]

MOMENTS = ("exp_avg", "exp_avg_sq")


@runtime_checkable
class StateStore(Protocol):
    """Home of the Adam moments; see the module docstring for when CPUAdam calls each method."""

    def new_moments(self, key: int, shape: torch.Size) -> dict[str, torch.Tensor]: ...

    def track(self, key: int, state: dict) -> dict: ...

    def resident(self, keys: list[int]) -> ContextManager[None]: ...

    def chunks(self, keys: list[int]) -> Iterator[list[int]]: ...

    def export(self, key: int) -> Optional[dict[str, torch.Tensor]]: ...

    def end_step(self, group: Any = None) -> None: ...

    def reset(self) -> None: ...


class HostStore:
    """Moments in host memory, always resident (pinned when ``pin_memory``: asynchronous CUDA copies)."""

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory

    def new_moments(self, key: int, shape: torch.Size) -> dict[str, torch.Tensor]:
        return {k: torch.zeros(shape, dtype=torch.float32, pin_memory=self.pin_memory) for k in MOMENTS}

    def track(self, key: int, state: dict) -> dict:
        return state

    def resident(self, keys: list[int]) -> ContextManager[None]:
        return contextlib.nullcontext()

    def chunks(self, keys: list[int]) -> Iterator[list[int]]:
        if keys:
            yield keys

    def export(self, key: int) -> Optional[dict[str, torch.Tensor]]:
        return None  # the live tensors are in memory: torch's state_dict packs them as they are

    def end_step(self, group: Any = None) -> None:
        pass

    def reset(self) -> None:
        pass
