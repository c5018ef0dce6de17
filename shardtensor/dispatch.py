"""The op table: what each aten op does when it meets a ``ShardedParam`` (DESIGN.md section 3).

Five classes of rule, tried in this order:
  1. views      -> a ShardedParam over the same shard that records the view (no gather; see tensor.py notes)
  2. local      -> pointwise / foreach / fused-optimizer ops on shards of one layout run on ``_local``s
  3. reductions -> whole-tensor sum / norm / max...: local reduction + one all-reduce, a plain replicated result
  4. compute    -> everything else: gather the full tensors, run, release; outputs are plain tensors
  5. refuse     -> an op that would write into a ShardedParam but cannot run on shards raises, naming the op

[Note: when is a plain 0-d tensor safe in a local op]
A ShardedParam stands for one tensor that every rank agrees on.  ``W * s`` run shard-wise is right only if
``s`` is the same on every rank.  Optimizers (step tensors, lr tensors, ``clip_grad_norm_``'s coefficient from
an all-reduced norm) use such replicated scalars under ``no_grad``; forward code may multiply by a per-rank,
data-dependent scalar.  So plain 0-d tensors join local ops only when grad mode is off or the op writes into a
ShardedParam (only legal under ``no_grad`` for leaves); otherwise the op gathers, which is always right.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import _comm, _compile
from .tensor import ShardedParam, ViewStep, _view_geometry, apply_views

aten = torch.ops.aten

_TABLE: dict[Any, Callable] = {}


class ShardedOpError(RuntimeError):
    """An op cannot run on a ShardedParam without silently losing or corrupting data."""


def implements(ops):
    """Register ``rule(func, args, kwargs)`` for each op (an OpOverload, or a packet for all its overloads)."""
    ops = ops if isinstance(ops, (list, tuple)) else [ops]

    def decorator(rule):
        for op in ops:
            _TABLE[op] = rule
        return rule

    return decorator


def dispatch_op(func, args: tuple, kwargs: dict):
    """Run ``func`` by its rule.  The hot path (a pointwise op on shards: every optimizer step runs hundreds) is
    tried first, with as little Python as possible; everything else starts with the torch.compile check."""
    entry = _RULE_BY_ID.get(id(func))  # keyed by id: OpOverload.__hash__ is a Python method
    if entry is None:
        entry = _RULE_BY_ID[id(func)] = (_rule_for(func), _written_args(func))
    rule, written = entry
    if rule is _local_or_compute:
        out = _local_fast(func, args, kwargs, written)
        if out is not _NO_FAST_PATH:
            return out
    _compile.break_graph_if_traced(func, args)  # torch.compile: see [Note: torch.compile] in _compile.py
    return rule(func, args, kwargs)


_RULE_BY_ID: dict[int, tuple] = {}  # id(OpOverload) -> (rule, written args); OpOverloads live as long as the process


def _rule_for(func) -> Callable:
    """The rule of ``func``: its table entry, else by family (foreach / fused optimizer / pointwise), else compute."""
    rule = _TABLE.get(func) or _TABLE.get(func.overloadpacket)
    if rule is not None:
        return rule
    name = func.overloadpacket.__name__
    if name.startswith("_foreach_") or name in _FUSED_OPTIMIZER_OPS:
        return _foreach_local
    if torch.Tag.pointwise in func.tags or func in _EXTRA_LOCAL_OPS:
        return _local_or_compute
    return compute


# ====================================================================== helpers
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


def _written_args(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments ``func`` writes into (in-place self, out=...)."""
    written = _WRITTEN_BY_ID.get(id(func))
    if written is None:
        written = _WRITTEN_BY_ID[id(func)] = tuple(
            (i, a.name) for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
    return written


_WRITTEN_BY_ID: dict[int, tuple] = {}


def _written_params(func, args, kwargs) -> list[ShardedParam]:
    written = []
    for position, name in _written_args(func):
        value = args[position] if position < len(args) else kwargs.get(name)
        written += _params_in((value,))
    return written


def _describe(func, args, kwargs) -> str:
    kinds = [type(x).__name__ + (f"{tuple(x.shape)}" if isinstance(x, torch.Tensor) else "")
             for x in _leaves(args, kwargs) if isinstance(x, torch.Tensor)]
    return f"{func} with tensor arguments {kinds}"


def _refuse(func, args, kwargs, why: str):
    names = ", ".join(repr(p._name or tuple(p.shape)) for p in _written_params(func, args, kwargs))
    raise ShardedOpError(
        f"{func} would write into ShardedParam {names} but {why}. Running it on a gathered temporary would drop "
        f"the update silently. Fix: use the out-of-place form on the full tensor, update each rank's shard "
        f"through `.to_local()`, or `shardtensor.unshard_module(model)` first. ({_describe(func, args, kwargs)})"
    )


_BIJECTIVE_VIEWS = {
    aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default, aten._unsafe_view.default,
    aten._reshape_alias.default, aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.reshape.default, aten.view_as_real.default,
}


def _chain_is_bijective(views: tuple) -> bool:
    return all(step.func in _BIJECTIVE_VIEWS for step in views)


def _same_placement(a: ShardedParam, b: ShardedParam) -> bool:
    return a._layout == b._layout and a._views == b._views


def _localizable(params: list[ShardedParam]) -> bool:
    first = params[0]
    return _chain_is_bijective(first._views) and all(_same_placement(first, p) for p in params[1:])


def _plain_tensors_ok(leaves, allow_scalar_tensors: bool) -> bool:
    for x in leaves:
        if isinstance(x, torch.Tensor) and not isinstance(x, ShardedParam):
            if x.dim() != 0 or not allow_scalar_tensors:
                return False
    return True


def _to_local(x):
    return x._local if isinstance(x, ShardedParam) else x


def _wrap_like(template: ShardedParam, out):
    if type(out) is torch.Tensor and out.shape == template._local.shape:  # the common case, without the scans
        return ShardedParam(out, template._layout, template._views, None, template._name)

    def wrap(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, ShardedParam) and t.shape[:1] == template._local.shape[:1] \
                and t.shape[1:] == template._layout.shape[1:]:
            return ShardedParam(t, template._layout, template._views, None, template._name)
        return t

    return _map_out(wrap, out)


# ====================================================================== 1. views
@implements([aten.detach.default, aten.alias.default, aten.lift_fresh.default])
def _identity_view(func, args, kwargs):
    # detach: nn.Parameter(...), AccumulateGrad and optimizers call it; it must not gather.
    self = args[0]
    return ShardedParam(self._local, self._layout, self._views, self._gatherer, self._name)


def _freeze(x):
    return tuple(_freeze(v) for v in x) if isinstance(x, list) else x


@implements(sorted(_BIJECTIVE_VIEWS - {aten.view_as_real.default}, key=str) + [
    aten.expand.default, aten.slice.Tensor, aten.select.int, aten.as_strided.default, aten.diagonal.default,
    aten.unfold.default,
])
def _view(func, args, kwargs):
    """Record the view; ``F.linear``'s ``t(weight)`` lands here, and so does autograd's saved copy of it."""
    self = args[0]
    if not isinstance(self, ShardedParam) or _params_in(args[1:], kwargs):
        return compute(func, args, kwargs)
    step = ViewStep(func, _freeze(list(args[1:])), tuple(sorted(kwargs.items())), None)
    if not _replayable(self._layout.shape, self._views + (step,)):
        return _view_as_copy(func, args, kwargs)
    return ShardedParam(self._local, self._layout, self._views + (step,), self._gatherer, self._name)


def _replayable(shape: torch.Size, views: tuple) -> bool:
    """Whether the chain is a view of a contiguous base (a reshape of a permuted parameter is not)."""
    try:
        _view_geometry(shape, views)
    except RuntimeError:
        return False
    return True


# Reshapes that torch turns into a copy when the input cannot be viewed (reshape -> clone + _unsafe_view).
_RESHAPE_FAMILY = {aten.view.default, aten._unsafe_view.default, aten._reshape_alias.default, aten.reshape.default}


def _view_as_copy(func, args, kwargs):
    """A view step that no strides express (einsum's reshape of a permuted 3-d weight, ``__rmatmul__``,
    tensordot): gather, reshape a contiguous copy, hand out a plain tensor, as torch's ``reshape`` copies."""
    self = args[0]
    with _Gathered([self]) as fulls:
        full = fulls[id(self)]
        out = aten.reshape.default(full.contiguous(), args[1]) if func in _RESHAPE_FAMILY else func(full, *args[1:], **kwargs)
        return _unalias(out, fulls)


@implements([aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default])
def _multi_view(func, args, kwargs):
    """Multi-output views (``nn.MultiheadAttention`` splits its packed in_proj weight): one view per output."""
    self = args[0]
    meta = func(torch.empty(self.shape, device="meta"), *args[1:], **kwargs)
    frozen_args, frozen_kwargs = _freeze(list(args[1:])), tuple(sorted(kwargs.items()))
    return [
        ShardedParam(self._local, self._layout, self._views + (ViewStep(func, frozen_args, frozen_kwargs, i),),
                     self._gatherer, self._name)
        for i in range(len(meta))
    ]


# ====================================================================== 2. local
_EXTRA_LOCAL_OPS = {
    aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zeros_like.default, aten.ones_like.default,
    aten.empty_like.default, aten.full_like.default, aten._to_copy.default, aten.clone.default,
}


def _local_or_compute(func, args, kwargs):
    params = _params_in(args, kwargs)
    written = _written_params(func, args, kwargs)
    allow_scalars = bool(written) or not torch.is_grad_enabled()
    if _localizable(params) and _plain_tensors_ok(_leaves(args, kwargs), allow_scalars):
        out = func(*_map_args(_to_local, args), **_map_kwargs(_to_local, kwargs))
        if written:
            return kwargs["out"] if "out" in kwargs else args[0]
        return _wrap_like(params[0], out)
    if written and not _backward_temporaries(written):
        _refuse(func, args, kwargs, "its operands are not shards of one layout (or include a full plain tensor)")
    return compute(func, args, kwargs)


_NO_FAST_PATH = object()


def _local_fast(func, args, kwargs, written):
    """The common shape of an optimizer's pointwise op (``exp_avg.lerp_(grad, 0.1)``): positional shards of
    one placement with plain local tensors, and Python scalars, no tensor keywords.  One pass instead of the
    general scans; anything else (plain tensors, lists, ``out=``, fake shards under torch.compile) returns
    ``_NO_FAST_PATH`` for the general rule."""
    first = None
    locals_ = []
    for x in args:
        kind = type(x)
        if kind is ShardedParam:
            local = x._local
            if type(local) is not torch.Tensor:  # FakeTensor while Dynamo traces, or another subclass
                return _NO_FAST_PATH
            if first is None:
                if x._views and not _chain_is_bijective(x._views):
                    return _NO_FAST_PATH
                first = x
            elif not (x._layout is first._layout or x._layout == first._layout) or x._views != first._views:
                return _NO_FAST_PATH
            locals_.append(local)
        elif kind is float or kind is int or kind is bool or x is None:
            locals_.append(x)
        elif isinstance(x, (torch.Tensor, list, tuple)):
            return _NO_FAST_PATH
        else:
            locals_.append(x)
    if first is None:
        return _NO_FAST_PATH
    if kwargs:
        for value in kwargs.values():
            if isinstance(value, (torch.Tensor, list, tuple)):
                return _NO_FAST_PATH
    if written and (written != ((0, "self"),) or args[0] is not first):
        return _NO_FAST_PATH
    out = func(*locals_, **kwargs)
    return args[0] if written else _wrap_like(first, out)


@implements(aten.copy_.default)
def _copy(func, args, kwargs):
    """``load_state_dict`` copies a full tensor into each parameter: every rank keeps its own rows."""
    dst, src = args[0], args[1]
    if not isinstance(dst, ShardedParam):
        return compute(func, args, kwargs)  # plain.copy_(sharded): gather the source
    if dst._views:
        if _backward_temporaries([dst]):  # householder_product's / ormqr's backward fill a temporary's columns
            return _write_back(func, args, kwargs, [dst])
        _refuse(func, args, kwargs, "the destination is a view of a shard")
    if isinstance(src, ShardedParam):
        if src._layout == dst._layout and not src._views:
            dst._local.copy_(src._local)
            return dst
        src = _gather_for_user(src)
    if src.dim() == 0 or src.shape != dst.shape:
        src = src.expand(dst.shape) if src.dim() == 0 else src
        if src.shape != dst.shape:
            raise ValueError(f"copy_ into ShardedParam {dst._name!r}: source shape {tuple(src.shape)} "
                             f"!= parameter shape {tuple(dst.shape)}")
    layout = dst._layout
    with torch.no_grad():
        if layout.valid_rows:
            dst._local[: layout.valid_rows].copy_(src[layout.row_start : layout.row_start + layout.valid_rows])
    return dst


@implements([aten.new_empty_strided.default, aten.new_empty.default, aten.new_zeros.default,
             aten.new_full.default, aten.new_ones.default])
def _new_like(func, args, kwargs):
    # AccumulateGrad clones a grad with new_empty_strided; a tensor of the global shape stays sharded.
    self, size = args[0], tuple(args[1])
    if size == tuple(self.shape) and not self._views:
        local_size = list(self._local.shape)
        rest = [local_size] + list(args[2:]) if func is not aten.new_empty_strided.default else \
            [local_size, list(torch.empty(local_size, device="meta").stride())]
        return ShardedParam(func(self._local, *rest, **kwargs), self._layout, (), None, self._name)
    return func(torch.empty(0, dtype=self.dtype, device=self.device), *args[1:], **kwargs)


@implements([aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float, aten.exponential_.default,
             aten.random_, aten.log_normal_.default,
             aten.cauchy_.default, aten.geometric_.default])
def _random_init(func, args, kwargs):
    """``nn.init`` on a sharded parameter: draw the full tensor (same RNG stream as unsharded), keep own rows."""
    self = args[0]
    if not isinstance(self, ShardedParam) or self._views:
        _refuse(func, args, kwargs, "random in-place ops on views of shards are not supported")
    full = torch.empty(self._layout.shape, dtype=self.dtype, device=self.device)
    func(full, *args[1:], **kwargs)
    layout = self._layout
    if layout.valid_rows:
        self._local[: layout.valid_rows].copy_(full[layout.row_start : layout.row_start + layout.valid_rows])
    return self


@implements(aten.embedding_renorm_.default)
def _embedding_renorm(func, args, kwargs):
    """``F.embedding(..., max_norm=...)`` rescales, in place, the weight rows its indices pick.  Each rank picks
    by its own batch, so a sharded weight would take a different update on each rank (unsharded DDP replicas
    diverge the same way): refused with the fix, rather than writing rows back."""
    weight = args[0]
    name = weight._name or tuple(weight.shape) if isinstance(weight, ShardedParam) else "weight"
    raise ShardedOpError(
        f"F.embedding(..., max_norm=...) renormalises rows of the sharded weight {name!r} in place, chosen by each "
        "rank's own indices; the shards would disagree. Fix: drop max_norm (renormalise the weight yourself "
        "from indices every rank shares), or keep this embedding unsharded.")


def _foreach_localizable(lists_and_rest) -> bool:
    """Each index position must hold shards of one layout (or only plain tensors); plain tensors beside
    shards must be 0-d (step counters, lr tensors)."""
    lists = [x for x in lists_and_rest if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor)]
    if not lists:
        return False
    length = len(lists[0])
    for i in range(length):
        column = [lst[i] for lst in lists if i < len(lst)]
        shards = [t for t in column if isinstance(t, ShardedParam)]
        if not shards:
            continue
        if not _localizable(shards):
            return False
        if any(not isinstance(t, ShardedParam) and t.dim() != 0 for t in column):
            return False
    return True


def _foreach_local(func, args, kwargs):
    """``torch.optim``'s foreach and fused paths (and ``clip_grad_norm_``'s ``_foreach_mul_``)."""
    params = _params_in(args, kwargs)
    if not _foreach_localizable(list(args) + list(kwargs.values())):
        if _written_params(func, args, kwargs):
            _refuse(func, args, kwargs, "the lists mix shards of different layouts or full plain tensors")
        return compute(func, args, kwargs)
    for value in _leaves((), kwargs):  # grad_scale / found_inf / lr tensors must be scalars
        if isinstance(value, torch.Tensor) and not isinstance(value, ShardedParam) and value.numel() != 1:
            _refuse(func, args, kwargs, f"a keyword tensor of shape {tuple(value.shape)} is not a scalar")
    out = func(*_map_args(_to_local, args), **_map_kwargs(_to_local, kwargs))
    if out is None or _written_params(func, args, kwargs) and not isinstance(out, (list, tuple)):
        return out
    first = args[0]
    if isinstance(out, (list, tuple)) and isinstance(first, (list, tuple)) and len(out) == len(first):
        return [
            ShardedParam(o, t._layout, t._views, None, t._name) if isinstance(t, ShardedParam) and isinstance(o, torch.Tensor) else o
            for o, t in zip(out, first)
        ]
    return out if not params else _wrap_like(params[0], out)


# torch.optim's fused kernels: lists of params, grads and states, updated in place (``_foreach_*`` too).
_FUSED_OPTIMIZER_OPS = {"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_", "_fused_adam",
                        "_fused_adamw", "_fused_sgd", "_fused_adagrad"}


# ====================================================================== 3. reductions
def _valid(p: ShardedParam) -> torch.Tensor:
    return p._local[: p._layout.valid_rows]


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


def _all_reduce_keep_nan(partial: torch.Tensor, group, op: str) -> None:
    """All-reduce in place; a NaN on any rank stays NaN under max/min (gloo's and NCCL's max/min drop it, so
    ``max()`` or an inf-norm would hide a NaN gradient on another rank).  One collective: the NaN flags ride
    along, negated for min."""
    if op not in ("max", "min") or not partial.is_floating_point():
        _comm.all_reduce(partial, group, op=op)
        return
    flags = partial.isnan().to(partial.dtype)
    both = torch.cat([partial.reshape(-1), flags.reshape(-1) if op == "max" else -flags.reshape(-1)])
    _comm.all_reduce(both, group, op=op)
    n = partial.numel()
    partial.copy_(both[:n].reshape(partial.shape).masked_fill(both[n:].reshape(partial.shape) != 0, float("nan")))


def _p_norm_partial(x: torch.Tensor, ord: float) -> torch.Tensor:
    """The all-reducible part of a p-norm: sum |x|^p, or max/min |x| for +-inf, count for 0."""
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
    x = _valid(self) if dtype is None else _valid(self).to(dtype)
    if self.numel() == 0 and ord in (float("inf"), float("-inf")):
        return compute(func, args, kwargs)  # torch's own error: the inf-norm of an empty tensor has no identity
    partial = _p_norm_partial(x, ord).reshape(1).clone()
    _all_reduce_keep_nan(partial, self._layout.group, _norm_reduce_op(ord))
    return _p_norm_finish(partial[0], ord)


@implements(aten._foreach_norm.Scalar)
def _foreach_norm(func, args, kwargs):
    """``clip_grad_norm_``'s default path: one all-reduce for the whole list, not one per tensor."""
    tensors = args[0]
    ord = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    out: list = [None] * len(tensors)
    sharded = [(i, t) for i, t in enumerate(tensors) if isinstance(t, ShardedParam)]
    plain = [(i, t) for i, t in enumerate(tensors) if not isinstance(t, ShardedParam)]
    if plain:
        for (i, _), norm in zip(plain, func([t for _, t in plain], *args[1:], **kwargs)):
            out[i] = norm
    if sharded:
        if not all(_chain_is_bijective(t._views) for _, t in sharded):
            return [torch.linalg.vector_norm(gather_for_compute_once(t), ord, dtype=dtype) if isinstance(t, ShardedParam)
                    else o for t, o in zip(tensors, out)]
        # float64 for the cross-rank sum: float32 partials would round a float64 model's norm (and cost the
        # float32 ones nothing measurable: one value per tensor)
        partials = torch.stack([_p_norm_partial(_valid(t) if dtype is None else _valid(t).to(dtype), ord).double()
                                for _, t in sharded])
        groups: dict = {}  # one all-reduce per process group (models sharded over several groups)
        for k, (_, t) in enumerate(sharded):
            groups.setdefault(id(t._layout.group), (t._layout.group, []))[1].append(k)
        for group, members in groups.values():
            if len(groups) == 1:
                _all_reduce_keep_nan(partials, group, _norm_reduce_op(ord))
            else:
                part = partials[members].clone()
                _all_reduce_keep_nan(part, group, _norm_reduce_op(ord))
                partials[members] = part
        finished = _p_norm_finish(partials, ord)
        for k, (i, t) in enumerate(sharded):
            out[i] = finished[k].to(dtype or t.dtype)
    return out


def _simple_reduction(op: str, local_fn: Callable, finish: Callable | None = None):
    def rule(func, args, kwargs):
        dim_arg = 1 if func not in (aten.sum.default, aten.mean.default, aten.max.default, aten.min.default,
                                    aten.all.default, aten.any.default) else None
        if not _whole_tensor_operand(func, args, kwargs, dim_arg=dim_arg) or kwargs.get("keepdim") \
                or (dim_arg is not None and len(args) > 2 and args[2]):
            return compute(func, args, kwargs)
        self = args[0]
        if self.numel() == 0 and op in ("max", "min") and func not in (aten.all.default, aten.any.default):
            return compute(func, args, kwargs)  # torch's own error: max() of an empty tensor has no identity
        partial = local_fn(_valid(self), func, args, kwargs).reshape(1).clone()
        _all_reduce_keep_nan(partial, self._layout.group, op)
        result = partial[0]
        return finish(result, self) if finish else result

    return rule


def _sum_local(x, func, args, kwargs):
    return x.sum(dtype=kwargs.get("dtype"))


def _float_identity_or(x, reducer, identity):
    return reducer(x) if x.numel() else torch.tensor(identity, dtype=x.dtype, device=x.device)


_TABLE[aten.sum.default] = _simple_reduction("sum", _sum_local)
_TABLE[aten.sum.dim_IntList] = _simple_reduction("sum", _sum_local)
_TABLE[aten.mean.default] = _simple_reduction("sum", _sum_local, lambda total, p: total / p.numel())
_TABLE[aten.mean.dim] = _simple_reduction("sum", _sum_local, lambda total, p: total / p.numel())
_TABLE[aten.max.default] = _simple_reduction("max", lambda x, *_: _float_identity_or(x, torch.amax, float("-inf")))
_TABLE[aten.min.default] = _simple_reduction("min", lambda x, *_: _float_identity_or(x, torch.amin, float("inf")))
_TABLE[aten.amax.default] = _simple_reduction("max", lambda x, *_: _float_identity_or(x, torch.amax, float("-inf")))
_TABLE[aten.amin.default] = _simple_reduction("min", lambda x, *_: _float_identity_or(x, torch.amin, float("inf")))
_TABLE[aten.all.default] = _simple_reduction(
    "min", lambda x, *_: x.all().to(torch.uint8), lambda total, p: total.bool())
_TABLE[aten.any.default] = _simple_reduction(
    "max", lambda x, *_: x.any().to(torch.uint8), lambda total, p: total.bool())


# ====================================================================== 4. compute
def gather_for_compute_once(p: ShardedParam) -> torch.Tensor:
    from .gather import gather_full

    return gather_full(p)


def _gather_for_user(p: ShardedParam) -> torch.Tensor:
    return gather_for_compute_once(p)


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
                else:
                    from .gather import _gather_now

                    base = _gather_now(p._local, p._layout)
                fulls[id(p)] = apply_views(base, p._views)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return fulls

    def __exit__(self, *exc) -> None:
        for p in self.acquired:
            p._gatherer.release(p)
        self.acquired = []


def compute(func, args, kwargs):
    """Class 4: gather -> run -> release.  Outputs are plain tensors that never alias a gathered buffer."""
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
            raise
        return _unalias(out, fulls)


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
            from .gather import _gather_now

            bases[id(p._local)] = _gather_now(p._local, p._layout).clone()
        fulls[id(p)] = apply_views(bases[id(p._local)], p._views)
    others = [p for p in _params_in(args, kwargs) if id(p) not in fulls]
    with _Gathered(others) as gathered:
        fulls.update(gathered)
        swap = lambda x: fulls[id(x)] if isinstance(x, ShardedParam) else x  # noqa: E731
        func(*_map_args(swap, args), **_map_kwargs(swap, kwargs))
    for p in written:
        layout = p._layout
        if layout.valid_rows:
            p._local[: layout.valid_rows].copy_(bases[id(p._local)][layout.row_start: layout.row_start + layout.valid_rows])
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


# Decompositions that keep sequential mode at one gathered parameter per op: the bias (or norm weight) is
# gathered after the weight is released.  Only used when more than one ShardedParam meets the op.
def _one_param_at_a_time(params: list[ShardedParam]) -> bool:
    if len(params) < 2 or params[0]._layout.world == 1:  # world 1 gathers nothing: the shard is the tensor
        return False
    if len({id(p._local) for p in params}) < 2:
        return False
    gatherer = params[0]._gatherer
    return gatherer is not None and gatherer.mode.value == "sequential"


def _apply_with(p, fn):
    with _Gathered([p]) as fulls:
        return fn(fulls[id(p)])


@implements(aten.addmm.default)
def _addmm(func, args, kwargs):
    bias, mat1, mat2 = args[:3]
    params = _params_in(args, kwargs)
    if not _one_param_at_a_time(params) or not isinstance(bias, ShardedParam):
        return compute(func, args, kwargs)
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    out = compute(aten.mm.default, (mat1, mat2), {})
    if alpha != 1:
        out.mul_(alpha)
    _apply_with(bias, lambda b: out.add_(b, alpha=beta))
    return out


@implements(aten.native_layer_norm.default)
def _layer_norm(func, args, kwargs):
    x, shape, weight, bias, eps = args
    if not _one_param_at_a_time(_params_in(args)):
        return compute(func, args, kwargs)
    out, mean, rstd = compute(func, (x, shape, None, None, eps), {})
    _apply_with(weight, lambda w: out.mul_(w))
    _apply_with(bias, lambda b: out.add_(b))
    return out, mean, rstd


@implements(aten.native_layer_norm_backward.default)
def _layer_norm_backward(func, args, kwargs):
    grad_out, x, shape, mean, rstd, weight, bias, mask = args
    if not _one_param_at_a_time(_params_in(args)):
        return compute(func, args, kwargs)
    grad_x, grad_w, _ = compute(func, (grad_out, x, shape, mean, rstd, weight, None, [mask[0], mask[1], False]), {})
    grad_b = None
    if mask[2]:
        lead = grad_out.dim() - len(shape)
        grad_b = grad_out.sum(dim=list(range(lead))) if lead else grad_out.clone()
    return grad_x, grad_w, grad_b


@implements(aten.convolution.default)
def _convolution(func, args, kwargs):
    x, weight, bias = args[:3]
    if not _one_param_at_a_time(_params_in(args)) or not isinstance(bias, ShardedParam):
        return compute(func, args, kwargs)
    out = compute(func, (x, weight, None, *args[3:]), kwargs)
    _apply_with(bias, lambda b: out.add_(b.reshape(1, -1, *([1] * (out.dim() - 2)))))
    return out
