"""A comm module (with ``_comm``): several buffers gathered or reduce-scattered in place under one identity check.

Why: a unit's parameters gathered through one flat buffer cost a staging buffer as large as the unit, written
and then copied out into each parameter's full tensor; on the CPU a fresh buffer is mostly page faults (a fresh
35 MB copy takes 5x a reused one, measured).  On gloo, where a gather is one broadcast per rank anyway
(``_comm``'s [Note: gloo's tensor collectives copy]), each rank's rows can go straight into each parameter's
full tensor, and a gradient can be reduced in the tensor autograd produced.  NCCL keeps the flat collectives
(one kernel; its allocator caches).  The identity check and the timed wait are ``_comm``'s, once per call.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import _comm, _comm_shm
from ._comm_work import P2P_IN_FLIGHT as _IN_FLIGHT, _DoneWork, _rows_alias, _WorkList

ProcessGroup = Optional["dist.ProcessGroup"]


def _rank_blocks(buffers: list[torch.Tensor], world: int):
    """(group rank, rows of one buffer that rank owns, as an alias) for every buffer and rank: see ``_rows_alias``."""
    for buffer in buffers:
        rows = buffer.shape[0] // world
        for r in range(world):
            yield r, _rows_alias(buffer, r * rows, rows)


@torch.no_grad()
def all_gather_in_place(buffers: list[torch.Tensor], group: ProcessGroup = None, *, async_op: bool = False,
                        label: str = "", channel: Optional[_comm_shm.Channel] = None):
    """Complete several contiguous ``(world * rows, ...)`` buffers (one dtype) whose rows of this rank are
    written: gloo CPU only (``_comm.on_gloo_cpu``).  One identity check for all, then one broadcast per
    (buffer, rank): each buffer can be a parameter's full tensor, so nothing is staged or copied out.  Through
    ``channel`` where its slot holds this rank's rows (see [Note: unit collectives through shared memory])."""
    world, kind = _comm.world_size(group), "all-gather in place"
    if world == 1:
        return _DoneWork()
    total = buffers[0].new_empty(1).expand(sum(b.numel() for b in buffers))  # the check's size: no memory
    seq, shared = _check(kind, total, group, label, channel, total.numel() // world)
    if shared:
        return _comm._issued(channel.gather(buffers), kind + " (shared memory)", total, group, async_op, label, seq)
    works = [dist.broadcast(rows, src=_comm.global_rank_of(group, r), group=group, async_op=True)
             for r, rows in _rank_blocks(buffers, world)]
    return _comm._issued(_WorkList(works), kind, total, group, async_op, label, seq)


@torch.no_grad()
def reduce_scatter_in_place(buffers: list[torch.Tensor], group: ProcessGroup = None, *, async_op: bool = False,
                            label: str = "", channel: Optional[_comm_shm.Channel] = None
                            ) -> tuple[list[torch.Tensor], object]:
    """Sum several contiguous ``(world * rows, ...)`` buffers (one dtype) over ranks: this rank's rows of each,
    as views, hold the sums once the returned work is waited for (``async_op=False``: already).  gloo CPU only,
    inside ``inputs_may_be_overwritten()``.  One identity check, then, for each buffer, this rank's rows of
    every other rank sent to it and theirs of this rank's received into scratch, added at the wait
    (*[Note: a reduce-scatter by sends]*)."""
    world, kind = _comm.world_size(group), "reduce-scatter in place"
    if world == 1:
        return list(buffers), _DoneWork()
    if not _comm.inputs_overwritable():
        raise AssertionError("reduce_scatter_in_place overwrites its inputs: call it in inputs_may_be_overwritten()")
    total = buffers[0].new_empty(1).expand(sum(b.numel() for b in buffers))
    seq, shared = _check(kind, total, group, label, channel, total.numel() // world * (world - 1))
    if shared:
        rows, work = channel.reduce_scatter(buffers)
        return rows, _comm._issued(work, kind + " (shared memory)", total, group, async_op, label, seq)
    me, tag = _comm.rank(group), seq % _P2P_TAGS
    works, sums = [], []
    for buffer in buffers:
        rows = buffer.shape[0] // world
        own = buffer[me * rows:(me + 1) * rows]
        for k in range(1, world):  # peer k ahead gets its rows, peer k behind sends this rank's: no two wait on one
            to, frm = (me + k) % world, (me - k) % world
            scratch = torch.empty_like(own)
            works.append(dist.isend(_rows_alias(buffer, to * rows, rows), dst=_comm.global_rank_of(group, to),
                                    group=group, tag=tag))
            works.append(dist.irecv(scratch, src=_comm.global_rank_of(group, frm), group=group, tag=tag))
            sums.append((own, scratch))
    _IN_FLIGHT[:] = [w for w in _IN_FLIGHT if not w.is_completed()] + works  # see the note below
    work = _comm._issued(_AddOnWait(_WorkList(works), sums), kind, total, group, async_op, label, seq)
    return [b[me * (b.shape[0] // world):(me + 1) * (b.shape[0] // world)] for b in buffers], work


def _check(kind: str, total: torch.Tensor, group, label: str, channel: Optional[_comm_shm.Channel],
           share: int) -> tuple[int, bool]:
    """The identity check: its sequence number, and whether the collective goes through ``channel``: where a
    slot holds ``share`` elements and every rank's next slot is free (a vote in the same exchange, so every rank
    decides alike; see [Note: unit collectives through shared memory])."""
    if channel is None or not channel.fits(share * total.element_size()):
        return _comm._check(kind, total, group, label), False
    channel.progress()  # (what peers posted for this rank's pending collectives: it frees their slots)
    return _comm._check(kind, total, group, label, channel.next_slot_free())


# [Note: a reduce-scatter by sends]
# gloo's ``reduce`` moves and sums more than a reduce-scatter needs (measured on 2 cores, 8.7M floats in 5
# buffers, world 2 / 4: 15.9 / 28.8 CPU ms on rank 0, 32 / 87 ms wall, against 11.9 / 16.9 CPU ms and 23 / 44 ms
# for the sends here, where each rank sends each peer that peer's rows once and adds what it receives).  The
# price is a scratch of (world - 1) times this rank's rows per buffer, alive until the wait: the sum of a
# rank's rows cannot be received into the rows being sent.  Each call's sends carry their own tag (the identity
# check's sequence number, the same on every rank), so two reductions in flight never match each other's sends;
# collectives use tags of their own (a slot prefix), so the two never meet either.  A caller may drop a
# reduction it no longer wants (a failed backward's, at the next forward): a send or receive whose work object
# is destroyed before it completes breaks the pair's stream, and the next broadcast between the two ranks hung
# (test_a_failed_backward_leaves_no_half_reduced_gradients).  So every send and receive stays referenced here
# until it has completed (``_IN_FLIGHT``, _comm_work's, which the exit settles too); the list is pruned at each call
# and each wait.
_P2P_TAGS = 1 << 30


class _AddOnWait:
    """A work whose received rows are added into this rank's rows once, at the first wait."""

    __slots__ = ("work", "sums")

    def __init__(self, work, sums: list):
        self.work, self.sums = work, sums

    def wait(self, timeout=None) -> bool:
        self.work.wait(timeout=timeout)
        for own, received in self.sums:
            own.add_(received)
        self.sums = []
        _IN_FLIGHT[:] = [w for w in _IN_FLIGHT if not w.is_completed()]  # (they held the buffers past the step)
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()
