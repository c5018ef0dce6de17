"""Class 2 of the op table: ops that run shard by shard on ``_local``, with no communication.

Pointwise ops (``torch.Tag.pointwise`` plus ``EXTRA_LOCAL_OPS``), the ``_foreach_*`` family and torch.optim's
fused kernels on shards of one placement give, row by row, the shard of the full result.  Writes into a shard
that cannot be done this way are refused (``refusals.py``), reads fall back to ``compute``.

[Note: when is a plain 0-d tensor safe in a local op]
A ShardedParam stands for one tensor that every rank agrees on.  ``W * s`` run shard-wise is right only if
``s`` is the same on every rank.  Optimizers (step tensors, lr tensors, ``clip_grad_norm_``'s coefficient from
an all-reduced norm) use such replicated scalars under ``no_grad``; forward code may multiply by a per-rank,
data-dependent scalar.  So plain 0-d tensors join local ops only when grad mode is off or the op writes into a
ShardedParam (only legal under ``no_grad`` for leaves); otherwise the op gathers, which is always right.
"""

from __future__ import annotations

import torch

from .. import _agreement, _grad_edits
from .._full import gather_full
from .._layout import ShardLayout, view_geometry
from ..tensor import ShardedParam
from ._common import (
    _WRITTEN_BY_ID, OpFamily, _broadcast_source, _chain_is_bijective, _leaves, _localizable, _map_args, _map_kwargs,
    _mark_written, _params_in, _rows_of, _to_local, _wrap_like, _written_args, _written_params,
    _written_shards_and_plain, aten, implements,
)
from .compute import _backward_temporaries, _write_back, compute
from .refusals import _refuse
from . import recipes, traced

POINTWISE = OpFamily("pointwise", lambda func: torch.Tag.pointwise in func.tags)
FOREACH = OpFamily("foreach", lambda func: func.overloadpacket.__name__.startswith("_foreach_"))
EXTRA_LOCAL_OPS = [  # not tagged pointwise, but element-wise on a shard all the same
    aten._to_copy.default, aten.clone.default,
    # in-place forms whose out-of-place twin is tagged pointwise, but not themselves (torch 2.13)
    aten.abs_.default, aten.absolute_.default, aten.fix_.default, aten.mish_.default, aten.xlogy_.Scalar_Other,
    aten.copysign_.Tensor, aten.copysign_.Scalar, aten.true_divide_.Tensor, aten.heaviside_.default,
    aten.threshold_.default, aten.masked_fill_.Scalar,
]
# torch.optim's fused kernels: lists of params, grads and states, updated in place (like ``_foreach_*``).
FUSED_OPTIMIZER_OPS = [aten._fused_adam_, aten._fused_adamw_, aten._fused_sgd_, aten._fused_adagrad_,
                       aten._fused_adam, aten._fused_adamw, aten._fused_sgd, aten._fused_adagrad]


def _plain_tensors_ok(leaves, allow_scalar_tensors: bool) -> bool:
    for x in leaves:
        if isinstance(x, torch.Tensor) and not isinstance(x, ShardedParam):
            if x.dim() != 0 or not allow_scalar_tensors:
                return False
    return True


# The foreach family is declared before the pointwise one: families are tried in declaration order.
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


@implements(FOREACH, FUSED_OPTIMIZER_OPS)
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
    written, plain = _written_shards_and_plain(func, args, kwargs)
    _mark_written(written, plain)  # see [Note: writes through the wrapper are versioned on the shard]
    if out is None or written and not isinstance(out, (list, tuple)):
        return out
    first = args[0]
    if isinstance(out, (list, tuple)) and isinstance(first, (list, tuple)) and len(out) == len(first):
        return [
            t._derived(o)
            if isinstance(t, ShardedParam) and isinstance(o, torch.Tensor) else o
            for o, t in zip(out, first)
        ]
    return out if not params else _wrap_like(params[0], out)


@implements(POINTWISE, EXTRA_LOCAL_OPS)
def _local(func, args, kwargs):
    """Run ``func`` on the shards when they share one placement, else gather (reads) or refuse (writes).

    The fast path first: it is the common shape of an optimizer's pointwise op (``exp_avg.lerp_(grad, 0.1)``:
    every step runs hundreds), positional shards of one placement with Python scalars and no tensor keywords,
    checked in one pass.  Anything else (plain tensors, lists, ``out=``, fake shards under torch.compile) takes
    the general path below, which starts with the torch.compile check that the fast path does not need (a fake
    shard is never a plain ``torch.Tensor``)."""
    written = _WRITTEN_BY_ID.get(id(func))
    if written is None:
        written = _written_args(func)
    first = None
    locals_ = []
    for x in args:
        kind = type(x)
        if kind is ShardedParam:
            local = x._local
            if type(local) is not torch.Tensor:  # FakeTensor while Dynamo traces, or another subclass
                break
            if first is None:
                if x._views and not _chain_is_bijective(x._views):
                    break
                first = x
            elif not (x._layout is first._layout or x._layout == first._layout) or x._views != first._views:
                break
            locals_.append(local)
        elif kind is float or kind is int or kind is bool or x is None:
            locals_.append(x)
        elif isinstance(x, (torch.Tensor, list, tuple)):
            break
        else:
            locals_.append(x)
    else:
        if first is not None and not (kwargs and any(isinstance(v, (torch.Tensor, list, tuple)) for v in kwargs.values())) \
                and (not written or (written == ((0, "self"),) and args[0] is first)):
            out = func(*locals_, **kwargs)
            if written:
                _mark_written((first,))  # see [Note: writes through the wrapper are versioned on the shard]
                return args[0]
            out = _wrap_like(first, out)
            if (first._gatherer is not None and first._gatherer.held or hasattr(first._local, recipes.RECIPE)) \
                    and recipes.reads_held_expert_parameter(args) and not recipes.remember(out, func, args, kwargs):
                return compute(func, args, kwargs)  # see [Note: reads of a parameter its unit holds] in recipes.py
            return out
    params = _params_in(args, kwargs)
    if traced.is_traced(args):  # torch.compile: see [Note: the traced path] in _traced.py
        if params and _localizable(params) and _plain_tensors_ok(_leaves(args, kwargs), False) \
                and not _written_params(func, args, kwargs):  # shards alone (two parts of a tied gradient)
            return _wrap_like(params[0], func(*_map_args(_to_local, args), **_map_kwargs(_to_local, kwargs)))
        return traced.run_traced(func, args, kwargs, _local)
    written_params = _written_params(func, args, kwargs)
    writes_shard = bool(written_params)
    # A 0-d tensor operand is the same on every rank in an optimizer step, but not inside a backward: there it
    # can be this rank's upstream gradient (vector_norm's backward is ``w * (grad / norm)``), and a shard-wise
    # product would leave each rank's rows scaled by its own gradient, never averaged.  Those run gathered, so
    # the gradient hook receives a whole gradient and reduces it.
    allow_scalars = writes_shard or (not torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1)
    if _localizable(params) and _plain_tensors_ok(_leaves(args, kwargs), allow_scalars):
        out = func(*_map_args(_to_local, args), **_map_kwargs(_to_local, kwargs))
        if writes_shard:
            _mark_written(written_params)
            return kwargs["out"] if "out" in kwargs else args[0]
        out = _wrap_like(params[0], out)
        if recipes.reads_held_expert_parameter(params) and not recipes.remember(out, func, args, kwargs):
            return compute(func, args, kwargs)  # see [Note: reads of a parameter its unit holds] in recipes.py
        return out
    if writes_shard and not _backward_temporaries(written_params):  # those: compute() writes them back
        if _write_dim0_rows(func, args, kwargs):
            return args[0]
        _refuse(func, args, kwargs, "its operands are not shards of one layout (or include a full plain tensor)")
    return compute(func, args, kwargs)


@implements([aten.zero_.default, aten._foreach_zero_.default, aten.fill_.Scalar, aten.fill_.Tensor])
def _zero(func, args, kwargs):
    """``p.grad.zero_()``, ``p.grad.data.fill_(0)``, ``zero_grad(set_to_none=False)``: zeros written over a whole
    tensor are noted on its shard (``.data`` and ``detach()`` share it), since a ``no_sync`` gradient deferred
    before them is thrown away (see [Note: edits of a gradient between no_sync micro-batches] in _grad_edits.py);
    zeros through a row view (``emb.weight.grad[pad].zero_()``) are not a zero_grad."""
    out = (_foreach_local if func is aten._foreach_zero_.default else _local)(func, args, kwargs)
    value = args[1] if func in (aten.fill_.Scalar, aten.fill_.Tensor) else 0  # (p.grad[:] = 0: fill_.Tensor)
    if not isinstance(value, torch.Tensor) and value == 0 or isinstance(value, torch.Tensor) and _is_plain_zero(value):
        _grad_edits.note_overwritten([_whole_shard(t) for t in _written_list(args[0])])
    return out


_DIVIDES = {aten.div_.Scalar, aten.div_.Tensor, aten._foreach_div_.Scalar, aten._foreach_div_.Tensor}
_FOREACH_SCALES = {aten._foreach_mul_.Scalar, aten._foreach_mul_.Tensor, aten._foreach_div_.Scalar,
                   aten._foreach_div_.Tensor}


@implements([aten.mul_.Scalar, aten.mul_.Tensor, aten.div_.Scalar, aten.div_.Tensor, *_FOREACH_SCALES])
def _scale(func, args, kwargs):
    """``p.grad.mul_(s)``, ``clip_grad_norm_``'s ``_foreach_mul_``: a scale by a scalar over a whole shard that
    holds a deferred ``no_sync`` gradient scales that gradient too (see [Note: edits of a gradient between
    no_sync micro-batches] in _grad_edits.py)."""
    out = (_foreach_local if func in _FOREACH_SCALES else _local)(func, args, kwargs)
    if _grad_edits.logging_scales() and _scalar_operand(args[1]) and not kwargs:
        _grad_edits.note_scaled([_whole_shard(t) for t in _written_list(args[0])], args[1], func in _DIVIDES)
    return out


def _written_list(target) -> list:
    return list(target) if isinstance(target, (list, tuple)) else [target]


def _is_plain_zero(value: torch.Tensor) -> bool:
    return type(value) is torch.Tensor and value.dim() == 0 and not bool(value)


def _whole_shard(t):
    """The tensor a write into ``t`` covers whole: a shard's ``_local`` (None through a partial view), or ``t``."""
    if not isinstance(t, ShardedParam):
        return t
    return t._local if not t._views or t.shape.numel() == t._layout.shape.numel() else None


def _scalar_operand(x) -> bool:
    """A Python scalar or a plain 0-d tensor (``t.mul_(3.0)`` arrives as one): the same for every row."""
    if isinstance(x, torch.Tensor):
        return type(x) is torch.Tensor and x.dim() == 0
    return not isinstance(x, (list, tuple))


def _write_dim0_rows(func, args, kwargs) -> bool:
    """An in-place op with scalar operands through one dim-0 row view (``weight[padding_idx].zero_()``, which
    ``nn.Embedding.reset_parameters`` and Hugging Face's inits run; ``weight[2:5].fill_(0)``), or through views of
    one selected row (``nn.init.dirac_``: ``w[i, j, k] = 1``): each rank writes the rows of the view it holds, a
    rank holding none writes nothing.  No collective: every rank knows the rows from the layout.  Returns False
    where the op is not of that form (the caller refuses it)."""
    view = args[0]
    if not isinstance(view, ShardedParam) or not view._views or type(view._layout) is not ShardLayout \
            or not all(_scalar_operand(x) for x in (*args[1:], *kwargs.values())):
        return False
    columns = _rows_of(view)  # ``p.real.add_(1)``, ``w[:, 0].zero_()``: views that keep every row
    if columns is not None:
        func(columns, *args[1:], **kwargs)
        _mark_written((view,))
        return True
    (step, *within_row), layout = view._views, view._layout
    dim, *rest = step.args or (None,)
    if dim not in (0, -len(layout.shape)) or step.kwargs or step.index is not None:
        return False
    if within_row and (step.func is not aten.select.int or any(s.func is aten.as_strided.default
                                                              for s in within_row)):
        return False  # (a view after a slice would index the slice's rows, not this rank's)
    n = layout.shape[0]
    if step.func is aten.select.int:
        row = rest[0] + n if rest[0] < 0 else rest[0]
        lo, hi = row, row + 1
    elif step.func is aten.slice.Tensor:
        start, end, stride = (list(rest) + [None, None, 1][len(rest):])[:3]  # slice(dim, start, end, step)
        if stride != 1:
            return False
        lo, hi, _ = slice(start, end).indices(n)
    else:
        return False
    start = layout.row_start
    lo, hi = max(lo, start), min(hi, start + layout.valid_rows)
    if lo < hi:
        rows = view._local[lo - start: hi - start]
        target = rows[0] if step.func is aten.select.int else rows
        for later in within_row:
            target = later.apply(target)
        func(target, *args[1:], **kwargs)
    _mark_written((view,))
    return True


def _whole_base_reshape(view: ShardedParam) -> bool:
    """A contiguous view of all of the base, in its order (``w.view_as(w)``; ``w.view(rows, -1)`` of a conv
    weight, which ``nn.init.orthogonal_`` writes through): element ``i`` of the view is element ``i`` of the base,
    so writing ``src`` through it is writing ``src.reshape(base shape)`` into the base."""
    shape, stride, offset = view_geometry(view._layout.shape, view._views)
    return (offset == 0 and shape.numel() == view._layout.shape.numel()
            and stride == torch.empty(shape, device="meta").stride())


def _index_put_by_mask(func, args, kwargs):
    """``g[mask] = v`` with a boolean mask of ``g``'s own placement and one value (torch.optim.Rprop:
    ``grad[sign.eq(etaminus)] = 0``) is element-wise: run it on the shards.  Anything else gathers or is refused
    (``compute``)."""
    target, indices, values = args[0], args[1], args[2]
    mask = indices[0] if len(indices) == 1 else None
    if (isinstance(target, ShardedParam) and isinstance(mask, ShardedParam) and mask.dtype == torch.bool
            and type(values) is torch.Tensor and values.numel() == 1 and not (args[3:] or kwargs)
            and _localizable([target, mask])):
        func(target._local, [mask._local], values)
        _mark_written((target,))
        return target
    return compute(func, args, kwargs)


@implements(aten.copy_.default)
def _copy(func, args, kwargs):
    """``load_state_dict`` copies a full tensor into each parameter: every rank keeps its own rows."""
    dst, src = args[0], args[1]
    if not isinstance(dst, ShardedParam):
        return compute(func, args, kwargs)  # plain.copy_(sharded): gather the source
    if isinstance(src, ShardedParam) and src._local is dst._local and src._views == dst._views:
        return dst  # a copy onto itself: Python's write-back of ``w[i] += c``, whose add_ already landed
    if dst._views:
        if not _whole_base_reshape(dst):
            if _backward_temporaries([dst]):  # householder_product's / ormqr's backward fill a temporary's columns
                return _write_back(func, args, kwargs, [dst])
            if _write_dim0_rows(func, args, kwargs):  # a scalar into rows (nn.init.dirac_'s w[i, j, k] = 1)
                return dst
            _refuse(func, args, kwargs, "the destination is a view of a shard")
        src = _broadcast_source(gather_full(src) if isinstance(src, ShardedParam) else src, dst, "a view of ")
        _copy(func, (dst._derived(dst._local, views=()), src.reshape(dst._layout.shape)), {})
        return dst
    if isinstance(src, ShardedParam):
        if src._layout == dst._layout and not src._views:
            dst._local.copy_(src._local)
            _mark_written((dst,))
            return dst
        src = gather_full(src)
    src = _broadcast_source(src, dst)
    if _agreement.is_plain(src):  # see [Note: full tensors written into shards]
        _agreement.refuse_differing([(dst._name, dst, src)], f"copy_ into {dst._name!r}")
    with torch.no_grad():
        dst._layout.copy_own_rows(dst._local, src)
    _mark_written((dst,))
    return dst


@implements([aten.eye.out, aten.eye.m_out])
def _eye_into_shard(func, args, kwargs):
    """``nn.init.eye_(w)`` is ``torch.eye(n, m, out=w)``: the same full tensor on every rank, of which each keeps
    its rows."""
    out = kwargs["out"]
    if not isinstance(out, ShardedParam) or out._views or type(out._layout) is not ShardLayout:
        _refuse(func, args, kwargs, "out= is a view of a shard")
    full = torch.empty(out._layout.shape, dtype=out.dtype, device=out.device)
    func(*args, **{**kwargs, "out": full})
    if full.shape != out._layout.shape:
        _refuse(func, args, kwargs, f"it would resize the parameter to {tuple(full.shape)}")
    out._layout.copy_own_rows(out._local, full)
    _mark_written((out,))
    return out


@implements([aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default])
def _like(func, args, kwargs):
    """``zeros_like(p)`` is a shard of ``p``'s placement (an optimizer's state), except inside a backward, where
    it is a whole plain tensor: there a formula fills it with this rank's gradient (``take``'s backward is
    ``zeros_like(self).put_(index, grad)``; ``householder_product``'s, ``ormqr``'s), and a shard kept this rank's
    rows of this rank's gradient, which the gradient hook took for the mean (silently: rows 1x and 2x where DDP
    gives 1.5x, helper H).  A plain one is reduced like any gradient.  Only in torch's own backward formulas: an
    optimizer stepping in a gradient hook (optimizer-in-backward) or a custom Function's backward makes states."""
    if type(args[0]) is ShardedParam and _in_a_backward_formula():
        shape = torch.empty((), dtype=args[0].dtype, device=args[0].device).expand(args[0].shape)
        return func(shape, *args[1:], **kwargs)
    return _local(func, args, kwargs)


def _in_a_backward_formula() -> bool:
    node = torch._C._current_autograd_node()  # the node autograd runs now: None outside a backward
    return node is not None and not isinstance(node, torch.autograd.function.BackwardCFunction) \
        and not node.name().endswith("AccumulateGrad")  # (hooks run under AccumulateGrad)


@implements([aten.new_empty_strided.default, aten.new_empty.default, aten.new_zeros.default,
             aten.new_full.default, aten.new_ones.default])
def _new_like(func, args, kwargs):
    """AccumulateGrad clones a grad with new_empty_strided; a tensor of the global shape stays sharded.  Not
    ``new_empty``'s: ``nn.init.orthogonal_`` draws into one and transposes it in place (``t_``), which a shard
    cannot do; its plain draw is written back through ``copy_``, which checks that the ranks drew alike."""
    self, size = args[0], tuple(args[1])
    if size == tuple(self.shape) and not self._views and func is not aten.new_empty.default:
        local_size = list(self._local.shape)
        rest = [local_size] + list(args[2:]) if func is not aten.new_empty_strided.default else \
            [local_size, list(torch.empty(local_size, device="meta").stride())]
        return self._derived(func(self._local, *rest, **kwargs), views=())
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
    _agreement.take_rank0_draw(self, full)  # see [Note: full tensors written into shards]
    self._layout.copy_own_rows(self._local, full)
    _mark_written((self,))
    return self
