"""The op table's rule while torch.compile traces: see [Note: the traced path] in ``_traced.py``.

[Note: a compiled optimizer step]
``torch.compile(opt.step)`` traces a ``torch.optim`` step over ShardedParams: its pointwise, ``_foreach_*`` and
fused ops, whose operands are a parameter's shard, its gradient's and its state's (one layout) and 0-d tensors
(the step count, a tensor lr), run on the traced shards as in eager: the compiler fuses the update of each rank's
rows into a few loops (the benchmark GPT's AdamW step: about 3.5x faster than the eager for-loop here), with no
gather and no collective.  Only inside a step: the global step hooks (run eagerly, never traced: they check the
step, count it and compare it across ranks) mark the step in progress, and an in-place write into a ShardedParam
elsewhere in compiled code stays refused, as does any write with grad enabled.  A compiled graph writes into the
shards without moving their version counters, which the Gatherer reads to tell a held gather from a stale one, so
the post-hook moves them for the optimizer's parameters; no such hook would run after other compiled code.
The check is made when a graph is traced: a compiled function of the user's whose graph was first traced inside a
step (called from a per-optimizer step hook) and is called again outside one runs its cached writes unchecked,
and moves no version counter.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .._traced import is_traced, traced_gather  # noqa: F401  (is_traced: the dispatcher's check)
from ..tensor import ShardedParam
from . import local, views
from ._common import (
    _leaves, _localizable, _map_args, _map_kwargs, _mark_written, _params_in, _to_local, _wrap_like, _written_params,
    aten,
)


def run_traced(func, args: tuple, kwargs: dict, rule: Callable) -> Any:
    """``func`` on traced ShardedParams: views by their rule (no gather), an optimizer step's update on the shards,
    everything else on gathered tensors."""
    if rule in (views._view, views._identity_view):
        return rule(func, args, kwargs)
    if _update_on_shards(func, args, kwargs, rule):  # see [Note: a compiled optimizer step]
        return _on_traced_shards(func, args, kwargs)
    written = _written_params(func, args, kwargs)
    if written:
        raise NotImplementedError(
            f"torch.compile: {func} writes into the sharded tensors {[p._name or tuple(p.shape) for p in written]} "
            "(parameters, their gradients or optimizer state) inside a compiled function, outside a torch.optim "
            "step; such writes run eagerly only (without fullgraph=True the compiler breaks its graph there and "
            "runs them eagerly). Fix: keep them outside the compiled function (clip_grad_norm_ before the step "
            "too), or inside an optimizer step: torch.compile(opt.step) compiles."
        )
    after = _first_activation(args, kwargs)
    swap = lambda x: traced_gather(x, after) if isinstance(x, ShardedParam) else x  # noqa: E731
    return func(*_map_args(swap, args), **_map_kwargs(swap, kwargs))


def _first_activation(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The op's first tensor argument that is not a parameter: the gather waits for it (see [Note: a gather
    where it is read] in ``_traced.py``)."""
    for x in (*args, *kwargs.values()):
        for t in (x if isinstance(x, (list, tuple)) else (x,)):
            if isinstance(t, torch.Tensor) and not isinstance(t, ShardedParam):
                return t
    return None


_STEP_IN_PROGRESS = [False]  # a torch.optim step between its global pre- and post-hook (see _misuse_optim.py)


def optimizer_step_begins() -> None:
    _STEP_IN_PROGRESS[0] = True


def optimizer_step_ends(params: list) -> None:
    """The step is over: its parameters' shards were written (see [Note: a compiled optimizer step])."""
    _STEP_IN_PROGRESS[0] = False
    _mark_written(params)


def _update_on_shards(func, args: tuple, kwargs: dict, rule: Callable) -> bool:
    """Whether ``func`` is an optimizer step's shard-wise op (see [Note: a compiled optimizer step])."""
    if not _STEP_IN_PROGRESS[0] or torch.is_grad_enabled() or rule not in _shard_wise_rules():
        return False
    if _is_list_op(func):
        return local._foreach_localizable(list(args) + list(kwargs.values()))
    params = _params_in(args, kwargs)
    if not params or not _localizable(params):
        return False
    plain = [x for x in _leaves(args, kwargs) if isinstance(x, torch.Tensor) and not isinstance(x, ShardedParam)]
    if any(t.dim() != 0 for t in plain):
        return False
    if rule is local._copy:  # a whole shard from a shard of its layout, or a 0-d value
        return isinstance(args[0], ShardedParam) and not args[0]._views and \
            not (isinstance(args[1], ShardedParam) and args[1]._views)
    return True


def _shard_wise_rules() -> tuple:
    return (local._local, local._foreach_local, local._scale, local._zero, local._copy, local._like)


def _is_list_op(func) -> bool:
    return func.overloadpacket.__name__.startswith(("_foreach_", "_fused_"))


def _on_traced_shards(func, args: tuple, kwargs: dict) -> Any:
    if _is_list_op(func):
        return local._foreach_local(func, args, kwargs)
    if func is aten.copy_.default and isinstance(args[1], ShardedParam) and args[1]._local is args[0]._local:
        return args[0]  # a copy onto itself
    out = func(*_map_args(_to_local, args), **_map_kwargs(_to_local, kwargs))
    if _written_params(func, args, kwargs):
        return kwargs["out"] if "out" in kwargs else args[0]
    return _wrap_like(_params_in(args, kwargs)[0], out)
