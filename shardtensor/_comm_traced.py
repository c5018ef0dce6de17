"""A comm module (with ``_comm``): the gather a compiled graph calls, on gloo CPU groups.

[Note: a traced gather by broadcasts]
The functional all-gather (``_c10d_functional.all_gather_into_tensor``) is gloo's flat all-gather, which costs
4-6x the wall time of the one-broadcast-per-rank gather the eager path uses (``benchmarks/results/collective_cost*``).
So on a gloo CPU group the traced gather is a custom op, opaque to the compiler, whose kernel is the eager
``_comm.all_gather_rows``: the broadcasts, with the same identity check (ranks that diverge inside compiled code
are named by a ``DivergenceError``, as in eager) and the same timed wait.  Its fake kernel gives the shape, so the
graph has no break.  No autograd formula is needed: the graph reads the parameter through the ``ShardedParam``
wrapper, whose gradient leaves the compiled backward whole and is reduced by the eager hook (``_traced.py``).
Other backends (NCCL) keep the functional collective, which the compiler can reorder and bucket.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from . import _comm


@torch.library.custom_op("shardtensor::gather_rows", mutates_args=())
def _gather_rows(local: torch.Tensor, group_name: str, label: str) -> torch.Tensor:
    group = _resolve_process_group(group_name)
    return _comm.all_gather_rows(local, None if group == dist.group.WORLD else group, label=label).buffer


@_gather_rows.register_fake
def _(local: torch.Tensor, group_name: str, label: str) -> torch.Tensor:
    world = dist.get_world_size(_resolve_process_group(group_name))
    return local.new_empty((world * local.shape[0], *local.shape[1:]))


def traced_all_gather_rows(local: torch.Tensor, group, label: str) -> torch.Tensor:
    """The ``(world * rows, ...)`` gather of ``local`` as one node of the traced graph (world > 1)."""
    if local.device.type == "cpu" and "gloo" in str(dist.get_backend(group)):
        named = group if group is not None else dist.group.WORLD
        return _gather_rows(local.contiguous(), named.group_name, label)
    return _comm.functional_all_gather_rows(local, group)
