"""The op table's rule while torch.compile traces: see [Note: the traced path] in ``_traced.py``."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .._traced import is_traced, traced_gather  # noqa: F401  (is_traced: the dispatcher's check)
from ..tensor import ShardedParam
from . import views
from ._common import _map_args, _map_kwargs, _written_params


def run_traced(func, args: tuple, kwargs: dict, rule: Callable) -> Any:
    """``func`` on traced ShardedParams: views by their rule (no gather), everything else on gathered tensors."""
    if rule in (views._view, views._identity_view):
        return rule(func, args, kwargs)
    written = _written_params(func, args, kwargs)
    if written:
        raise NotImplementedError(
            f"torch.compile: {func} writes into the ShardedParams {[p._name or tuple(p.shape) for p in written]} "
            "inside a compiled function; in-place updates of sharded parameters run eagerly only. Fix: keep the "
            "optimizer step (and any in-place parameter update) outside the compiled function."
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
