"""ShardedParam <-> DTensor (``Shard(0)`` on a 1-d mesh): the bridge ``torch.distributed.checkpoint`` and DTensor
code cross.  Our split is DTensor's (``torch.chunk``: ceil(rows / world) rows per rank) plus zero padding.

[Note: checkpoint chunks come from the layout]
DCP asks a partial tensor which block of the global tensor it holds (``__create_write_items__``,
``__create_chunk_list__``) and for that block's data (``__get_tensor_shard__``).  The answer is the layout's own
rows (``row_start``, ``valid_rows``), not a ``Shard(0)`` DTensor's: an ``OwnerLayout`` (layer-wise placement)
holds every row on its owner and none elsewhere, which ``Shard(0)`` cannot say.  Through the DTensor, the
metadata listed dim-0 chunks while the owner wrote its whole tensor: a load put wrong rows everywhere, silently.
A rank without rows gives no chunk.
"""

from __future__ import annotations

import torch

from . import _comm, _grad_edits
from ._layout import ShardLayout


def _rows_held(param):
    """``(offsets, sizes)`` of the block of the global tensor this rank's shard holds; None: no rows."""
    if param._views:
        raise ValueError(f"checkpoint: {param._name or 'tensor'!r} is a view of a shard; save the parameter")
    layout = param._layout
    if layout.valid_rows == 0:
        return None
    offsets = torch.Size((layout.row_start,) + (0,) * (len(layout.shape) - 1))
    return offsets, torch.Size((layout.valid_rows, *layout.shape[1:]))


def dcp_write_items(param, fqn: str) -> list:
    """DCP's write items for this rank's rows (see [Note: checkpoint chunks come from the layout])."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    held = _rows_held(param)
    if held is None:
        return []
    offsets, sizes = held
    return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                  properties=TensorProperties.create_from_tensor(param._local),
                                                  size=param._layout.shape))]


def dcp_chunks(param) -> list:
    """The block this rank loads into (none where it holds no rows)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    held = _rows_held(param)
    return [] if held is None else [ChunkStorageMetadata(offsets=held[0], sizes=held[1])]


def dcp_shard(param) -> torch.Tensor:
    """This rank's rows without padding, a view: DCP's load writes into the shard through it."""
    return param._local[: param._layout.valid_rows]


def to_dtensor(param):
    """This rank's rows as a ``DTensor`` with ``Shard(0)`` on a 1-d mesh of the layout's group (no copy).

    For ``torch.distributed.checkpoint`` and DTensor code.  DTensor's ``Shard(0)`` splits like
    ``torch.chunk``: ceil(rows / world) rows per rank, the last ranks shorter or empty.  That is our split
    without the zero padding, so the DTensor's local tensor is ``_local[:valid_rows]``, a view: writing into
    it (``dcp.load``) writes into this shard.  Needs an initialised process group (even for one process).
    """
    from torch.distributed.tensor import DTensor, Shard

    _grad_edits.refuse_read_of_pending(param, "to_dtensor()")
    if param._views:
        raise ValueError(f"to_dtensor: {param._name or 'tensor'!r} is a view of a shard; call it on the parameter")
    layout = param._layout
    if type(layout) is not ShardLayout:
        raise NotImplementedError(
            f"to_dtensor: {param._name or 'tensor'!r} is placed by {type(layout).__name__} (layer-wise placement: "
            "one rank holds the whole tensor), which no DTensor placement describes. Fix: pass the ShardedParams "
            "themselves to torch.distributed.checkpoint (shardtensor.save_checkpoint / load_checkpoint, or "
            "get_model_state_dict + dcp.save), or shardtensor.full_state_dict(model) for whole tensors.")
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
