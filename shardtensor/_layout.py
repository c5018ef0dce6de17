"""Placements and views: the data that describes a ``ShardedParam`` without being one.

``ShardLayout`` says how one base tensor is split over a process group (and owns the collectives that move
it); ``ViewStep`` records one view op so that views of a shard never gather (see [Note: views do not gather]
in ``tensor.py``).  Nothing here imports the tensor subclass, so the Gatherer, the reducers and the op rules
can all depend on this module without an import cycle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from . import _comm


@dataclass(frozen=True)
class ShardLayout:
    """How one base tensor is split over a process group along dim 0 (immutable; shared by views and grads)."""

    shape: torch.Size  # global shape of the base tensor
    rows_per_rank: int  # padded rows each rank holds: ceil(shape[0] / world)
    rank: int
    world: int
    group: Any = None  # ProcessGroup or None (the default group); compared by identity

    def __deepcopy__(self, memo: dict) -> "ShardLayout":
        """Itself: a layout is immutable, and its ProcessGroup cannot be copied (Dynamo's guards deepcopy a traced
        ShardedParam's flatten context, which holds the layout: a model sharded over a subgroup failed to
        compile with "cannot pickle 'ProcessGroup' object")."""
        return self

    @staticmethod
    def for_shape(shape: torch.Size, group=None) -> "ShardLayout":
        world = _comm.world_size(group)
        rows = -(-shape[0] // world) if shape[0] else 0
        return ShardLayout(torch.Size(shape), rows, _comm.rank(group), world, group)

    @property
    def row_start(self) -> int:
        return min(self.rank * self.rows_per_rank, self.shape[0])

    @property
    def valid_rows(self) -> int:
        """Rows of ``_local`` that hold data; the rest is padding (kept out of reductions and gathers)."""
        return max(0, min(self.rows_per_rank, self.shape[0] - self.rank * self.rows_per_rank))

    @property
    def padded_shape(self) -> torch.Size:
        return torch.Size((self.rows_per_rank * self.world, *self.shape[1:]))

    def local_shape(self) -> torch.Size:
        return torch.Size((self.rows_per_rank, *self.shape[1:]))

    # A placement's gather lives on its layout and its gradient reduction on its reducer (``reduce.py``), so
    # another placement (layer-wise ownership) is a layout subclass plus a reducer; gather.py only schedules.
    def gather(self, local: torch.Tensor, *, async_op: bool = False) -> _comm.CollectiveResult:
        """Start gathering the full tensor; its first ``shape[0]`` rows of ``.buffer`` are the base tensor."""
        self.check_live(local, "gather")
        return _comm.all_gather_rows(local, self.group, async_op=async_op)

    def check_live(self, local: torch.Tensor, what: str = "gather") -> None:
        """Raise unless this shard belongs to this process's rank and world: one saved by another rank or in
        another world (rank 0's ``torch.save`` of a sharded state dict) would gather alone, or reduce its rows
        as if they were this rank's (``sum()`` of rank 0's file was rank 0's rows' sum, silently)."""
        if _comm.world_size(self.group) != self.world:  # e.g. a shard unpickled in a process of another world
            raise RuntimeError(
                f"cannot {what} a shard of {self.world} ranks (global shape {tuple(self.shape)}) in a process group "
                f"of {_comm.world_size(self.group)}: it was saved or built in another world (a sharded model's "
                "state_dict() holds each rank's own rows). Fix: for a plain model, save "
                "shardtensor.full_state_dict(model, rank0_only=True) (called on every rank); for a sharded one, "
                "shardtensor.save_checkpoint / load_checkpoint (any world size)."
            )
        if self.world > 1 and _comm.rank(self.group) != self.rank:  # e.g. rank 0's torch.save loaded on rank 1
            message = (
                f"cannot {what} rank {self.rank}'s shard (global shape {tuple(self.shape)}) on rank "
                f"{_comm.rank(self.group)}: it was saved by another rank (model.state_dict() of a sharded model holds "
                "that rank's rows only), and this rank would gather alone. Fix: shardtensor.save_checkpoint / "
                "load_checkpoint, or shardtensor.full_state_dict(model, rank0_only=True) for full tensors.")
            try:  # the saving rank's gather of its own shard waits in the identity check: a record it cannot match
                _comm._check(f"refused {what}", local, self.group, f"{what} refused: rank {self.rank}'s saved shard")
            except _comm.CollectiveError as exc:  # (a DivergenceError there, naming this rank's refusal)
                raise RuntimeError(message) from exc
            raise RuntimeError(message)

    def gather_numel(self) -> int:
        """Elements a gather materialises (for prefetch budgets)."""
        return self.padded_shape.numel()

    def pad(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` as ``(world * rows_per_rank, ...)``; copies only when the rows do not divide evenly."""
        full = full.contiguous()
        if full.shape[0] == self.padded_shape[0]:
            return full
        padded = torch.zeros(self.padded_shape, dtype=full.dtype, device=full.device)
        padded[: full.shape[0]].copy_(full)
        return padded

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's padded rows of a full (replicated) tensor of the base shape: a fresh tensor."""
        local = torch.zeros(self.local_shape(), dtype=full.dtype, device=full.device)
        return self.copy_own_rows(local, full)

    def copy_own_rows(self, local: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """Copy this rank's rows of ``full`` (a tensor of the base shape every rank holds) into ``local``.

        The one place that maps "the full tensor" to "this rank's part of it" for every placement: a subclass
        moves the rows by overriding ``row_start`` / ``valid_rows``.  Padding rows of ``local`` are left alone.
        Returns ``local``."""
        if self.valid_rows:
            local[: self.valid_rows].copy_(full[self.row_start : self.row_start + self.valid_rows])
        return local


class ViewStep(NamedTuple):
    """One recorded view op, replayed on the gathered tensor: ``func(t, *args, **kwargs)[index]``."""

    func: Any  # torch._ops.OpOverload
    args: tuple
    kwargs: tuple  # sorted (name, value) pairs, so the step is hashable
    index: Optional[int]  # output index of multi-output views (split, unbind), else None

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        out = self.func(t, *self.args, **dict(self.kwargs))
        return out if self.index is None else out[self.index]


@functools.lru_cache(maxsize=4096)
def view_geometry(shape: torch.Size, views: tuple) -> tuple[torch.Size, tuple, int]:
    """Shape, stride and storage offset the view chain gives a contiguous base of ``shape`` (via meta tensors)."""
    t = torch.empty(shape, device="meta")
    for step in views:
        t = step.apply(t)
    return t.shape, t.stride(), t.storage_offset()


def apply_views(base: torch.Tensor, views: tuple) -> torch.Tensor:
    for step in views:
        base = step.apply(base)
    return base
