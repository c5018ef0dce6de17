"""Layer-wise placement: every parameter is owned whole by one rank (see ARCHITECTURE.md).

``shard_module(model, placement="layerwise")`` gives each parameter an ``OwnerLayout``.  A placement is a
layout: the ShardedParam interface, the op table and the Gatherer are the dim-0 ones, only the layout's
collectives differ.

  - the owner's ``_local`` is the whole tensor; every other rank's ``_local`` has 0 rows;
  - a gather is a broadcast from the owner (the Gatherer prefetches them asynchronously in recorded order);
  - a gradient is summed to the owner and divided by the world there: the owner holds the whole mean
    gradient, the others a 0-row one.

An optimizer that needs whole matrices (Muon's Newton-Schulz orthogonalisation, Shampoo) then runs unchanged
on the owner's ``to_local()``: see ``shardtensor.optim.Muon``.

[Note: why the op table is right for owner layouts without new rules]
Local ops (pointwise, ``_foreach_*``, fused optimizers) run on ``_local``s of *equal* layouts; equal owner
layouts have the same owner, so every rank holds matching rows of every operand (all of them, or none) and the
shard-wise result is the owner's whole result.  Reductions reduce ``_local[:valid_rows]`` and all-reduce: the
owner contributes everything, the others an empty slice (the op's identity: 0 for sums, -inf for max), so the
all-reduced value is the whole tensor's.  ``copy_``/``nn.init`` keep ``row_start : row_start + valid_rows``,
which is everything on the owner and nothing elsewhere.

[Note: the plan]
Largest parameter first, onto the rank with the fewest bytes so far (ties: lowest rank; equal sizes keep
module order).  It is a function of the names, shapes and dtypes only, which ``shard_module`` has checked to
agree across ranks, so every rank computes the same plan without communicating.  Greedy placement onto the
least-loaded rank bounds the heaviest rank by ``mean + largest``: when its last parameter ``s`` arrived, that
rank held at most ``(total - s) / world`` bytes (the least loaded one holds at most the mean of the others).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from . import _comm
from ._layout import ShardLayout
from .reduce import ExactReducer
from .tensor import ShardedParam


@dataclass(frozen=True)
class OwnerLayout(ShardLayout):
    """One rank (``owner``, a rank within ``group``) holds the whole tensor; the others hold 0 rows.

    ``rows_per_rank`` is this rank's local row count (``shape[0]`` on the owner, else 0), so layouts of one
    parameter differ across ranks exactly as dim-0 layouts do (by ``rank``), and ``repr`` reads ``rows/rows``.
    """

    owner: int = 0

    @staticmethod
    def for_owner(shape: torch.Size, owner: int, group=None) -> "OwnerLayout":
        world, rank = _comm.world_size(group), _comm.rank(group)
        if not 0 <= owner < world:
            raise ValueError(f"OwnerLayout: owner={owner} is not a rank of the group ({world=})")
        if len(shape) == 0:
            raise ValueError("OwnerLayout: a 0-d tensor has no rows to own; it stays replicated")
        rows = shape[0] if rank == owner else 0
        return OwnerLayout(torch.Size(shape), rows, rank, world, group, owner)

    @property
    def owns(self) -> bool:
        """Whether this rank holds the whole tensor."""
        return self.rank == self.owner

    @property
    def row_start(self) -> int:
        return 0

    @property
    def valid_rows(self) -> int:
        return self.shape[0] if self.owns else 0

    @property
    def padded_shape(self) -> torch.Size:
        return self.shape

    def local_shape(self) -> torch.Size:
        return torch.Size((self.valid_rows, *self.shape[1:]))

    def gather(self, local: torch.Tensor, *, async_op: bool = False) -> _comm.CollectiveResult:
        """Broadcast from the owner.  The owner's buffer is an alias of ``local`` (no copy); the others get a
        fresh buffer that the broadcast fills."""
        if self.owns:
            buffer = local.view(local.shape)  # a distinct alias, so the Gatherer's lifetime accounting sees it
        else:
            buffer = torch.empty(self.shape, dtype=local.dtype, device=local.device)
        work = _comm.broadcast(buffer, self.owner, self.group, async_op=async_op)
        return _comm.CollectiveResult(buffer, work)

    def gather_numel(self) -> int:
        return self.shape.numel()

    def pad(self, full: torch.Tensor) -> torch.Tensor:
        return full.contiguous()

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        if self.owns:
            return full.detach().clone(memory_format=torch.contiguous_format)
        return torch.empty(self.local_shape(), dtype=full.dtype, device=full.device)

class OwnerReducer(ExactReducer):
    """Layer-wise gradients: every rank's full gradient is summed to the parameter's owner (``GradStrategy``)."""

    def reduce_grad(self, grad: torch.Tensor, layout: OwnerLayout, *, key: str, dtype: torch.dtype, owned: bool,
                    overlap: bool) -> torch.Tensor:
        """Sum every rank's full gradient to the owner, divide by the world there (the mean, as dim 0 gives).

        Exact, in ``reduce_dtype`` when given; compressed reducers are refused by ``shard_module``.  Non-owners
        return a 0-row gradient, matching their 0-row ``_local``.  Never asynchronous (``overlap`` is ignored).
        """
        wire_dtype = self.reduce_dtype or grad.dtype
        if _comm.inputs_overwritable() and grad.dtype == wire_dtype and grad.is_contiguous():
            wire = grad  # the gradient hook vouches that nobody else holds it
        else:
            # A copy we own: reduce may use the non-destinations' tensor as scratch, and autograd's gradient may
            # be shared with another input (``x + W`` passes one buffer to both).
            wire = grad.to(wire_dtype, memory_format=torch.contiguous_format, copy=True)
        with _comm.labelled(f"gradient reduction of {key!r}"):
            _comm.reduce(wire, layout.owner, layout.group)
        if not layout.owns:
            return grad.new_empty((0, *layout.shape[1:]))
        if layout.world > 1:
            wire.div_(layout.world)
        return wire.to(grad.dtype)


def plan_placement(sizes: Sequence[int], world: int) -> list[int]:
    """Owner rank of each item of ``sizes`` (bytes), balanced: see [Note: the plan].  Pure and deterministic."""
    if world < 1:
        raise ValueError(f"plan_placement: world={world} must be >= 1")
    if any(s < 0 for s in sizes):
        raise ValueError(f"plan_placement: sizes must be >= 0, got {min(sizes)}")
    load = [0] * world
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += sizes[i]
    return owners


def _placed_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters ``shard_module`` shards (floating, at least 1-d), each tied parameter once, in module order."""
    return [(n, p) for n, p in module.named_parameters() if p.is_floating_point() and p.dim() > 0]


def owner_layouts(module: nn.Module, group=None, reducer=None) -> dict[int, OwnerLayout]:
    """``id(parameter) -> OwnerLayout`` for every parameter ``shard_module`` will shard (used by ``shard_module``)."""
    if reducer is not None and not isinstance(reducer, ExactReducer):
        raise NotImplementedError(
            f"shard_module(placement='layerwise'): reducer={type(reducer).__name__} is not supported yet; "
            "layer-wise gradients are reduced exactly to their owner. Pass reducer=None or ExactReducer(...)."
        )
    placed = _placed_parameters(module)
    owners = plan_placement([p.numel() * p.element_size() for _, p in placed], _comm.world_size(group))
    return {id(p): OwnerLayout.for_owner(p.shape, owner, group) for (_, p), owner in zip(placed, owners)}


def placement_plan(module: nn.Module) -> dict[str, int]:
    """Owner rank of each layer-wise parameter of a sharded ``module``, by name (never communicates)."""
    return {n: p._layout.owner for n, p in module.named_parameters()
            if isinstance(p, ShardedParam) and isinstance(p._layout, OwnerLayout)}
