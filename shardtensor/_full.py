"""Gathers outside the Gatherer's schedule: on demand, for one op or for the user (``full_tensor()``).

``_FullTensor`` sits beside the Gatherer (not in tensor.py) so the tensor subclass needs nothing from the
scheduling code, and this module needs nothing from the subclass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import _comm, _grad_edits
from ._layout import ShardLayout, apply_views

if TYPE_CHECKING:
    from .tensor import ShardedParam


def gather_now(local: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """The base tensor gathered now (padding rows cut off); blocking, not cached."""
    buffer = layout.gather(local).buffer
    return buffer[: layout.shape[0]]


def gather_label(param: ShardedParam) -> str:
    """Names what a gather carries in the identity check: the parameter (or a view of it: they carry its
    Gatherer), or a tensor computed from it.  A gradient keeps its parameter's name, so with one label
    ``p.grad.full_tensor()`` on rank 0 alone (a debugging print) met the next forward's gather of ``p`` on the
    other ranks, and their forward ran on rank 0's gradient rows, silently."""
    if param._gatherer is not None:
        return f"all-gather of {param._name!r}"
    return f"all-gather of a tensor computed from {param._name!r} (a gradient, optimizer state or op result)"


def gather_base(param: ShardedParam) -> torch.Tensor:
    """The base tensor of ``param`` (views not applied) gathered now, labelled by ``gather_label``."""
    with _comm.labelled(gather_label(param)):
        return gather_now(param._local, param._layout)


def gather_full(param: ShardedParam) -> torch.Tensor:
    """Full tensor of ``param`` with its views applied, gathered on demand (not scheduled, not cached)."""
    return apply_views(gather_base(param), param._views)


class _FullTensor(torch.autograd.Function):
    """Gather for the user; the incoming full gradient flows to the parameter unchanged (its hook shards it)."""

    generate_vmap_rule = True  # (with forward free of ctx: the form torch.func transforms accept)

    @staticmethod
    def forward(param: ShardedParam) -> torch.Tensor:
        return gather_full(param).clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def full_tensor_of(param: ShardedParam) -> torch.Tensor:
    """``param.full_tensor()``: a differentiable gather whose result the caller owns."""
    _grad_edits.refuse_read_of_pending(param, "full_tensor()")
    return _FullTensor.apply(param)
