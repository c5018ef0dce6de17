"""Gradients: the full gradient arrives, this rank's shard of the mean leaves (see ARCHITECTURE.md).

[Note: why a pre-accumulate hook]
The hook is a tensor hook on the leaf (``register_hook``), so it runs *before* AccumulateGrad.  It turns the
full gradient into a sharded one, and AccumulateGrad then stores (first backward) or adds (gradient
accumulation) ShardedParams of one layout, which the op table runs shard-wise.  A post-accumulate hook would
see the full gradient already summed into a sharded ``.grad`` it cannot reduce any more.  The full gradient is
dropped when the hook returns.

Reducers are pluggable.  The protocol a user's reducer implements::

    reducer.reduce(full_grad, *, key, group) -> shard

``full_grad`` is this rank's un-reduced gradient padded with zero rows to ``(world * rows_per_rank, ...)``;
the result is this rank's ``(rows_per_rank, ...)`` rows of the *mean* over ranks, in ``full_grad``'s dtype.
``ExactReducer`` reduce-scatters; ``shardtensor.optim.CompressedReducer`` sends 4-bit chunks.

A reducer owns the placement logic too: ``GradSync`` calls ``reduce_grad(grad, layout, ...)`` (the
``GradStrategy`` protocol), which pads, reduces, and may start the collective asynchronously.  ``ExactReducer``
implements it; ``layerwise.OwnerReducer`` reduces to the owner; a reducer with only ``reduce`` is adapted by
``as_strategy``.  So the gradient hook has one path whatever the placement and the reducer.
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional, Protocol

import torch

from . import _comm, _compile, _grad_landing, _misuse, _traced_grads
from ._deferred_grads import DeferredGradients
from ._layout import ShardLayout
from .tensor import ShardedParam


class GradientReducer(Protocol):
    def reduce(self, full_grad: torch.Tensor, *, key: str, group) -> torch.Tensor: ...


class GradStrategy(Protocol):
    def reduce_grad(self, grad: torch.Tensor, layout: ShardLayout, *, key: str, dtype: torch.dtype,
                    owned: bool, overlap: bool) -> "torch.Tensor | PendingReduce":
        """This rank's shard of the mean gradient (or a ``PendingReduce`` that becomes it, when ``overlap``
        allows an asynchronous start).  ``grad`` is this rank's full gradient; ``owned``: nobody else holds it."""
        ...


class _ReduceOnly:
    """A reducer that only implements ``reduce`` (e.g. ``CompressedReducer``), on dim-0 layouts."""

    def __init__(self, reducer: GradientReducer):
        self.reducer = reducer

    def reduce_grad(self, grad, layout, *, key, dtype, owned, overlap):
        with _comm.labelled(f"gradient reduction of {key!r}"):
            return self.reducer.reduce(layout.pad(grad), key=key, group=layout.group)


def as_strategy(reducer) -> GradStrategy:
    """``reducer`` itself when it implements ``reduce_grad``, else an adapter around its ``reduce``."""
    return reducer if hasattr(reducer, "reduce_grad") else _ReduceOnly(reducer)


class ExactReducer:
    """Mean gradient by reduce-scatter, optionally in ``reduce_dtype`` (e.g. fp32 for bf16 gradients)."""

    def __init__(self, reduce_dtype: Optional[torch.dtype] = None):
        self.reduce_dtype = reduce_dtype

    def start(self, full_grad: torch.Tensor, *, key: str, group) -> "PendingReduce":
        """Issue the reduce-scatter without waiting (only when no dtype change is needed: the result buffer is
        the shard itself, finished in place)."""
        result = _comm.reduce_scatter_rows(full_grad, group, async_op=True)
        return PendingReduce(result.buffer, result.work, _comm.world_size(group), full_grad)

    def can_start(self, full_grad: torch.Tensor, group) -> bool:
        return _comm.world_size(group) > 1 and (self.reduce_dtype is None or self.reduce_dtype == full_grad.dtype)

    def reduce_grad(self, grad: torch.Tensor, layout: ShardLayout, *, key: str, dtype: torch.dtype,
                    owned: bool, overlap: bool) -> "torch.Tensor | PendingReduce":
        if layout.world == 1 and grad.dtype == dtype and self.reduce_dtype in (None, dtype):
            # The mean over one rank is the gradient itself: keep it, as AccumulateGrad would, unless someone
            # else holds it (then a copy, as AccumulateGrad makes).
            return grad if owned and grad.is_contiguous() else grad.clone(memory_format=torch.contiguous_format)
        with _comm.labelled(f"gradient reduction of {key!r}"):  # named if a rank dies before it completes
            if overlap and self.can_start(grad, layout.group):
                return self.start(layout.pad(grad), key=key, group=layout.group)
            return self.reduce(layout.pad(grad), key=key, group=layout.group)

    def reduce(self, full_grad: torch.Tensor, *, key: str, group) -> torch.Tensor:
        wire = full_grad if self.reduce_dtype is None else full_grad.to(self.reduce_dtype)
        shard = _comm.reduce_scatter_rows(wire, group).buffer
        world = _comm.world_size(group)
        if shard is wire:  # world 1: no collective, and the input must not be modified in place
            shard = shard.clone() if shard is full_grad else shard
        if world > 1:
            shard.div_(world)
        return shard.to(full_grad.dtype)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class PendingReduce:
    """An issued reduce-scatter: ``shard`` becomes this rank's mean gradient once ``finish()`` has run."""

    __slots__ = ("shard", "work", "world", "full_grad")

    def __init__(self, shard: torch.Tensor, work, world: int, full_grad: torch.Tensor):
        self.shard = shard
        self.work = work
        self.world = world
        self.full_grad = full_grad  # the input must stay alive until the collective completes

    def nbytes(self) -> int:
        return self.full_grad.numel() * self.full_grad.element_size()

    def finish(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.shard.div_(self.world)
            self.work = None
            self.full_grad = None
        return self.shard


# A tensor that autograd passes to a tensor hook is referenced by the engine's input buffer and by the hook's
# Python object; a higher count means another node of the graph (or a view's base link) still holds it.
_HOOK_USE_COUNT = 2
_HAS_USE_COUNT = hasattr(torch.Tensor, "_use_count")


def _only_autograd_holds(grad: torch.Tensor) -> bool:
    """AccumulateGrad's test for stealing a gradient instead of copying it (``use_count`` of the tensor, and of a
    view's base), so a gradient we keep can alias nothing that a plain PyTorch ``.grad`` could not alias.  Where
    the engine passes one gradient to two leaves (``p + q``), the first to arrive sees the other's reference."""
    if not _HAS_USE_COUNT or grad._use_count() > _HOOK_USE_COUNT or grad._is_zerotensor():
        return False  # (a torch without Tensor._use_count: always copy, as before; a ZeroTensor is immutable)
    if not grad._is_view():
        return True
    base = grad._base  # None for some views autograd builds (linalg.vector_norm's backward): cannot tell, copy
    return base is not None and base._use_count() <= _HOOK_USE_COUNT


def _read_by_user_hooks(param: torch.Tensor) -> bool:
    """Whether hooks besides our own reducing one read ``param``'s gradient during backward."""
    return bool(getattr(param, "_post_accumulate_grad_hooks", None)) or len(param._backward_hooks or ()) > 1


class GradSync(DeferredGradients, _traced_grads.CompiledReductions):
    """Per-module switch and reducer shared by the gradient hooks of one ``shard_module`` call."""

    def __init__(self, reducer: GradientReducer, grad_dtype: Optional[torch.dtype] = None,
                 max_pending_bytes: int = 64 << 20, strategy: Optional[GradStrategy] = None):
        self.reducer = reducer  # the user's reducer (its state_dict is checkpointed)
        self.strategy = strategy if strategy is not None else as_strategy(reducer)
        self.enabled = True
        self.grad_dtype = grad_dtype
        self.max_pending_bytes = max_pending_bytes
        self.pending_budget: Callable[[], int] = lambda: max_pending_bytes  # shard_module: the Gatherer's policy
        self._pending: list[PendingReduce] = []
        self._replicated_params: dict[int, tuple] = {}  # id -> (parameter, group, name), in registration order
        self._finish_queued_for = None  # the backward (graph task) whose end-of-backward callback is queued
        self._deferred: dict[str, torch.Tensor] = {}  # key -> summed full local gradient (gradient_sync off)
        self._deferred_at: dict[str, int] = {}  # key -> its last deferral's stamp (zero_grad since throws it away)
        self._deferred_now: set[str] = set()  # keys deferred since the last end of a deferring backward
        self._deferred_task: dict[str, int] = {}  # key -> the backward (graph task) that last deferred it
        self._holders_queued_for = None  # the deferring backward whose end gives their .grad shards a scale log
        self._local_sums: set[int] = set()  # kept-whole parameters whose .grad got gradients while sync was off
        self._averaged_at_once: set[int] = set()  # kept-whole parameters a hook averaged in this backward
        self.units = None  # _units.UnitSet: its parameters' gradients are reduced per unit, not here
        self._frozen: dict[int, tuple] = {}  # id(param) -> (param, key, group, handles): hooked once trainable
        self.compiled_params: dict[str, ShardedParam] = {}  # key -> parameter, for compiled backwards' reductions

    # A parameter frozen at shard time (``requires_grad=False``) can take no hook (torch refuses one), and one
    # unfrozen later would otherwise train on its own full, unaveraged gradient.  So its hook is registered at the
    # first root forward that finds it trainable (``attach_unfrozen``).
    def attach(self, param: torch.Tensor, handles: list, *, key: Optional[str] = None, group=None,
               name: str = "") -> None:
        """Register ``param``'s gradient hook: the sharded one (``key``: its name), or the replicated one
        (``group``, ``name``); now if it requires a gradient, else once it does."""
        if key is None:
            self._replicated_params.setdefault(id(param), (param, group, name))
            param._shardtensor_replicated = True  # averaged here (an optimizer's check tells it from an outsider)
        else:
            _traced_grads.record(param, self, key)
        if not param.requires_grad:
            self._frozen[id(param)] = (param, key, group, handles, name)
            return
        self._frozen.pop(id(param), None)
        hook = self.sharded_grad_hook(param, key) if key is not None else \
            self.replicated_grad_hook(group, param, name)
        _compile.skip_in_dynamo(hook)  # see [Note: backward hooks run eagerly] in _compile.py
        handles.append(torch.Tensor.register_hook(param, hook) if key is not None else param.register_hook(hook))

    def attach_unfrozen(self) -> None:
        """Root forward: hook the parameters frozen at shard time that require a gradient now."""
        for param, key, group, handles, name in [v for v in self._frozen.values() if v[0].requires_grad]:
            self.attach(param, handles, key=key, group=group, name=name)

    # [Note: overlapped gradient reduction]
    # The first gradient of a parameter in a backward is reduce-scattered asynchronously: the hook returns a
    # ShardedParam over the output buffer, AccumulateGrad stores it without reading it, and the engine's
    # end-of-backward callback waits and divides by the world size in place.  It is only safe when nothing
    # reads the gradient before backward ends, so it stays synchronous when the parameter already has a
    # gradient (AccumulateGrad adds at once), when the user hooked it (a ``register_hook`` hook after ours reads
    # the returned gradient: a clamp of a buffer still being filled is garbage; post-accumulate hooks such as
    # CPUAdam's speculative steps read ``.grad``), or when the reducer cannot start one (4-bit, layer-wise, a
    # dtype change).
    def _may_overlap(self, param: ShardedParam, grad: torch.Tensor, dtype: torch.dtype) -> bool:
        self.max_pending_bytes = self.pending_budget()
        return (self.max_pending_bytes > 0 and grad.dtype == dtype and param.grad is None
                and not _read_by_user_hooks(param))

    def _track(self, pending: PendingReduce) -> torch.Tensor:
        self._pending.append(pending)
        while sum(p.nbytes() for p in self._pending if p.work is not None) > self.max_pending_bytes:
            next(p for p in self._pending if p.work is not None).finish()
        self._queue_finish()
        return pending.shard

    def finish_pending(self) -> None:
        """End of backward: reduce the deferred gradients this synced backward did not reach, wait for every
        issued reduce-scatter, average the replicated gradients.  One callback, in that order: two callbacks
        queued by whichever hook fired first ran in an order the data chose (a rank whose first hook was a
        replicated gain's averaged those first, its peer reduced a deferred weight first: a divergence)."""
        if self._deferred and self.enabled and torch._C._current_graph_task_id() != -1:
            _misuse.flush_deferred(self)
        pending, self._pending = self._pending, []
        for p in pending:
            p.finish()
        self._finish_replicated()

    def sharded_grad_hook(self, param: ShardedParam, key: str):
        layout = param._layout
        dtype = param.dtype

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if isinstance(grad, ShardedParam):  # a gradient computed shard-wise is already this rank's
                if _traced_grads.reduced_in_this_backward(key) and _grad_landing.captured_by_autograd_grad(param):
                    raise RuntimeError(
                        f"torch.autograd.grad through a compiled sharded model: its backward reduced the gradient "
                        f"of {key!r} to this rank's shard of the mean, where eager returns this rank's own full "
                        "gradient. Fix: call loss.backward() and read .grad, or run the model eagerly for "
                        "torch.autograd.grad.")
                return grad
            if _grad_landing.captured_by_autograd_grad(param):  # see [Note: torch.autograd.grad of ...]
                return grad
            _grad_landing.refuse_a_graph_on_grad(key)
            if grad.layout is not torch.strided:  # F.embedding(..., sparse=True) called on a sharded weight
                raise RuntimeError(f"the gradient of {param._name!r} is {grad.layout} (sparse=True in "
                                   "F.embedding or F.embedding_bag): a sharded parameter needs a dense gradient. "
                                   "Fix: sparse=False.")
            owned = _only_autograd_holds(grad)
            grad = grad.detach()
            if not self.enabled:  # gradient_sync(module, False): keep the full local gradient, reduce later
                self._defer(key, grad, (param, layout))
                return _grad_landing.zero_placeholder(param, grad)
            summed = self._with_deferred(key, grad, param)
            owned, grad = owned or summed is not grad, summed
            if self._replicated_params:
                self._queue_finish_once()  # the replicated gradients' reduction must run on every rank
            kept = self.units.take_grad(param, grad, owned) if self.units is not None else None
            if kept is not None:
                return kept
            with _comm.inputs_may_be_overwritten(owned):  # nobody else reads this gradient after us
                shard = self.strategy.reduce_grad(grad, layout, key=key, dtype=dtype, owned=owned,
                                                  overlap=self._may_overlap(param, grad, dtype))
            if isinstance(shard, PendingReduce):
                shard = self._track(shard)
            return ShardedParam(shard if shard.dtype == dtype else shard.to(dtype), layout, name=key)

        return hook

    def replicated_grad_hook(self, group, param: Optional[torch.Tensor] = None, name: str = ""):
        """Parameters that stay whole on every rank (0-d, or below ``persist_numel``): gradients averaged like
        DDP's.  The first gradient of a backward is averaged with the others in one flat all-reduce at the end
        of backward (the same safety rules as the overlapped reduce-scatter, see [Note: replicated gradients]);
        the rest at once, each under its own name."""

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if param is not None and _grad_landing.captured_by_autograd_grad(param):  # this rank's own gradient
                return grad
            _grad_landing.refuse_a_graph_on_grad(name)
            if not self.enabled:  # DDP's no_sync: .grad sums this rank's gradients, averaged whole at the next end
                if param is not None:
                    self._local_sums.add(id(param))
                return grad
            self._queue_finish_once()
            if param is None or not _read_by_user_hooks(param):
                return grad
            # A hook reads .grad during backward (see [Note: replicated gradients]): average now, with this rank's
            # own sum of micro-batches folded in, so every rank's hook reads the same .grad.
            grad = grad.detach().clone()
            local = param.grad if id(param) in self._local_sums else None
            if local is not None:
                grad.add_(local)
            _comm.all_reduce(grad, group, op="avg", label=f"average of the replicated gradient of {name!r}")
            self._averaged_at_once.add(id(param))
            if local is None:
                return grad
            self._local_sums.discard(id(param))
            local.copy_(grad)
            return torch.zeros_like(grad)  # (AccumulateGrad adds zeros to the mean)

        return hook

    def _queue_finish(self) -> None:
        # One callback per issued reduction, not one per GradSync: a flag would go stale if a backward failed
        # before its callbacks ran, and the next backward's reductions would then never be finished.  Extra
        # callbacks find nothing pending and return.
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_pending)

    def _queue_finish_once(self) -> None:
        """``_queue_finish`` once per backward (graph task), marking that its end reduces the replicated gradients
        (a failed backward's callback never ran; the next backward is another task)."""
        task = torch._C._current_graph_task_id()
        if task != self._finish_queued_for:
            self._finish_queued_for = task
            self._queue_finish()

    # [Note: replicated gradients]
    # A replicated parameter's gradient is averaged like DDP's: AccumulateGrad sums this rank's gradients into
    # ``.grad`` (also while ``gradient_sync`` is off, as DDP's ``no_sync`` does), and the end of a synced backward
    # averages every trainable replicated parameter's whole ``.grad`` over the ranks, in registration order (the
    # same on every rank), in one flat all-reduce per (group, dtype, device) with a has-gradient count per
    # parameter.  So whatever a script does to ``.grad`` between micro-batches (zeroes it by hand, clips it, reads
    # it) is what DDP would see; a part already averaged is the same on every rank and stays itself.  A rank whose
    # ``.grad`` is None adds zeros; the mean is then the unsharded run's (an expert one rank's tokens skipped), and
    # a parameter no rank has a gradient for keeps grad None.  Averaging in the order the hooks fired put one
    # parameter's gradient beside another's where the ranks' data took different paths (an MoE's per-expert gains,
    # two heads picked by the batch): averaged with each other, silently.  Only a gradient a user hook reads
    # during backward is averaged at once (the whole ``.grad`` again at the end: a no-op for what was averaged).
    def _finish_replicated(self) -> None:
        if self._finish_queued_for is None:  # no gradient of this module in this backward (or done already)
            return
        self._finish_queued_for = None
        failed = torch._C._current_graph_task_id() == -1  # a failed backward's, finished at the next forward: its
        buckets: dict = {}  # gradients are left as they are (the next synced end averages them)
        if not failed:
            self._local_sums.clear()
        averaged, self._averaged_at_once = self._averaged_at_once, set()
        # Frozen ones too: a sum kept while sync was off must be averaged, and the layout is the same on every rank.
        for param, group, name in self._replicated_params.values():
            buckets.setdefault((id(group), param.dtype, param.device), (group, []))[1].append((param, name))
        for group, params in buckets.values():
            self._average_replicated(group, params, failed, averaged)

    @torch.no_grad()
    def _average_replicated(self, group, params: list, failed: bool, averaged: set) -> None:
        """``averaged``: ids of parameters a hook averaged during this backward; their ``.grad`` is the mean on
        every rank already and is not written again (the write's version bump read as a gradient rewritten after
        its hooks, and ``CPUAdam`` paused speculation for the whole model)."""
        sizes = [param.numel() for param, _ in params]
        total = sum(sizes)
        flat = torch.zeros(total + len(params), dtype=params[0][0].dtype, device=params[0][0].device)
        values, counts = flat[:total].split(sizes), flat[total:]
        for k, (param, _) in enumerate(params):
            if param.grad is not None and not failed:
                values[k].copy_(param.grad.reshape(-1))
                counts[k] = 1
        frozen = frozen_in_label([name for param, name in params if not param.requires_grad])
        _comm.all_reduce(flat, group, label=f"replicated gradients of {params[0][1]!r} and {len(params) - 1} more{frozen}")
        world = _comm.world_size(group)
        for k, (param, _) in enumerate(params):
            if counts[k] == 0 or failed or id(param) in averaged:
                continue  # no rank has a gradient for it, or it is the mean already
            mean = values[k].div_(world).view_as(param)
            if param.grad is None:
                param.grad = mean.clone()
            else:
                param.grad.copy_(mean)


def frozen_in_label(frozen: list[str]) -> str:
    """Frozen parameters, for the label of a reduction whose CRC is in the identity record: a parameter frozen on
    one rank only has no gradient there, and the has-gradient flags took it for one that rank's data skipped (the
    other ranks' gradient over the world, silently) where DDP refuses it."""
    if not frozen:
        return ""
    return (f"; frozen: {len(frozen)}, first {frozen[0]!r}, #{zlib.crc32(' '.join(frozen).encode()):08x} "
            "(requires_grad must be the same on every rank)")


_compile.skip_in_dynamo(GradSync.finish_pending)  # see [Note: backward hooks run eagerly] in _compile.py
