"""A comm module (with ``_comm``): the gather a compiled graph calls, on gloo CPU groups.

[Note: a traced gather by broadcasts]
The functional all-gather (``_c10d_functional.all_gather_into_tensor``) is gloo's flat all-gather, which costs
4-6x the wall time of the one-broadcast-per-rank gather the eager path uses (``benchmarks/results/collective_cost*``).
So on a gloo CPU group the traced gather is a custom op, opaque to the compiler, whose kernel is the eager
``_comm.all_gather_rows``: the broadcasts, with the same identity check (ranks that diverge inside compiled code
are named by a ``DivergenceError``, as in eager) and the same timed wait.  Its fake kernel gives the shape, so the
graph has no break.  No autograd formula is needed: the graph reads the parameter through the ``ShardedParam``
wrapper, whose gradient the compiled backward reduces by its own node (``_traced_grads.py``).
Other backends (NCCL) keep the functional collective, which the compiler can reorder and bucket.

A gather unit's parameters are gathered by one node (``traced_unit_gather``, see [Note: unit gathers under
compile] in ``_traced.py``) whose kernel is the unit's own eager collective: one identity check, the broadcasts
straight into each parameter's full tensor, or the shared-memory channel in overlapped mode (``_comm_shm``).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from . import _comm


@torch.library.custom_op("shardtensor::gather_rows", mutates_args=())
def _gather_rows(local: torch.Tensor, group_name: str, label: str, after: Optional[torch.Tensor]) -> torch.Tensor:
    group = _resolve_process_group(group_name)
    return _comm.all_gather_rows(local, None if group == dist.group.WORLD else group, label=label).buffer


@_gather_rows.register_fake
def _(local: torch.Tensor, group_name: str, label: str, after: Optional[torch.Tensor]) -> torch.Tensor:
    world = dist.get_world_size(_resolve_process_group(group_name))
    return local.new_empty((world * local.shape[0], *local.shape[1:]))


UNITS: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()  # key -> _Unit (_traced.py)


def _unit(key: str):
    unit = UNITS.get(key)
    if unit is None:  # a graph compiled for a model that is gone (unsharded, or another process's cache entry)
        raise RuntimeError(f"torch.compile: the compiled graph gathers gather unit {key!r}, which no sharded "
                           "model in this process has. Fix: torch._dynamo.reset() and compile the model again.")
    return unit


@torch.library.custom_op("shardtensor::gather_unit", mutates_args=())
def _gather_unit(shards: list[torch.Tensor], unit: str, phase: int, after: Optional[torch.Tensor]
                 ) -> list[torch.Tensor]:
    return _unit(unit).gather_for_graph(shards)


@_gather_unit.register_fake
def _(shards: list[torch.Tensor], unit: str, phase: int, after: Optional[torch.Tensor]) -> list[torch.Tensor]:
    return [s.new_empty(p._layout.shape) for s, p in zip(shards, _unit(unit).params)]


def traced_unit_gather(shards: list[torch.Tensor], key: str, phase: int, after: Optional[torch.Tensor]
                       ) -> list[torch.Tensor]:
    """The full base tensors of unit ``key``'s parameters from their (cast) traced shards, as one node of the
    graph that runs once ``after`` exists; ``phase`` (0 forward, 1 backward) keeps the two phases' nodes apart."""
    return _gather_unit([s.contiguous() for s in shards], key, phase, after)


def traced_all_gather_rows(local: torch.Tensor, group, label: str, after: Optional[torch.Tensor] = None
                           ) -> torch.Tensor:
    """The ``(world * rows, ...)`` gather of ``local`` as one node of the traced graph (world > 1), on gloo run
    once ``after`` exists."""
    if _comm.on_gloo_cpu(local.device, group):
        named = group if group is not None else dist.group.WORLD
        return _gather_rows(local.contiguous(), named.group_name, label, after)
    return _comm.functional_all_gather_rows(local, group)
