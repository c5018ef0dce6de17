"""A comm module (with ``_comm``): identity records exchanged through shared memory by the ranks of one host.

[Note: identity records through shared memory]
Every data collective first waits for an exchange of identity records (``_comm_divergence``, [Note: the identity
check]).  Over a gloo group that exchange needs two hand-offs per rank: the caller's thread to gloo's worker,
which sends, and on the peer a worker that must first get a slice of a core the peer's compute keeps busy.  On
the benchmark GPT (2 ranks, 2 cores) a check took 5.5 ms on average, 14 checks a step: 8% of the step, nearly
all of it threads waiting to be scheduled, and it put the prefetched gathers back in lockstep.  Ranks of one
host share memory: each writes its record into a slot of its own in a small file under ``/dev/shm`` and reads
the others' slots, so a record is there the moment its rank's own thread reaches the check, with no thread to
wake.  Measured on that GPT: the step at 0.93x (wall) and 0.95x (CPU seconds) of the gloo exchange, about what
turning the check off gives.

Slots: each rank has ``_SLOTS``, used in turn (exchange n in slot n % _SLOTS).  A rank can be at most one
exchange ahead of a peer (it needs that peer's record to finish one), so no slot is rewritten while a peer may
still read it.  A slot holds the exchange number, the payload's length and a CRC of both with the payload, then
the payload; the writer writes the payload first and that header last, and a reader takes a slot only when the
number is the one it waits for and the CRC matches, so a half-written slot is read again, on any memory model.
The waiting rank polls: it yields its core for a short while (its own gloo threads may have transfers to run),
then sleeps in steps of up to 200 us, under the same timed and probed wait as a gloo exchange.

Built once per data group where its control group was built (every member arrives there together): rank 0
creates the file under a random name, the others map it and check its nonce, every rank says through the
default store whether it could, and the file's name is removed once all have answered (the mappings outlive it,
so nothing is left behind when a rank dies later).  If any rank could not (another host, another ``/dev/shm``),
every rank keeps the gloo control group; ``SHARDTENSOR_SHM_RECORDS=0`` keeps it always.
"""

from __future__ import annotations

import datetime
import mmap
import os
import struct
import time
import uuid
import zlib
from typing import Callable, Optional

import torch

_SLOTS = 4
_HEADER = struct.Struct("<qqq")  # exchange number, payload bytes, CRC
CAPACITY = 1024  # payload bytes: a record (56) or the labels exchanged after a divergence (512 per rank)
_SLOT_BYTES = _HEADER.size + CAPACITY
_MAGIC = b"shardtensor identity records\0"
_PREAMBLE = len(_MAGIC) + 32 + 3  # the magic, the nonce (32 hex digits), padding to 8-byte alignment
_SHM_DIR = "/dev/shm"
_YIELDS = 64  # polls that only yield the core before the first sleep
_LONGEST_SLEEP_S = 2e-4


def _crc(number: int, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(number.to_bytes(8, "little", signed=True)))


class Mailbox:
    """This rank's view of a group's shared slots (see the note above)."""

    def __init__(self, mapping: mmap.mmap, rank: int, world: int):
        self.mapping, self.rank, self.world = mapping, rank, world
        self.count = 0  # exchanges this rank began: the same sequence on every rank of the group

    def _offset(self, rank: int, number: int) -> int:
        return _PREAMBLE + (rank * _SLOTS + number % _SLOTS) * _SLOT_BYTES

    def exchange(self, out: torch.Tensor, inp: torch.Tensor) -> "MailboxWork":
        """Write ``inp``'s bytes into this rank's next slot; the returned work fills ``out`` with every rank's, in
        rank order, once they are all there (an all-gather of ``inp``)."""
        payload = inp.detach().contiguous().view(torch.uint8).numpy().tobytes()
        if len(payload) > CAPACITY or out.numel() * out.element_size() != len(payload) * self.world:
            raise AssertionError(f"identity mailbox: {len(payload)} bytes per rank into {tuple(out.shape)} "
                                 f"{out.dtype} (capacity {CAPACITY})")
        self.count += 1
        offset = self._offset(self.rank, self.count)
        self.mapping[offset + _HEADER.size: offset + _HEADER.size + len(payload)] = payload
        self.mapping[offset: offset + _HEADER.size] = _HEADER.pack(self.count, len(payload), _crc(self.count, payload))
        return MailboxWork(self, self.count, out, payload)

    def read(self, rank: int, number: int, nbytes: int) -> Optional[bytes]:
        """``rank``'s payload of exchange ``number``, or None while it is not (completely) there."""
        offset = self._offset(rank, number)
        found, length, crc = _HEADER.unpack_from(self.mapping, offset)
        if found != number or length != nbytes:
            return None
        payload = self.mapping[offset + _HEADER.size: offset + _HEADER.size + length]
        return payload if _crc(found, payload) == crc else None


class MailboxWork:
    """The waiting half of one exchange, shaped like a ``Work`` for ``_comm._TimedWork``."""

    __slots__ = ("box", "number", "out", "rows", "done")

    def __init__(self, box: Mailbox, number: int, out: torch.Tensor, mine: bytes):
        self.box, self.number, self.out = box, number, out
        self.rows: dict[int, bytes] = {box.rank: mine}
        self.done = False

    def _poll(self) -> bool:
        nbytes = len(self.rows[self.box.rank])
        for rank in range(self.box.world):
            if rank not in self.rows:
                payload = self.box.read(rank, self.number, nbytes)
                if payload is not None:
                    self.rows[rank] = payload
        return len(self.rows) == self.box.world

    def is_completed(self) -> bool:
        return self.done or self._poll()

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        if self.done:
            return True
        poll_until(self._poll, timeout, lambda: "identity records through shared memory", lambda: (
            f"exchange #{self.number} of group rank(s) {[r for r in range(self.box.world) if r not in self.rows]}"))
        joined = b"".join(self.rows[r] for r in range(self.box.world))
        self.out.view(torch.uint8).view(-1).copy_(torch.frombuffer(bytearray(joined), dtype=torch.uint8))
        self.done = True
        return True


def poll_until(done: Callable[[], bool], timeout: Optional[datetime.timedelta], who: Callable[[], str],
               what: Callable[[], str]) -> bool:
    """Poll ``done`` until true: a peer's write through shared memory wakes no thread, so the waiter looks.  It
    yields the core first (the peer may need it to write), then sleeps in growing steps; past ``timeout`` a
    ``TimeoutError`` names ``what`` it waited for."""
    seconds = float("inf") if timeout is None else timeout.total_seconds()
    deadline, polls = time.monotonic() + seconds, 0
    while not done():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{who()}: timed out after {seconds:g} s waiting for {what()}")
        polls += 1
        if polls <= _YIELDS:
            os.sched_yield()
        else:
            time.sleep(min(_LONGEST_SLEEP_S, 1e-5 * (polls - _YIELDS)))
    return True


def open_mailbox(store, rank: int, world: int, timeout_s: float) -> Optional[Mailbox]:
    """Every member of a group calls this together (``store``: a prefix of the default store for this group);
    every member gets a mailbox, or every member gets None."""
    wanted = os.environ.get("SHARDTENSOR_SHM_RECORDS", "1") != "0" and hasattr(os, "sched_yield")
    mapping = map_shared(store, rank, world, _PREAMBLE + world * _SLOTS * _SLOT_BYTES, timeout_s, wanted)
    return Mailbox(mapping, rank, world) if mapping is not None else None


def map_shared(store, rank: int, world: int, size: int, timeout_s: float, wanted: bool) -> Optional[mmap.mmap]:
    """One file of ``size`` bytes (after a ``_PREAMBLE``'s nonce) mapped by every member of a group, or None on
    every member where any cannot map it (or does not want it).  Every member calls this together; ``store`` is
    a prefix of the default store of the members' own."""
    wanted = wanted and os.path.isdir(_SHM_DIR)
    wait = datetime.timedelta(seconds=timeout_s)
    mapping, path = None, ""
    if rank == 0:
        if wanted:
            mapping, path = _create(size)
        store.set("path", path)
    store.wait(["path"], wait)
    path = store.get("path").decode()
    if rank != 0 and wanted and path:
        mapping = _map(path, size)
    store.set(f"ok/{rank}", b"1" if mapping is not None else b"0")
    answers = [f"ok/{r}" for r in range(world)]
    store.wait(answers, wait)
    everyone = all(store.get(key) == b"1" for key in answers)
    if rank == 0 and path:
        try:
            os.unlink(path)  # every rank has mapped it or given up: the name is no longer needed
        except OSError:
            pass
    if everyone:
        return mapping
    if mapping is not None:
        mapping.close()
    return None


def _create(size: int) -> tuple[Optional[mmap.mmap], str]:
    nonce = uuid.uuid4().hex
    path = os.path.join(_SHM_DIR, f"shardtensor-records-{nonce}")
    try:
        if size > _free_bytes():
            return None, ""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Every page now: a sparse file whose page is first written when /dev/shm is full (Docker's default
            # is 64 MB) kills the writer with SIGBUS; a failure here only means gloo.
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
    except OSError:
        return None, ""
    mapping[: len(_MAGIC) + 32] = _MAGIC + nonce.encode()
    return mapping, path


def _free_bytes() -> int:
    st = os.statvfs(_SHM_DIR)
    return st.f_bavail * st.f_frsize


def _map(path: str, size: int) -> Optional[mmap.mmap]:
    """The file rank 0 made, if this rank sees that very file (same host, same ``/dev/shm``)."""
    nonce = path.rsplit("-", 1)[-1].encode()
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                return None
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
    except OSError:
        return None
    if mapping[: len(_MAGIC) + 32] != _MAGIC + nonce:
        mapping.close()
        return None
    return mapping
