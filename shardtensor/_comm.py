"""Every ``torch.distributed`` call shardtensor makes lives here.

Why one module: the other modules (gather, reduce, optim, offload) only decide *when* to communicate; this one
decides *how*.  Version differences (``all_gather_single`` replacing ``all_gather_into_tensor`` in torch 2.13,
``reduce_scatter_single`` replacing ``reduce_scatter_tensor``) are absorbed in one place, and a future timeout /
debug layer wraps one set of functions.

All functions accept ``group=None`` (the default group) and work without an initialised process group when the
world is a single process, so single-process use needs no ``init_process_group``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

ProcessGroup = Optional["dist.ProcessGroup"]

_all_gather_single = getattr(dist, "all_gather_single", None)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group: ProcessGroup = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def rank(group: ProcessGroup = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def global_rank_of(group: ProcessGroup, group_rank: int) -> int:
    """The default-group rank of ``group_rank`` in ``group`` (``broadcast``'s ``src`` wants a global rank)."""
    if group is None or not is_distributed():
        return group_rank
    return dist.get_global_rank(group, group_rank)


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


@torch.no_grad()
def all_gather_rows(local: torch.Tensor, group: ProcessGroup = None, *, async_op: bool = False) -> CollectiveResult:
    """Gather equal dim-0 shards into one ``(world * rows, ...)`` buffer, rows in rank order.

    The output is the full (padded) tensor itself: no copy-out afterwards (see DESIGN.md section 4).
    """
    world = world_size(group)
    if world == 1:
        return CollectiveResult(local, _DoneWork())
    local = local.contiguous()
    out = torch.empty((world * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
    if _all_gather_single is not None:
        work = _all_gather_single(out, local, group=group, async_op=async_op)
    else:  # torch < 2.13
        work = dist.all_gather_into_tensor(out, local, group=group, async_op=async_op)
    return CollectiveResult(out, work if async_op else _DoneWork())


@torch.no_grad()
def reduce_scatter_rows(full: torch.Tensor, group: ProcessGroup = None, *, async_op: bool = False) -> CollectiveResult:
    """Sum ``full`` (``(world * rows, ...)``) over ranks and keep this rank's ``rows``: the inverse of the gather."""
    world = world_size(group)
    if world == 1:
        return CollectiveResult(full, _DoneWork())
    full = full.contiguous()
    if full.shape[0] % world:
        raise AssertionError(f"reduce_scatter_rows needs rows divisible by the world: {full.shape=} {world=}")
    out = torch.empty((full.shape[0] // world, *full.shape[1:]), dtype=full.dtype, device=full.device)
    if _reduce_scatter_single is not None:
        work = _reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    else:
        work = dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return CollectiveResult(out, work if async_op else _DoneWork())


@torch.no_grad()
def all_reduce(tensor: torch.Tensor, group: ProcessGroup = None, *, op: str = "sum", async_op: bool = False):
    """In-place all-reduce; ``op`` is ``"sum"``, ``"max"``, ``"min"`` or ``"avg"`` (avg = sum / world, gloo has none)."""
    world = world_size(group)
    if world == 1:
        return _DoneWork()
    reduce_op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    work = dist.all_reduce(tensor, op=reduce_op, group=group, async_op=async_op)
    if op == "avg":
        if async_op:
            raise ValueError("all_reduce(op='avg', async_op=True) is not supported: divide after waiting")
        tensor.div_(world)
    return work if async_op else _DoneWork()


@torch.no_grad()
def all_to_all(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup = None, *, async_op: bool = False):
    """Equal-split all-to-all: chunk r of ``input`` goes to rank r; chunk q of ``output`` came from rank q."""
    if world_size(group) == 1:
        output.copy_(input)
        return _DoneWork()
    work = dist.all_to_all_single(output, input, group=group, async_op=async_op)
    return work if async_op else _DoneWork()


@torch.no_grad()
def broadcast(tensor: torch.Tensor, src_group_rank: int, group: ProcessGroup = None, *, async_op: bool = False):
    """Broadcast ``tensor`` in place from ``src_group_rank`` (a rank *within* ``group``)."""
    if world_size(group) == 1:
        return _DoneWork()
    work = dist.broadcast(tensor, src=global_rank_of(group, src_group_rank), group=group, async_op=async_op)
    return work if async_op else _DoneWork()


@torch.no_grad()
def reduce(tensor: torch.Tensor, dst_group_rank: int, group: ProcessGroup = None, *, async_op: bool = False):
    """Sum ``tensor`` over ranks into ``dst_group_rank``'s copy, in place (layer-wise gradients go to the owner).

    Only the destination's ``tensor`` holds the sum afterwards; backends may use the others' as scratch, so
    callers hand in a tensor they own.
    """
    if world_size(group) == 1:
        return _DoneWork()
    work = dist.reduce(tensor, dst=global_rank_of(group, dst_group_rank), op=dist.ReduceOp.SUM, group=group,
                       async_op=async_op)
    return work if async_op else _DoneWork()


def all_gather_object(obj: object, group: ProcessGroup = None) -> list:
    """Every rank's ``obj``, in rank order (small control data only: plans, fingerprints)."""
    world = world_size(group)
    if world == 1:
        return [obj]
    out: list = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: ProcessGroup = None) -> None:
    if world_size(group) > 1:
        dist.barrier(group=group)
