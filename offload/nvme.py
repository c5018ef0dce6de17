"""NVMe offload of optimizer state: swapped to files, read ahead and written behind, within a resident budget.

``NVMeOffload(path, budget_bytes=...)`` keeps *units* (the state tensors of one parameter: ``exp_avg`` and
``exp_avg_sq``) in a ``SwapSpace`` under ``path``.  A unit is made resident for its step (``use``), may be read
ahead (``prefetch``), and is written behind: released units stay in memory until room is needed, then the least
recently used one is swapped out (a unit unchanged since its last write is dropped without writing).

How much may stay resident: ``min(budget_bytes, max_host_fraction * available)`` (available host memory from the
shared psutil monitor), never less than the largest unit (one parameter's state must fit to be stepped).  The
budget counts every byte of registered state whose memory is allocated, including reads ahead and writes still in
flight; ``SwapSpace.peak_resident_bytes`` is the measured high-water mark.

``NVMeCPUAdam`` is ``shardtensor.optim.CPUAdam`` with its moments in an ``NVMeOffload``: the Adam arithmetic is
CPUAdam's own (so results are bit-identical); only *which* parameters' moments are in memory changes.  Not
offloaded: the fp32 master that speculation keeps (``speculative=True``, 4 bytes/param) and the step counters.

Parameter shards on NVMe (``shard_module(..., offload=NVMeOffload(...))``) are not built yet.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections import OrderedDict
from typing import Any, Iterable, Iterator, Optional

import torch

from shardtensor.optim import CPUAdam

from .monitor import MemoryMonitor, shared_monitor
from .swap import SwapHandle, SwapSpace

__all__ = ["NVMeOffload", "NVMeCPUAdam"]


class NVMeOffload:
    """Optimizer state swapped to files under ``path``; see the module docstring.

    Args:
        path: directory for the swap files (created; one subdirectory per instance).
        budget_bytes: most bytes of offloaded state resident at once. (Default: 1 GiB)
        max_host_fraction: cap the budget at this fraction of available host memory (psutil). (Default: 0.5)
        monitor: memory monitor (Default: the process-wide ``shared_monitor()``).
        **swap_kwargs: passed to ``SwapSpace`` (``workers``, ``buffer_bytes``, ``timeout_s``, ``durable``,
            ``direct``, ``writer``/``reader`` for fault injection).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        budget_bytes: int = 1 << 30,
        max_host_fraction: float = 0.5,
        monitor: Optional[MemoryMonitor] = None,
        **swap_kwargs: Any,
    ):
        if budget_bytes <= 0:
            raise ValueError(f"NVMeOffload: {budget_bytes=} must be positive")
        if not 0 < max_host_fraction <= 1:
            raise ValueError(f"NVMeOffload: {max_host_fraction=} must be in (0, 1]")
        self.path = os.fspath(path)
        self.budget_bytes = int(budget_bytes)
        self.max_host_fraction = float(max_host_fraction)
        self.monitor = monitor or shared_monitor()
        directory = os.path.join(self.path, f"shardtensor_swap_{os.getpid()}_{id(self):x}")
        self.swap = SwapSpace(directory, **swap_kwargs)
        # Owner threads (the training thread and CPUAdam's worker) serialise here.  The I/O threads never take
        # this lock, so waiting on an issued request while holding it cannot deadlock (see swap.py).
        self._lock = threading.RLock()
        self._units: dict[Any, list[SwapHandle]] = {}
        self._users: dict[Any, int] = {}
        self._lru: OrderedDict[Any, None] = OrderedDict()  # idle resident units, least recently used first
        self.evictions = 0
        self.prefetches = 0

    # ------------------------------------------------------------------ budget
    def unit_bytes(self, key: Any) -> int:
        return sum(h.nbytes for h in self._units[key])

    def effective_budget(self) -> int:
        """``min(budget_bytes, max_host_fraction * available host memory)``, at least the largest unit."""
        host_cap = int(self.monitor.host_available() * self.max_host_fraction)
        largest = max((self.unit_bytes(k) for k in self._units), default=0)
        return max(largest, min(self.budget_bytes, host_cap))

    def make_room(self, nbytes: int, *, block: bool = True) -> bool:
        """Evict idle units (least recently used first) until ``nbytes`` more fit in the budget.

        With ``block=False`` nothing is waited for (read-ahead uses this); returns whether the room is there.
        """
        with self._lock:
            budget = max(self.effective_budget(), nbytes)
            while True:
                self.swap.poll()
                if self.swap.resident_bytes + nbytes <= budget:
                    return True
                victim = next((k for k in self._lru if any(h.resident for h in self._units[k])), None)
                if victim is not None:
                    self._lru.pop(victim)
                    for h in self._units[victim]:
                        self.swap.swap_out(h)
                    self.evictions += 1
                    continue
                if not block or not self.swap.wait_oldest():  # a write in flight frees memory when it lands
                    if block:
                        raise RuntimeError(
                            f"NVMeOffload: {nbytes} bytes do not fit the resident budget of {budget} bytes "
                            f"({self.swap.resident_bytes} resident, all in use); raise budget_bytes"
                        )
                    return False

    # ------------------------------------------------------------------ units
    def register(self, key: Any, tensors: dict[str, torch.Tensor]) -> None:
        """Track a unit (resident, idle).  Call ``make_room(bytes)`` before allocating it to stay in budget."""
        with self._lock:
            if key in self._units:
                raise ValueError(f"NVMeOffload.register: unit {key!r} is already registered")
            self._units[key] = [self.swap.register(f"{key}.{name}", t) for name, t in tensors.items()]
            self._users[key] = 0
            self._lru[key] = None
        self.make_room(0)

    def has(self, key: Any) -> bool:
        return key in self._units

    def prefetch(self, keys: Iterable[Any]) -> None:
        """Read ahead: issue swap-ins for ``keys`` that fit the budget now (waits for nothing)."""
        with self._lock:
            for key in keys:
                handles = self._units.get(key)
                if handles is None:
                    continue
                need = self._claim(key)  # off the eviction list while room is made for it
                fits = need == 0 or self.make_room(need, block=False)
                if fits and need:
                    for h in handles:
                        self.swap.swap_in(h)
                    self.prefetches += 1
                if self._users[key] == 0:
                    self._lru[key] = None  # idle again, most recently used: the last candidate for eviction
                if not fits:
                    return

    def _claim(self, key: Any) -> int:
        """Take ``key`` off the eviction list and keep the memory it still has; returns the bytes it lacks."""
        self._lru.pop(key, None)
        for h in self._units[key]:
            if h.resident:
                self.swap.swap_in(h)  # a write in flight (an earlier eviction) keeps its memory after it lands
        return sum(h.nbytes for h in self._units[key] if not h.resident)

    def acquire(self, keys: list, *, dirty: bool = True) -> None:
        """Make ``keys`` resident and pin them (not evicted) until ``release``.  Waits for their reads.

        ``dirty``: the caller will modify the tensors (a step), so their files become stale.
        """
        with self._lock:
            for key in keys:
                self._users[key] += 1
                self._claim(key)
            for key in keys:
                need = self._claim(key)
                if need:
                    self.make_room(need)
                for h in self._units[key]:
                    self.swap.swap_in(h)
        try:
            for key in keys:
                for h in self._units[key]:
                    self.swap.wait(h)
                    if dirty:
                        self.swap.mark_dirty(h)
        except BaseException:
            self.release(keys)
            raise

    def release(self, keys: list) -> None:
        """Unpin ``keys``: they stay resident (write-behind) until their room is needed."""
        with self._lock:
            for key in keys:
                self._users[key] -= 1
                if self._users[key] == 0:
                    self._lru[key] = None

    @contextlib.contextmanager
    def use(self, keys: list, *, dirty: bool = True) -> Iterator[None]:
        self.acquire(keys, dirty=dirty)
        try:
            yield
        finally:
            self.release(keys)

    def plan(self, keys: list) -> list[list]:
        """Split ``keys`` into consecutive chunks of at most half the budget each (so the next chunk can be read
        ahead while one is stepped); a unit larger than that is a chunk of its own."""
        half = max(1, self.effective_budget() // 2)
        chunks, current, size = [], [], 0
        for key in keys:
            nbytes = self.unit_bytes(key)
            if current and size + nbytes > half:
                chunks.append(current)
                current, size = [], 0
            current.append(key)
            size += nbytes
        if current:
            chunks.append(current)
        return chunks

    def read_copy(self, key: Any) -> dict[str, torch.Tensor]:
        """Copies of a unit's tensors (for state dicts), read through the budget like a step."""
        with self.use([key], dirty=False):
            return {h.name.rsplit(".", 1)[1]: h.tensor.detach().clone() for h in self._units[key]}

    def unregister_all(self) -> None:
        with self._lock:
            for handles in self._units.values():
                for h in handles:
                    self.swap.unregister(h)
            self._units.clear()
            self._users.clear()
            self._lru.clear()

    def flush(self) -> None:
        """Write every resident unit whose file is stale and wait: the files then hold the whole state."""
        with self._lock:
            for handles in self._units.values():
                for h in handles:
                    if h.resident and h.disk_stamp != h.stamp() and h.future is None:
                        self.swap.swap_out(h)
                        self.swap.swap_in(h)  # keep it resident: this is a flush, not an eviction
            self.swap.sync()

    def stats(self) -> dict[str, int]:
        s = self.swap
        return {"resident_bytes": s.resident_bytes, "peak_resident_bytes": s.peak_resident_bytes,
                "budget_bytes": self.effective_budget(), "bytes_written": s.bytes_written,
                "bytes_read": s.bytes_read, "writes": s.writes, "reads": s.reads, "clean_drops": s.clean_drops,
                "evictions": self.evictions, "prefetches": self.prefetches}

    def close(self) -> None:
        """Bring every unit back into memory, stop the I/O threads and remove the files."""
        self.unregister_all()
        self.swap.close()
        with contextlib.suppress(OSError):
            os.rmdir(self.swap.directory)


_STATE_KEYS = ("exp_avg", "exp_avg_sq")


class NVMeCPUAdam(CPUAdam):
    """``CPUAdam`` whose ``exp_avg`` / ``exp_avg_sq`` live in ``offload`` (files, within a resident budget).

    Same arguments as ``CPUAdam`` plus ``offload``.  The arithmetic is CPUAdam's: steps run over chunks of
    parameters whose state fits half the budget, the next chunk read ahead while one steps; speculative steps
    (on CPUAdam's worker) make their one parameter's state resident for the step.
    """

    def __init__(self, params: Iterable, offload: NVMeOffload, **kwargs: Any):
        if not isinstance(offload, NVMeOffload):
            raise TypeError(f"NVMeCPUAdam: offload must be an NVMeOffload, got {type(offload).__name__}")
        self.offload = offload
        super().__init__(params, **kwargs)

    def _empty_host(self, shape: torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # Pageable, resizable storage: the swap layer frees a swapped-out tensor's storage (resize_(0)), which
        # neither pinned memory nor CPUAdam's huge-page mappings allow.
        return torch.empty(shape, dtype=dtype)

    # CPUAdam creates a slot's state lazily here; room is made first so the new state lands within budget.
    def _slot(self, p: torch.Tensor):
        slot = self._slots.get(id(p))
        if slot is not None:
            return slot
        local = p.to_local() if hasattr(p, "to_local") else p
        state = self.state[p]
        fresh = "exp_avg" not in state
        if fresh:
            self.offload.make_room(2 * local.numel() * 4)
        slot = super()._slot(p)
        for key in _STATE_KEYS:
            t = state[key]
            if t.is_pinned() or not t.untyped_storage().resizable():
                t = t.clone()  # pinned memory cannot be freed per tensor: the swap layer needs pageable storage
                state[key] = t
                setattr(slot, key, t)
        self.offload.register(slot.index, {k: state[k] for k in _STATE_KEYS})
        return slot

    def _speculate_job(self, slot, hp, t) -> None:
        with self.offload.use([slot.index]):
            super()._speculate_job(slot, hp, t)

    def _rollback_job(self, slot) -> None:
        with self.offload.use([slot.index]):
            super()._rollback_job(slot)

    def _chunked(self, slots: list, *lists: list) -> Iterator[tuple]:
        """Yield ``(slot_chunk, *list_chunks)`` with the chunk's state resident; read the next chunk ahead."""
        order = {s.index: i for i, s in enumerate(slots)}
        chunks = self.offload.plan([s.index for s in slots])
        self.offload.prefetch(chunks[0] if chunks else [])
        for k, keys in enumerate(chunks):
            with self.offload.use(keys):
                if k + 1 < len(chunks):
                    self.offload.prefetch(chunks[k + 1])
                idx = [order[key] for key in keys]
                yield ([slots[i] for i in idx], *[[lst[i] for i in idx] for lst in lists])

    def _step_batched(self, slots: list, grads: list) -> list:
        hps: list = [None] * len(slots)
        pos = {id(s): i for i, s in enumerate(slots)}
        for chunk, chunk_grads in self._chunked(slots, grads):
            for s, hp in zip(chunk, super()._step_batched(chunk, chunk_grads)):
                hps[pos[id(s)]] = hp
        return hps

    def _rollback_batched(self, slots: list, grads: list, hps: list) -> None:
        for chunk, chunk_grads, chunk_hps in self._chunked(slots, grads, hps):
            CPUAdam._rollback_batched(chunk, chunk_grads, chunk_hps)

    def state_dict(self) -> dict:
        """CPUAdam's state dict with the offloaded moments as in-memory copies (read through the budget)."""
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for i, state in list(sd["state"].items()):
            slot = self._slots.get(id(params[i]))
            if slot is not None and self.offload.has(slot.index):
                # a new dict: torch packs the live per-parameter dicts, which must keep the offloaded tensors
                sd["state"][i] = {**state, **self.offload.read_copy(slot.index)}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load; the loaded moments are registered with the offload (and swapped out as the budget requires)
        as each parameter's slot is rebuilt."""
        self.offload.unregister_all()
        super().load_state_dict(state_dict)
