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
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from . import _comm
from ._layout import ShardLayout
from .reduce import ExactReducer


def flat_dtype(params: Sequence, strategy) -> Optional[torch.dtype]:
    """The dtype a unit's flat gradient buffer holds, or None where the exact path would cast or promote, a
    parameter has another placement or another reducer reduces: those units keep their gradients apart."""
    dtypes = {p.dtype for p in params}
    if type(strategy) is not ExactReducer or len(dtypes) != 1 or \
            any(type(p._layout) is not ShardLayout for p in params):
        return None
    (dtype,) = dtypes
    return dtype if strategy.reduce_dtype in (None, dtype) else None


class FlatGrads:
    """One backward's gradients of a unit, each in its slot of the ``(world, flat + flags)`` reduction buffer."""

    def __init__(self, params: Sequence, dtype: torch.dtype, device: torch.device):
        self.layouts = [p._layout for p in params]
        self.world = self.layouts[0].world
        self.offsets, total = [], 0
        for lay in self.layouts:
            self.offsets.append(total)
            total += lay.local_shape().numel()
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

    def add(self, position: int, grad: torch.Tensor) -> None:
        """Write (first gradient) or add (a later one) ``grad`` into the parameter's slot; zeros in its padding."""
        lay = self.layouts[position]
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
        return {i: self._slot(i).reshape(lay.padded_shape)[: lay.shape[0]].clone()
                for i, lay in enumerate(self.layouts) if self.have[i]}

    def finish(self, mine: torch.Tensor) -> torch.Tensor:
        """The buffer to reduce-scatter: zeros for the parameters this rank has no gradient for, then the flags."""
        for position, had in enumerate(self.have):
            if not had:
                self._slot(position).zero_()
        self.buffer[:, self.total:].copy_(mine.to(self.dtype).expand(self.world, -1))
        return self.buffer


def reduce_exact(name: str, params: Sequence, fulls: Optional[list[torch.Tensor]], mine: Optional[torch.Tensor],
                 reduce_dtype: Optional[torch.dtype], grads: Optional[FlatGrads] = None
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A unit's mean gradient shards and summed has-gradient flags, by one reduce-scatter of ``grads`` (built
    in place; its own flags) or of ``fulls`` (this rank's full gradients, padded, cast and concatenated here)
    with ``mine``, this rank's has-gradient flags."""
    layouts = [p._layout for p in params]
    world, count = layouts[0].world, len(params)
    if grads is not None:  # already in place (see [Note: flat unit gradients])
        flat = grads.finish(torch.tensor([1.0 if had else 0.0 for had in grads.have], dtype=torch.float64))
    else:
        dtype = reduce_dtype or functools.reduce(torch.promote_types, [g.dtype for g in fulls])
        pieces = [lay.pad(g).to(dtype).reshape(world, -1) for lay, g in zip(layouts, fulls)]
        pieces.append(mine.to(dtype).expand(world, -1))  # every rank's flags in every rank's row: summed
        flat = torch.cat(pieces, dim=1)
    with _comm.labelled(f"gradient reduction of unit {name!r} ({count} parameters, "
                        f"first {params[0]._name!r})"), \
            _comm.inputs_may_be_overwritten(True):
        shard = _comm.reduce_scatter_rows(flat.reshape(-1), layouts[0].group).buffer
    flags = shard[-count:].to(torch.float64)
    shard = shard[:-count] / world
    out, offset = [], 0
    for lay in layouts:
        n = lay.local_shape().numel()
        out.append(shard[offset:offset + n].view(lay.local_shape()))
        offset += n
    return out, flags
