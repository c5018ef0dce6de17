"""The traced path: what an op on a ShardedParam becomes while torch.compile traces it.

[Note: the traced path]
Dynamo wraps a ShardedParam as a traceable tensor subclass (``__tensor_flatten__``): its shard is a fake tensor
while Dynamo propagates shapes, and a functional fake tensor while AOTAutograd traces the forward and backward
graphs through ``__torch_dispatch__``.  Our eager rules cannot run there (the Gatherer's Python scheduling, its
identity-keyed buffers, blocking gloo collectives), so the dispatcher sends every op whose shard is fake here:

  - views (``t``, ``view``, ``detach``...) stay views: a ShardedParam over the same shard, no gather;
  - every other op gathers each ShardedParam it meets with one node of the graph (on gloo CPU a custom op over
    the eager broadcasts: see [Note: a traced gather by broadcasts] in _comm_traced.py; elsewhere a functional
    all-gather, ``torch.distributed._functional_collectives``), cuts the padding rows, replays the views and runs the op
    on plain tensors.  The collective is a node of the graph, so the compiler schedules it (and, with
    ``torch._inductor.config.reorder_for_compute_comm_overlap``, overlaps it with compute).  Autograd saves the
    *view* (a ShardedParam over the shard), never the gathered tensor, so the backward graph gathers again
    where autograd's formulas read the parameter (``grad @ W``), as eager does: a 1-block GPT's graphs hold 17
    all-gathers forward and 11 backward, and no full weight lives from forward to backward.

The gradient of a parameter leaves the compiled backward whole (autograd's formulas see plain tensors) and is
reduce-scattered to this rank's shard of the mean by the same gradient hook as in eager: hooks on leaves run in
the autograd engine after the compiled backward, not in the graph, so they cost no graph break.  Local ops
(shard-wise pointwise ops, the optimizer step) are not traced by ``torch.compile(model)``; a compiled function
that runs them on real shards takes the eager rules.

The eager forward hooks (the step hook, gather units) stand aside while Dynamo traces.  A gather unit's
gradients still meet in its hook after the compiled backward and are reduced together, one collective per unit
(see [Note: unheld gradients] in ``_units.py``); a parameter outside every unit is reduced on its own.
Mixed precision: the traced gather casts the shard to ``param_dtype`` before the collective, as the Gatherer
does, and the step hook casts the root's floating inputs (both traced).

``gather="sequential"`` and ``"overlapped"`` are eager schedules: under compile both mean "whatever order the
compiler gives the graph's collectives" (one all-gather per parameter read, placed by the scheduler).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from . import _comm_traced
from ._layout import ShardLayout, apply_views


def _traced_shard(x: Any) -> bool:
    local = getattr(x, "_local", None) if isinstance(x, torch.Tensor) else None
    return local is not None and type(local) is not torch.Tensor and isinstance(local, (FakeTensor, FunctionalTensor))


def is_traced(args: tuple) -> bool:
    """Whether an op's arguments hold a ShardedParam whose shard is being traced (fake or functional)."""
    for x in args:
        if isinstance(x, (list, tuple)):
            if any(_traced_shard(t) for t in x):
                return True
        elif _traced_shard(x):
            return True
    return False


# Mixed precision under compile: a traced ShardedParam is rebuilt by ``__tensor_unflatten__`` from its flatten
# context, which holds the eager parameter's ShardLayout object itself but not its Gatherer.  shard_module records
# each layout's ``param_dtype`` here (by identity; the entry goes when the layout does).
_PARAM_DTYPES: dict[int, torch.dtype] = {}


def record_param_dtype(layout: Any, dtype: Optional[torch.dtype]) -> None:
    """Remember that gathers of ``layout``'s parameter cast to ``dtype`` (None: no cast)."""
    if dtype is None or id(layout) in _PARAM_DTYPES:
        return
    _PARAM_DTYPES[id(layout)] = dtype
    weakref.finalize(layout, _PARAM_DTYPES.pop, id(layout), None)


def param_dtype_of(layout: Any) -> Optional[torch.dtype]:
    """The dtype gathers of ``layout``'s parameter cast to (None: no cast)."""
    return _PARAM_DTYPES.get(id(layout))


def traced_gather(param) -> torch.Tensor:
    """The full tensor of ``param`` (views applied) as traced ops: a functional all-gather of the padded shard,
    then the padding rows cut off.  Its result is an ordinary tensor of the graph."""
    layout = param._layout
    if type(layout) is not ShardLayout:
        raise NotImplementedError(
            f"torch.compile of ShardedParam {param._name!r} with a {type(layout).__name__}: only the dim-0 "
            "placement has a traced gather. Fix: shard with placement='dim0' to compile, or run eagerly."
        )
    local, dtype = param._local, param_dtype_of(layout)
    if dtype is not None and local.is_floating_point() and local.dtype != dtype:  # cast before the gather
        local = local.to(dtype)
    if layout.world > 1:  # see [Note: a traced gather by broadcasts] in _comm_traced.py
        local = _comm_traced.traced_all_gather_rows(local, layout.group, f"all-gather of {param._name!r} (compiled)")
    full = local
    return apply_views(full[: layout.shape[0]], param._views)
