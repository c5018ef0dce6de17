"""The op table's rule while torch.compile traces: see [Note: the traced path] in ``_traced.py``."""

from __future__ import annotations

from typing import Any, Callable

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
    swap = lambda x: traced_gather(x) if isinstance(x, ShardedParam) else x  # noqa: E731
    return func(*_map_args(swap, args), **_map_kwargs(swap, kwargs))
