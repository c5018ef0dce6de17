"""A sharded parameter's gradient hooks run on its reduced gradient, also where the reduction lands late.

[Note: gradient hooks run when the gradient lands]
Where the reduction of a gradient comes after autograd is done with the parameter (a gather unit reduces its
parameters together after the unit's backward; ``gradient_sync(model, False)`` keeps full local gradients for a
later backward), the parameter's AccumulateGrad receives a zero placeholder shard, and the reduced rows are added
to ``.grad`` later.  A user's hook that ran on the placeholder would compute on zeros: an optimizer stepping in
backward (``register_post_accumulate_grad_hook``) would step on nothing, ``CPUAdam``'s speculative steps would
always be redone, a clamp (``register_hook``) would clamp zeros and let the real rows through unclamped.  Silently
wrong numbers, so a ``ShardedParam`` registers both kinds of hook behind a guard:

- the code that makes a placeholder (``zero_placeholder``) records it;
- a guarded tensor hook handed that placeholder returns without calling the user's hook, and a guarded
  post-accumulate-grad hook swallows the one AccumulateGrad call that stored it;
- the code that adds the reduced rows calls ``run_tensor_hooks`` on this backward's reduced shard first (their
  result is what is added), then ``gradient_landed`` after, which runs the post-accumulate-grad hooks.

So every hook sees what it sees on a parameter whose reduction is immediate: the reduced shard, as a
``ShardedParam`` (FSDP2 runs post-accumulate-grad hooks after its reduce-scatter the same way).  Either order of
landing and AccumulateGrad is right: if the rows land first (the engine orders nodes, not hooks), the hooks run at
the landing and the guard still swallows the placeholder's call.

[Note: a lazy placeholder]
A gather unit's placeholder is one zero element expanded to the shard's shape, and where the unit's mean rows land
they become ``.grad`` (``rehome_``) instead of being added to it: a placeholder of real zeros cost each backward a
fresh shard-sized buffer (its pages faulted in and zeroed) and a pass adding the rows into it, for nothing (9 ms of
16 per backward at the benchmark GPT's 4.4M-element shard, measured).  An expanded tensor cannot be written in place,
so no placeholder outlives its backward lazy: a backward's end (or, after a failed one, the next forward) turns any
left into real zeros.  ``gradient_sync(model, False)`` keeps real zeros: its placeholders stay ``.grad`` until a
later backward.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch

from . import _compile


# id(placeholder) -> a weak reference to it.  Weak, so that AccumulateGrad can take the placeholder itself as
# ``.grad`` (it steals a gradient nobody else references; held here, it was cloned: an allocation, a copy and two
# dispatched ops per parameter and backward); a dead reference never matches, so a reused id is harmless.
_placeholders: dict[int, weakref.ref] = {}
_lazy: dict[int, tuple] = {}  # id(a lazy placeholder's shard) -> weak references to it and to its parameter
_swallow: dict[int, int] = {}  # id(parameter) -> guarded hooks still to be called by the AccumulateGrad of a placeholder
_queued = [-1]  # the backward (graph task) whose end forgets them
_captured = [-1, False]  # (graph task, whether it is torch.autograd.grad): asked once per backward


class GuardedTensorHook:
    """A user's ``register_hook`` hook, skipped for a placeholder and run when the reduced rows land."""

    __slots__ = ("hook",)

    def __init__(self, hook: Callable):
        self.hook = hook

    def __call__(self, grad: torch.Tensor) -> Optional[torch.Tensor]:
        if _live(_placeholders, grad):
            return None
        return self.hook(grad)


class GuardedPostAccumulateHook:
    """A user's ``register_post_accumulate_grad_hook`` hook, not run for the call that stores a placeholder."""

    __slots__ = ("hook",)

    def __init__(self, hook: Callable[[torch.Tensor], None]):
        self.hook = hook

    def __call__(self, param: torch.Tensor) -> None:
        left = _swallow.get(id(param), 0)
        if left:  # this is AccumulateGrad storing the placeholder (each of its guarded hooks once): wait for the rows
            if left == 1:
                del _swallow[id(param)]
            else:
                _swallow[id(param)] = left - 1
            return
        self.hook(param)


def _guarded(hooks, kind: type) -> list:
    return [h for h in (hooks or {}).values() if isinstance(h, kind)]


def zero_placeholder(param, like: torch.Tensor, lazy: bool = False):
    """The zero shard handed to ``param``'s AccumulateGrad while its reduced rows are still to come.  ``lazy``
    (see [Note: a lazy placeholder]): one zero element, expanded; the rows replace it where they land."""
    shape = param._layout.local_shape()
    zeros = (like.new_zeros((), dtype=param.dtype).expand(shape) if lazy
             else like.new_zeros(shape, dtype=param.dtype))
    placeholder = type(param)(zeros, param._layout, name=param._name)
    _placeholders[id(placeholder)] = weakref.ref(placeholder)
    if lazy:  # (by its shard: AccumulateGrad stores a detached alias of the placeholder, which shares it)
        _lazy[id(zeros)] = (weakref.ref(zeros), weakref.ref(param))
    task = torch._C._current_graph_task_id()
    if task != -1 and task != _queued[0]:  # forgotten at the end of this backward: all stored by then
        _queued[0] = task
        torch.autograd.Variable._execution_engine.queue_callback(forget_placeholders)
    guarded = len(_guarded(getattr(param, "_post_accumulate_grad_hooks", None), GuardedPostAccumulateHook))
    if guarded:
        _swallow[id(param)] = guarded
    return placeholder


def _live(table: dict[int, weakref.ref], grad) -> bool:
    ref = table.get(id(grad))
    return ref is not None and ref() is grad


def _is_lazy(grad) -> bool:
    refs = _lazy.get(id(grad._local))
    return refs is not None and refs[0]() is grad._local


def land_rows(param, shard: torch.Tensor, owned: bool) -> None:
    """Put this backward's reduced ``shard`` (after the tensor hooks) into ``param.grad``: in place of a lazy
    placeholder (``owned``: nobody else holds ``shard``, so it becomes the gradient, else a copy does), added to
    a gradient that holds rows already (an earlier backward's, or a placeholder of zeros)."""
    grad = param.grad
    if grad is None:  # the rows came before AccumulateGrad stored the placeholder (which then adds its zeros)
        param.grad = type(param)(shard if owned else shard.clone(), param._layout, name=param._name)
    elif _is_lazy(grad):
        del _lazy[id(grad._local)]
        grad.rehome_(shard if owned else shard.clone())
    else:
        grad._local.add_(shard)


def run_tensor_hooks(param, shard: torch.Tensor) -> torch.Tensor:
    """``param``'s guarded ``register_hook`` hooks on this backward's reduced ``shard``, in order; their result."""
    hooks = _guarded(getattr(param, "_backward_hooks", None), GuardedTensorHook)
    if not hooks:
        return shard
    grad = type(param)(shard, param._layout, name=param._name)
    for hook in hooks:
        result = hook.hook(grad)
        if result is None:
            continue
        if not isinstance(result, type(param)) or result._layout != param._layout or result.dtype != grad.dtype:
            raise TypeError(
                f"a gradient hook (register_hook) of sharded parameter {param._name!r} returned "
                f"{type(result).__name__} of shape {tuple(result.shape)} {result.dtype}; it receives the reduced "
                f"gradient as a sharded tensor ({type(param).__name__}, this rank's rows) and must return one like "
                "it (g.clamp(-c, c), g * 0.5) or None. To edit the full gradient, do it after backward().")
        grad = result
    return grad._local


def gradient_landed(param) -> None:
    """The reduced rows are in ``param.grad``: run the post-accumulate-grad hooks AccumulateGrad did not run."""
    for hook in _guarded(getattr(param, "_post_accumulate_grad_hooks", None), GuardedPostAccumulateHook):
        hook.hook(param)


def forget_placeholders() -> None:
    """A backward ended (or failed): its placeholders are stored or gone, and no AccumulateGrad call is owed."""
    for zeros_ref, param_ref in _lazy.values():  # never replaced (a failed backward): real zeros, writable
        zeros, param = zeros_ref(), param_ref()
        grad = None if param is None else param.grad
        if zeros is not None and grad is not None and grad._local is zeros:
            grad.rehome_(torch.zeros_like(zeros, memory_format=torch.contiguous_format))
    _placeholders.clear()
    _lazy.clear()
    _swallow.clear()
    _queued[0] = -1


# [Note: torch.autograd.grad of sharded parameters]
# ``torch.autograd.grad(loss, params)`` hands the gradients back and leaves ``.grad`` alone; a gradient penalty
# (``create_graph=True``) differentiates them again.  So the gradient hook must not reduce, defer or stash there:
# the caller gets what DDP's caller gets, this rank's own full gradient (a plain tensor, still in the graph), and
# no collective runs.  (Reducing it, as ``backward()`` does, returned a detached mean; a gather unit returned
# zeros and wrote the mean into ``.grad``.)
def captured_by_autograd_grad(param) -> bool:
    """Whether the running backward is ``torch.autograd.grad`` (gradients returned, nothing accumulated)."""
    task = torch._C._current_graph_task_id()
    if task == -1:
        return False
    if task != _captured[0]:
        _captured[0], _captured[1] = task, not _will_accumulate(param)
    return _captured[1]


def refuse_a_graph_on_grad(name: str) -> None:
    """``loss.backward(create_graph=True)`` (gradients that carry their graph, for a penalty on ``.grad``): a
    sharded ``.grad`` is this rank's shard of the mean over ranks, reduced by a collective that has no backward,
    so it cannot carry one, and a penalty built on it added nothing (gradients 2.1 off, silently).  Inside a
    backward the engine runs with grad mode on only where ``create_graph=True``."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"loss.backward(create_graph=True) on a sharded model: the gradient of {name!r} is reduced across "
            "ranks into this rank's shard, which cannot carry a graph, so a penalty built on .grad would add "
            "nothing. Fix: grads = torch.autograd.grad(loss, params, create_graph=True) (this rank's own full "
            "gradients, differentiable, as under DDP), build the penalty from them, then (loss + penalty)"
            ".backward(). Call zero_grad() before the next backward.")


def _will_accumulate(param) -> bool:
    with torch.enable_grad():
        accumulate = param.view_as(param).grad_fn.next_functions[0][0]  # the leaf's AccumulateGrad node
    try:
        return bool(torch._C._will_engine_execute_node(accumulate))
    except RuntimeError as exc:  # torch refuses to answer for a leaf under autograd.grad: that is the answer
        if "autograd.grad" in str(exc):
            return False
        raise


_compile.skip_in_dynamo(forget_placeholders)  # see [Note: backward hooks run eagerly] in _compile.py
