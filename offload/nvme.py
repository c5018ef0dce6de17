"""NVMe offload of optimizer state: swapped to files, read ahead and written behind, within a resident budget.

``NVMeOffload(path, budget_bytes=...)`` keeps *units* (the state tensors of one parameter: ``exp_avg`` and
``exp_avg_sq``) in a ``SwapSpace`` under ``path``.  A unit is made resident for its step (``use``), may be read
ahead (``prefetch``), and is written behind: released units stay in memory until room is needed, then the least
recently used one is swapped out (a unit unchanged since its last write is dropped without writing).

How much may stay resident: ``min(budget_bytes, max_host_fraction * available)`` (available host memory from the
shared psutil monitor), never less than the largest unit (one parameter's state must fit to be stepped); where
every resident unit is in use (a speculative step beside the next one), a unit goes over it, with one warning.  The
budget counts every byte of registered state whose memory is allocated, including reads ahead and writes still in
flight; ``SwapSpace.peak_resident_bytes`` is the measured high-water mark.

``NVMeOffload`` is a ``shardtensor.optim.state_store.StateStore``: ``NVMeCPUAdam`` is ``CPUAdam`` with
``state_store=offload``, so the Adam arithmetic is CPUAdam's own (results are bit-identical); only *which*
parameters' moments are in memory changes.  Not offloaded: the fp32 master that a non-fp32 or device parameter
needs, the speculative copy of the master, and the step counters.

Write failures (a full disk): the unit stays in memory, over the budget if it must, and the step completes; at
the end of that ``step()`` the failures are raised as one ``OffloadWriteError`` naming the file(s) and the fix.
Every failed write is kept by the swap layer until then, whichever thread applied it, so the outcome does not
depend on timing; the state stays consistent and ``state_dict()`` saves it.  Later evictions retry the writes.

Parameter shards on NVMe (``shard_module(..., offload=NVMeOffload(...))``) are not built yet.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections import OrderedDict
from typing import Any, Iterable, Iterator, Optional

import torch

from shardtensor import _comm
from shardtensor._agreement import any_rank
from shardtensor.optim.state_store import MOMENTS

from ._resident_state import ResidentOnRead
from .monitor import MemoryMonitor, shared_monitor
from .swap import SwapError, SwapHandle, SwapSpace, SwapWriteError

__all__ = ["NVMeOffload", "OffloadWriteError"]


class OffloadWriteError(SwapError):
    """Writes of offloaded state failed during a step (disk full, ...); the state is intact in memory."""

    def __init__(self, msg: str, paths: list[str]):
        super().__init__(msg)
        self.paths = paths


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
        self._key_of: dict[str, Any] = {}  # handle name -> unit
        self._unwritable: set = set()  # units whose write failed since the last end_step(): not evicted again
        self._write_errors: list[SwapWriteError] = []  # failures not yet raised (by check_writes)
        self.evictions = 0
        self.prefetches = 0
        self.over_budget = 0  # times a unit had to go over the budget (every resident unit in use): see make_room

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
                self._note_write_errors()
                if self.swap.resident_bytes + nbytes <= budget:
                    return True
                victim = next((k for k in self._lru if k not in self._unwritable
                               and any(h.resident for h in self._units[k])), None)
                if victim is not None:
                    self._lru.pop(victim)
                    for h in self._units[victim]:
                        self.swap.swap_out(h)
                    self.evictions += 1
                    continue
                try:
                    waited = block and self.swap.wait_oldest()  # a write in flight frees memory when it lands
                except SwapWriteError:
                    continue  # noted at the top of the loop; the unit stays resident
                if not waited:
                    if block and self._unwritable:
                        return True  # over budget because writes failed: end_step() raises, nothing is lost
                    if block:  # every resident unit is in use (a step running beside this one): going over the
                        self.over_budget += 1  # budget for a moment beats an error inside backward on one rank
                        if self.over_budget == 1:
                            warnings.warn(f"NVMeOffload: {nbytes} bytes did not fit the resident budget of {budget} "
                                          f"bytes ({self.swap.resident_bytes} resident, all in use): going over it. "
                                          "Fix: budget_bytes of at least twice the largest parameter's state.")
                        return True
                    return False

    # ------------------------------------------------------------------ units
    def register(self, key: Any, tensors: dict[str, torch.Tensor]) -> None:
        """Track a unit (resident, idle).  Call ``make_room(bytes)`` before allocating it to stay in budget."""
        with self._lock:
            if key in self._units:
                raise ValueError(f"NVMeOffload.register: unit {key!r} is already registered")
            self._units[key] = [self.swap.register(f"{key}.{name}", t) for name, t in tensors.items()]
            self._key_of.update({h.name: key for h in self._units[key]})
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
        try:  # whatever fails below, the units are released: a failed step must not pin them forever
            with self._lock:
                for key in keys:
                    need = self._claim(key)
                    if need:
                        self.make_room(need)
                    for h in self._units[key]:
                        self.swap.swap_in(h)
            for key in keys:
                for h in self._units[key]:
                    try:
                        self.swap.wait(h)
                    except SwapWriteError:
                        pass  # its earlier eviction's write failed: the data is in memory; end_step() reports it
                    except SwapError as exc:  # a read: the state is lost here, and the other ranks would wait
                        _comm.announce_failure(f"{type(exc).__name__}: {exc}")
                        raise
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
            self._key_of.clear()
            self._unwritable.clear()
            self._write_errors.clear()
            self.swap.take_write_errors()  # the files are gone: their failures no longer matter

    def flush(self) -> None:
        """Write every resident unit whose file is stale and wait: the files then hold the whole state."""
        with self._lock:
            for handles in self._units.values():
                for h in handles:
                    if h.resident and h.disk_stamp != h.stamp() and h.future is None:
                        self.swap.swap_out(h)
                        self.swap.swap_in(h)  # keep it resident: this is a flush, not an eviction
            self.swap.sync()

    # ------------------------------------------------------------------ write failures
    def _note_write_errors(self) -> None:
        """Mark the units of failed writes unwritable (not chosen for eviction again until ``end_step``)."""
        for err in self.swap.take_write_errors():
            self._write_errors.append(err)
            key = self._key_of.get(err.name)
            if key is not None:
                self._unwritable.add(key)

    def check_writes(self) -> None:
        """Wait for the writes in flight, then raise every write failure since the last call as one
        ``OffloadWriteError`` (the data of those units is in memory; nothing is lost)."""
        for h in self.swap.handles:
            if h.kind == "write":
                with contextlib.suppress(SwapWriteError):
                    self.swap.wait(h)
        self._note_write_errors()
        errors, self._write_errors = self._write_errors, []
        over = max(0, self.swap.resident_bytes - self.effective_budget())
        self._unwritable.clear()  # the next evictions retry: the disk may have room again
        if errors:
            paths = sorted({e.path for e in errors})
            raise OffloadWriteError(
                f"NVMeOffload: {len(errors)} write(s) of offloaded optimizer state failed in this step, e.g. file "
                f"{paths[0]} ({len(paths)} file(s) under {self.swap.directory}): {errors[0]}.  The step was applied "
                f"and the whole state is intact in memory ({over} bytes over the resident budget): save it with "
                "optimizer.state_dict(); free space on that filesystem (or give NVMeOffload a larger one) and "
                "training can go on: the writes are retried.",
                paths,
            )

    # ------------------------------------------------------------------ StateStore (CPUAdam's moments)
    def new_moments(self, key: int, shape: torch.Size) -> dict[str, torch.Tensor]:
        """Zeroed moments in pageable memory (the swap layer frees a swapped-out tensor's storage, which pinned
        memory does not allow), after making room for them in the budget."""
        self.make_room(len(MOMENTS) * shape.numel() * 4)
        return {k: torch.zeros(shape, dtype=torch.float32) for k in MOMENTS}

    def track(self, key: int, state: dict) -> dict:
        for k in MOMENTS:
            t = state[k]
            if t.is_pinned() or not t.untyped_storage().resizable():
                state[k] = t.clone()  # e.g. loaded into pinned memory: the swap layer needs pageable storage
        self.register(key, {k: state[k] for k in MOMENTS})
        return ResidentOnRead(state, self, key)

    def resident(self, keys: list[int]) -> contextlib.AbstractContextManager:
        return self.use(keys)

    def chunks(self, keys: list[int]) -> Iterator[list[int]]:
        """``keys`` in chunks of at most half the budget, each resident while the caller's loop body runs; the
        next chunk is read ahead meanwhile."""
        plan = self.plan(keys)
        self.prefetch(plan[0] if plan else [])
        for k, chunk in enumerate(plan):
            with self.use(chunk):
                if k + 1 < len(plan):
                    self.prefetch(plan[k + 1])
                yield chunk

    def export(self, key: int) -> Optional[dict[str, torch.Tensor]]:
        return self.read_copy(key) if self.has(key) else None

    def end_step(self, group: Any = None) -> None:
        """``check_writes``, agreed over ``group``: a disk that filled on one rank raises on every rank, each
        naming the ranks and files, so a loop that catches the error and goes on keeps the ranks in step."""
        try:
            self.check_writes()
            mine = None
        except OffloadWriteError as exc:
            mine = exc
        if not any_rank(mine is not None, group, "NVMeOffload: did any rank's writes fail"):
            return
        if not _comm.is_distributed() or _comm.world_size(group) == 1:
            raise mine
        verdicts = _comm.all_gather_object(None if mine is None else (str(mine), mine.paths), group,
                                           label="NVMeOffload write verdicts")
        failed = [(r, v) for r, v in enumerate(verdicts) if v is not None]
        ranks = ", ".join(str(r) for r, _ in failed)
        raise OffloadWriteError(f"(rank(s) {ranks} of {len(verdicts)}) {failed[0][1][0]}",
                                [path for _, v in failed for path in v[1]])

    def reset(self) -> None:
        self.unregister_all()

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
