"""The autograd node that tells a gather unit where its backward ends (see ``_units``).

[Note: a unit's output that needs no gradient on one rank]
A unit's backward is found from its outputs: a hook on their gradients gathers its parameters again, and this
node on its inputs frees them and reduces its gradients.  An MoE layer on a rank whose batch routed no token
anywhere calls no expert: its output (``zeros_like(x)``) needs no gradient, so on that rank the unit's backward
never began while the other ranks gathered and reduced it: a ``DivergenceError`` (sequential mode, where the MoE
layer is the unit; in overlapped mode the block's residual keeps its output in the graph).  Tying such an output
to the unit's inputs (zeros flowing back) fixes that rank, but where *every* rank's output needs no gradient it
gave the layers before the unit zero gradients instead of none, which AdamW's decay then moved.  So a unit that
routes by its data (``_unit_policy._data_dependent``) asks the other ranks, once per forward with gradients (one
flag all-reduce), whether any needs its backward, and ties its output (``TieToInputs``) only then.  A rank whose
unit has no input that needs a gradient cannot be tied: that case stays a named ``DivergenceError``.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves, tree_map

from ._hooks import outside_functorch_transforms


class PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward has produced their gradients.

    (Both functions here keep ``forward`` free of ``ctx``, with a ``setup_context``, and let torch derive their
    vmap rule: that is the form ``torch.func`` transforms accept, so ``jacrev(model)(x)`` and per-sample gradients
    of the input run through a unit's forward.)"""

    generate_vmap_rule = True

    @staticmethod
    def forward(unit, *tensors):
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.unit = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        with outside_functorch_transforms():
            ctx.unit.post_backward()
        return (None, *grads)


class TieToInputs(torch.autograd.Function):
    """``output`` unchanged, as a function of the unit's inputs whose gradient is zero: the unit's backward (its
    gather and reduction, with no gradient of this rank's) runs here as on the ranks that need it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(output, *inputs):
        return output.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in inputs[1:]]

    @staticmethod
    def backward(ctx, grad):
        return (None, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.shapes))


def tie_if_another_rank_needs(unit, args: tuple, output, group):
    """The unit's output, tied to its inputs where it needs no gradient here but does on another rank (see the
    note above); ``None``: keep it as it is."""
    from ._agreement import any_rank  # (imported here: _agreement imports the comm layer, this module is a leaf)

    mine = any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(output))
    with outside_functorch_transforms():
        needed = any_rank(mine, group, f"whether any rank needs the backward of unit {unit.name!r}")
    if not needed or mine:
        return None
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if not inputs:
        return None
    return tree_map(lambda t: TieToInputs.apply(t, *inputs) if isinstance(t, torch.Tensor) and t.is_floating_point()
                    else t, output)

