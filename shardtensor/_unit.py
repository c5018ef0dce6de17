"""One gather unit: its parameters gathered together (held while its module runs forward or backward) and its
gradients reduced together.  The hooks that decide when are ``_units.UnitSet``'s; see [Note: why units] there."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from . import _comm, _grad_landing, _misuse
from ._layout import ShardLayout
from .reduce import ExactReducer
from ._unit_buffers import (FlatGrads, HeldFull, complete_unit_gathers, finish_reductions, flat_dtype,
                            issue_unit_gathers, reduce_exact)
from .tensor import ShardedParam

if TYPE_CHECKING:
    from .gather import Gatherer
    from .reduce import GradSync


class _Unit:
    def __init__(self, name: str, params: list[ShardedParam], gatherer: Gatherer, grad_sync: GradSync):
        self.name = name
        self.params = params  # fixed order: every rank gathers and reduces them in it
        self.gatherer = gatherer
        self.grad_sync = grad_sync
        self.holds, self.backward_holds = 0, 0  # phases holding the gathered parameters (all; backward ones)
        self.grads: dict[int, torch.Tensor] = {}  # position -> this rank's summed full gradient
        self.flat: Optional[FlatGrads] = None  # or: in the reduction buffer (see [Note: flat unit gradients])
        self.prefetched: Optional[tuple] = None  # gathers issued ahead of the unit's hold
        self._held_keys: list[int] = []
        self._fulls: list[torch.Tensor] = []  # held full tensors the UnitSet's pool may recycle when ``gives``
        self.pool, self.gives = None, False  # (see [Note: recycled full tensors])
        self.channel = None  # the UnitSet's shared-memory channel, if any (see _comm_shm)
        self.in_flight: list = []  # UnitSet's reductions in flight (see finish_reductions)
        self.unheld: set[int] = set()  # positions stashed outside a hold (see [Note: unheld gradients])
        self.backward_task = -1  # the graph task that last held the unit for backward

    def reset(self) -> None:
        """Forget what a failed backward left (held buffers, stashed gradients): a new backward starts clean."""
        self.grads, self.flat, self.unheld = {}, None, set()
        self.backward_holds = 0
        self.holds, self.gives = 1, False
        self.unhold()

    # ------------------------------------------------------------------ gathers
    def hold(self) -> None:
        if self.holds == 0:
            pending = self.prefetched or self._start(async_op=False)
            fulls = self._finish(pending)
            self._fulls = [full for bucket in pending[1] for full in bucket.fulls.values()]
            self._held_keys = [id(param._local) for param in self.params]  # ops find their shard by identity
            self.gatherer.held.update((k, HeldFull(f, v, self)) for k, f, v in zip(self._held_keys, fulls, pending[2]))
            self.prefetched = None
        self.holds += 1

    def regather(self, param: ShardedParam) -> torch.Tensor:
        """``param``'s shard was written since the unit gathered it (a weight constraint in the unit's forward, an
        earlier unit writing into it): gather it again, so later ops see the write, as unsharded ones would."""
        with _comm.labelled(self._label([[id(p._local) for p in self.params].index(id(param._local))])):
            full = param._layout.gather(self._shard_for_gather(param)).buffer[: param._layout.shape[0]]
        self.gatherer.held[id(param._local)] = HeldFull(full, param._local._version, self)
        return full

    def unhold(self) -> None:
        self.holds = max(0, self.holds - 1)
        if self.holds == 0:
            for key in self._held_keys:
                self.gatherer.held.pop(key, None)
            self._held_keys = []
            fulls, self._fulls = self._fulls, []
            if self.gives and self.pool is not None:
                for full in fulls:
                    self.pool.give(full)

    def prefetch(self) -> None:
        """Start this unit's gathers now (overlapped mode: while the previous unit computes)."""
        if self.holds == 0 and self.prefetched is None:
            self.prefetched = self._start(async_op=True)
            self.gatherer.prefetches += 1

    def drop_prefetch(self) -> None:
        pending, self.prefetched = self.prefetched, None
        if pending is not None:
            self._finish(pending)  # every rank issued it: complete it before dropping

    def _label(self, positions: list[int]) -> str:
        names = [self.params[i]._name for i in positions]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        return f"all-gather of {', '.join(map(repr, names[:3]))}{more} (unit {self.name!r})"

    def _start(self, *, async_op: bool) -> tuple:
        """Issue the unit's gathers: one collective per (group, dtype), see ``issue_unit_gathers``."""
        versions = [param._local._version for param in self.params]  # what the gathered data is (see regather)
        shards = [self._shard_for_gather(param) for param in self.params]
        self.gatherer.gathers += len(self.params)
        return shards, issue_unit_gathers(self.params, shards, self._label, async_op, self.pool,
                                          self._channel()), versions

    def gather_for_graph(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """A compiled graph's gather of the whole unit from ``shards`` (see [Note: unit gathers under compile] in
        ``_traced.py``): fresh tensors the graph owns (no pool: the graph frees them), full base shapes."""
        self.gatherer.gathers += len(self.params)
        label = lambda positions: self._label(positions) + " (compiled)"  # noqa: E731
        return complete_unit_gathers(self.params, issue_unit_gathers(self.params, shards, label, False, None,
                                                                     self._channel()))

    def _channel(self):
        """Overlapped mode's shared-memory channel, if the UnitSet opened one (see ``_comm_shm``); None in
        sequential mode (the lowest peak: its slots would add to it) and under memory pressure."""
        return self.channel if self.channel is not None and self.gatherer.reduce_overlap_bytes() > 0 else None

    def _shard_for_gather(self, param: ShardedParam) -> torch.Tensor:
        g = self.gatherer
        local = param._local if g.shard_source is None else g.shard_source.shard_for_gather(
            g._index[id(param._local)], param)
        return local.to(g.param_dtype) if g.param_dtype is not None and local.is_floating_point() else local

    def _finish(self, pending: tuple) -> list[torch.Tensor]:
        """Full base tensors of the unit's parameters, once their gathers completed."""
        shards, issued, _ = pending
        out = complete_unit_gathers(self.params, issued)
        for i, param in enumerate(self.params):  # other placements (layer-wise): their own gather, in order
            if out[i] is None:
                with _comm.labelled(self._label([i])):
                    out[i] = param._layout.gather(shards[i]).buffer[: param._layout.shape[0]]
        return out

    # ------------------------------------------------------------------ gradients
    def stash(self, position: int, grad: torch.Tensor, owned: bool = False) -> None:
        if self.flat is None and not self.grads and grad.dtype == flat_dtype(self.params, self.grad_sync.strategy):
            self.flat = FlatGrads(self.params, grad.dtype, grad.device)
        if self.flat is not None:
            if self.flat.fits(grad):
                return self.flat.add(position, grad, owned)
            self.grads, self.flat = self.flat.kept(), None  # another dtype: keep them apart from now on
        kept = self.grads.get(position)
        if kept is None:
            self.grads[position] = grad.clone(memory_format=torch.contiguous_format)
        else:
            kept.add_(grad)

    def stash_unheld(self, position: int, grad: torch.Tensor, owned: bool) -> None:
        """A gradient that came while the unit was not held: reduced with the unit's others once every parameter
        that needs a gradient has one (see [Note: unheld gradients])."""
        self.stash(position, grad, owned)
        self.unheld.add(position)
        if len(self.unheld) == sum(p.requires_grad for p in self.params):
            self.reduce_unheld()

    def reduce_unheld(self) -> None:
        if self.unheld:
            self.unheld = set()
            self.reduce()

    def post_backward(self) -> None:
        if self.backward_holds == 0:
            return
        self.backward_holds -= 1
        self.unhold()
        self.reduce()

    @torch.no_grad()
    def reduce(self) -> None:
        """Every rank: this unit's gradients, in the fixed order, zeros where this rank has none.  Under
        ``gradient_sync(model, False)`` GradSync kept every gradient whole and nothing came here: no collective
        (it reduce-scattered zeros once per unit and micro-batch)."""
        if not self.grad_sync.enabled and not self.grads and self.flat is None:
            return
        if self.grad_sync.enabled and self.grad_sync._deferred:
            self._take_deferred()
        strategy = self.grad_sync.strategy
        if self.flat is not None and self.flat.dtype == flat_dtype(self.params, strategy):
            flat, self.flat = self.flat, None
            finish = reduce_exact(self.name, self.params, None, None, strategy.reduce_dtype, flat, async_op=True,
                                  channel=self._channel())
            self.in_flight.append((self._accumulate, finish))
            # Overlapped: in flight during the next unit's backward; sequential (lowest peak): finished now.
            return finish_reductions(self.in_flight, keep=1 if self.gatherer.reduce_overlap_bytes() > 0 else 0)
        if self.flat is not None:  # the reducer changed since the gradients came
            self.grads, self.flat = self.flat.kept(), None
        grads, self.grads = self.grads, {}
        fulls = [grads.get(i) for i in range(len(self.params))]
        mine = torch.tensor([0.0 if g is None else 1.0 for g in fulls], dtype=torch.float64)
        zeros = lambda p: torch.zeros(p._layout.shape, dtype=p.dtype, device=p._local.device)  # noqa: E731
        if type(strategy) is ExactReducer and all(type(p._layout) is ShardLayout for p in self.params):
            fulls = [zeros(p) if g is None else g for p, g in zip(self.params, fulls)]
            shards, flags = reduce_exact(self.name, self.params, fulls, mine, strategy.reduce_dtype,
                                         channel=self._channel())
            owned = True
        else:  # another reducer or placement: the flags in one all-reduce, then each parameter in order
            flags, owned = mine.clone(), False  # (a reducer's shard may alias its input)
            _comm.all_reduce(flags, self.params[0]._layout.group)
            shards = []
            for p, g, flag in zip(self.params, fulls, flags.tolist()):
                if flag == 0:  # no rank has a gradient (a frozen parameter): every rank skips it (a compressed
                    shards.append(None)  # reducer sent its zeros each step and kept a full-size error buffer)
                    continue
                with _comm.inputs_may_be_overwritten(True):
                    shards.append(strategy.reduce_grad(zeros(p) if g is None else g, p._layout, key=p._name,
                                                       dtype=p.dtype, owned=True, overlap=False))
        self._accumulate(shards, flags, owned)

    def _take_deferred(self) -> None:
        """Gradients ``gradient_sync(model, False)`` deferred for parameters this synced backward did not reach on
        this rank (an expert only an earlier micro-batch was routed to) go into this reduction: every rank reduces
        the unit, whatever its data.  Reduced apart, at the backward's end, each rank's own deferred experts were
        a divergence."""
        for position, param in enumerate(self.params):
            kept = self.grad_sync.pop_deferred(param)
            if kept is not None:
                self.stash(position, kept, owned=True)

    def _accumulate(self, shards: list[torch.Tensor], flags: torch.Tensor, owned: bool = True) -> None:
        """``owned``: nobody else holds the shards (``reduce_exact``'s means), so each can become ``.grad``;
        else ``.grad`` gets a copy."""
        for p, shard, flag in zip(self.params, shards, flags.tolist()):
            if flag == 0:
                continue  # no rank produced a gradient: .grad stays as it was (None in a first backward)
            mine = shard.to(p.dtype)
            hooked = _grad_landing.run_tensor_hooks(p, mine)
            if p.grad is not None:
                _misuse.refuse_plain_grad_in_unit(p)
            # Owned: no hook replaced it (a hook's result may be held by the user) and it is a cast or ours.
            fresh = hooked is mine and (mine is not shard or owned)
            _grad_landing.land_rows(p, hooked, owned=fresh)
            _grad_landing.gradient_landed(p)
