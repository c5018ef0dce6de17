"""Class 3 of the op table: whole-tensor reductions as a local reduction plus one all-reduce.

``sum``/``mean``/``max``/``min``/``all``/``any`` and vector norms of a whole ShardedParam (no ``dim``) reduce the
valid rows of the shard (``_valid``: padding rows stay out) and combine the per-rank partials with one
all-reduce (``_reduce_partials``); the result is a plain tensor that every rank holds.  With a ``dim`` (or a
non-bijective view) the op gathers instead (``compute``).
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import _comm
from .._full import gather_full
from ..tensor import ShardedParam
from ._common import _chain_is_bijective, _mark_written, _params_in, aten, implements
from .compute import compute
from .refusals import _refuse


_NARROW = (torch.float16, torch.bfloat16)  # reduced in float32, as torch's own CPU kernels accumulate
_REAL = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a norm of a ``dtype`` tensor (torch's: real)."""
    return _REAL.get(dtype, dtype)


def _valid(p: ShardedParam) -> torch.Tensor:
    """This rank's rows of ``p``, to reduce with the other ranks' (a shard saved by another rank or in another
    world is refused, as its gather is: its sum was its saver's rows' sum, silently; helper J)."""
    p._layout.check_live(p._local, "reduce")
    return p._local[: p._layout.valid_rows]


def _raise_as_torch_would(func, self: ShardedParam, args, kwargs) -> None:
    """torch's own error, on every rank, for a dtype the op refuses (``mean`` or a norm of an integer tensor): the
    op run on one element of ``self``'s dtype.  The partials went ahead: an integer mean came back a float, and
    an integer norm's partial on a rank with no rows (float32) met the others' (int64): a DivergenceError."""
    if not (self.dtype.is_floating_point or self.dtype.is_complex):
        func(torch.zeros(1, dtype=self.dtype), *args[1:], **kwargs)


def _whole_tensor_operand(func, args, kwargs, dim_arg=None) -> bool:
    self = args[0]
    if not isinstance(self, ShardedParam) or not _chain_is_bijective(self._views):
        return False
    if _params_in(args[1:], kwargs):
        return False
    if dim_arg is not None:
        dim = args[dim_arg] if len(args) > dim_arg else kwargs.get("dim")
        if dim not in (None, [], ()):
            return False
    return True


def _reduction_label(func, tensors: list) -> str:
    """Names the op and its tensors in the identity check: without it ``w.norm()`` on one rank (a debugging
    print under ``if rank == 0``) and ``w.sum()`` on every rank were the same one-element all-reduce, and the
    ranks added each other's partials silently."""
    names = [t._name or str(tuple(t.shape)) for t in tensors]
    return f"{func.overloadpacket.__name__} of {', '.join(repr(n) for n in names)}"


def _reduce_partials(partials: torch.Tensor, groups: list, op: str, label: str) -> torch.Tensor:
    """All-reduce ``partials[k]`` over the ranks of ``groups[k]`` (one collective per distinct process group:
    models sharded over several groups), in place; returns ``partials``.  The one cross-rank step of every rule
    in this module; ``label`` (``_reduction_label``) names it."""
    by_group: dict = {}
    for k, group in enumerate(groups):
        by_group.setdefault(id(group), (group, []))[1].append(k)
    for group, members in by_group.values():
        if len(by_group) == 1:
            _all_reduce_keep_nan(partials, group, op, label)
        else:
            part = partials[members].clone()
            _all_reduce_keep_nan(part, group, op, label)
            partials[members] = part
    return partials


def _all_reduce_keep_nan(partial: torch.Tensor, group, op: str, label: str) -> None:
    """All-reduce in place; a NaN on any rank stays NaN under max/min (gloo's and NCCL's max/min drop it, so
    ``max()`` or an inf-norm would hide a NaN gradient on another rank).  One collective: the NaN flags ride
    along, negated for min."""
    if op not in ("max", "min") or not partial.is_floating_point():
        _comm.all_reduce(partial, group, op=op, label=label)
        return
    flags = partial.isnan().to(partial.dtype)
    both = torch.cat([partial.reshape(-1), flags.reshape(-1) if op == "max" else -flags.reshape(-1)])
    _comm.all_reduce(both, group, op=op, label=label)
    n = partial.numel()
    partial.copy_(both[:n].reshape(partial.shape).masked_fill(both[n:].reshape(partial.shape) != 0, float("nan")))


def _p_norm_partial(x: torch.Tensor, ord: float) -> torch.Tensor:
    """The all-reducible part of a p-norm: sum |x|^p, or max/min |x| for +-inf, count for 0."""
    if x.is_complex():  # the norm of a complex tensor is real (ord 0 counted in complex; an empty rank's
        x = x.abs()  # partial was float32 beside the others' complex64: another collective, a DivergenceError)
    if x.dtype in _NARROW:  # float32 partials, as torch accumulates: float16's overflowed (norm of 300s: inf)
        x = x.float()
    if x.numel() == 0:
        return torch.tensor(float("-inf") if ord == float("inf") else float("inf") if ord == float("-inf") else 0.0,
                            dtype=torch.float32 if not x.is_floating_point() else x.dtype, device=x.device)
    if ord == float("inf"):
        return x.abs().amax()
    if ord == float("-inf"):
        return x.abs().amin()
    if ord == 0:
        return (x != 0).sum().to(x.dtype)
    if ord == 2:
        return torch.linalg.vector_norm(x, 2).square()
    return x.abs().pow(ord).sum()


def _p_norm_finish(total: torch.Tensor, ord: float) -> torch.Tensor:
    if ord in (float("inf"), float("-inf"), 0):
        return total
    if ord == 2:
        return total.sqrt()
    return total.pow(1.0 / ord)


def _norm_reduce_op(ord: float) -> str:
    return "max" if ord == float("inf") else "min" if ord == float("-inf") else "sum"


@implements(aten.linalg_vector_norm.default)
def _vector_norm(func, args, kwargs):
    # clip_grad_norm_(foreach=False) and loss scalers.
    if not _whole_tensor_operand(func, args, kwargs, dim_arg=2) or kwargs.get("keepdim") or (len(args) > 3 and args[3]):
        return compute(func, args, kwargs)
    self = args[0]
    ord = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dtype = kwargs.get("dtype")
    _raise_as_torch_would(func, self, args, kwargs)
    if self.numel() == 0 and ord in (float("inf"), float("-inf")):
        return compute(func, args, kwargs)  # torch's own error: the inf-norm of an empty tensor has no identity
    x = _valid(self) if dtype is None else _valid(self).to(dtype)
    partial = _p_norm_partial(x, ord).reshape(1).clone()
    total = _reduce_partials(partial, [self._layout.group], _norm_reduce_op(ord), _reduction_label(func, [self]))[0]
    return _p_norm_finish(total, ord).to(_norm_dtype(x.dtype))


def _foreach_norm_partial(x: torch.Tensor, args, kwargs) -> torch.Tensor:
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    return _p_norm_partial(x if dtype is None else x.to(dtype), _ord_of(args, kwargs))


def _foreach_powsum_partial(x: torch.Tensor, args, kwargs) -> torch.Tensor:
    return torch._foreach_powsum([x], *args[1:], **kwargs)[0]  # torch's own arithmetic on this rank's rows


def _foreach_max_partial(x: torch.Tensor, args, kwargs) -> torch.Tensor:
    return _max_local(x)


def _ord_of(args, kwargs) -> float:
    return float(args[1] if len(args) > 1 else kwargs.get("ord", 2))


# op, partial, finish: the reduction across ranks of one value per tensor (the partials are float64)
_FOREACH_REDUCTIONS = {
    "_foreach_norm": (lambda a, k: _norm_reduce_op(_ord_of(a, k)), _foreach_norm_partial,
                      lambda total, a, k: _p_norm_finish(total, _ord_of(a, k))),
    "_foreach_powsum": (lambda a, k: "sum", _foreach_powsum_partial, lambda total, a, k: total),
    "_foreach_max": (lambda a, k: "max", _foreach_max_partial, lambda total, a, k: total),
}


@implements([aten._foreach_norm.Scalar, aten._foreach_powsum.Scalar, aten._foreach_max.default])
def _foreach_reduction(func, args, kwargs):
    """One value per tensor of the list, each over the whole tensor (``clip_grad_norm_``'s default path is
    ``_foreach_norm``): one all-reduce for the whole list, not one per tensor."""
    op_of, partial_of, finish = _FOREACH_REDUCTIONS[func.overloadpacket.__name__]
    tensors, rest = args[0], args[1:]
    dtype = kwargs.get("dtype", args[2] if len(args) > 2 else None)
    out: list = [None] * len(tensors)
    sharded = [(i, t) for i, t in enumerate(tensors) if isinstance(t, ShardedParam)]
    plain = [(i, t) for i, t in enumerate(tensors) if not isinstance(t, ShardedParam)]
    if plain:
        for (i, _), value in zip(plain, func([t for _, t in plain], *rest, **kwargs)):
            out[i] = value
    if not sharded:
        return out
    no_identity = func is aten._foreach_max.default or abs(_ord_of(args, kwargs)) == float("inf") \
        and func is aten._foreach_norm.Scalar  # an empty tensor's max or inf-norm: torch's own error
    if not all(_chain_is_bijective(t._views) for _, t in sharded) \
            or no_identity and any(t.numel() == 0 for _, t in sharded):
        for i, t in sharded:  # a view that is not one element per element (or an empty tensor without identity)
            out[i] = func([gather_full(t)], *rest, **kwargs)[0]
        return out
    # float64 for the cross-rank reduction: float32 partials would round a float64 model's norm (and cost the
    # float32 ones nothing measurable: one value per tensor)
    partials = torch.stack([partial_of(_valid(t), args, kwargs).double().reshape(()) for _, t in sharded])
    _reduce_partials(partials, [t._layout.group for _, t in sharded], op_of(args, kwargs),
                     _reduction_label(func, [t for _, t in sharded]))
    finished = finish(partials, args, kwargs)
    for k, (i, t) in enumerate(sharded):
        out[i] = finished[k].to(_norm_dtype(dtype or t.dtype))
    return out


@implements([aten._foreach_norm.Scalar_out, aten._foreach_powsum.Scalar_out, aten._foreach_max.out])
def _foreach_reduction_out(func, args, kwargs):
    """The ``out=`` forms: the reduction above, copied into ``out`` (plain tensors: a shard cannot hold a
    whole-tensor value)."""
    kwargs = dict(kwargs)
    outs = kwargs.pop("out")
    if any(isinstance(o, ShardedParam) for o in outs):
        _refuse(func, args, {**kwargs, "out": outs}, "out= holds a sharded tensor")
    functional = getattr(aten, func.overloadpacket.__name__)
    values = _foreach_reduction(functional.default if func is aten._foreach_max.out else functional.Scalar,
                                args, kwargs)
    for o, v in zip(outs, values):
        o.copy_(v)


_NO_DIM_ARG = (aten.sum.default, aten.mean.default, aten.max.default, aten.min.default, aten.all.default,
               aten.any.default)


def _simple_reduction(op: str, local_fn: Callable, finish: Callable | None = None):
    """A rule for a whole-tensor reduction: ``local_fn`` on the valid rows, ``op`` across ranks, ``finish``."""

    def rule(func, args, kwargs):
        dim_arg = 1 if func not in _NO_DIM_ARG else None
        if not _whole_tensor_operand(func, args, kwargs, dim_arg=dim_arg) or kwargs.get("keepdim") \
                or (dim_arg is not None and len(args) > 2 and args[2]):
            return compute(func, args, kwargs)
        self = args[0]
        if func in (aten.mean.default, aten.mean.dim):
            _raise_as_torch_would(func, self, args, kwargs)
        if self.numel() == 0 and op in ("max", "min") and func not in (aten.all.default, aten.any.default):
            return compute(func, args, kwargs)  # torch's own error: max() of an empty tensor has no identity
        partial = local_fn(_valid(self), func, args, kwargs).reshape(1).clone()
        result = _reduce_partials(partial, [self._layout.group], op, _reduction_label(func, [self]))[0]
        return finish(result, self) if finish else result

    return rule


def _sum_local(x, func, args, kwargs):
    """Half types sum in float32, the result cast back at the end, as torch's own sum accumulates: each rank's
    partial kept in float16 overflowed (``mean()`` of 40000s was inf) and rounded twice."""
    dtype = kwargs.get("dtype")
    return x.sum(dtype=torch.float32 if dtype is None and x.dtype in _NARROW else dtype)


def _sum_finish(total: torch.Tensor, p: ShardedParam, func=None, kwargs=None) -> torch.Tensor:
    return total.to(p.dtype) if p.dtype in _NARROW and total.dtype != p.dtype else total


def _identity(dtype: torch.dtype, op: str):
    """What a rank with no rows contributes to a max or min: -inf/+inf for floats, the integer type's bounds, and
    False/True for bool (-inf cast to an integer raised on that rank alone, while the others waited in the
    all-reduce: a hang; cast to bool it was True, so ``(w > 100).max()`` said True on every rank)."""
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point:
        return float("-inf") if op == "max" else float("inf")
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


def _identity_or(x, reducer, op: str):
    return reducer(x) if x.numel() else torch.tensor(_identity(x.dtype, op), dtype=x.dtype, device=x.device)


def _max_local(x, *_):
    return _identity_or(x, torch.amax, "max")


def _min_local(x, *_):
    return _identity_or(x, torch.amin, "min")


implements([aten.sum.default, aten.sum.dim_IntList])(_simple_reduction("sum", _sum_local, _sum_finish))
implements([aten.mean.default, aten.mean.dim])(_simple_reduction("sum", _sum_local,
                                                                 lambda total, p: _sum_finish(total / p.numel(), p)))
implements([aten.max.default, aten.amax.default])(_simple_reduction("max", _max_local))
implements([aten.min.default, aten.amin.default])(_simple_reduction("min", _min_local))
def _flag_finish(total: torch.Tensor, p: ShardedParam) -> torch.Tensor:
    return total if p.dtype == torch.uint8 else total.bool()  # torch's all()/any() of uint8 is uint8


implements(aten.all.default)(_simple_reduction("min", lambda x, *_: x.all().to(torch.uint8), _flag_finish))
implements(aten.any.default)(_simple_reduction("max", lambda x, *_: x.any().to(torch.uint8), _flag_finish))


@implements(aten.equal.default)
def _equal(func, args, kwargs):
    """``torch.equal`` of two shards of one layout: this rank's rows, then every rank's verdict (torch tags it
    pointwise, so it ran on the shards alone and each rank answered for its own rows)."""
    a, b = args[0], args[1]
    if not (isinstance(a, ShardedParam) and isinstance(b, ShardedParam) and a._layout == b._layout
            and a._views == b._views and _chain_is_bijective(a._views) and a.shape == b.shape):
        return compute(func, args, kwargs)
    same = torch.tensor([1 if torch.equal(_valid(a), _valid(b)) else 0], dtype=torch.uint8)
    return bool(_reduce_partials(same, [a._layout.group], "min", _reduction_label(func, [a, b]))[0])


@implements(aten._amp_foreach_non_finite_check_and_unscale_.default)
def _amp_unscale(func, args, kwargs):
    """``GradScaler.unscale_`` (and its step): each gradient shard is unscaled in place and checked for inf/NaN on
    this rank; ``found_inf`` is then all-reduced (max) over the shards' groups, so every rank skips the step
    together when any rank's rows overflowed (a rank that skipped alone would drift from the others silently)."""
    grads, found_inf, inv_scale = (*args, *(kwargs[k] for k in ("found_inf", "inv_scale") if k in kwargs))
    if any(isinstance(g, ShardedParam) and g._views for g in grads):
        _refuse(func, args, kwargs, "a gradient is a view of a shard")
    func([g._local if isinstance(g, ShardedParam) else g for g in grads], found_inf, inv_scale)
    _mark_written([g for g in grads if isinstance(g, ShardedParam)])
    groups = list({id(g._layout.group): g._layout.group for g in grads if isinstance(g, ShardedParam)}.values())
    if groups:
        partials = _reduce_partials(found_inf.reshape(1).repeat(len(groups)), groups, "max",
                                    _reduction_label(func, [g for g in grads if isinstance(g, ShardedParam)]))
        found_inf.copy_(partials.max().reshape(found_inf.shape))
