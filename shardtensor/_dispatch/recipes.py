"""Shard-wise reads of a parameter an expert unit holds, and how their full tensors are made without a gather.

[Note: reads of a parameter its unit holds]
Inside a gather unit's forward or backward every parameter of the unit is held in full, gathered on every rank
whatever the data.  A pointwise read of one (``1.0 + norm.weight``, autocast's cast of an expert's weight,
``w * 2``) runs shard-wise, as everywhere: the result is a derived sharded tensor the size of a shard, and that
is what autograd saves for the backward.  Its full tensor is needed when an op uses it (the expert's matmul, in
the forward and again in the backward).  Gathered then, on demand, the collective has no name: in an expert loop
routed differently per rank, rank 0 gathered expert 0's derived tensor and rank 1 expert 2's in one collective,
and their rows were mixed, silently (helper C).  Run on the held full tensor instead, the read made a full result
that autograd kept from forward to backward: under autocast every expert's bf16 weights (helper G priced the
same in block units at +37% forward peak).

So inside a unit whose calls depend on the data (an expert list) the read keeps its recipe (op and operands) on
its shard, and a use of the derived tensor while its parameters are held again recomputes the full tensor from
the held ones: no collective, no full tensor kept, the same numbers.  Outside such a window (a derived tensor kept past the unit) the parameters
are gathered again by name: right where every rank kept the same expert's tensor, a ``DivergenceError`` where
not (gathered on demand by its shard, it mixed the ranks' rows silently: 0.51 off).  Block units keep no recipes: there every rank reads the same tensors in the same order.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..tensor import ShardedParam

RECIPE = "_shardtensor_recipe"  # on a derived tensor's shard: (op, args, kwargs) that made it from held tensors


def reads_held_expert_parameter(operands) -> bool:
    """Whether an operand is a parameter an expert unit holds now, or a tensor derived from one."""
    for x in operands:
        if type(x) is ShardedParam:
            if hasattr(x._local, RECIPE):
                return True
            gatherer = x._gatherer
            if gatherer is not None and gatherer.held:
                held = gatherer.held.get(id(x._local))
                if held is not None and getattr(held.unit, "routes_by_data", False):
                    return True
    return False


def remember(out, func, args, kwargs) -> bool:
    """Keep the recipe of ``out``, a shard-wise read's result; ``False`` if it is not one derived tensor."""
    if type(out) is not ShardedParam:
        return False
    setattr(out._local, RECIPE, (func, args, dict(kwargs)))
    return True


def full_base(p: ShardedParam, acquire: Callable[[ShardedParam], torch.Tensor]) -> Optional[torch.Tensor]:
    """The full base tensor (views not applied) of a derived ``p`` made by its recipe, or ``None`` if it has none.
    A parameter the recipe read is taken as its unit holds it, else through ``acquire`` (its Gatherer: a gather
    named by the parameter, so ranks that kept different experts' tensors past the unit raise
    ``DivergenceError`` instead of mixing their rows)."""
    recipe = getattr(p._local, RECIPE, None)
    if recipe is None:
        return None
    func, args, kwargs = recipe
    return func(*[_base(x, acquire) for x in args], **{k: _base(v, acquire) for k, v in kwargs.items()})


def _base(x, acquire):
    if type(x) is not ShardedParam:
        return x
    if hasattr(x._local, RECIPE):
        return full_base(x, acquire)
    gatherer = x._gatherer
    held = gatherer.held.get(id(x._local)) if gatherer is not None and gatherer.held else None
    if held is not None and held.version == x._local._version:
        return held.full
    return acquire(x)
