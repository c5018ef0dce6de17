"""Every ``torch.distributed`` call shardtensor makes lives here.

Why one module: the other modules (gather, reduce, optim, offload) only decide *when* to communicate; this one
decides *how*.  Version differences (``all_gather_single`` replacing ``all_gather_into_tensor`` in torch 2.13,
``reduce_scatter_single`` replacing ``reduce_scatter_tensor``) are absorbed in one place, and so is the timeout
that keeps a dead or diverged rank from hanging the others (see [Note: every collective has a timeout]).

All functions accept ``group=None`` (the default group) and work without a process group in a one-process world.
"""

from __future__ import annotations

import datetime
import os
import pickle
from typing import Optional

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


def group_ranks(group: ProcessGroup = None) -> list[int]:
    """The default-group ranks of ``group``'s members, in group-rank order (``[0]`` without a process group)."""
    if not is_distributed():
        return [0]
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def global_rank_of(group: ProcessGroup, group_rank: int) -> int:
    """The default-group rank of ``group_rank`` in ``group`` (``broadcast``'s ``src`` wants a global rank)."""
    if group is None or not is_distributed():
        return group_rank
    return dist.get_global_rank(group, group_rank)


# [Note: every collective has a timeout]
# A rank that dies, skips a step or runs a different program leaves the others waiting in a collective; with
# no limit that is a hang that costs a cluster-day.  Every collective here is issued with ``async_op=True`` and
# waited for through ``_TimedWork.wait``, which gives up after ``collective_timeout()`` seconds and raises a
# ``CollectiveError`` naming the step (a label set by the caller: "all-gather of 'fc.weight'") and a sequence
# number that is the same on every rank of the same program.  CUDA tensors (NCCL) are the exception: a timed
# ``Work.wait`` would block the CPU until the kernel ends and kill the overlap of communication with compute,
# so there the wait stays stream-ordered and the limit is NCCL's watchdog (``init_process_group(timeout=...)``).
_timeout_s: float = float(os.environ.get("SHARDTENSOR_COLLECTIVE_TIMEOUT", "600"))

from ._comm_labels import (  # noqa: E402,F401 (re-exported)
    compiled_graph, current_label, inputs_may_be_overwritten, inputs_overwritable, labelled)
from ._comm_work import (  # noqa: E402,F401 (re-exported)
    _WIRE_DTYPE, CollectiveError, CollectiveResult, _CopyOnWait, _dense, _DoneWork, _reducible, _rows_alias, _WorkList,
    keep_past_exit, track_in_flight)
# Imported here, after CollectiveError, which DivergenceError subclasses (the module imports it from this one).
from . import _comm_divergence as _div  # noqa: E402
from . import _comm_stall as _stall  # noqa: E402


def _check(kind: str, tensor: torch.Tensor, group, label: str, vote: bool | None = None):
    """Before every data collective: the group's sequence number, after the cross-rank identity check
    (see [Note: the identity check] in ``_comm_divergence``); with a ``vote``, also whether every rank voted yes."""
    seq, all_yes = _div.check_identity(kind, tensor, group, current_label(label), _identity_all_gather, bool(vote))
    return seq if vote is None else (seq, all_yes)


def count_optimizer_step(group, settings: int = 0) -> None:
    """An optimizer step over sharded parameters of ``group`` (see [Note: optimizer steps in the record])."""
    _div.count_optimizer_step(group, settings)


def announce_failure(message: str) -> None:
    """This rank raises where the other ranks will wait for it (a check only this rank can make): they raise
    too, quoting ``message``, within a probe interval instead of at the collective timeout."""
    _stall.publish_failure(message)


def set_collective_timeout(seconds: float) -> float:
    """Limit every shardtensor collective (gloo / CPU) to ``seconds``; returns the previous limit.

    Why: a rank that dies or skips a step must make the others fail with a named step, not hang.  The default
    (600 s, or ``$SHARDTENSOR_COLLECTIVE_TIMEOUT``) leaves room for slow first steps; tests use a few seconds."""
    global _timeout_s
    previous, _timeout_s = _timeout_s, _div.positive_seconds("set_collective_timeout", seconds)
    return previous


def collective_timeout() -> float:
    """The current limit in seconds (see ``set_collective_timeout``)."""
    return _timeout_s


def _identity_all_gather(out: torch.Tensor, inp: torch.Tensor, group, what: str, seq: int) -> None:
    """The identity check's own exchange (``_comm_divergence``): not itself checked, but timed and probed."""
    start = _div.record_exchange(group)  # shared memory or the control group, once the first exchange built one
    if start is not None:
        _TimedWork(start(out, inp), "identity all-gather", inp, group, what, seq).wait()
        return
    _stall.publish_process()  # (once per process)
    exchange = _div.StoreExchange.open(group, inp, seq)  # the group's first exchange (see its docstring)
    if exchange is not None:
        _TimedWork(exchange, "identity all-gather", inp, group, what, seq).wait()
        exchange.gathered_into(out)
    else:  # no default store (a custom launcher), or torch's fake group: on the data group itself
        device = _control_device(group)
        fn = _all_gather_single or dist.all_gather_into_tensor
        wire = out.to(device)
        _TimedWork(fn(wire, inp.to(device), group=group, async_op=True), "identity all-gather", inp, group, what,
                   seq).wait()
        out.copy_(wire)
    try:
        _div.build_control_group(group, _timeout_s)
    except Exception as exc:  # noqa: BLE001 - a member that died just now: the same named error as a collective
        message = _TimedWork(None, "identity check setup", inp, group, what, seq)._message(_timeout_s, exc)
        _stall.publish_failure(message)
        raise CollectiveError(message) from exc


class _TimedWork:
    """A ``Work`` handle whose ``wait`` has a limit and whose errors name the step, the tensor and the rank."""

    __slots__ = ("work", "kind", "shape", "dtype", "group", "label", "seq", "cpu", "__weakref__")

    def __init__(self, work, kind: str, tensor: torch.Tensor, group, label: str, seq: int):
        self.work = work
        self.kind = kind
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype
        self.group = group
        self.label = current_label(label)
        self.seq = seq  # this group's collective count: the same on every rank of one program
        self.cpu = tensor.device.type == "cpu"

    def wait(self, timeout=None) -> bool:
        seconds = _timeout_s if timeout is None else (
            timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout))
        try:
            if self.cpu:  # probes name a rank that is provably elsewhere early (see [Note: stall probes])
                _stall.wait_watched(self.work, seconds, self.group, _div.position(self.group),
                                  self.label or self.kind)
            else:  # stream-ordered (see [Note: every collective has a timeout])
                self.work.wait()
        except Exception as exc:  # noqa: BLE001 - every backend error becomes one that names the step
            keep_past_exit(self.work)  # see [Note: a work given up on outlives the interpreter]
            if isinstance(exc, CollectiveError):
                raise
            message = self._message(seconds, exc)
            _stall.publish_failure(message)
            raise CollectiveError(message) from exc
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def _message(self, seconds: float, exc: BaseException) -> str:
        timed_out = "timed out" in str(exc).lower() or "timeout" in str(exc).lower()
        what = f"did not complete within {seconds:g} s" if timed_out else f"failed ({type(exc).__name__}: {exc})"
        try:
            who = f"rank {rank(self.group)}/{world_size(self.group)}"
        except Exception:  # noqa: BLE001 - the group itself may be broken
            who = "rank ?"
        return (
            f"shardtensor {who}: {self.label or self.kind} {what} "
            f"[collective #{self.seq}: {self.kind} of {self.shape} {self.dtype}]. Another rank died, skipped this "
            f"step, or runs a different program (every rank must run the same ops on the same parameters in the "
            f"same order); compare the collective numbers in each rank's log. If a rank is only slow, raise the "
            f"limit with shardtensor.set_collective_timeout(seconds) (now {_timeout_s:g} s)."
        )


def _issued(work, kind: str, tensor: torch.Tensor, group, async_op: bool, label: str, seq: int):
    """Wrap ``work`` (issued with ``async_op=True``); wait now, with the limit, unless the caller waits later."""
    timed = _TimedWork(work, kind, tensor, group, label, seq)
    track_in_flight(timed)  # see [Note: gloo's worker threads at interpreter exit]
    if async_op:
        return timed
    timed.wait()
    return _DoneWork()


# [Note: gloo's tensor collectives copy]
# gloo implements ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` through a temporary as large as the
# full tensor (measured on torch 2.13, 2 and 4 ranks, a 6 MiB tensor: +6 MiB transient for the all-gather,
# +7.9 MiB for the reduce-scatter), and that temporary lands on the step's memory peak.  One broadcast per
# rank, each from its shard's own rows of the output buffer, writes in place (0 MiB transient) and is faster
# (2 ranks: 4.6 vs 11.4 ms; 4 ranks: 11.6 vs 25.6 ms).  So CPU tensors on a gloo group gather by broadcasts;
# NCCL keeps its native all-gather.  Likewise one in-place ``reduce`` per rank's rows reduce-scatters with
# 1.5 MiB transient instead of 7.9 and in 10 ms instead of 16 (2 ranks), but it overwrites the other rows of
# its input, so it is used only inside ``inputs_may_be_overwritten()`` (gradients nobody else holds).
def on_gloo_cpu(device: torch.device, group: ProcessGroup) -> bool:
    """CPU tensors on a gloo group: gathered by broadcasts, reduce-scattered by in-place reduces (see above)."""
    # Asked every time (2 us): a process group can be destroyed and the default one re-created on another backend.
    return device.type == "cpu" and "gloo" in str(dist.get_backend(group))


@torch.no_grad()
def all_gather_rows(local: torch.Tensor, group: ProcessGroup = None, *, async_op: bool = False,
                    label: str = "", out: Optional[torch.Tensor] = None) -> CollectiveResult:
    """Gather equal dim-0 shards into one ``(world * rows, ...)`` buffer, rows in rank order.

    The output is the full (padded) tensor itself: no copy-out afterwards.  ``out``: the caller's buffer for it;
    ``local`` may already be this rank's rows of ``out`` (written in place by the caller: no copy-in pass).
    """
    world = world_size(group)
    if world == 1:
        return CollectiveResult(local, _DoneWork())
    local = _dense(local).contiguous()
    if local.dtype in _WIRE_DTYPE:
        wire = _WIRE_DTYPE[local.dtype]
        result = all_gather_rows(local.view(wire), group, async_op=async_op, label=label,
                                 out=None if out is None else out.view(wire))
        return CollectiveResult(result.buffer.view(local.dtype), result.work)
    shape = (world * local.shape[0], *local.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=local.dtype, device=local.device)
    elif tuple(out.shape) != shape or out.dtype != local.dtype or not out.is_contiguous():
        raise AssertionError(f"all_gather_rows: out {tuple(out.shape)} {out.dtype} for shards {tuple(local.shape)} "
                             f"{local.dtype}; expected a contiguous {shape}")
    gloo = on_gloo_cpu(local.device, group)
    kind = "all-gather (broadcasts)" if gloo else "all-gather"
    seq = _check(kind, local, group, label)
    rows, me = local.shape[0], rank(group)
    in_place = local.numel() > 0 and local.data_ptr() == out[me * rows:(me + 1) * rows].data_ptr()
    if gloo:  # see [Note: gloo's tensor collectives copy]
        if not in_place:
            out[me * rows:(me + 1) * rows].copy_(local)
        works = [dist.broadcast(_rows_alias(out, r * rows, rows), src=global_rank_of(group, r), group=group,
                                async_op=True) for r in range(world)]
        return CollectiveResult(out, _issued(_WorkList(works), kind, local, group, async_op, label, seq))
    if in_place and "nccl" not in str(dist.get_backend(group)):  # NCCL gathers in place (FSDP2 relies on it)
        local = local.clone()
    if _all_gather_single is not None:
        work = _all_gather_single(out, local, group=group, async_op=True)
    else:  # torch < 2.13
        work = dist.all_gather_into_tensor(out, local, group=group, async_op=True)
    return CollectiveResult(out, _issued(work, kind, local, group, async_op, label, seq))


@torch.no_grad()
def reduce_scatter_rows(full: torch.Tensor, group: ProcessGroup = None, *, async_op: bool = False,
                        label: str = "") -> CollectiveResult:
    """Sum ``full`` (``(world * rows, ...)``) over ranks and keep this rank's ``rows``: the inverse of the gather."""
    world = world_size(group)
    if world == 1:
        return CollectiveResult(full, _DoneWork())
    full = _dense(full).contiguous()
    _reducible(full, "reduce_scatter_rows")
    if full.shape[0] % world:
        raise AssertionError(f"reduce_scatter_rows needs rows divisible by the world: {full.shape=} {world=}")
    out = torch.empty((full.shape[0] // world, *full.shape[1:]), dtype=full.dtype, device=full.device)
    by_reduces = inputs_overwritable() and on_gloo_cpu(full.device, group)
    kind = "reduce-scatter (reduces)" if by_reduces else "reduce-scatter"
    seq = _check(kind, full, group, label)
    if by_reduces:  # see [Note: gloo's tensor collectives copy]
        rows = out.shape[0]
        works = [dist.reduce(_rows_alias(full, r * rows, rows), dst=global_rank_of(group, r), group=group,
                             async_op=True) for r in range(world)]
        mine = _rows_alias(full, rank(group) * rows, rows)
        return CollectiveResult(out, _issued(_CopyOnWait(_WorkList(works), mine, out), kind, full, group, async_op,
                                             label, seq))
    if _reduce_scatter_single is not None:
        work = _reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
    else:
        work = dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return CollectiveResult(out, _issued(work, kind, full, group, async_op, label, seq))


@torch.no_grad()
def all_reduce(tensor: torch.Tensor, group: ProcessGroup = None, *, op: str = "sum", async_op: bool = False,
               label: str = ""):
    """In-place all-reduce; ``op`` is ``"sum"``, ``"max"``, ``"min"`` or ``"avg"`` (avg = sum / world, gloo has none)."""
    world = world_size(group)
    if world == 1:
        return _DoneWork()
    _reducible(tensor, "all_reduce")
    reduce_op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    if op == "avg" and async_op:
        raise ValueError("all_reduce(op='avg', async_op=True) is not supported: divide after waiting")
    seq = _check(f"all-reduce ({op})", tensor, group, label)
    work = _issued(dist.all_reduce(tensor, op=reduce_op, group=group, async_op=True), f"all-reduce ({op})", tensor,
                   group, async_op, label, seq)
    if op == "avg":
        tensor.div_(world)
    return work


@torch.no_grad()
def all_to_all(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup = None, *, async_op: bool = False,
               label: str = ""):
    """Equal-split all-to-all: chunk r of ``input`` goes to rank r; chunk q of ``output`` came from rank q."""
    if world_size(group) == 1:
        output.copy_(input)
        return _DoneWork()
    seq = _check("all-to-all", input, group, label)
    work = dist.all_to_all_single(output, input, group=group, async_op=True)
    return _issued(work, "all-to-all", input, group, async_op, label, seq)


@torch.no_grad()
def broadcast(tensor: torch.Tensor, src_group_rank: int, group: ProcessGroup = None, *, async_op: bool = False,
              label: str = ""):
    """Broadcast ``tensor`` in place from ``src_group_rank`` (a rank *within* ``group``)."""
    if world_size(group) == 1:
        return _DoneWork()
    seq = _check(f"broadcast from rank {src_group_rank}", tensor, group, label)
    work = dist.broadcast(tensor, src=global_rank_of(group, src_group_rank), group=group, async_op=True)
    return _issued(work, f"broadcast from rank {src_group_rank}", tensor, group, async_op, label, seq)


@torch.no_grad()
def reduce(tensor: torch.Tensor, dst_group_rank: int, group: ProcessGroup = None, *, async_op: bool = False,
           label: str = ""):
    """Sum ``tensor`` over ranks into ``dst_group_rank``'s copy, in place (layer-wise gradients go to the owner).

    Only the destination's ``tensor`` holds the sum afterwards; backends may use the others' as scratch, so
    callers hand in a tensor they own.
    """
    if world_size(group) == 1:
        return _DoneWork()
    seq = _check(f"reduce to rank {dst_group_rank}", tensor, group, label)
    work = dist.reduce(tensor, dst=global_rank_of(group, dst_group_rank), op=dist.ReduceOp.SUM, group=group,
                       async_op=True)
    return _issued(work, f"reduce to rank {dst_group_rank}", tensor, group, async_op, label, seq)


def _control_device(group) -> torch.device:
    """Where control data travels: the CPU, except on NCCL groups (CUDA only), as ``dist.all_gather_object``."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_object(obj: object, group: ProcessGroup = None, *, label: str = "") -> list:
    """Every rank's ``obj``, in rank order (small control data only: plans, fingerprints).

    Two timed all-gathers (lengths, then the padded pickles) instead of ``dist.all_gather_object``, which has no
    limit of its own.  The pickles come from the ranks of this job, the same trust ``dist.all_gather_object``
    assumes.
    """
    world = world_size(group)
    if world == 1:
        return [obj]
    device = _control_device(group)
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    sizes = all_gather_rows(torch.tensor([payload.numel()], dtype=torch.int64, device=device), group,
                            label=label or "all_gather_object (sizes)").buffer.tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    rows = all_gather_rows(padded.unsqueeze(0), group, label=label or "all_gather_object").buffer.cpu()
    return [pickle.loads(bytes(rows[r, : sizes[r]].tolist())) for r in range(world)]  # plain bytes: no numpy on this path


def barrier(group: ProcessGroup = None, *, label: str = "") -> None:
    if world_size(group) > 1:
        probe = torch.zeros(1, device=_control_device(group))
        seq = _check("barrier", probe, group, label)
        _issued(dist.barrier(group=group, async_op=True), "barrier", probe, group, False, label, seq)


# DTensor meshes and functional collectives (torch's own distributed tensors): in ``_comm_mesh``.
from ._comm_mesh import default_group_or, device_mesh, functional_all_gather_rows  # noqa: E402,F401
