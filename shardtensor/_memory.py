"""One memory-pressure monitor shared by the Gatherer's ``auto`` mode and the offload layer.

Why one: the Gatherer decides whether to prefetch, and ``NVMeOffload`` decides how much optimizer state may stay
resident, from the same numbers.  Two monitors polling on their own would disagree for a moment and each would
count the other's memory as free.

Where the numbers come from:
  - host: ``psutil.virtual_memory().available`` (what the kernel could hand out without swapping);
  - CUDA: ``torch.cuda.mem_get_info(device)`` (the driver's free bytes; the caching allocator's reserved but
    unused blocks are not counted as free there, so ``reserved - allocated`` is added back).

Readings are cached for ``ttl_s`` seconds: the Gatherer asks once per prefetch decision and ``/proc/meminfo``
is not free (about 20 us); memory does not change meaningfully within a few milliseconds.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import torch

__all__ = ["MemoryMonitor", "shared_monitor"]

log = logging.getLogger("shardtensor")


class MemoryMonitor:
    """Free memory of the host and of CUDA devices, cached for ``ttl_s`` seconds.  Thread-safe.

    Args:
        ttl_s: how long a reading stays valid. (Default: 0.01)
    """

    def __init__(self, ttl_s: float = 0.01):
        if ttl_s < 0:
            raise ValueError(f"MemoryMonitor: {ttl_s=} must be >= 0")
        self.ttl_s = float(ttl_s)
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, int]] = {}  # key -> (monotonic time of the reading, bytes)

    def _cached(self, key: str, read) -> int:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and now - hit[0] <= self.ttl_s:
                return hit[1]
        value = int(read())  # outside the lock: a slow driver call must not block other readers
        with self._lock:
            self._cache[key] = (now, value)
        return value

    def host_available(self) -> int:
        """Bytes of host memory available without swapping (psutil)."""
        import psutil

        return self._cached("host", lambda: psutil.virtual_memory().available)

    def device_free(self, device: torch.device | str | int) -> int:
        """Free bytes on a CUDA device, counting the caching allocator's reserved-but-unused blocks as free."""
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"MemoryMonitor.device_free: {device=} is not a CUDA device; use host_available()")

        def read() -> int:
            free, _total = torch.cuda.mem_get_info(device)
            return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)

        return self._cached(str(device), read)

    def free_bytes(self, device: Optional[torch.device] = None) -> int:
        """Free memory where tensors on ``device`` live: the CUDA device's, else the host's."""
        if device is not None and torch.device(device).type == "cuda":
            return self.device_free(device)
        return self.host_available()

    def process_rss(self) -> int:
        """Resident set size of this process (not cached: tests and benchmarks compare readings)."""
        import psutil

        return psutil.Process().memory_info().rss


_SHARED: Optional[MemoryMonitor] = None
_SHARED_LOCK = threading.Lock()


def shared_monitor() -> MemoryMonitor:
    """The process-wide monitor that ``Gatherer(gather="auto")`` and ``NVMeOffload`` read."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = MemoryMonitor()
        return _SHARED


# [Note: auto mode decides on every rank alike]
# Overlapped and sequential gathers issue different collectives: overlapped mode prefetches and keeps a buffer
# for its next use, sequential mode drops it and gathers again.  So ``gather="auto"`` must not switch on one rank's
# reading alone: ranks share a host's memory unevenly (or a GPU with other processes), and a rank that switched
# alone issued other collectives than its peers (a DivergenceError mid-step, or a hang where the check is off).
# Each rank notes whether memory ran low during a step; at the next step's start every rank takes part in one
# all-reduce (max) of that flag, and all switch together: sequential for the step if any rank ran low.
class AgreedPressure:
    """``gather="auto"``'s switch: the same on every rank of ``group``, changed only at step boundaries."""

    def __init__(self, free_memory_fn: Callable[[torch.device], int], min_free_bytes: int):
        self.free_memory_fn = free_memory_fn
        self.min_free_bytes = int(min_free_bytes)
        self.pressure = False  # the agreed state: sequential while True
        self._ran_low = False  # this rank's reading went below min_free_bytes since the last agreement

    def sample(self, device: torch.device) -> None:
        if not self._ran_low and self.free_memory_fn(device) < self.min_free_bytes:
            self._ran_low = True

    def agree(self, device: torch.device, group) -> bool:
        """Every rank, at a step boundary: the state for the next step.  One all-reduce of one number."""
        from . import _comm  # (every collective lives in the comm modules)

        self.sample(device)
        flag = torch.tensor([1.0 if self._ran_low else 0.0], device=device)
        _comm.all_reduce(flag, group, op="max", label="gather='auto' memory-pressure agreement")
        self._ran_low = False
        pressure = bool(flag.item())
        if pressure != self.pressure:
            log.warning("shardtensor: gather=auto switched to %s (free memory %s min_free_bytes on %s rank)",
                        "sequential" if pressure else "overlapped", "<" if pressure else ">=",
                        "some" if pressure else "every")
        self.pressure = pressure
        return pressure
