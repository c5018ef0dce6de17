"""The registry and the argument helpers every rule of the op table uses.

``implements`` registers a rule for ops (an ``OpOverload``, a packet for all its overloads) or for a family of
ops (an ``OpFamily``: every op carrying a ``torch.Tag``, or another declared membership).  The lookup tries the
overload, then its packet, then the families in the order they were declared, then falls back to ``compute``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from .._layout import ShardLayout
from .._errors import ShardedOpError  # noqa: F401  (re-exported: shardtensor.ShardedOpError)
from ..tensor import ShardedParam

aten = torch.ops.aten

Rule = Callable[[Any, tuple, dict], Any]  # rule(func, args, kwargs) -> result


class OpFamily(NamedTuple):
    """A declared set of ops given by a membership test (a tag, a name prefix torch uses for a kernel family)."""

    name: str
    contains: Callable[[Any], bool]  # OpOverload -> bool


TABLE: dict[Any, Rule] = {}  # OpOverload or OpOverloadPacket -> rule
FAMILIES: list[tuple[OpFamily, Rule]] = []  # tried in declaration order after TABLE


def implements(*targets):
    """Register ``rule(func, args, kwargs)`` for each target: an op, a packet, a list of them, or an OpFamily."""

    def decorator(rule: Rule) -> Rule:
        for target in targets:
            if isinstance(target, OpFamily):
                FAMILIES.append((target, rule))
            elif isinstance(target, (list, tuple, set, frozenset)):
                for op in target:
                    TABLE[op] = rule
            else:
                TABLE[target] = rule
        return rule

    return decorator


# ====================================================================== argument scans
# Aten op arguments nest at most one level (``Tensor[]``), so these scans replace pytree on the hot path.
def _params_in(args, kwargs=None) -> list[ShardedParam]:
    found = []
    for group in (args, kwargs.values() if kwargs else ()):
        for x in group:
            if isinstance(x, ShardedParam):
                found.append(x)
            elif isinstance(x, (list, tuple)):
                found.extend(t for t in x if isinstance(t, ShardedParam))
    return found


def _map_args(fn, args: tuple) -> tuple:
    return tuple([fn(t) for t in x] if isinstance(x, (list, tuple)) else fn(x) for x in args)


def _map_kwargs(fn, kwargs: dict) -> dict:
    return {k: ([fn(t) for t in x] if isinstance(x, (list, tuple)) else fn(x)) for k, x in kwargs.items()} if kwargs else kwargs


def _map_out(fn, out):
    if isinstance(out, (list, tuple)):
        return type(out)(fn(x) for x in out)
    return fn(out)


def _leaves(args, kwargs):
    for group in (args, kwargs.values()):
        for x in group:
            if isinstance(x, (list, tuple)):
                yield from x
            else:
                yield x


_WRITTEN_BY_ID: dict[int, tuple] = {}  # id(OpOverload) -> written args; OpOverloads live as long as the process


def _written_args(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments ``func`` writes into (in-place self, out=...)."""
    written = _WRITTEN_BY_ID.get(id(func))
    if written is None:
        written = _WRITTEN_BY_ID[id(func)] = tuple(
            (i, a.name) for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
    return written


def _written_params(func, args, kwargs) -> list[ShardedParam]:
    written = []
    for position, name in _written_args(func):
        value = args[position] if position < len(args) else kwargs.get(name)
        written += _params_in((value,))
    return written


def _written_shards_and_plain(func, args, kwargs) -> tuple[list[ShardedParam], list[torch.Tensor]]:
    """``_written_params`` and, in the same pass, the plain tensors ``func`` writes into beside the shards (a
    replicated 0-d parameter's gradient in ``clip_grad_norm_``'s ``_foreach_mul_`` list): written below
    autograd's version bump, like the shards.  One pass: the foreach path runs every optimizer step."""
    shards, plain = [], []
    for position, name in _written_args(func):
        value = args[position] if position < len(args) else kwargs.get(name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, ShardedParam):
                shards.append(t)
            elif type(t) in (torch.Tensor, torch.nn.Parameter):
                plain.append(t)
    return shards, plain


def _mark_written(params, plain: Sequence[torch.Tensor] = ()) -> None:
    """Bump the version counter of each written shard's local tensor (and of each written ``plain`` tensor).

    [Note: writes through the wrapper are versioned on the shard]
    Inside ``__torch_dispatch__`` an in-place op on ``_local`` runs below autograd's ADInplaceOrView layer, so it
    does not bump ``_local``'s version counter; the wrapper's own counter moves for ``p.mul_(c)`` but not for the
    ``_foreach_*`` ops (``clip_grad_norm_``'s ``_foreach_mul_``).  Code that asks whether a shard changed since it
    last looked (CPUAdam's speculation: was the gradient clipped after it was snapshotted?) reads ``_local``'s
    counter, so every write through the wrapper bumps it here.
    """
    locals_ = [p._local for p in params if type(p._local) is torch.Tensor]  # not fake shards under torch.compile
    locals_ += plain
    if locals_:
        torch._C._increment_version(locals_)  # a list: one call (inference tensors, with no counter, are skipped)


# ====================================================================== placement tests
_BIJECTIVE_VIEWS = frozenset({
    aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default, aten._unsafe_view.default,
    aten._reshape_alias.default, aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.reshape.default, aten.view_as_real.default,
})


def _chain_is_bijective(views: tuple) -> bool:
    """Whether every element of the view is one element of the base (so shard-wise ops stay element-wise)."""
    return all(step.func in _BIJECTIVE_VIEWS for step in views)


def _same_placement(a: ShardedParam, b: ShardedParam) -> bool:
    return a._layout == b._layout and a._views == b._views


def _localizable(params: list[ShardedParam]) -> bool:
    first = params[0]
    return _chain_is_bijective(first._views) and all(_same_placement(first, p) for p in params[1:])


def _to_local(x):
    return x._local if isinstance(x, ShardedParam) else x


def _wrap_like(template: ShardedParam, out):
    """Outputs of a shard-wise op that have the shard's shape become ShardedParams of the template's placement."""
    if type(out) is torch.Tensor and out.shape == template._local.shape:  # the common case, without the scans
        return template._derived(out)

    def wrap(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, ShardedParam) and t.shape[:1] == template._local.shape[:1] \
                and t.shape[1:] == template._layout.shape[1:]:
            return template._derived(t)
        return t

    return _map_out(wrap, out)


def _rows_of(target) -> Optional[torch.Tensor]:
    """This rank's rows of ``target``: its shard's valid rows, through ``target``'s views where they all keep dim 0
    whole (``w[:, 2]``, ``w[:, 1:3]``); None for anything else (a view of some rows, a reshape, layer-wise)."""
    if not isinstance(target, ShardedParam) or type(target._layout) is not ShardLayout:
        return None
    local, dims = target._local[: target._layout.valid_rows], len(target._layout.shape)
    for step in target._views:
        dim = step.args[0] if step.args else None
        if step.func not in (aten.select.int, aten.slice.Tensor) or step.kwargs or step.index is not None or \
                dim is None or dim % dims == 0:
            return None
        local, dims = step.apply(local), dims - (step.func is aten.select.int)
    return local


def _broadcast_source(src: torch.Tensor, dst, where: str = "") -> torch.Tensor:
    """``src`` expanded to ``dst``'s shape, as torch's ``copy_`` broadcasts it (a row into every row, a 0-d value
    everywhere), or a ValueError naming both shapes."""
    if src.shape == dst.shape:
        return src
    try:
        if torch.broadcast_shapes(src.shape, dst.shape) == dst.shape:
            return src.expand(dst.shape)
    except RuntimeError:
        pass
    raise ValueError(f"copy_ into {where}ShardedParam {dst._name!r}: source shape {tuple(src.shape)} does not "
                     f"broadcast to {tuple(dst.shape)}")
