"""The swap layer: CPU tensors swapped to files in a directory through a bounded pool of I/O threads.

Contract:
  - Every wait is on the future of a request that was issued (``SwapHandle.future``), with a timeout whose error
    names the tensor and the file.  Waiting on a handle with nothing in flight returns at once: there is no
    "wait for the queue".  (DeepSpeed's swapper aborted on an assertion when it waited with nothing pending.)
  - The I/O threads take no lock of ours (only the buffer pool's queue, which never blocks them: there are as
    many buffers as threads), so no wait here can hold a lock an I/O thread needs (``_swap_io`` says why).
  - A write is durable (``pwritev`` returned every byte, then ``fdatasync``) before its buffer goes back to the
    pool and before the tensor's memory is freed.  A failed write (disk full, ...) raises a ``SwapWriteError``
    naming the tensor and the file, the tensor stays resident (the in-memory copy survives), and the error is
    also kept for ``take_write_errors`` (a write nobody waits for must not fail silently).
  - A failed read (file removed, short read) raises a ``SwapError`` naming the tensor and the file; the tensor
    stays swapped out (its only copy is the file).
  - No stale data: the disk copy is stamped with the tensor's version counter and a generation the owner bumps
    with ``mark_dirty`` before it modifies the tensor.  A clean tensor (same stamp as its file) is dropped
    without writing; a tensor modified while its write was in flight is kept resident, its file marked stale.

How memory is freed: a tensor keeps its identity (optimizer state dicts and closures hold it) and only its
storage is freed, ``untyped_storage().resize_(0)``, then re-allocated before a read; FSDP frees unsharded
parameters the same way.  A swapped-out tensor must not be touched: ``SwapSpace`` tracks the state
(``SwapState``) and whoever owns the tensor asks ``swap_in`` + ``wait`` first.
Files hold the raw bytes, padded to ``align`` for ``O_DIRECT`` (``direct=True``, a real drive; not tmpfs).
"""

from __future__ import annotations

import concurrent.futures
import enum
import itertools
import os
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from ._swap_io import Buffers, Reader, Writer, read_file, write_file

__all__ = ["SwapError", "SwapWriteError", "SwapSpace", "SwapHandle", "SwapState"]


class SwapError(RuntimeError):
    """An I/O request of the swap layer failed or timed out; the message names the tensor and the file."""


class SwapWriteError(SwapError):
    """A write failed (disk full, ...): the tensor stays resident, so nothing is lost; ``path`` is the file."""

    def __init__(self, msg: str, path: str, name: str):
        super().__init__(msg)
        self.path, self.name = path, name


class SwapState(enum.Enum):
    RESIDENT = "resident"  # memory holds the data (the disk copy may or may not be current)
    WRITING = "writing"  # resident; a write of it is in flight (it must not be modified meanwhile)
    SWAPPED = "swapped"  # memory freed; the file holds the only copy
    READING = "reading"  # memory allocated; a read into it is in flight


@dataclass(eq=False)
class SwapHandle:
    """One swappable tensor.  Fields are changed by ``SwapSpace`` under its lock only."""

    name: str
    # CPU, contiguous, owns its whole (resizable) storage.  Not in the repr: printing a swapped-out tensor would
    # read freed memory.
    tensor: torch.Tensor = field(repr=False)
    path: str
    nbytes: int
    state: SwapState = SwapState.RESIDENT
    future: Optional[concurrent.futures.Future] = None  # the one request in flight, if any
    kind: str = ""  # "read" / "write": what ``future`` is
    generation: int = 0  # bumped by ``SwapSpace.mark_dirty``: the owner is about to modify the tensor
    issued_stamp: tuple = ()  # stamp() when the in-flight write was issued
    disk_stamp: Optional[tuple] = None  # stamp() of the data the file holds; None: no valid disk copy
    keep_resident: bool = False  # swap_in() arrived while a write was in flight: do not free after it
    error: Optional[BaseException] = field(default=None, repr=False)  # last failure, for waiters that lost a race

    def stamp(self) -> tuple:
        # Both: in-place torch ops bump the version counter, but fused/foreach kernels need not (the
        # ``_fused_adamw_`` CPU kernel does not), so owners also declare writes with ``mark_dirty``.
        return (self.tensor._version, self.generation)

    @property
    def resident(self) -> bool:
        return self.state is not SwapState.SWAPPED


class SwapSpace:
    """Tensors swapped to files under ``directory``, through ``workers`` I/O threads.

    Args:
        directory: where the swap files go (created if missing).  One file per registered tensor.
        workers: I/O threads, and the number of buffers. (Default: 4)
        buffer_bytes: size of each buffer; requests larger than this go through it in chunks.  Rounded up to
            ``align``. (Default: 4 MiB)
        max_inflight: most requests in flight; issuing one more first waits for the oldest. (Default: 64)
        timeout_s: longest wait for one request before ``SwapError``. (Default: 120)
        durable: ``fdatasync`` each file before its write completes. (Default: True)
        direct: open files with ``O_DIRECT`` (Linux; a real drive, not tmpfs). (Default: False)
        align: file and buffer alignment in bytes. (Default: 4096)
        writer, reader: the raw calls, ``os.pwritev`` / ``os.preadv`` by default; injectable for fault tests.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        workers: int = 4,
        buffer_bytes: int = 4 << 20,
        max_inflight: int = 64,
        timeout_s: float = 120.0,
        durable: bool = True,
        direct: bool = False,
        align: int = 4096,
        writer: Optional[Writer] = None,
        reader: Optional[Reader] = None,
    ):
        if workers < 1 or max_inflight < 1 or buffer_bytes < 1 or align < 1 or timeout_s <= 0:
            raise ValueError(f"SwapSpace: invalid {workers=} {max_inflight=} {buffer_bytes=} {align=} {timeout_s=}")
        if direct and not hasattr(os, "O_DIRECT"):
            raise ValueError("SwapSpace: direct=True needs os.O_DIRECT (Linux); use direct=False")
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.align = int(align)
        self.buffer_bytes = -(-int(buffer_bytes) // self.align) * self.align
        self.max_inflight = int(max_inflight)
        self.timeout_s = float(timeout_s)
        self.durable = durable
        self.direct = direct
        self._writer: Writer = writer or os.pwritev
        self._reader: Reader = reader or os.preadv
        self._buffers = Buffers(workers, self.buffer_bytes)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="swap_io")
        self._lock = threading.RLock()  # bookkeeping only; never held across a wait, never taken by I/O threads
        self._handles: dict[str, SwapHandle] = {}
        self._inflight: list[SwapHandle] = []  # issue order
        self._ids = itertools.count()
        self._closed = False
        # accounting, read by NVMeOffload, tests and benchmarks
        self.resident_bytes = 0  # bytes of registered tensors whose storage is allocated
        self.peak_resident_bytes = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.writes = 0
        self.reads = 0
        self.clean_drops = 0  # swap-outs that needed no write (the disk copy was current)
        # Every failed write, whether or not a waiter saw it (``poll`` applies outcomes nobody waits for): an
        # owner that must report write failures at a fixed point takes them with ``take_write_errors``.
        self._write_errors: list[SwapWriteError] = []

    # ------------------------------------------------------------------ registration
    def register(self, name: str, tensor: torch.Tensor) -> SwapHandle:
        """Start tracking ``tensor`` (resident).  It must be a CPU tensor that owns its whole, resizable storage."""
        if self._closed:
            raise SwapError(f"SwapSpace({self.directory!r}) is closed; cannot register {name!r}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.storage_offset() != 0:
            raise ValueError(
                f"SwapSpace.register({name!r}): needs a contiguous CPU tensor at storage offset 0, got "
                f"{tensor.device=} {tensor.is_contiguous()=} {tensor.storage_offset()=}"
            )
        storage = tensor.untyped_storage()
        nbytes = tensor.numel() * tensor.element_size()
        if storage.nbytes() != nbytes or not storage.resizable():
            raise ValueError(
                f"SwapSpace.register({name!r}): the tensor must own its whole resizable storage "
                f"({storage.nbytes()=} {nbytes=} {storage.resizable()=}); pass a fresh tensor (e.g. .clone()), "
                "not a view, a pinned tensor or one made from numpy"
            )
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:80]
        path = os.path.join(self.directory, f"{next(self._ids):06d}_{safe}.swp")
        handle = SwapHandle(name, tensor, path, nbytes)
        with self._lock:
            if name in self._handles:
                raise ValueError(f"SwapSpace.register: {name!r} is already registered")
            self._handles[name] = handle
            self._count_alloc(nbytes)
        return handle

    def unregister(self, handle: SwapHandle) -> None:
        """Stop tracking ``handle``: its data is brought back into memory, then its file is removed."""
        try:
            self.wait(handle)
        except SwapError:
            pass  # a failed write leaves the tensor resident; a failed read is retried just below
        if handle.state is SwapState.SWAPPED:  # read it back: the owner keeps a valid tensor
            self.swap_in(handle)
            self.wait(handle)  # a failure here raises (naming the file), and the handle stays registered
        with self._lock:
            self.resident_bytes -= handle.nbytes  # no longer ours to count
            self._handles.pop(handle.name, None)
        try:
            os.unlink(handle.path)
        except FileNotFoundError:
            pass

    @property
    def handles(self) -> list[SwapHandle]:
        with self._lock:
            return list(self._handles.values())

    # ------------------------------------------------------------------ requests (owner threads)
    def swap_out(self, handle: SwapHandle) -> Optional[concurrent.futures.Future]:
        """Free the tensor's memory once the file holds its current data: at once when the disk copy is current
        (no write), else after a write that this issues.  Returns the write's future, or None."""
        self._throttle()
        with self._lock:
            if handle.state is SwapState.WRITING:
                handle.keep_resident = False  # a write is already on its way: free after it
                return handle.future
            if handle.state is not SwapState.RESIDENT:
                return handle.future  # swapped, or being read: nothing to write
            handle.keep_resident = False
            if handle.disk_stamp == handle.stamp():
                self._free(handle)
                self.clean_drops += 1
                return None
            handle.state = SwapState.WRITING
            handle.kind = "write"
            handle.issued_stamp = handle.stamp()
            flat = handle.tensor.detach().reshape(-1).view(torch.uint8)
            handle.future = self._pool.submit(self._write_job, handle.name, handle.path, flat)
            self._inflight.append(handle)
            return handle.future

    def swap_in(self, handle: SwapHandle) -> Optional[concurrent.futures.Future]:
        """Make the tensor resident: allocate its memory and issue a read (when swapped out).  Returns the read's
        future, or None when the data is already in memory (``wait`` then returns at once)."""
        self._throttle()
        with self._lock:
            if handle.state is SwapState.WRITING:
                handle.keep_resident = True  # the memory still holds the data: keep it after the write
                return None
            if handle.state is not SwapState.SWAPPED:
                return handle.future
            handle.tensor.untyped_storage().resize_(handle.nbytes)
            self._count_alloc(handle.nbytes)
            handle.state = SwapState.READING
            handle.kind = "read"
            flat = handle.tensor.detach().reshape(-1).view(torch.uint8)
            handle.future = self._pool.submit(self._read_job, handle.name, handle.path, flat)
            self._inflight.append(handle)
            return handle.future

    def mark_dirty(self, handle: SwapHandle) -> None:
        """Declare that the owner is about to modify the tensor: its disk copy will be stale.  Call it before the
        change (a write in flight then completes as stale instead of being trusted)."""
        with self._lock:
            handle.generation += 1

    def wait(self, handle: SwapHandle, timeout_s: Optional[float] = None) -> None:
        """Wait for ``handle``'s request in flight, if any (with a timeout), and apply its outcome.

        Raises ``SwapError`` naming the tensor and the file when the request failed or timed out.
        """
        with self._lock:
            fut, kind = handle.future, handle.kind
        if fut is None:
            return  # nothing was issued: nothing to wait for
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            fut.result(timeout=timeout)
            err: Optional[BaseException] = None
        except concurrent.futures.TimeoutError:
            raise SwapError(
                f"swap {kind} of tensor {handle.name!r} (file {handle.path}) did not finish in {timeout}s "
                "(stuck device or directory?)"
            ) from None
        except BaseException as e:  # noqa: BLE001 - the job's error, re-raised below with names
            err = e
        self._complete(handle, fut, err)

    def take_write_errors(self) -> list[SwapWriteError]:
        """The write failures since the last call (each once), oldest first."""
        with self._lock:
            errors, self._write_errors = self._write_errors, []
        return errors

    def poll(self) -> None:
        """Apply the outcome of every finished request (frees memory of finished writes).  Never blocks; a write
        failure is kept for ``take_write_errors``, a read failure is raised by the next ``wait`` on the handle."""
        with self._lock:
            done = [(h, h.future) for h in self._inflight if h.future is not None and h.future.done()]
        for h, fut in done:
            try:
                self._complete(h, fut, fut.exception())
            except SwapError:
                pass

    def wait_oldest(self) -> bool:
        """Wait for the oldest request in flight; False when none is."""
        with self._lock:
            oldest = next((h for h in self._inflight if h.future is not None), None)
        if oldest is None:
            return False
        self.wait(oldest)
        return True

    def sync(self) -> None:
        """Wait for every request in flight; the first failure is raised after all have finished."""
        first: Optional[SwapError] = None
        for h in self.handles:
            try:
                self.wait(h)
            except SwapError as e:
                first = first or e
        if first is not None:
            raise first

    def close(self) -> None:
        """Finish every request, stop the threads, remove the files (tensors that are swapped out get their
        data back first, so nothing is lost)."""
        if self._closed:
            return
        for h in self.handles:
            try:
                self.wait(h)
                if h.state is SwapState.SWAPPED:
                    self.swap_in(h)
                    self.wait(h)
            except SwapError:
                pass
        for h in self.handles:
            try:
                self.unregister(h)
            except SwapError:  # its file is gone or short: the loss was reported when it was read; drop it
                with self._lock:
                    self._handles.pop(h.name, None)
        self._pool.shutdown(wait=True)
        self._closed = True

    # ------------------------------------------------------------------ internals
    def _count_alloc(self, nbytes: int) -> None:
        self.resident_bytes += nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def _free(self, handle: SwapHandle) -> None:
        handle.tensor.untyped_storage().resize_(0)
        handle.state = SwapState.SWAPPED
        self.resident_bytes -= handle.nbytes

    def _throttle(self) -> None:
        """Bound the queue: before issuing one more request, wait for the oldest issued one (never "the queue")."""
        self.poll()
        while True:
            with self._lock:
                over = sum(1 for h in self._inflight if h.future is not None) >= self.max_inflight
            if not over or not self.wait_oldest():
                return

    def _complete(self, handle: SwapHandle, fut: concurrent.futures.Future, err: Optional[BaseException]) -> None:
        with self._lock:
            if handle.future is not fut:  # another thread applied this outcome first (and raised its error)
                return
            handle.future = None
            self._inflight = [h for h in self._inflight if h is not handle]
            if handle.kind == "write":
                if err is None:
                    self.writes += 1
                    self.bytes_written += handle.nbytes
                    if handle.stamp() != handle.issued_stamp:
                        handle.disk_stamp = None  # modified during the write: the file is torn/stale
                        handle.state = SwapState.RESIDENT
                    else:
                        handle.disk_stamp = handle.issued_stamp
                        if handle.keep_resident:
                            handle.state = SwapState.RESIDENT
                        else:
                            self._free(handle)
                else:
                    handle.disk_stamp = None  # the file may be partial: never read it
                    handle.state = SwapState.RESIDENT  # the in-memory copy survives
            else:
                if err is None:
                    self.reads += 1
                    self.bytes_read += handle.nbytes
                    handle.state = SwapState.RESIDENT
                    handle.disk_stamp = handle.stamp()  # the copy_ in the read bumped the version
                else:
                    self._free(handle)  # the memory holds garbage; the file stays the only copy
            handle.keep_resident = False
            handle.error = None
            if err is not None:
                action = "write" if handle.kind == "write" else "read"
                kept = ("the tensor stays in memory" if action == "write"
                        else "the tensor stays swapped out")
                msg = f"swap {action} of tensor {handle.name!r} (file {handle.path}) failed: {err!r}; {kept}"
                handle.error = SwapWriteError(msg, handle.path, handle.name) if action == "write" else SwapError(msg)
                if action == "write":
                    self._write_errors.append(handle.error)
                raise handle.error from err

    def _write_job(self, name: str, path: str, src: torch.Tensor) -> None:
        write_file(path, src, self._buffers, self._writer, self.align, self.buffer_bytes, self.direct, self.durable)

    def _read_job(self, name: str, path: str, dst: torch.Tensor) -> None:
        read_file(path, dst, self._buffers, self._reader, self.align, self.buffer_bytes, self.direct)
