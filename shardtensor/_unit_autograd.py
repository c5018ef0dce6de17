"""The autograd nodes that tell a gather unit where its backward begins and ends (see ``_units``).

[Note: a unit's output that needs no gradient on one rank]
A unit's backward is found from its outputs: a hook on their gradients gathers its parameters again, and a node
on its inputs (``PostBackward``) frees them and reduces its gradients.  An MoE layer on a rank whose batch routed
no token anywhere (an empty batch) calls no expert: its output is ``zeros_like(x)``, which needs no gradient, so
on that rank the unit's backward never begins while the other ranks gather and reduce it in the middle of their
backward: different collectives (a ``DivergenceError``).  ``AttachToInputs`` gives such outputs a place in the
graph, between the unit's inputs and its outputs (a copy of each output; zeros flow back to the inputs), so every
rank's backward reaches the unit at the same point and reduces it there: zeros, flagged as no gradient, on the
rank whose data did not use it.
"""

from __future__ import annotations

import torch


class PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward has produced their gradients."""

    @staticmethod
    def forward(ctx, unit, *tensors):
        ctx.unit = unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward()
        return (None, *grads)


class AttachToInputs(torch.autograd.Function):
    """``outputs`` (copies) tied to ``inputs`` in the graph: zero gradients flow back to the inputs (see [Note: a
    unit's output that needs no gradient on one rank]).  Copies, not views: the caller may write into them."""

    @staticmethod
    def forward(ctx, n_outputs: int, *tensors):
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in tensors[n_outputs:]]
        return tuple(t.clone() for t in tensors[:n_outputs])

    @staticmethod
    def backward(ctx, *grads):
        zeros = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.inputs]
        return (None, *[None] * len(grads), *zeros)
