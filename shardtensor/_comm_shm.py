"""A comm module (with ``_comm``): a gather unit's collectives between the ranks of one host, through shared memory.

[Note: unit collectives through shared memory]
On gloo a unit's gather is one broadcast per rank and its reduce-scatter one send per peer (``_comm_rows``): each
byte goes through loopback TCP, copied into the kernel and out again by gloo's worker threads, which must first
get a slice of a core that the ranks' compute keeps busy.  Ranks of one host can share memory instead: a rank
copies the bytes its peers need (its rows of a gather; each peer's rows of its gradients) into a slot of its own
in a file under ``/dev/shm`` and writes the collective's number beside it; a peer, when it waits, copies them
out (or adds them into its own rows) and writes that it has read them.  No thread, no socket: one copy in, one
out.  The identity check still runs before each collective (only the transport changes), so a slot always holds
what its reader expects, and a collective that does not fit a slot goes over gloo, on every rank alike (the same
sizes: the check compared them).

Slots: every rank has ``SLOTS`` of them, used in turn, and writes into one only once every peer has read its
previous use.  It never waits for that: each rank votes, in the identity check before the collective, whether its
next slot is free, and where any is not, the collective goes over gloo on every rank (a rank waiting for a peer to
read could wait forever: the peer may be blocked in a collective of the user's, waiting for it).  Each check
first takes what peers have posted for this rank's pending collectives, which frees their slots; a rank's own
code leaves at most two unit collectives unwaited (a prefetched gather and a reduction in flight), so with three
slots the vote is yes in a steady step.  The number is written after the data and read before it: on x86-64,
whose stores are seen in program order, a peer never sees the number before the data, so the channel opens only
there.  A reduction adds its peers' rows in the order gloo's does (``_comm_rows``), so its sums are the same bits
by either transport.  Waits are ``_comm``'s timed, probed waits.

Memory: ``SLOTS`` slots per rank of the largest unit's share ((world - 1) / world of a unit, the rows a
reduce-scatter sends; 3 x 3.5 MB at the benchmark GPT), in overlapped mode only (sequential mode, the lowest peak,
keeps gloo).  A rank's mapping of a peer's slot is dropped once read (``MADV_DONTNEED``), so resident memory counts
every slot once, on the rank that writes it.  Opened at ``shard_module`` (every rank is there: the model agreement
exchange precedes it) as the identity mailbox is; where any rank cannot map the file, or with
``SHARDTENSOR_SHM_COLLECTIVES=0``, every rank keeps gloo.
"""

from __future__ import annotations

import datetime
import mmap
import os
import platform
import struct
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ._comm_divergence import _store
from ._comm_mailbox import map_shared, poll_until

SLOTS = 3
_opened: dict = {}  # group name -> channels this process opened on it (their store keys)
_PAGE = mmap.PAGESIZE
_WORD = struct.Struct("<q")


def supported() -> bool:
    """Whether this process may open a channel (x86-64: see the note above; not turned off)."""
    return (platform.machine() in ("x86_64", "AMD64") and hasattr(os, "sched_yield")
            and os.environ.get("SHARDTENSOR_SHM_COLLECTIVES", "1") != "0")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class Channel:
    """This rank's view of one unit set's slots: ``posted[writer][slot]`` (the number of the collective whose
    data the slot holds), ``read[reader][writer][slot]`` (the last number the reader took from it), then the
    slots' bytes, each starting on a page."""

    def __init__(self, mapping: mmap.mmap, rank: int, world: int, capacity: int):
        self.mapping, self.rank, self.world, self.capacity = mapping, rank, world, capacity
        self._control = _PAGE  # (the first page holds the file's nonce)
        self._data = _PAGE + _round_up((world + world * world) * SLOTS * _WORD.size, _PAGE)
        self.bytes = torch.frombuffer(mapping, dtype=torch.uint8)
        self.count = 0  # collectives through this channel: the same sequence on every rank
        self.mine = [0] * SLOTS  # the number this rank last posted in each of its slots
        self.pending: list[ChannelWork] = []

    @staticmethod
    def size_for(world: int, capacity: int) -> int:
        return _PAGE + _round_up((world + world * world) * SLOTS * _WORD.size, _PAGE) + world * SLOTS * capacity

    @classmethod
    def open(cls, group, largest_share: int, timeout_s: float) -> Optional["Channel"]:
        """Every member of ``group`` (gloo, CPU) calls this together; every member gets a channel, or every member
        None.  ``largest_share``: the most bytes one collective writes into a slot."""
        pg = group if group is not None else dist.group.WORLD
        store = _store()
        if store is None or dist.get_backend(pg) != "gloo" or dist.get_world_size(pg) == 1:
            return None
        name = getattr(pg, "group_name", "?")
        _opened[name] = _opened.get(name, 0) + 1  # every member opens its channels on a group in the same order
        store = dist.PrefixStore(f"shardtensor/channel/{name}/{_opened[name]}/", store)
        rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        capacity = _round_up(max(largest_share, 1), _PAGE)
        mapping = map_shared(store, rank, world, cls.size_for(world, capacity), timeout_s, supported())
        return cls(mapping, rank, world, capacity) if mapping is not None else None

    # ------------------------------------------------------------------ control words
    def _word(self, offset: int) -> int:
        return _WORD.unpack_from(self.mapping, offset)[0]

    def _posted_at(self, writer: int, slot: int) -> int:
        return self._control + (writer * SLOTS + slot) * _WORD.size

    def _read_at(self, reader: int, writer: int, slot: int) -> int:
        return self._control + (self.world * SLOTS + (reader * self.world + writer) * SLOTS + slot) * _WORD.size

    def _slot(self, writer: int, slot: int) -> int:
        return self._data + (writer * SLOTS + slot) * self.capacity

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.capacity

    # ------------------------------------------------------------------ writing
    def next_slot_free(self) -> bool:
        """Whether every peer has read this rank's previous use of the slot the next collective takes."""
        slot = (self.count + 1) % SLOTS
        last = self.mine[slot]
        return last == 0 or all(self._word(self._read_at(p, self.rank, slot)) == last
                                for p in range(self.world) if p != self.rank)

    def _post(self, pieces: list[torch.Tensor]) -> tuple[int, int]:
        if not self.next_slot_free():
            raise AssertionError("shared-memory channel: a slot was written before its readers were done")
        self.count += 1
        number, slot = self.count, self.count % SLOTS
        offset = self._slot(self.rank, slot)
        for piece in pieces:
            nbytes = piece.numel() * piece.element_size()
            self.bytes[offset: offset + nbytes].copy_(piece.reshape(-1).view(torch.uint8))
            offset += nbytes
        _WORD.pack_into(self.mapping, self._posted_at(self.rank, slot), number)  # after the data (see the note)
        self.mine[slot] = number
        return number, slot

    def gather(self, buffers: list[torch.Tensor]) -> "ChannelWork":
        """Like ``_comm_rows.all_gather_in_place``: each ``(world * rows, ...)`` buffer's rows of this rank are
        written; the work fills in every peer's."""
        rows = [b.shape[0] // self.world for b in buffers]
        number, slot = self._post([b[self.rank * r:(self.rank + 1) * r] for b, r in zip(buffers, rows)])

        def take(peer: int, offset: int) -> int:
            for b, r in zip(buffers, rows):
                offset = self._copy_out(b[peer * r:(peer + 1) * r], offset, add=False)
            return offset

        return self._pending(ChannelWork(self, number, slot, lambda peer: 0, take, in_order=False))

    def reduce_scatter(self, buffers: list[torch.Tensor]) -> tuple[list[torch.Tensor], "ChannelWork"]:
        """Like ``_comm_rows.reduce_scatter_in_place``: each peer's rows of every buffer are written (peers in rank
        order); the work adds every peer's share for this rank into this rank's rows, which it returns."""
        rows = [b.shape[0] // self.world for b in buffers]
        own = [b[self.rank * r:(self.rank + 1) * r] for b, r in zip(buffers, rows)]
        share = sum(o.numel() * o.element_size() for o in own)  # one peer's bytes, the same for every peer
        number, slot = self._post([b[p * r:(p + 1) * r] for p in range(self.world) if p != self.rank
                                   for b, r in zip(buffers, rows)])
        first = lambda peer: (self.rank - (self.rank > peer)) * share  # noqa: E731 (this rank's place among peer's)

        def take(peer: int, offset: int) -> int:
            for o in own:
                offset = self._copy_out(o, offset, add=True)
            return offset

        return own, self._pending(ChannelWork(self, number, slot, first, take, in_order=True))

    def _copy_out(self, dest: torch.Tensor, offset: int, add: bool) -> int:
        nbytes = dest.numel() * dest.element_size()
        source = self.bytes[offset: offset + nbytes].view(dest.dtype).view(dest.shape)
        if dest.is_inference():  # a gather issued inside inference mode (a prefetch its forward never took: an
            with torch.inference_mode():  # evaluation that stopped early), taken by a later collective outside it
                dest.add_(source) if add else dest.copy_(source)
        else:  # (a normal tensor may be written inside inference mode too: no context on the hot path)
            dest.add_(source) if add else dest.copy_(source)
        return offset + nbytes

    def _pending(self, work: "ChannelWork") -> "ChannelWork":
        self.pending.append(work)
        return work

    # ------------------------------------------------------------------ reading
    def progress(self) -> None:
        """Take whatever peers have posted for this rank's pending collectives (any order: each owns its slot)."""
        for work in list(self.pending):
            work.poll()

    def _took(self, work: "ChannelWork", peer: int, used: int) -> None:
        _WORD.pack_into(self.mapping, self._read_at(self.rank, peer, work.slot), work.number)
        start = self._slot(peer, work.slot)
        self.mapping.madvise(mmap.MADV_DONTNEED, start, _round_up(max(used, 1), _PAGE))  # (see the note)


class ChannelWork:
    """One collective's reading half, shaped like a ``Work`` for ``_comm._TimedWork``."""

    __slots__ = ("channel", "number", "slot", "first", "take", "peers", "in_order")

    def __init__(self, channel: Channel, number: int, slot: int, first: Callable, take: Callable, in_order: bool):
        self.channel, self.number, self.slot, self.first, self.take = channel, number, slot, first, take
        # Still to read, in the order gloo's reduce-scatter by sends adds them (``_comm_rows``), so a sum is the
        # same bits by either transport and from run to run: ``in_order`` takes them in it.
        self.peers = [(channel.rank - k) % channel.world for k in range(1, channel.world)]
        self.in_order = in_order

    def poll(self) -> bool:
        channel = self.channel
        for peer in list(self.peers):
            if channel._word(channel._posted_at(peer, self.slot)) != self.number:
                if self.in_order:
                    break
                continue
            start = channel._slot(peer, self.slot)
            used = self.take(peer, start + self.first(peer)) - start
            channel._took(self, peer, used)
            self.peers.remove(peer)
        if not self.peers and self in channel.pending:
            channel.pending.remove(self)
        return not self.peers

    def is_completed(self) -> bool:
        return self.poll()

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        return poll_until(self.poll, timeout, lambda: "shared-memory channel",
                          lambda: f"collective #{self.number} of group rank(s) {self.peers}")
