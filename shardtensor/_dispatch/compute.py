"""Class 4 of the op table: gather the full tensors, run the op on them, release them.

The default rule: any op without a shard-wise rule lands here.  Outputs are plain tensors, and never aliases of
a gathered buffer (``_unalias``), so a full weight lives exactly as long as the op that needed it (or the
Gatherer's reuse window), never as long as some output.
"""

from __future__ import annotations

import torch

from .._layout import apply_views
from .._full import gather_base
from ..tensor import ShardedParam
from ._common import _map_args, _map_kwargs, _map_out, _params_in, _written_params
from .recipes import full_base
from .refusals import _refuse


class _Gathered:
    """Acquire the full tensors of the ShardedParams in ``(args, kwargs)``; release them on exit."""

    def __init__(self, params: list[ShardedParam]):
        self.params = params
        self.acquired: list[ShardedParam] = []

    def __enter__(self) -> dict[int, torch.Tensor]:
        fulls: dict[int, torch.Tensor] = {}
        try:
            for p in self.params:
                if id(p) in fulls:
                    continue
                if p._gatherer is not None:
                    base = p._gatherer.acquire(p)
                    self.acquired.append(p)
                else:  # a derived tensor: by its recipe if it has one (see recipes.py), else gathered
                    base = full_base(p, self._acquire)
                    if base is None:
                        base = gather_base(p)
                fulls[id(p)] = apply_views(base, p._views)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return fulls

    def _acquire(self, p: ShardedParam) -> torch.Tensor:
        base = p._gatherer.acquire(p) if p._gatherer is not None else gather_base(p)
        if p._gatherer is not None:
            self.acquired.append(p)
        return base

    def __exit__(self, *exc) -> None:
        for p in self.acquired:
            p._gatherer.release(p)
        self.acquired = []


def compute(func, args, kwargs):
    """Gather -> run -> release.  Outputs are plain tensors that never alias a gathered buffer."""
    written = _written_params(func, args, kwargs)
    if written:
        if _backward_temporaries(written):
            return _write_back(func, args, kwargs, written)
        _refuse(func, args, kwargs, "it is not an op that can run on this rank's shard")
    params = _params_in(args, kwargs)
    with _Gathered(params) as fulls:
        swap = lambda x: fulls[id(x)] if isinstance(x, ShardedParam) else x  # noqa: E731
        try:
            out = func(*_map_args(swap, args), **_map_kwargs(swap, kwargs))
        except Exception as exc:  # the op's own error, with the op and the parameters it ran on
            exc.add_note(f"shardtensor: raised by {func} on the gathered ShardedParams "
                         f"{[p._name or tuple(p.shape) for p in params]}")
            cast = next((p for p in params if fulls[id(p)].dtype != p.dtype), None) if _about_dtypes(exc) else None
            if cast is not None:  # param_dtype: the gathered weight is not what ``weight.dtype`` says
                exc.add_note(f"{cast._name!r} is gathered in {fulls[id(cast)].dtype} (shard_module's param_dtype) "
                             f"while its .dtype reads {cast.dtype}, so code that casts its input to weight.dtype "
                             "casts to the wrong one. Fix: torch.autocast instead of param_dtype for such a model.")
            raise
        return _unalias(out, fulls)


def _about_dtypes(exc: Exception) -> bool:
    """Whether torch's error is a dtype mismatch (helper I: the param_dtype note was added to every error of a
    gathered op, an index out of range or a shape mismatch included)."""
    text = str(exc)
    return "dtype" in text or "scalar type" in text or "should be the same" in text


def compute_with(p: ShardedParam, fn):
    """``fn(full tensor of p)`` with ``p`` gathered (scheduled by its Gatherer) only for the call."""
    with _Gathered([p]) as fulls:
        return fn(fulls[id(p)])


def _backward_temporaries(written: list[ShardedParam]) -> bool:
    """Whether every written ShardedParam is a temporary of a backward formula (``linalg.vector_norm``'s backward
    ``masked_fill_``s ``self * grad / norm``): written while autograd runs a backward, and neither a parameter
    nor a view of one (those carry the module's gatherer).  Such writes may run on gathered copies."""
    return torch._C._current_graph_task_id() != -1 and all(
        p._gatherer is None and not isinstance(p, torch.nn.Parameter) for p in written)


def _write_back(func, args, kwargs, written: list[ShardedParam]):
    """Run an in-place op on gathered copies of the written temporaries, then keep this rank's rows of each."""
    bases: dict[int, torch.Tensor] = {}  # id(_local) -> gathered base (views of one temporary share it)
    fulls: dict[int, torch.Tensor] = {}
    for p in written:
        if id(p._local) not in bases:
            bases[id(p._local)] = gather_base(p).clone()
        fulls[id(p)] = apply_views(bases[id(p._local)], p._views)
    others = [p for p in _params_in(args, kwargs) if id(p) not in fulls]
    with _Gathered(others) as gathered:
        fulls.update(gathered)
        swap = lambda x: fulls[id(x)] if isinstance(x, ShardedParam) else x  # noqa: E731
        func(*_map_args(swap, args), **_map_kwargs(swap, kwargs))
    for p in written:
        p._layout.copy_own_rows(p._local, bases[id(p._local)])
    return kwargs["out"] if "out" in kwargs else args[0]


def _unalias(out, fulls: dict[int, torch.Tensor]):
    """An op that returned an alias of a gathered buffer would keep it alive: hand out a copy instead."""
    ptrs = {t.untyped_storage().data_ptr() for t in fulls.values()}
    if not ptrs:
        return out

    def fix(t):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel() \
                and t.untyped_storage().data_ptr() in ptrs:  # sparse outputs have no storage (and are copies)
            return t.clone()
        return t

    return _map_out(fix, out)
