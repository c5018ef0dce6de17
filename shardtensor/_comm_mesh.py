"""A comm module (with ``_comm``): what torch's own distributed tensors need from a group.

DTensor meshes (``ShardedParam.to_dtensor`` / ``from_dtensor``, DCP) and the functional all-gather of the traced
path (torch.compile), kept apart from ``_comm``'s eager collectives because neither goes through its identity
check or timed waits: a mesh creates no communicator, and a functional collective is a node of a compiled graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

ProcessGroup = Optional["dist.ProcessGroup"]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


_meshes: dict = {}


def default_group_or(group: ProcessGroup) -> ProcessGroup:
    """``None`` for the default group (how ``ShardLayout`` names it), else ``group`` itself."""
    if group is None or (is_distributed() and group == dist.group.WORLD):
        return None
    return group


def as_sharding_group(group) -> ProcessGroup:
    """``shard_module``'s ``group=`` as a process group of this rank's: a 1-d ``DeviceMesh`` (FSDP2's ``mesh=``
    habit) is its group; anything else is named with the fix (a mesh, a list of ranks and a group without this
    rank failed deep in torch: a bare ``KeyError``, ``'list' object has no attribute 'size'``)."""
    if group is None:
        return None
    if is_distributed() and group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("shard_module(group=...): this rank is not a member of the group (dist.new_group returns "
                         "that marker on the ranks it leaves out). Fix: call shard_module on the group's members "
                         "only, or pass a group that holds this rank.")
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim == 1:
            return group.get_group()
        raise TypeError(f"shard_module(group=...): a {group.ndim}-d DeviceMesh (dimensions "
                        f"{group.mesh_dim_names}): shard over one of its dimensions, group=mesh.get_group(name).")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"shard_module(group=...): expected a torch.distributed ProcessGroup, got "
                        f"{type(group).__name__}. Fix: group = torch.distributed.new_group(ranks) on every rank, "
                        "a 1-d DeviceMesh, or None for the default group.")
    return group


def device_mesh(group: ProcessGroup, device_type: str):
    """A 1-d ``DeviceMesh`` over ``group`` (cached), for ``ShardedParam.to_dtensor``.  Creates no communicator."""
    if not is_distributed():
        raise RuntimeError(
            "to_dtensor needs an initialised process group, even for one process: "
            "torch.distributed.init_process_group(...) first (DTensor has no single-process mode)"
        )
    key = (id(group), device_type)
    mesh = _meshes.get(key)
    if mesh is None:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = _meshes[key] = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device_type)
    return mesh


def functional_all_gather_rows(local: torch.Tensor, group: ProcessGroup = None) -> torch.Tensor:
    """``all_gather_rows`` as a functional collective, for code that torch.compile traces (the gather becomes a
    node of the graph, scheduled by the compiler): the ``(world * rows, ...)`` buffer, rows in rank order."""
    import torch.distributed._functional_collectives as funcol

    return funcol.all_gather_tensor(local.contiguous(), 0, group if group is not None else dist.group.WORLD)
