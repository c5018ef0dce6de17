"""Sequential mode's decompositions: ops that read two parameters gather them one at a time.

``gather="sequential"`` promises at most one gathered parameter per op.  ``addmm`` (linear + bias),
``native_layer_norm`` (+ its backward) and ``convolution`` (+ bias) read a weight and a bias; the rules in
``SEQUENTIAL_DECOMPOSITIONS`` run them as the weight's op, then the bias's (gathered after the weight is
released).  They apply only in sequential mode, with more than one distinct ShardedParam in a world above one;
everywhere else the op takes the ordinary ``compute`` rule.
"""

from __future__ import annotations

from typing import Callable

from ..gather import GatherMode
from ..tensor import ShardedParam
from ._common import Rule, _params_in, aten, implements
from .compute import compute, compute_with

SEQUENTIAL_DECOMPOSITIONS: dict = {}  # OpOverload -> decomposition(func, args, kwargs)


def _one_param_at_a_time(params: list[ShardedParam]) -> bool:
    if len(params) < 2 or params[0]._layout.world == 1:  # world 1 gathers nothing: the shard is the tensor
        return False
    if len({id(p._local) for p in params}) < 2:
        return False
    gatherer = params[0]._gatherer
    return gatherer is not None and gatherer.mode is GatherMode.SEQUENTIAL


def _decompose_or_compute(func, args, kwargs):
    """The op-table rule of every op in ``SEQUENTIAL_DECOMPOSITIONS``."""
    if _one_param_at_a_time(_params_in(args, kwargs)):
        return SEQUENTIAL_DECOMPOSITIONS[func](func, args, kwargs)
    return compute(func, args, kwargs)


def sequential_decomposition(op) -> Callable[[Rule], Rule]:
    def decorator(rule: Rule) -> Rule:
        SEQUENTIAL_DECOMPOSITIONS[op] = rule
        implements(op)(_decompose_or_compute)
        return rule

    return decorator


@sequential_decomposition(aten.addmm.default)
def _addmm(func, args, kwargs):
    bias, mat1, mat2 = args[:3]
    if not isinstance(bias, ShardedParam):
        return compute(func, args, kwargs)
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    out = compute(aten.mm.default, (mat1, mat2), {})
    if alpha != 1:
        out.mul_(alpha)
    compute_with(bias, lambda b: out.add_(b, alpha=beta))
    return out


def _mixed_dtype(x, *params) -> bool:
    return any(p is not None and p.dtype != x.dtype for p in params)


@sequential_decomposition(aten.native_layer_norm.default)
def _layer_norm(func, args, kwargs):
    x, shape, weight, bias, eps = args
    if _mixed_dtype(x, weight, bias):  # autocast: a low-precision input with fp32 weights keeps fp32 statistics
        return compute(func, args, kwargs)  # and rounds once only in the fused mixed-dtype kernel
    out, mean, rstd = compute(func, (x, shape, None, None, eps), {})
    for param, apply in ((weight, out.mul_), (bias, out.add_)):  # either may be None (bias=False) or plain (kept
        if isinstance(param, ShardedParam):                      # whole; helper H: an AttributeError before)
            compute_with(param, apply)
        elif param is not None:
            apply(param)
    return out, mean, rstd


@sequential_decomposition(aten.native_layer_norm_backward.default)
def _layer_norm_backward(func, args, kwargs):
    grad_out, x, shape, mean, rstd, weight, bias, mask = args
    if _mixed_dtype(x, weight, bias):
        return compute(func, args, kwargs)
    grad_x, grad_w, _ = compute(func, (grad_out, x, shape, mean, rstd, weight, None, [mask[0], mask[1], False]), {})
    grad_b = None
    if mask[2]:
        lead = grad_out.dim() - len(shape)
        grad_b = grad_out.sum(dim=list(range(lead))) if lead else grad_out.clone()
    return grad_x, grad_w, grad_b


@sequential_decomposition(aten.convolution.default)
def _convolution(func, args, kwargs):
    x, weight, bias = args[:3]
    if not isinstance(bias, ShardedParam):
        return compute(func, args, kwargs)
    out = compute(func, (x, weight, None, *args[3:]), kwargs)
    compute_with(bias, lambda b: out.add_(b.reshape(1, -1, *([1] * (out.dim() - 2)))))
    return out
