"""The autograd node that tells a gather unit where its backward ends (see ``_units``).

[Note: a unit's output that needs no gradient on one rank]
A unit's backward is found from its outputs: a hook on their gradients gathers its parameters again, and this
node on its inputs frees them and reduces its gradients.  An MoE layer on a rank whose batch routed no token
anywhere calls no expert: its output (``zeros_like(x)``) needs no gradient, so on that rank the unit's backward
never begins while the other ranks gather and reduce it: a ``DivergenceError`` (sequential mode, where the MoE
layer is the unit; in overlapped mode the block's residual keeps its output in the graph).  Tying such an output
to the unit's inputs (zeros flowing back) fixes that rank, but where *every* rank's output needs no gradient it
gives the layers before the unit zero gradients instead of none, which AdamW's decay then moves: whether another
rank needs the unit's backward is only known by asking them (a collective per unit and forward), so the case
stays a named error.
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
