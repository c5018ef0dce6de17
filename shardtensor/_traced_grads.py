"""The compiled backward reduces each gradient: a sharded gradient leaves the graph, never a whole one.

[Note: a gradient reduced inside the compiled backward]
The traced gather (``_traced.py``) runs below autograd, so autograd's formulas give the gradient of a
ShardedParam as a whole, plain tensor.  Left at that, every parameter's whole gradient is an output of the
compiled backward, and all of them live at once at its end until the eager hooks reduce them: on a 54M-parameter
GPT the compiled step's peak was 1.56x the eager one's, most of the memory ZeRO-3 saves.  So while Dynamo
traces, a module reads each trainable ShardedParam of its own through ``grad_boundary``: an alias of the
parameter at the autograd level whose backward formula reduce-scatters the whole gradient it receives
(``reduce_grad``, an opaque node of the backward graph whose kernel is the eager reducer) and hands back this
rank's shard of the mean as a ShardedParam.  The read is a property of the module's class: ``shard_module``
gives each module that holds sharded parameters a subclass of its own class (same name, same ``isinstance``)
with one property per sharded parameter, as ``torch.nn.utils.parametrize`` does, because Dynamo traces such a
property but not a ``__torch_function__`` of a subclass like ours (it treats ShardedParam as a plain tensor).
AOTAutograd flattens the gradient to the shard, so the backward graph outputs shards, each whole gradient is
freed where it was reduced, and the eager gradient hook takes the arriving ShardedParam as it is (as it takes
any gradient computed shard-wise).

A parameter read twice (tied embeddings) gets one boundary node per read: ``shard_module`` gives the second
module that holds it (the head) the property too.  Without it the head's part of the gradient left the graph
whole, autograd added it to the reduced part by gathering that back (a traced add of a ShardedParam and a full
tensor), and the eager hook reduced the sum again: an all-gather, a second reduce-scatter and a whole gradient
per step.  Now the two reduced parts are shards of one layout, which autograd adds shard-wise (the local rule
runs on traced shards when every operand is one); under inductor the merge pass sums the parts before the one
reduction ([Note: a unit's gradients reduced together under compile]).  With ``gradient_sync`` off, both parts
go into the one deferred sum (``DeferredGradients._defer``).

What the kernel does is the hook's synchronous path (``GradSync.reduce_compiled``): the reducer in the
parameter's ``reduce_dtype``, ``gradient_sync(model, False)``'s deferral, the deferred sum folded into the next
synced backward.  Under inductor a pass of ours merges each gather unit's reductions into one (``_traced_buckets``:
[Note: a unit's gradients reduced together under compile]); other backends reduce each parameter on its own.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from . import _comm, _compile, _traced, _traced_buckets
from ._dispatch import implements, views
from .tensor import ShardedParam

_RECORDS: dict[str, tuple] = {}  # graph key -> (weakref to the GradSync, the parameter's name)
_GRAD_SYNCS: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()  # GradSync -> its number
_grad_sync_numbers = itertools.count()  # in shard_module call order: the same in every process of a job


def record(param, grad_sync, name: str) -> None:
    """Make ``param``'s gradient reducible inside a compiled backward, under a key that is the same in every
    process of a job (it is baked into the graph: the ``shard_module`` call's number, then the name)."""
    number = _GRAD_SYNCS.get(grad_sync)
    if number is None:  # (a count, not len(_GRAD_SYNCS): the table shrinks as models go, and a number came back)
        number = _GRAD_SYNCS[grad_sync] = next(_grad_sync_numbers)
        weakref.finalize(grad_sync, _forget_records, f"{number}/")  # (a process that shards many models)
    key = f"{number}/{name}"
    # The GradSync holds the parameter (as its hooks do); no weakref to it, which would stop
    # torch.utils.swap_tensors (``module.to_empty``, ``_apply``) from swapping it.
    grad_sync.compiled_params[name] = param
    _RECORDS[key] = (weakref.ref(grad_sync), name)
    _traced.record_grad_key(param._layout, key)  # (also in the graph's cache key: _traced.cache_fields)


def _forget_records(prefix: str) -> None:
    for key in [k for k in _RECORDS if k.startswith(prefix)]:
        del _RECORDS[key]


key_of = _traced.grad_key_of


_REDUCED: list = [None, set()]  # [the backward (graph task) whose kernels reduced, the keys they reduced]


def note_reduced(key: str) -> None:
    """A compiled backward's kernel reduced ``key``'s gradient (in the running backward)."""
    task = torch._C._current_graph_task_id()
    if task != _REDUCED[0]:
        _REDUCED[0], _REDUCED[1] = task, set()
    _REDUCED[1].add(key)


def reduced_in_this_backward(key: str) -> bool:
    """Whether the running backward's compiled graph reduced ``key``'s gradient (its hook then sees a shard)."""
    return _REDUCED[0] == torch._C._current_graph_task_id() != -1 and key in _REDUCED[1]


class CompiledReductions:
    """The compiled backward's half of ``GradSync`` (which defines the deferral, the reducer and the units)."""

    def reduce_compiled(self, param: ShardedParam, key: str, grad: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the mean of ``grad``, reduced inside a compiled backward (see [Note: a gradient
        reduced inside the compiled backward]).  ``grad`` is the graph's and is not written to."""
        return self.reduce_compiled_together([param], [key], [grad], [False])[0]

    def reduce_compiled_together(self, params: list, keys: list[str], grads: list[torch.Tensor],
                                 owned: list[bool]) -> list[torch.Tensor]:
        """The shards of the means of ``grads`` (``params``' whole gradients, of one unit where there are more
        than one: see [Note: a unit's gradients reduced together under compile]): the hook's synchronous path,
        through the unit's shared memory where it has one.  ``owned[i]``: nothing in the graph reads ``grads[i]``
        after this, so a large one may be reduced in its own tensor; the others are not written to."""
        for key in keys:
            note_reduced(key)  # (the hook names torch.autograd.grad, which this kernel cannot tell)
        if not self.enabled:  # gradient_sync(module, False): keep the full local gradients, reduce later
            for param, key, grad in zip(params, keys, grads):
                self._defer(key, grad.detach(), (param, param._layout))
            return [grad.new_zeros(p._layout.local_shape(), dtype=p.dtype) for p, grad in zip(params, grads)]
        fulls, ours = [], []
        for param, key, grad in zip(params, keys, grads):
            detached = grad.detach()
            fulls.append(self._with_deferred(key, detached, param))
            ours.append(fulls[-1] is not detached)  # (the deferred sum, ours)
        if self._replicated_params:
            self._queue_finish_once()  # the replicated gradients' reduction must run on every rank
        shards = None
        if self.units is not None:
            writable = [mine or own for mine, own in zip(ours, owned)]
            shards = self.units.reduce_together(params, keys, fulls, writable, self.strategy)
        if shards is None:  # (with overlap=False a strategy returns the shard itself)
            shards = [self.strategy.reduce_grad(full, p._layout, key=key, dtype=p.dtype, owned=mine, overlap=False)
                      for p, key, full, mine in zip(params, keys, fulls, ours)]
        # An op's outputs alias neither its inputs nor each other (the small parameters' shards are columns of
        # one reduced buffer): those get a tensor of their own.
        taken = {g.untyped_storage().data_ptr() for g in grads}
        out = []
        for shard, param in zip(shards, params):
            shard = shard.to(param.dtype)
            storage = shard.untyped_storage().data_ptr()
            out.append(shard.clone() if storage in taken else shard)
            taken.add(storage)
        return out


def _resolve(key: str) -> tuple:
    record = _RECORDS.get(key)
    grad_sync = record[0]() if record is not None else None
    param = grad_sync.compiled_params.get(record[1]) if grad_sync is not None else None
    if param is None:
        raise RuntimeError(f"torch.compile: the compiled backward reduces the gradient of {key!r}, a parameter no "
                           "sharded model in this process has. Fix: torch._dynamo.reset() and compile the model "
                           "again.")
    return grad_sync, param, record[1]


def resolve_params(keys: list[str]) -> tuple:
    """(the GradSync, the parameters, their names) of graph keys of one model (``_traced_buckets``)."""
    found = [_resolve(key) for key in keys]
    if any(grad_sync is not found[0][0] for grad_sync, _, _ in found):
        raise RuntimeError(f"torch.compile: one reduction of the compiled backward holds gradients of two sharded "
                           f"models ({keys}). Fix: torch._dynamo.reset() and compile the model again.")
    return found[0][0], [param for _, param, _ in found], [name for _, _, name in found]


@torch.library.custom_op("shardtensor::reduce_grad", mutates_args=())
def _reduce_grad(grad: torch.Tensor, key: str, unit: str) -> torch.Tensor:
    # (``unit``: the gather unit's key, or "": read only by the pass that merges a unit's reductions)
    grad_sync, param, name = _resolve(key)
    with _comm.compiled_graph():
        return grad_sync.reduce_compiled(param, name, grad)


@_reduce_grad.register_fake
def _(grad: torch.Tensor, key: str, unit: str) -> torch.Tensor:
    _, param, _ = _resolve(key)
    return grad.new_empty(param._layout.local_shape(), dtype=param.dtype)


# The reductions of one unit, merged (``_traced_buckets``).
@torch.library.custom_op("shardtensor::reduce_grads", mutates_args=())
def _reduce_grads(grads: list[torch.Tensor], keys: str, owned: list[bool]) -> list[torch.Tensor]:
    # (``keys``: the parameters' graph keys, one per line: an op's schema has no list of strings)
    grad_sync, params, names = resolve_params(keys.split("\n"))
    with _comm.compiled_graph():
        return grad_sync.reduce_compiled_together(params, names, list(grads), list(owned))


@_reduce_grads.register_fake
def _(grads: list[torch.Tensor], keys: str, owned: list[bool]) -> list[torch.Tensor]:
    _, params, _ = resolve_params(keys.split("\n"))
    return [g.new_empty(p._layout.local_shape(), dtype=p.dtype) for g, p in zip(grads, params)]


@torch.library.custom_op("shardtensor::grad_boundary", mutates_args=())
def _grad_boundary(param: torch.Tensor) -> torch.Tensor:
    # Reached only by a plain tensor (a ShardedParam's op table takes the op as an alias): nothing to reduce.
    return param.clone()


@_grad_boundary.register_fake
def _(param: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(param)


def _remember(ctx, inputs: tuple, output: Any) -> None:
    param = inputs[0]
    ctx.key, ctx.layout, ctx.name, ctx.device = key_of(param._layout), param._layout, param._name, param.device
    ctx.unit = _traced.unit_key_of(param._layout) or ""
    if ctx.unit:
        _traced_buckets.install()  # (before inductor compiles this backward)


def _reduced(ctx, grad: torch.Tensor):
    if ctx.key is None:  # a parameter whose gradient the eager hook reduces
        return grad
    shard = torch.ops.shardtensor.reduce_grad(grad, ctx.key, ctx.unit)
    return ShardedParam(shard, ctx.layout, name=ctx.name, device=ctx.device)


_grad_boundary.register_autograd(_reduced, setup_context=_remember)

BOUNDARY = torch.ops.shardtensor.grad_boundary.default
implements(BOUNDARY)(views._identity_view)  # on a ShardedParam: an alias over the same shard (no gather)


def _reader(name: str):
    def read(module):
        """The parameter; while torch.compile traces, read through its gradient boundary (see [Note: a gradient
        reduced inside the compiled backward])."""
        param = module._parameters.get(name)
        if param is None:
            return torch.nn.Module.__getattr__(module, name)
        if torch.compiler.is_compiling() and isinstance(param, ShardedParam) and param.requires_grad \
                and torch.is_grad_enabled():
            return BOUNDARY(param)
        return param

    return property(read)


# After a graph break Dynamo may meet ``read`` as a frame of its own (eager code between compiled regions reads
# the attribute): compiled alone, it returned the boundary's ShardedParam as a graph output, whose gradient
# AOTAutograd then refused ("Expected a ShardedParam tangent").  Such a read runs eagerly (the eager gather and
# gradient hook); inside a traced frame Dynamo still inlines it.
_compile.compile_callees_only(_reader("").fget)


_READING_CLASSES: dict[tuple, type] = {}


def _refuse_pickling(module, protocol):  # (as the sharded root's hooks do; the class is not importable by name)
    from ._misuse import PICKLE_REFUSAL

    raise TypeError(PICKLE_REFUSAL)


def _refuse_deepcopy(module, memo):
    from ._misuse import PickleRefusingHook

    return PickleRefusingHook.__deepcopy__(None, memo)


def read_through_boundaries(module: torch.nn.Module, names: list[str]) -> None:
    """Give ``module`` a class of its own kind whose attributes ``names`` (sharded parameters) read through
    their gradient boundary under torch.compile; ``isinstance`` and the name are unchanged."""
    base = getattr(type(module), "_shardtensor_base", type(module))
    names = frozenset(names) | getattr(type(module), "_shardtensor_reads", frozenset())
    cls = _READING_CLASSES.get((base, names))
    if cls is None:
        attrs = {name: _reader(name) for name in sorted(names)}
        cls = type(base.__name__, (base,), {**attrs, "_shardtensor_base": base, "_shardtensor_reads": names,
                                             "__module__": base.__module__, "__qualname__": base.__qualname__,
                                             "__reduce_ex__": _refuse_pickling, "__deepcopy__": _refuse_deepcopy})
        _READING_CLASSES[(base, names)] = cls
    module.__class__ = cls


def stop_reading_through_boundaries(module: torch.nn.Module) -> None:
    """Undo ``read_through_boundaries`` (``unshard_module``)."""
    module.__class__ = getattr(type(module), "_shardtensor_base", type(module))
