"""Gather units: the parameters of one module (a transformer block, an MoE layer) gathered and reduced together.

[Note: why units]
Per-op gathers are issued by the ops a rank runs, so a rank whose data decides which parameters it touches (an
expert loop that calls only the experts its tokens were routed to) issues other collectives than its peers.
A unit fixes that as FSDP2 does: its forward pre-hook gathers *all* its parameters (one collective per dtype:
a flat buffer of the unit's shards, or on gloo each large parameter straight into its full tensor, see
``_unit_buffers``), whatever the data, and ops inside find them in ``Gatherer.held`` (gathered again if written
since: ``regather``); the post-hook frees them.  Before the unit's backward (a hook on its outputs' gradients)
they are gathered again, and after it (a node on its inputs, or the end of backward) they are freed and the
unit's gradients are reduced together, in a fixed order, zeros for a parameter this rank gave no gradient; a
has-gradient flag per parameter travels in the same collective: a parameter no rank produced a gradient for
keeps ``grad=None``, as in the unsharded model (so AdamW does not decay an expert nobody used).

[Note: unheld gradients]
A gradient can reach a unit's parameter while the unit is not held for backward (its modules' backward hooks are
not around the op that produced it).  The unit keeps them and reduces them together once every parameter of it
that requires a gradient has one (or at the end of backward, zeros for the others): one collective per unit, and
the same order on every rank.

A parameter shared outside its unit (tied weights) keeps per-op gathers.  Default units: overlapped and auto
take FSDP2's wrapping (one collective per block and direction, not per parameter); sequential mode (lowest peak)
takes only MoE layers, where a unit is needed for the right numbers.  An explicit ``units=`` applies always.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from . import _comm, _comm_shm, _compile, _grad_landing, _hooks, _misuse, _traced
from ._layout import ShardLayout
from .gather import Gatherer, GatherMode
from .reduce import ExactReducer
from ._unit import _Unit
from ._unit_autograd import PostBackward, tie_if_another_rank_needs
from ._unit_policy import UnitPolicy, _data_dependent, select_units  # noqa: F401  (UnitPolicy: re-exported)
from ._unit_buffers import FullsPool, direct_positions, finish_reductions, reduce_exact
from .tensor import ShardedParam

if TYPE_CHECKING:
    from .reduce import GradSync


class UnitSet:
    """The units of one ``shard_module`` call, and the hooks that drive them."""

    def __init__(self, root: nn.Module, modules: list[nn.Module], gatherer: Gatherer, grad_sync: GradSync):
        self.units: list[_Unit] = []
        self.of_param: dict[int, tuple[_Unit, int]] = {}  # id(parameter) -> (unit, position)
        self.gatherer = gatherer
        self.pool = FullsPool()
        self.in_flight: list = []  # unit reductions in flight (see finish_reductions)
        self._tasks: set[int] = set()  # graph tasks whose end-of-backward callback is queued and has not run
        self.root_unit: Optional[_Unit] = None  # the unit of the module shard_module was given, if it is one
        self._kept: Optional[tuple[_Unit, object]] = None  # its forward's hold, kept for its backward (below)
        self._carry = False  # the pool holds the next forward's first buffers (see [Note: buffers across steps])
        uses: dict[int, int] = {}
        for _, p in root.named_parameters(remove_duplicate=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
        names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
        for module in modules:
            params, seen = [], set()
            inner: dict[int, int] = {}
            for _, p in module.named_parameters(remove_duplicate=False):
                inner[id(p)] = inner.get(id(p), 0) + 1
            for p in module.parameters():
                if isinstance(p, ShardedParam) and id(p) not in seen and inner[id(p)] == uses.get(id(p)) \
                        and p._gatherer is gatherer and id(p) not in self.of_param:
                    seen.add(id(p))
                    params.append(p)
            if not params:
                continue
            unit = _Unit(names.get(id(module)) or type(module).__name__, params, gatherer, grad_sync)  # (root: '')
            unit.pool, unit.in_flight = self.pool, self.in_flight
            unit.routes_by_data = _data_dependent(module)
            for i, p in enumerate(params):
                self.of_param[id(p)] = (unit, i)
            self.units.append(unit)
            module._shardtensor_unit = unit
            if module is root:
                self.root_unit = unit

    def open_channel(self) -> None:
        """Open the shared-memory channel for the units' collectives where every rank shares this host (see
        ``_comm_shm``): slots as large as the largest unit's share that one collective writes."""
        layouts = [p._layout for unit in self.units for p in unit.params]
        if not layouts:
            return
        group = layouts[0].group
        if any(type(lay) is not ShardLayout or lay.group is not group for lay in layouts) or \
                not all(_comm.on_gloo_cpu(p._local.device, group) for unit in self.units for p in unit.params):
            return
        dtypes = {p.dtype for unit in self.units for p in unit.params}  # gathered, reduced, or cast to these:
        dtypes |= {self.gatherer.param_dtype, getattr(self.units[0].grad_sync.strategy, "reduce_dtype", None)}
        itemsize = max(torch.empty((), dtype=d).element_size() for d in dtypes if d is not None)
        share = max(sum(p._layout.local_shape().numel() + 1 for p in unit.params) for unit in self.units)  # (+flags)
        channel = _comm_shm.Channel.open(group, (layouts[0].world - 1) * share * itemsize, _comm.collective_timeout())
        for unit in self.units:
            unit.channel = channel

    def attach(self, modules: list[nn.Module], handles: list) -> None:
        for module in modules:
            unit = getattr(module, "_shardtensor_unit", None)
            if unit is None:
                continue
            # (wrapped: pickling a unit's module names the fix instead of "Can't pickle local object")
            handles.append(module.register_forward_pre_hook(
                _misuse.PickleRefusingHook(self._pre_forward(unit), builds_graph=True), with_kwargs=True))
            handles.append(module.register_forward_hook(
                _misuse.PickleRefusingHook(self._post_forward(unit), builds_graph=True), always_call=True,
                with_kwargs=True))

    def reduce_together(self, params: list, keys: list[str], fulls: list[torch.Tensor], owned: list[bool],
                        strategy) -> Optional[list[torch.Tensor]]:
        """The mean shards of ``params``' whole gradients ``fulls`` (all of one unit), by one reduce-scatter through
        their unit's shared memory (a compiled backward's reduction, see ``_traced_grads.py``); None where they are
        not all of one unit with a channel, or the reducer is not the exact one.  ``owned[i]``: ``fulls[i]`` may be
        written (a gradient reduced in its own tensor is reduced in place: see [Note: direct gradients])."""
        found = [self.of_param.get(id(p)) for p in params]
        unit = found[0][0] if found[0] is not None else None
        channel = unit._channel() if unit is not None else None
        if channel is None or type(strategy) is not ExactReducer or any(f is None or f[0] is not unit for f in found):
            return None
        dtype = strategy.reduce_dtype or functools.reduce(torch.promote_types, [g.dtype for g in fulls])
        direct = set(direct_positions([p._layout for p in params], dtype, fulls[0].device))
        fulls = [g.clone(memory_format=torch.contiguous_format) if i in direct and not owned[i] else g
                 for i, g in enumerate(fulls)]
        ones = torch.ones(len(params), dtype=torch.float64)
        name = unit.name if len(params) > 1 else keys[0]
        return reduce_exact(name, params, fulls, ones, strategy.reduce_dtype, channel=channel)[0]

    def take_grad(self, param: ShardedParam, grad: torch.Tensor, owned: bool = False) -> Optional[torch.Tensor]:
        """GradSync's hook: keep a unit parameter's gradient for the unit's reduction; a zero shard goes to
        AccumulateGrad (the reduced shard is added to ``.grad`` later).  None: not a unit parameter."""
        found = self.of_param.get(id(param))
        if found is None:
            return None
        unit, position = found
        self._queue_end_of_backward()
        if unit.backward_holds == 0:
            unit.stash_unheld(position, grad, owned)
        else:
            unit.stash(position, grad, owned)
        return _grad_landing.zero_placeholder(param, grad, lazy=True)  # see [Note: a lazy placeholder]

    def _pre_forward(self, unit: _Unit):
        def hook(module, args, kwargs):
            if torch.compiler.is_compiling():  # traced gathers instead (see _traced.py)
                return None
            with _hooks.outside_functorch_transforms():  # (its autograd node below stays inside them)
                self._drop_failed_backward()
                unit.hold()
                self._prefetch_after(unit, +1)
                if not (self._carry and unit is self.root_unit):  # the first block's hook takes the rest
                    self._clear_pool()
            if not torch.is_grad_enabled():
                return None
            flat = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            if not flat:
                return None
            wrapped = iter(PostBackward.apply(unit, *flat))
            return tuple(next(wrapped) if isinstance(a, torch.Tensor) and a.requires_grad else a
                         for a in args), kwargs

        return hook

    def _post_forward(self, unit: _Unit):
        def hook(module, args, kwargs, output):
            if torch.compiler.is_compiling():
                return None
            with _hooks.outside_functorch_transforms():
                token = self._keep_for_backward(unit, output)
                if token is None:  # (the root's forward ends the forward: nothing of its gathers follows)
                    unit.gives = unit is not self.root_unit and self._next_overlapped(unit, +1) is not None
                    unit.unhold()
                    unit.gives = False
            if unit.routes_by_data and torch.is_grad_enabled():  # [Note: a unit's output that needs no gradient ...]
                tied = tie_if_another_rank_needs(unit, (*args, *kwargs.values()), output, unit.params[0]._layout.group)
                output = output if tied is None else tied
            outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs and torch.is_grad_enabled():
                torch.autograd.graph.register_multi_grad_hook(  # (a partial: no frame of its own for Dynamo)
                    outputs, functools.partial(self._pre_backward, unit, token), mode="any")
            return output

        return hook

    def _pre_backward(self, unit: _Unit, token: Optional[object] = None, _grads: object = None) -> None:
        with _hooks.outside_functorch_transforms():  # (a backward inside torch.func.jacrev, say)
            self._pre_backward_outside_transforms(unit, token)

    def _pre_backward_outside_transforms(self, unit: _Unit, token: Optional[object]) -> None:
        unit.backward_task = self._queue_end_of_backward()
        if token is not None and self._kept is not None and self._kept[1] is token:
            self._kept = None  # the hold its forward kept becomes this backward's
        else:
            unit.hold()
        unit.backward_holds += 1
        last = self._next_overlapped(unit, -1) is None
        unit.gives = not last or self._carries()  # for the unhold after backward
        self._prefetch_after(unit, -1)
        if not (last and self._carries()):  # the last unit's backward keeps what the one before it freed
            self._clear_pool()

    # [Note: the root unit's hold into its backward]
    # The root unit is held through the whole forward, and its backward is the first to run: freeing its
    # parameters after the forward only to gather them again a moment later costs a gather, an identity check
    # and, on the CPU, page faults for nothing.  FSDP2 does not reshard its root after the forward either.  In
    # overlapped mode a forward with gradients, outside any backward (not an activation checkpoint's recomputation),
    # keeps the root unit's hold with a token; the backward of that same forward takes it over, and the next root
    # forward releases a hold that no backward took (an evaluation with gradients on, a forward whose loss was
    # dropped).  A backward of an older forward gathers as before.  Every rank decides alike: the mode is agreed,
    # and grad mode and the graph are the program's.
    def _keep_for_backward(self, unit: _Unit, output) -> Optional[object]:
        """A token for the hold kept for this forward's backward (see the note above); None: release it now."""
        if unit is not self.root_unit or unit.routes_by_data or not torch.is_grad_enabled() \
                or torch._C._current_graph_task_id() != -1 or self.gatherer.reduce_overlap_bytes() <= 0 \
                or not any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(output)):
            return None
        self._release_kept()
        token = object()
        self._kept = (unit, token)
        return token

    def _release_kept(self) -> None:
        kept, self._kept = self._kept, None
        if kept is not None:
            kept[0].unhold()

    # [Note: nested and failed backwards]
    # A backward can run inside another: reentrant activation checkpointing recomputes a block and runs its own
    # ``torch.autograd.backward`` from within the outer one.  Each graph task gets its own end-of-backward callback,
    # and the outer task's state (stashed gradients, reductions in flight) is kept.  A backward that raised never
    # runs its callback: its state is dropped at the next forward that runs outside any backward, which no nested
    # backward can be (a reentrant recomputation runs inside one).
    def _queue_end_of_backward(self) -> int:
        task = torch._C._current_graph_task_id()
        if task != -1 and task not in self._tasks:
            self._tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._end_of_backward, task))
        return task

    def _drop_failed_backward(self) -> None:
        """A forward outside any backward while a backward's end never came: that backward failed."""
        if not self._tasks or torch._C._current_graph_task_id() != -1:
            return
        self._tasks.clear()
        self._kept = None
        for unit in self.units:
            unit.reset()
        self.in_flight.clear()
        _grad_landing.forget_placeholders()

    def _prefetch_after(self, unit: _Unit, step: int) -> None:
        """Overlapped mode: start the next unit's gathers (forward: the next in module order; backward: the
        previous), as FSDP2 does.  Every rank reaches the same hooks, so every rank issues the same prefetch."""
        if (neighbour := self._next_overlapped(unit, step)) is not None:
            neighbour.prefetch()

    def _next_overlapped(self, unit: _Unit, step: int) -> Optional[_Unit]:
        """The next unit this way, in overlapped mode; None in sequential mode (lowest peak: no prefetch, no reuse).
        The root unit, listed last, is held around every block: its forward is followed by the first block's."""
        k = self.units.index(unit) + step
        if unit is self.root_unit and step > 0:
            k = 0 if self.units[0] is not unit else len(self.units)
        return self.units[k] if self.gatherer.reduce_overlap_bytes() > 0 and 0 <= k < len(self.units) else None

    # [Note: buffers across steps]
    # On the CPU a full tensor allocated afresh costs its page faults (``_unit_buffers``, [Note: recycled full
    # tensors]), and within a step the pool recycles only between neighbouring units: every step began with fresh
    # buffers for the root unit and the first two blocks.  In overlapped mode on the CPU the units the backward
    # frees last (the root, the first block, the one after it) hand their buffers to the pool, which keeps them
    # through the optimizer step until the next forward's first gathers take them (the root's pre-forward hook,
    # then the first block's, which empties the pool).  The memory they hold then is what those gathers hold a
    # moment later, and the optimizer step's own peak is far below a forward's or a backward's (shards and their
    # moments, against those plus the activations and gathered units).  CUDA's caching allocator already reuses
    # freed blocks, so there nothing is carried.
    def _carries(self) -> bool:
        return self.gatherer.reduce_overlap_bytes() > 0 and self.units[0].params[0]._local.device.type == "cpu"

    def _clear_pool(self) -> None:
        self._carry = False
        self.pool.clear()

    def step_begin(self, *args) -> None:
        """Root forward: prefetches nobody used (the order changed) are completed and dropped."""
        if torch.compiler.is_compiling():
            return
        self._drop_failed_backward()
        self._release_kept()
        for unit in self.units:
            unit.drop_prefetch()
        if not self._carry:
            self._clear_pool()

    def _end_of_backward(self, task: int) -> None:
        """Units this backward held whose inputs needed no gradient (no post-backward node ran): free and reduce,
        in unit order.  A unit an enclosing backward holds is left to that one's end.  If this raises (a user's
        gradient hook, run as a reduction lands), the backward failed: its state is dropped at the next forward,
        as any failed backward's (see [Note: nested and failed backwards])."""
        self._tasks.discard(task)
        try:
            self._finish_backward()
        except BaseException:
            self._tasks.add(task)
            raise

    def _finish_backward(self) -> None:
        for unit in self.units:
            unit.drop_prefetch()
            if unit.backward_task in self._tasks:  # held by a backward still running around this one
                continue
            unit.gives = self._carries()  # (see [Note: buffers across steps])
            while unit.backward_holds:
                unit.post_backward()
            unit.gives = False
            unit.reduce_unheld()
        finish_reductions(self.in_flight)
        if self._carries() and not self._tasks:
            self._carry = True
        else:
            self._clear_pool()


def attach_units(root: nn.Module, policy: UnitPolicy, gatherer: Gatherer, grad_sync: GradSync,
                 handles: list) -> Optional[UnitSet]:
    """Build the units ``policy`` selects and hook them up (none in a world of one: nothing to gather)."""
    modules = select_units(root, policy, blocks=gatherer.mode is not GatherMode.SEQUENTIAL)
    units = UnitSet(root, modules, gatherer, grad_sync)
    if not units.units or all(u.params[0]._layout.world == 1 for u in units.units):
        return None
    # (before a root unit's own hook)
    handles.append(root.register_forward_pre_hook(_misuse.PickleRefusingHook(units.step_begin)))
    units.attach(modules, handles)
    grad_sync.units = units
    if gatherer.mode is not GatherMode.SEQUENTIAL:
        units.open_channel()
        _traced.record_units(units.units, units.root_unit)  # under compile too (sequential: a gather per read)
    return units


_compile.skip_in_dynamo(UnitSet._pre_backward)  # see [Note: backward hooks run eagerly] in _compile.py
_compile.skip_in_dynamo(UnitSet._end_of_backward)
_compile.skip_in_dynamo(Gatherer._backward_ended)
_compile.compile_callees_only(_misuse.PickleRefusingHook.__call__)  # every hook's wrapper (see _hooks.py)
