"""Class 1 of the op table: a view of a ShardedParam is a ShardedParam over the same shard that records the view.

No gather: see [Note: views do not gather] in ``tensor.py``.  The chain is replayed on the gathered base when a
compute op needs the data.
"""

from __future__ import annotations

import dataclasses

import torch

from .._layout import ShardLayout, ViewStep, view_geometry
from ..tensor import ShardedParam
from ._common import _BIJECTIVE_VIEWS, _params_in, aten, implements
from .compute import _Gathered, _unalias, compute


@implements([aten.detach.default, aten.alias.default, aten.lift_fresh.default])
def _identity_view(func, args, kwargs):
    # detach: nn.Parameter(...), AccumulateGrad and optimizers call it; it must not gather.
    self = args[0]
    return self._derived(self._local, gatherer=self._gatherer)


def _freeze(x):
    return tuple(_freeze(v) for v in x) if isinstance(x, list) else x


@implements(sorted(_BIJECTIVE_VIEWS - {aten.view_as_real.default}, key=str) + [
    aten.expand.default, aten.slice.Tensor, aten.select.int, aten.as_strided.default, aten.diagonal.default,
    aten.unfold.default,
])
def _view(func, args, kwargs):
    """Record the view; ``F.linear``'s ``t(weight)`` lands here, and so does autograd's saved copy of it."""
    self = args[0]
    if not isinstance(self, ShardedParam) or _params_in(args[1:], kwargs):
        return compute(func, args, kwargs)
    step = ViewStep(func, _freeze(list(args[1:])), tuple(sorted(kwargs.items())), None)
    if not _replayable(self._layout.shape, self._views + (step,)):
        return _view_as_copy(func, args, kwargs)
    return self._derived(self._local, views=self._views + (step,), gatherer=self._gatherer)


def _replayable(shape: torch.Size, views: tuple) -> bool:
    """Whether the chain is a view of a contiguous base (a reshape of a permuted parameter is not)."""
    try:
        view_geometry(shape, views)
    except RuntimeError:
        return False
    return True


# Reshapes that torch turns into a copy when the input cannot be viewed (reshape -> clone + _unsafe_view).
_RESHAPE_FAMILY = {aten.view.default, aten._unsafe_view.default, aten._reshape_alias.default, aten.reshape.default}


def _view_as_copy(func, args, kwargs):
    """A view step that no strides express (einsum's reshape of a permuted 3-d weight, ``__rmatmul__``,
    tensordot): gather, reshape a contiguous copy, hand out a plain tensor, as torch's ``reshape`` copies."""
    self = args[0]
    with _Gathered([self]) as fulls:
        full = fulls[id(self)]
        out = aten.reshape.default(full.contiguous(), args[1]) if func in _RESHAPE_FAMILY \
            else func(full, *args[1:], **kwargs)
        return _unalias(out, fulls)


@implements(aten.view.dtype)
def _dtype_view(func, args, kwargs):
    """``w.view(torch.int32)``: the same bits as another dtype, a view of the shard.  The fallback's gathered copy
    took a write through it and dropped it, silently.  Of the same element size every recorded view keeps its
    geometry; of another only the last dim changes, so the view is a new base over the shard's bytes where
    ``_reshaped_base`` says it is one."""
    self, dtype = args[0], args[1]
    if not isinstance(self, ShardedParam):
        return compute(func, args, kwargs)
    if torch.empty((), dtype=dtype).element_size() == self.element_size():
        return self._derived(self._local.view(dtype), gatherer=self._gatherer)
    return _reshaped_base(self, lambda t: t.view(dtype), func, args, kwargs)


@implements([aten.view_as_real.default, aten.view_as_complex.default])
def _complex_view(func, args, kwargs):
    """``view_as_real``, ``.real``, ``.imag`` (``view_as_real`` then ``select``) and ``view_as_complex`` change
    only the last dim, so a base of two dims or more (and ``view_as_real`` of a 1-d base) is a view of the shard:
    writes through it land in the parameter.  They were computed on a gathered copy, and a write was lost."""
    self = args[0]
    if not isinstance(self, ShardedParam):
        return compute(func, args, kwargs)
    return _reshaped_base(self, func, func, args, kwargs)


def _reshaped_base(self: ShardedParam, view, func, args, kwargs):
    """A new base over ``view(shard)``, dim 0 still split by rank, or the op computed where it is not one.

    A dtype or complex view reinterprets the bytes of each row, so it is a view of the shard wherever it keeps
    every dim but the last (of two dims or more) or, of a 1-d base, where each rank's padded rows still make a
    whole number of the new elements (each rank's bytes are then one block of the new tensor: its rows).  Writes
    through it land in this rank's rows; it shares the shard's version counter, so a held gather is stale as it is
    after any other write.  Elsewhere (a view chain before it, a 1-d shard whose bytes do not divide) it is
    computed: a copy, which reads right and which a write would not reach."""
    if self._views or type(self._layout) is not ShardLayout:
        return compute(func, args, kwargs)
    try:
        local = view(self._local)
        shape = view(torch.empty(self._layout.shape, dtype=self._local.dtype, device="meta")).shape
    except RuntimeError:
        return compute(func, args, kwargs)
    if local.dim() == 0 or shape[1:] != local.shape[1:] or local.data_ptr() != self._local.data_ptr():
        return compute(func, args, kwargs)
    layout = dataclasses.replace(self._layout, shape=shape, rows_per_rank=local.shape[0])
    device = self.device if local.device == self._local.device else local.device
    return ShardedParam(local, layout, name=self._name, device=device)


@implements([aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default])
def _multi_view(func, args, kwargs):
    """Multi-output views (``nn.MultiheadAttention`` splits its packed in_proj weight): one view per output."""
    self = args[0]
    meta = func(torch.empty(self.shape, device="meta"), *args[1:], **kwargs)
    frozen_args, frozen_kwargs = _freeze(list(args[1:])), tuple(sorted(kwargs.items()))
    return [
        self._derived(self._local, views=self._views + (ViewStep(func, frozen_args, frozen_kwargs, i),),
                      gatherer=self._gatherer)
        for i in range(len(meta))
    ]
