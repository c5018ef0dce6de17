"""Gradients: the full gradient arrives, this rank's shard of the mean leaves (DESIGN.md section 5).

[Note: why a pre-accumulate hook]
The hook is a tensor hook on the leaf (``register_hook``), so it runs *before* AccumulateGrad.  It turns the
full gradient into a sharded one, and AccumulateGrad then stores (first backward) or adds (gradient
accumulation) ShardedParams of one layout, which the op table runs shard-wise.  A post-accumulate hook would
see the full gradient already summed into a sharded ``.grad`` it cannot reduce any more.  The full gradient is
dropped when the hook returns.

Reducers are pluggable.  The protocol::

    reducer.reduce(full_grad, *, key, group) -> shard

``full_grad`` is this rank's un-reduced gradient padded with zero rows to ``(world * rows_per_rank, ...)``;
the result is this rank's ``(rows_per_rank, ...)`` rows of the *mean* over ranks, in ``full_grad``'s dtype.
``ExactReducer`` reduce-scatters; ``shardtensor.optim.CompressedReducer`` sends 4-bit chunks.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from . import _comm
from .tensor import ShardedParam, ShardLayout


class GradientReducer(Protocol):
    def reduce(self, full_grad: torch.Tensor, *, key: str, group) -> torch.Tensor: ...


class ExactReducer:
    """Mean gradient by reduce-scatter, optionally in ``reduce_dtype`` (e.g. fp32 for bf16 gradients)."""

    def __init__(self, reduce_dtype: Optional[torch.dtype] = None):
        self.reduce_dtype = reduce_dtype

    def reduce(self, full_grad: torch.Tensor, *, key: str, group) -> torch.Tensor:
        wire = full_grad if self.reduce_dtype is None else full_grad.to(self.reduce_dtype)
        shard = _comm.reduce_scatter_rows(wire, group).buffer
        world = _comm.world_size(group)
        if shard is wire:  # world 1: no collective, and the input must not be modified in place
            shard = shard.clone() if shard is full_grad else shard
        if world > 1:
            shard.div_(world)
        return shard.to(full_grad.dtype)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class GradSync:
    """Per-module switch and reducer shared by the gradient hooks of one ``shard_module`` call."""

    def __init__(self, reducer: GradientReducer, grad_dtype: Optional[torch.dtype] = None):
        self.reducer = reducer
        self.enabled = True
        self.grad_dtype = grad_dtype

    def sharded_grad_hook(self, param: ShardedParam, key: str):
        layout = param._layout
        dtype = param.dtype

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if isinstance(grad, ShardedParam):  # a gradient computed shard-wise is already this rank's
                return grad
            shard = layout.reduce_grad(grad.detach(), self.reducer, key)
            return ShardedParam(shard.to(dtype), layout, (), None, key)

        return hook

    def replicated_grad_hook(self, group):
        """0-d floating parameters are not sharded; their gradients are averaged like DDP's."""

        def hook(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.detach().clone()
            _comm.all_reduce(grad, group, op="avg")
            return grad

        return hook
