"""A unit's gradients written once, straight into the buffer its reduce-scatter sends.

[Note: flat unit gradients]
The exact unit reduction sends one ``(world, flat + flags)`` buffer: each parameter's full gradient, padded to
``world * rows_per_rank`` rows and cut into one row per rank, side by side, then one has-gradient flag column per
parameter.  Building it from kept gradients costs a clone at stash, then a pad, a cast and a ``cat`` at reduce:
four passes over every gradient and as many fresh allocations.  ``FlatGrads`` allocates the buffer at the unit's
first gradient and writes each gradient into its slot directly (a copy, or an in-place add for a second
gradient of the same parameter, as the clone-then-``add_`` did): one pass, the same bits, because it is used
only where the old path would neither cast nor promote (every parameter, every gradient and the reduce dtype
are one dtype).

[Note: direct gradients]
Where collectives work in place (gloo, ``_comm_rows``), a large parameter whose rows split evenly over the ranks
gets no slot: the unit keeps the full gradient autograd produced (when nothing else holds it; else a copy) and
reduce-scatters it in place, and this rank's rows, divided by the world size, are its mean.  That skips a copy
of every large gradient into a fresh buffer and of the result out of another (page faults, mostly).  The
flags and the small parameters still travel in the flat buffer, under the same single identity check.

[Note: unit gathers]
A unit's gather writes this rank's shards into a ``(world, flat)`` buffer, gathers it, and copies each
parameter's columns out into its full tensor.  Where collectives work in place, a large parameter skips that:
its full tensor is allocated first, this rank's rows written into it, and the other ranks' rows broadcast
straight into it.

[Note: recycled full tensors]
On the CPU a fresh buffer costs its page faults (5x the copy into it, measured), and every unit gather used to
allocate its full tensors afresh.  A unit that frees its full tensors hands them (those nothing else holds) to
the next unit's gather, which in overlapped mode is issued a moment later by the next unit's pre-hook: the
memory the freed tensors held is the memory the new ones would take, so the peak does not move.  The pool is
emptied after every unit pre-hook and at step boundaries, and a unit with no successor in its direction (the
last block's forward: the head, the loss and the peak come next) does not give, so a freed tensor never waits
across other work.  Overlapped mode only: sequential mode, the lowest peak, keeps nothing between two units.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import torch

from . import _comm, _comm_rows
from ._layout import ShardLayout
from .reduce import ExactReducer, frozen_in_label


class HeldFull(NamedTuple):
    """A full tensor a unit gathered (``Gatherer.held``), the version of the shard it came from, and the unit
    (``_unit._Unit.regather``: a write to the shard since makes the tensor stale)."""

    full: torch.Tensor
    version: int
    unit: object


# A parameter at least this large gathers into, and reduces out of, its own full tensor where the collectives
# work in place (gloo: see ``_comm_rows``); smaller ones share one flat buffer (one broadcast per rank for all).
DIRECT_MIN_NUMEL = 1 << 16


def _in_place(world: int, dtype: torch.dtype, device: torch.device, group) -> bool:
    return (world > 1 and dtype not in _comm._WIRE_DTYPE and _comm.is_distributed()
            and _comm.on_gloo_cpu(device, group))


def direct_positions(layouts: Sequence, dtype: torch.dtype, device: torch.device) -> list[int]:
    """The parameters whose gradients a unit reduces in their own tensors (see [Note: direct gradients]).

    A function of the layouts, the reduction dtype and the device only, never of which gradients came: a rank
    that got no gradient for the unit reduces zeros by another route than its peers, and must still issue the
    same collectives (else gloo aborts the process on a size mismatch)."""
    world = layouts[0].world
    if not _in_place(world, dtype, device, layouts[0].group):
        return []
    return [i for i, lay in enumerate(layouts) if lay.shape[0] % world == 0 and lay.shape.numel() >= DIRECT_MIN_NUMEL]


def flat_dtype(params: Sequence, strategy) -> Optional[torch.dtype]:
    """The dtype a unit's flat gradient buffer holds, or None where the exact path would cast or promote, a
    parameter has another placement or another reducer reduces: those units keep their gradients apart."""
    dtypes = {p.dtype for p in params}
    if type(strategy) is not ExactReducer or len(dtypes) != 1 or \
            any(type(p._layout) is not ShardLayout for p in params):
        return None
    (dtype,) = dtypes
    return dtype if strategy.reduce_dtype in (None, dtype) else None


def _dim0_buckets(params: Sequence, tensors: Sequence[torch.Tensor]) -> dict:
    """Positions of dim-0 (plain ``ShardLayout``) parameters, by (group, dtype, device): one collective each."""
    buckets: dict = {}
    for i, (param, t) in enumerate(zip(params, tensors)):
        if type(param._layout) is ShardLayout:
            buckets.setdefault((param._layout.group, t.dtype, t.device), []).append(i)
    return buckets


class UnitGather(NamedTuple):
    """One (group, dtype) bucket of a unit's gather in flight."""

    flat: list[int]  # positions gathered through ``rows`` and copied out
    rows: torch.Tensor  # ``(world, flat numel)``
    fulls: dict[int, torch.Tensor]  # position -> padded full tensor gathered in place (see [Note: unit gathers])
    work: object


@torch.no_grad()  # the writes go into buffers (out=), which autograd refuses for shards needing grad
def issue_unit_gathers(params: Sequence, shards: list[torch.Tensor], label, async_op: bool,
                       pool: Optional[FullsPool] = None, channel=None) -> list[UnitGather]:
    """Issue the gathers of a unit's dim-0 parameters from ``shards`` (see [Note: unit gathers]); ``label``
    names a list of positions.  The result goes to ``complete_unit_gathers``."""
    issued = []
    take = pool.take if pool is not None else lambda shape, dtype, device: torch.empty(shape, dtype=dtype,
                                                                                      device=device)
    for (group, dtype, device), positions in _dim0_buckets(params, shards).items():
        world, me = _comm.world_size(group), _comm.rank(group)
        in_place = _in_place(world, dtype, device, group)
        fulls = {i: take(params[i]._layout.padded_shape, dtype, device) for i in positions
                 if in_place and params[i]._layout.padded_shape.numel() >= DIRECT_MIN_NUMEL}
        for i, full in fulls.items():
            full.view(world, -1)[me].copy_(shards[i].reshape(-1))
        flat = [i for i in positions if i not in fulls]
        numel = sum(shards[i].numel() for i in flat)
        rows = torch.empty((world, numel), dtype=dtype, device=device)
        if flat:
            torch.cat([shards[i].reshape(-1) for i in flat], out=rows[me])
        with _comm.labelled(label(positions)):
            if in_place:
                work = _comm_rows.all_gather_in_place([rows, *fulls.values()] if flat else list(fulls.values()),
                                                      group, async_op=async_op, channel=channel)
            else:
                work = _comm.all_gather_rows(rows[me], group, async_op=async_op, out=rows.view(-1)).work
        issued.append(UnitGather(flat, rows, fulls, work))
    return issued


def complete_unit_gathers(params: Sequence, issued: list[UnitGather]) -> list[Optional[torch.Tensor]]:
    """Wait for ``issue_unit_gathers``' collectives: each parameter's full tensor (None: not a dim-0 one)."""
    out: list[Optional[torch.Tensor]] = [None] * len(params)
    for flat, rows, fulls, work in issued:
        work.wait()
        padded = [rows.new_empty(params[i]._layout.padded_shape) for i in flat]  # each one's columns, copied
        sizes = [params[i]._layout.local_shape().numel() for i in flat]  # out in one call
        if flat:
            torch.split_with_sizes_copy(rows, sizes, dim=1, out=[f.view(len(rows), n) for f, n in zip(padded, sizes)])
        for i, full in [*zip(flat, padded), *fulls.items()]:
            out[i] = full[: params[i]._layout.shape[0]]
    return out


class FullsPool:
    """Full tensors a unit just freed, handed to the next unit's gather of the same shapes (see [Note: recycled
    full tensors])."""

    def __init__(self):
        self.free: list[torch.Tensor] = []
        self.fresh = 0  # full tensors ``take`` had to allocate (accounting: a recycled one costs no page faults)

    def give(self, full: torch.Tensor) -> None:
        """Keep ``full`` if nothing else holds its memory (a view an op kept, a saved tensor, gloo's alias)."""
        if torch._C._storage_Use_Count(full.untyped_storage()._cdata) <= 2:  # ``full`` and the query's own
            self.free.append(full)

    def take(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        for i, full in enumerate(self.free):
            if full.shape == shape and full.dtype == dtype and full.device == device:
                return self.free.pop(i)
        self.fresh += 1
        return torch.empty(shape, dtype=dtype, device=device)

    def clear(self) -> None:
        self.free = []


class FlatGrads:
    """One backward's gradients of a unit, each in its slot of the ``(world, flat + flags)`` reduction buffer."""

    def __init__(self, params: Sequence, dtype: torch.dtype, device: torch.device):
        self.layouts = [p._layout for p in params]
        self.world = self.layouts[0].world
        # position -> the full gradient itself (see [Note: direct gradients]); None until it comes
        self.direct: dict[int, Optional[torch.Tensor]] = dict.fromkeys(direct_positions(self.layouts, dtype, device))
        self.offsets, total = [], 0
        for i, lay in enumerate(self.layouts):
            self.offsets.append(total)
            total += 0 if i in self.direct else lay.local_shape().numel()
        self.total = total
        self.dtype = dtype
        self.buffer = torch.empty((self.world, total + len(params)), dtype=dtype, device=device)
        self.have = [False] * len(params)

    def fits(self, grad: torch.Tensor) -> bool:
        return grad.dtype == self.dtype and grad.device == self.buffer.device

    def _slot(self, position: int) -> torch.Tensor:
        """The parameter's padded full gradient as ``(world, rows_per_rank, ...)``: a view into the buffer."""
        lay, offset = self.layouts[position], self.offsets[position]
        local = lay.local_shape()
        return self.buffer[:, offset:offset + local.numel()].unflatten(1, tuple(local))

    def add(self, position: int, grad: torch.Tensor, owned: bool = False) -> None:
        """Write (first gradient) or add (a later one) ``grad`` into the parameter's slot; zeros in its padding.
        A direct parameter keeps ``grad`` itself where this is its only holder (``owned``), else a copy."""
        lay = self.layouts[position]
        if position in self.direct:
            kept = self.direct[position]
            if kept is not None:
                kept.add_(grad.reshape(lay.shape))
            elif owned and grad.is_contiguous():
                self.direct[position] = grad.view(lay.shape)
            else:
                self.direct[position] = grad.reshape(lay.shape).clone(memory_format=torch.contiguous_format)
            self.have[position] = True
            return
        rows, slot = lay.rows_per_rank, self._slot(position)
        if rows == 0 or grad.numel() == 0:
            if not self.have[position]:
                slot.zero_()
            self.have[position] = True
            return
        grad = grad.reshape(lay.shape)
        whole, rem = divmod(lay.shape[0], rows)
        first = not self.have[position]
        put = (lambda dst, src: dst.copy_(src)) if first else (lambda dst, src: dst.add_(src))
        if whole:
            put(slot[:whole], grad[:whole * rows].reshape(whole, rows, *lay.shape[1:]))
        if rem:
            put(slot[whole, :rem], grad[whole * rows:])
        if first:  # the padding rows: zero, as the old pad was
            if rem:
                slot[whole, rem:].zero_()
            slot[whole + (1 if rem else 0):].zero_()
        self.have[position] = True

    def kept(self) -> dict[int, torch.Tensor]:
        """position -> full gradient (copies), as ``_Unit.grads`` keeps them: for a unit leaving the flat path."""
        return {i: self.direct[i] if i in self.direct  # already this unit's own (see [Note: direct gradients])
                else self._slot(i).reshape(lay.padded_shape)[: lay.shape[0]].clone()
                for i, lay in enumerate(self.layouts) if self.have[i]}

    def finish(self, mine: torch.Tensor) -> torch.Tensor:
        """The buffer to reduce-scatter: zeros for the parameters this rank has no gradient for, then the flags."""
        for position, had in enumerate(self.have):
            if not had and position in self.direct:
                self.direct[position] = torch.zeros(self.layouts[position].shape, dtype=self.dtype,
                                                    device=self.buffer.device)
            elif not had:
                self._slot(position).zero_()
        self.buffer[:, self.total:].copy_(mine.to(self.dtype).expand(self.world, -1))
        return self.buffer


def reduce_exact(name: str, params: Sequence, fulls: Optional[list[torch.Tensor]], mine: Optional[torch.Tensor],
                 reduce_dtype: Optional[torch.dtype], grads: Optional[FlatGrads] = None, async_op: bool = False,
                 channel=None):
    """A unit's mean gradient shards (each a tensor of its own, see ``_mean_shards``) and summed has-gradient
    flags, by one reduce-scatter of ``grads`` (built in place; its own flags) or of ``fulls`` (this rank's full
    gradients, padded, cast and concatenated here) with ``mine``, this rank's has-gradient flags.  ``async_op``: a
    function that waits and returns them."""
    layouts = [p._layout for p in params]
    world, count, group = layouts[0].world, len(params), layouts[0].group
    direct: dict[int, torch.Tensor] = {}
    if grads is not None:  # already in place (see [Note: flat unit gradients])
        flat = grads.finish(torch.tensor([1.0 if had else 0.0 for had in grads.have], dtype=torch.float64))
        direct = grads.direct
    else:  # the same split as FlatGrads: a peer may be on that route
        dtype = reduce_dtype or functools.reduce(torch.promote_types, [g.dtype for g in fulls])
        direct = {i: fulls[i].to(dtype).reshape(layouts[i].shape).contiguous()  # the caller's own: reduced in place
                  for i in direct_positions(layouts, dtype, fulls[0].device)}
        pieces = [lay.pad(g).to(dtype).reshape(world, -1) for i, (lay, g) in enumerate(zip(layouts, fulls))
                  if i not in direct]
        pieces.append(mine.to(dtype).expand(world, -1))  # every rank's flags in every rank's row: summed
        flat = torch.cat(pieces, dim=1)
    with _comm.labelled(f"gradient reduction of unit {name!r} ({count} parameters, "
                        f"first {params[0]._name!r}{frozen_in_label([p._name for p in params if not p.requires_grad])})"), \
            _comm.inputs_may_be_overwritten(True):
        if _in_place(world, flat.dtype, flat.device, group):
            rows, work = _comm_rows.reduce_scatter_in_place([flat.view(world, -1), *direct.values()], group,
                                                            async_op=True, channel=channel)
        else:
            result = _comm.reduce_scatter_rows(flat.reshape(-1), group, async_op=True)
            rows, work = [result.buffer], result.work
    finish = functools.partial(_mean_shards, layouts, rows, work, dict(zip(direct, rows[1:])))
    return finish if async_op else finish()


def _mean_shards(layouts: list, rows: list[torch.Tensor], work, sums: dict[int, torch.Tensor]
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Wait for a unit's reduction; each parameter's mean shard and the summed has-gradient flags.  Every shard is
    fresh (never rows of a full gradient), so each can become ``.grad`` as it is."""
    work.wait()
    world, count, shard = layouts[0].world, len(layouts), rows[0].reshape(-1)
    flags = shard[-count:].to(torch.float64)
    shard = shard[:-count] / world
    out, offset = [], 0
    for i, lay in enumerate(layouts):
        if i in sums:  # this rank's rows of a full gradient (autograd's buffer, or ours): the mean, in a shard
            out.append(torch.div(sums[i], world).view(lay.local_shape()))  # of its own (one pass, not two)
            continue
        n = lay.local_shape().numel()
        out.append(shard[offset:offset + n].view(lay.local_shape()))
        offset += n
    return out, flags


def finish_reductions(in_flight: list, keep: int = 0) -> None:
    """Wait for the oldest unit reductions in flight, ``(accumulate, finish)`` pairs, all but ``keep``, and hand
    their shards to ``accumulate``.  Units keep one in flight: its gradients go over the wire while the next
    unit's backward computes, and they were alive until their reduction anyway."""
    while len(in_flight) > keep:
        accumulate, finish = in_flight.pop(0)
        accumulate(*finish())
