"""ShardedParam <-> DTensor (``Shard(0)`` on a 1-d mesh): the bridge ``torch.distributed.checkpoint`` and DTensor
code cross.  Our split is DTensor's (``torch.chunk``: ceil(rows / world) rows per rank) plus zero padding."""

from __future__ import annotations

import torch

from . import _comm
from ._layout import ShardLayout


def to_dtensor(param):
    """This rank's rows as a ``DTensor`` with ``Shard(0)`` on a 1-d mesh of the layout's group (no copy).

    For ``torch.distributed.checkpoint`` and DTensor code.  DTensor's ``Shard(0)`` splits like
    ``torch.chunk``: ceil(rows / world) rows per rank, the last ranks shorter or empty.  That is our split
    without the zero padding, so the DTensor's local tensor is ``_local[:valid_rows]``, a view: writing into
    it (``dcp.load``) writes into this shard.  Needs an initialised process group (even for one process).
    """
    from torch.distributed.tensor import DTensor, Shard

    if param._views:
        raise ValueError(f"to_dtensor: {param._name or 'tensor'!r} is a view of a shard; call it on the parameter")
    layout = param._layout
    mesh = _comm.device_mesh(layout.group, param._local.device.type)
    stride = torch.empty(layout.shape, device="meta").stride()
    return DTensor.from_local(param._local[: layout.valid_rows], mesh, [Shard(0)], run_check=False,
                              shape=layout.shape, stride=stride)


def from_dtensor(cls, dtensor, name: str = "", requires_grad: bool = False):
    """A ShardedParam over the same rows as a 1-d ``DTensor`` placed ``Shard(0)`` (or ``Replicate()``).

    The rows are copied into a padded shard (DTensor's last shards are short; ours are padded).  Other
    placements (``Shard(1)``, 2-d meshes: tensor parallel) raise: redistribute to ``Shard(0)`` first.
    """
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = dtensor.device_mesh, tuple(dtensor.placements)
    if mesh.ndim != 1 or placements not in ((Shard(0),), (Replicate(),)):
        raise NotImplementedError(
            f"ShardedParam.from_dtensor({name or 'tensor'!r}): placements {placements} on a {mesh.ndim}-d mesh; "
            "only a 1-d mesh with Shard(0) or Replicate() maps onto a ShardedParam. "
            "Fix: dtensor.redistribute(mesh, [Shard(0)]) first (or dtensor.full_tensor())."
        )
    group = _comm.default_group_or(mesh.get_group())
    local = dtensor.to_local().detach()
    if placements == (Replicate(),):
        return cls.from_full(local, group, name=name, requires_grad=requires_grad)
    layout = ShardLayout.for_shape(dtensor.shape, group)
    if local.shape[0] != layout.valid_rows:
        raise AssertionError(f"from_dtensor: rank {layout.rank} holds {local.shape[0]} rows of {tuple(dtensor.shape)}; "
                             f"torch.chunk semantics give {layout.valid_rows}")
    padded = torch.zeros(layout.local_shape(), dtype=local.dtype, device=local.device)
    padded[: layout.valid_rows].copy_(local)
    return cls(padded, layout, name=name, requires_grad=requires_grad)
