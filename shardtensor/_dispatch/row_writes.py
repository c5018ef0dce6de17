"""Class 2 of the op table, continued: indexed writes into a sharded tensor, each rank writing the rows it holds.

[Note: indexed writes]
``emb.weight[new_ids] = mean`` after adding tokens, ``emb.weight.grad[frozen_ids] = 0`` to keep some rows fixed,
``nn.init.sparse_`` (zeros at random rows of each column), ``index_fill_`` / ``index_copy_`` / a full boolean
mask written into a weight: the indices address the full tensor, and such a write is separable along dim 0.
Each rank keeps the index entries that fall in its rows (shifted to its shard) with their values, or, where the
write indexes other dims only, runs it on its rows as it is (with its rows of a full-size value).  The indices
and values must be the same on every rank, else each rank would write its rows of another update (a
patchwork): one exchange of their digests checks that, on every rank, before anything is written (these writes
are rare: initialisation, surgery on a model, a gradient mask once per step).  Other forms (a view of a shard
as the target, advanced indices split by a slice, a sharded index) fall back to the rules that refuse them.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _agreement
from ..tensor import ShardedParam
from ._common import _mark_written, _rows_of, aten, implements
from .local import _index_put_by_mask, _local


def _agree(target: ShardedParam, what: str, tensors: list) -> None:
    """Every rank writes with the same indices and values (see [Note: indexed writes])."""
    items = [(f"{target._name} ({what}: argument {k})", target, t) for k, t in enumerate(tensors)
             if isinstance(t, torch.Tensor) and _agreement.is_plain(t)]
    _agreement.refuse_differing(items, f"{what} into {target._name!r}")


def _own_entries(index: torch.Tensor, target: ShardedParam) -> tuple[torch.Tensor, torch.Tensor]:
    """(which entries of ``index``, a dim-0 index of the full tensor, fall in this rank's rows; their rows in the
    shard).  Out-of-range entries raise as torch's own indexing does."""
    layout, n = target._layout, target._layout.shape[0]
    if index.numel() and bool(((index < -n) | (index >= n)).any()):
        raise IndexError(f"index out of range for dimension 0 of {target._name!r} (size {n}): "
                         f"{index[(index < -n) | (index >= n)][0].item()}")
    rows = index % n if index.numel() else index
    mine = (rows >= layout.row_start) & (rows < layout.row_start + layout.valid_rows)
    return mine, rows[mine] - layout.row_start


def _own_value_rows(value, target: ShardedParam, dims: int):
    """This rank's rows of a value that spans dim 0 of a ``dims``-dimensional result (else the value itself)."""
    layout = target._layout
    if isinstance(value, torch.Tensor) and value.dim() == dims and value.shape[0] == layout.shape[0]:
        return value[layout.row_start:layout.row_start + layout.valid_rows]
    return value


def _index_put_rows(target: ShardedParam, indices: list, values, accumulate: bool) -> bool:
    if not indices or not isinstance(values, torch.Tensor) or isinstance(values, ShardedParam) or \
            any(isinstance(i, ShardedParam) for i in indices):  # (a sharded mask: Rprop's, every step) cheap first
        return False
    local = _rows_of(target)
    if local is None:
        return False
    flat: list[Optional[torch.Tensor]] = []
    for index in indices:  # a boolean mask stands for one integer index per dim it covers
        if index is not None and index.dtype in (torch.bool, torch.uint8):
            covered = tuple(target.shape[len(flat):len(flat) + index.dim()])
            if tuple(index.shape) != covered:  # torch's own check (a mask of 6 rows on 7 wrote rows 0-5)
                raise IndexError(f"The shape of the mask {list(index.shape)} at index 0 does not match the shape "
                                 f"of the indexed tensor {list(target.shape)} at index {len(flat)}")
            flat.extend(index.nonzero().unbind(1))
        else:
            flat.append(index)
    given = [k for k, i in enumerate(flat) if i is not None]
    if not given or given != list(range(given[0], given[-1] + 1)) or given[0] > 1:
        return False  # advanced indices split by a slice move their dims to the front: not by rows
    _agree(target, "an indexed write", [*[flat[k] for k in given], values])
    shape = target.shape
    if given[0] == 1:  # w[:, ids] = v: every row alike, this rank's rows of a value that spans them
        spanned = torch.broadcast_shapes(*[flat[k].shape for k in given])
        dims = 1 + len(spanned) + len(shape) - 1 - len(given)
        aten.index_put_.default(local, flat, _own_value_rows(values, target, dims), accumulate)
        return True
    spanned = torch.broadcast_shapes(*[i.shape for i in flat[: len(given)]])
    mine, rows = _own_entries(flat[0].expand(spanned), target)
    own = [rows, *[i.expand(spanned)[mine] for i in flat[1: len(given)]]]
    if values.dim():
        values = values.expand(*spanned, *shape[len(given):])[mine]
    aten.index_put_.default(local, own, values, accumulate)
    return True


@implements(aten.index_put_.default)
def _index_put(func, args, kwargs):
    """``w[ids] = v``, ``w[ids, col] = 0``, ``w[mask] = v``, ``w[:, ids] = v`` (see [Note: indexed writes]); a
    mask that is itself a shard goes on to ``local``'s rule."""
    target, indices, values = args[0], list(args[1]), args[2]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if _index_put_rows(target, indices, values, accumulate):
        _mark_written((target,))
        return target
    return _index_put_by_mask(func, args, kwargs)


@implements([aten.index_fill_.int_Scalar, aten.index_fill_.int_Tensor, aten.index_copy_.default])
def _index_fill_or_copy(func, args, kwargs):
    """``w.index_fill_(dim, ids, v)``, ``w.index_copy_(dim, ids, src)``: by rows (see [Note: indexed writes])."""
    target, dim, index, value = args[0], args[1], args[2], args[3]
    local = _rows_of(target)
    if local is None or kwargs or isinstance(index, ShardedParam) or isinstance(value, ShardedParam):
        return _local(func, args, kwargs)
    _agree(target, func.overloadpacket.__name__, [index, value])
    if dim % max(1, target.dim()) != 0:
        copies = func is aten.index_copy_.default
        func(local, dim, index, _own_value_rows(value, target, target.dim()) if copies else value)
    else:
        if func is aten.index_copy_.default and index.numel() and bool((index < 0).any()):  # as torch refuses
            raise IndexError(f"index_copy_(): index {int(index.min())} is out of bounds for dimension 0 with size "
                             f"{target.shape[0]}")
        mine, rows = _own_entries(index.reshape(-1), target)
        func(local, 0, rows, value[mine] if func is aten.index_copy_.default else value)
    _mark_written((target,))
    return target


@implements([aten.masked_fill_.Scalar, aten.masked_fill_.Tensor])
def _masked_fill(func, args, kwargs):
    """``w.masked_fill_(mask, v)`` with a full plain mask: each rank its rows of the mask (a mask that is a shard
    of ``w``'s layout is element-wise: ``local``'s rule)."""
    target, mask = args[0], args[1]
    local = _rows_of(target)
    if local is None or kwargs or isinstance(mask, ShardedParam) or mask.dim() == 0:
        return _local(func, args, kwargs)
    _agree(target, "masked_fill_", [mask, args[2]])
    layout = target._layout
    func(local, mask.expand(target.shape)[layout.row_start:layout.row_start + layout.valid_rows], args[2])
    _mark_written((target,))
    return target
