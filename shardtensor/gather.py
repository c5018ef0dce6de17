"""The Gatherer: when full tensors are gathered, how long they live, and what is prefetched.

Modes (``GatherMode``):
  - ``sequential``: gather on demand, free as soon as the op that needed it returns.  At most the parameters
    of one op are alive (one, for the ops ``_dispatch/sequential.py`` decomposes: linear+bias, layer/batch norm, conv+bias).
  - ``overlapped``: the first step records the order of gathers (forward and backward); later steps issue
    async all-gathers for the next parameters in that order while the current op runs, within
    ``prefetch_bytes``.  A gather that does not match the recorded order is detected, in-flight prefetches are
    drained (every rank issued them, so every rank must complete them), and the rest of the step is re-recorded.
  - ``auto``: overlapped while free memory stays above ``min_free_bytes``; sequential for the next step once any
    rank ran below it (decided by every rank together at each step's start: ``_memory.AgreedPressure``).

[Note: reuse window]
Both modes record the order.  When an op releases a parameter that the *next* recorded gather needs again (the
tied embedding at the end of forward and the start of backward; two ops on one weight), the buffer is kept
instead of gathered twice.  Any in-place change of the shard (optimizer step, ``load_state_dict``) bumps the
shard's version counter, and a kept buffer with a stale version is never used.

[Note: collective order]
Every rank must issue the same gathers in the same order.  The order is a function of the program, so ranks
that run the same program replay the same prefetches; ``shardtensor`` cannot repair a program whose ranks take
different branches (neither can FSDP2 or ZeRO-3).
"""

from __future__ import annotations

import enum
import logging
import weakref
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

import torch

from . import _comm
from ._comm_divergence import divergences_named
from ._layout import ShardLayout
from ._full import gather_full, gather_now  # noqa: F401  (gather_full: re-exported for callers of the Gatherer)
from ._memory import AgreedPressure, shared_monitor

if TYPE_CHECKING:  # annotations only: tensor.py imports this module (ShardedParam.full_tensor)
    from .tensor import ShardedParam

log = logging.getLogger(__name__)

_MAX_RECORDING_PER_PARAM = 8  # a step gathers each parameter a few times (forward, backward, tied uses)
_SOURCE_LOOKAHEAD = 8  # parameters of the recorded order a ShardSource hears about ahead of their gathers


class GatherMode(str, enum.Enum):
    SEQUENTIAL = "sequential"
    OVERLAPPED = "overlapped"
    AUTO = "auto"


class GatherState(enum.Enum):
    """Where the Gatherer is in its step: recording the gather order, or replaying (and prefetching) it."""

    RECORDING = enum.auto()  # the first step, and the rest of a step whose order changed
    REPLAYING = enum.auto()  # the recorded order stands: prefetch along it


class ShardSource(Protocol):
    """Where a gather reads a parameter's shard from, when not from ``param.to_local()`` (CPU offload).

    The Gatherer calls ``shard_for_gather`` for the shard it is about to gather (the result must be on the
    compute device, in the shard's shape), then ``upcoming`` with the next parameters of the recorded order (an
    empty list while it records) so the source can stage them early, and ``on_step_begin`` at every step."""

    def shard_for_gather(self, index: int, param: ShardedParam) -> torch.Tensor: ...

    def upcoming(self, params: Sequence[tuple[int, ShardedParam]]) -> None: ...

    def on_step_begin(self) -> None: ...


def _free_memory_bytes(device: torch.device) -> int:
    """Free memory where the gathered tensors live: the CUDA allocator's view, or the host's (psutil).

    Read from the process-wide monitor (``shardtensor._memory``) that the offload layer reads too, so both
    decide from the same numbers."""
    return shared_monitor().free_bytes(device)


class _Entry:
    """One parameter's gathered buffer (or the in-flight gather that will fill it)."""

    __slots__ = ("full", "work", "version", "users")

    def __init__(self, full: torch.Tensor, work, version: int):
        self.full = full  # (shape[0], ...) view of the padded all-gather output
        self.work = work
        self.version = version
        self.users = 0


class Gatherer:
    """Schedules the gathers of one sharded module's parameters.  Not thread-safe: one backward at a time."""

    def __init__(
        self,
        mode: GatherMode | str = GatherMode.OVERLAPPED,
        *,
        prefetch_bytes: Optional[int] = None,
        min_free_bytes: int = 1 << 30,
        free_memory_fn: Optional[Callable[[torch.device], int]] = None,
        param_dtype: Optional[torch.dtype] = None,
    ):
        self.mode = GatherMode(mode)
        self.param_dtype = param_dtype  # mixed precision: cast the shard before the collective (half the bytes)
        self.prefetch_bytes = None if prefetch_bytes is None else int(prefetch_bytes)  # None: see _budget
        self.auto = AgreedPressure(free_memory_fn or _free_memory_bytes, min_free_bytes)  # gather="auto"
        # Where a gather reads the shard from: ``param._local`` unless an offload (``shardtensor.offload.
        # CPUOffload``) homes shards elsewhere and hands over a device copy, prefetched in the recorded order.
        self._shard_source: Optional[ShardSource] = None
        self._params: list[ShardedParam] = []  # registered base parameters, by index
        self._index: dict[int, int] = {}  # id(param._local) -> index
        self._entries: dict[int, _Entry] = {}  # index -> gathered / in-flight buffer
        self._order: list[int] = []  # recorded gather order of one step
        self._recording: list[int] = []
        self._state, self._pos = GatherState.RECORDING, 0
        self._backward_end_queued = False  # an end-of-backward callback will start the next step
        self._step_ended = False  # a backward ended: the next gather starts a step (no root forward seen)
        self._steps_marked = False  # someone calls step_begin (the root forward hook): trust it
        self.step_checks: Optional[Callable[[], None]] = None  # see [Note: step boundaries without a root forward]
        self.checks_run = 0  # times they ran (``_misuse_optim``: a compiled step, where no hook runs them)
        self._unchecked = True
        self._communicates = False  # a world of one gathers by aliasing: nothing to prefetch or overlap
        self._aliases_shards = False  # ... and with nothing to cast or fetch, acquire() returns the shard itself
        self.gathers = self.prefetches = self.prefetch_hits = self.mismatches = self.max_alive = 0  # (accounting)
        self._divergences_seen = divergences_named()
        self._alive_refs: list[weakref.ref] = []
        self.held: dict = {}  # id(shard) -> ``_unit_buffers.HeldFull``: the full base its unit gathered

    # ------------------------------------------------------------------ registration and step boundary
    def _budget(self) -> int:
        """Bytes that prefetched (and, for gradients, in-flight reduced) tensors may hold.

        Default: twice a large *typical* parameter (the 90th percentile of gather sizes), enough to have the next
        big weight in flight while the current one computes (FSDP2 prefetches one block).  Not twice the largest:
        an embedding eight times a block's matrices (a 1B GPT: 268 MB against 34 MB) would let half a gigabyte sit
        in prefetch at world 8 (``bench_fake_world.py``: 0.86x FSDP2's peak instead of 1.00x); a parameter above
        the budget is gathered when needed.  Prefetching the whole model at once costs memory and, on few cores,
        time: the communication threads then compete with compute.
        """
        if self.prefetch_bytes is None:
            sizes = sorted(p._layout.gather_numel() * self._gather_itemsize(p) for p in self._params)
            self.prefetch_bytes = 2 * sizes[int(0.9 * (len(sizes) - 1))] if sizes else 0
        return self.prefetch_bytes

    def _gather_itemsize(self, param: ShardedParam) -> int:
        dtype = self.param_dtype if self.param_dtype is not None else param._local.dtype
        return torch.empty((), dtype=dtype).element_size()

    def reduce_overlap_bytes(self) -> int:
        """Gradient reduce-scatters may stay in flight up to this many bytes (``GradSync.pending_budget``); 0 in
        sequential mode or under memory pressure: each gradient is reduced before the next backward op, the
        lowest-memory order."""
        return self._budget() if self._overlapping() else 0

    def register(self, param: ShardedParam) -> None:
        self._index[id(param._local)] = len(self._params)
        self._params.append(param)
        self._communicates = self._communicates or param._layout.world > 1
        self._aliases_shards = self._plain_world_of_one()

    @property
    def shard_source(self) -> Optional[ShardSource]: return self._shard_source  # noqa: E704

    @shard_source.setter
    def shard_source(self, source: Optional[ShardSource]) -> None:
        self._shard_source = source
        self._aliases_shards = self._plain_world_of_one()

    def rehome_shards(self, move: Callable[[ShardedParam], torch.Tensor]) -> None:
        """Give every registered parameter the shard ``move(param)`` returns (same shape and dtype: an offload
        moving shards to host memory) and re-index them (parameters are found by their shard's identity)."""
        for param in self._params:
            param.rehome_(move(param))
        self._index = {id(p._local): i for i, p in enumerate(self._params)}

    def _assert_in_states(self, *states: GatherState) -> None:
        if self._state not in states:
            raise AssertionError(f"Gatherer: expected state {[s.name for s in states]}, in {self._state.name}")

    def _to_state(self, state: GatherState) -> None:
        """The two transitions: RECORDING -> REPLAYING (an order was recorded), REPLAYING -> RECORDING (it broke)."""
        self._assert_in_states(GatherState.REPLAYING if state is GatherState.RECORDING else GatherState.RECORDING)
        self._state = state

    def _plain_world_of_one(self) -> bool:
        """Every parameter's full tensor is its shard: world 1, dim-0 layouts, no dtype cast, shards in place."""
        return (not self._communicates and self._shard_source is None and self.param_dtype is None
                and all(type(p._layout) is ShardLayout for p in self._params))

    def step_begin(self) -> None:
        """Called at the root module's forward: a new forward+backward sequence starts."""
        self._steps_marked, self._unchecked = True, False  # the root hook ran the checks
        self._begin_step()

    def _begin_step(self) -> None:
        self._drop_all()
        if self.mode is GatherMode.AUTO and self._communicates:  # every rank alike (see _memory.AgreedPressure)
            self.auto.agree(self._params[0].device, self._params[0]._layout.group)
        if self._divergences_seen != divergences_named():  # a DivergenceError was caught: the ranks' partial
            self._divergences_seen, self._order, self._recording = divergences_named(), [], []  # orders differ
            self._state = GatherState.RECORDING
        if self._state is GatherState.RECORDING and self._recording:
            self._order = self._recording
            self._to_state(GatherState.REPLAYING)
        # (replaying a shorter step, e.g. an eval forward with no backward: the order still stands)
        self._recording, self._pos, self._step_ended = [], 0, False
        self._alive_refs = [r for r in self._alive_refs if r() is not None]  # bounded over a long run
        if self._shard_source is not None:
            self._shard_source.on_step_begin()

    # [Note: step boundaries without a root forward]
    # ``shard_module`` marks a step at the root module's forward.  A root that is a container whose children
    # are called directly (``model[0](x)``) has no forward, so the backward's end marks it instead: the first
    # gather after a backward begins a step.  Without that the recording would grow by a step's gathers every
    # step, forever, and overlapped mode would never replay (so never prefetch).  A program that only runs
    # forwards through such children is bounded by ``_MAX_RECORDING_PER_PARAM``.  The root hook's checks run there too.
    def _note_gather(self) -> None:
        inside = torch._C._current_graph_task_id() != -1  # inside a backward
        if self._backward_end_queued and not inside:  # that backward raised: its end callback never ran
            self._backward_ended()
        if self._unchecked and self.step_checks is not None:
            self._unchecked = False
            self.step_checks()
        if self._step_ended and not self._steps_marked:
            self._begin_step()
        if not self._backward_end_queued and inside:
            self._backward_end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._backward_end_queued = False
        self._step_ended = self._unchecked = True

    @property
    def recorded_order(self) -> list[str]:
        """Parameter names in gather order: the order being recorded, else the one being replayed."""
        order = self._recording if self._state is GatherState.RECORDING else self._order
        return [self._params[i]._name for i in order]

    def alive_buffers(self) -> int:
        """Gathered buffers still referenced anywhere (not only here): for tests of memory lifetime."""
        self._alive_refs = [r for r in self._alive_refs if r() is not None]
        return len(self._alive_refs)

    # ------------------------------------------------------------------ acquire / release
    def acquire(self, param: ShardedParam) -> torch.Tensor:
        """The full base tensor of ``param`` (views not applied); pair with ``release``."""
        self._note_gather()
        held = self.held.get(id(param._local)) if self.held else None
        if held is not None:  # its unit gathered it (``_unit_buffers.HeldFull``): outside the recorded order
            return held.full if held.version == param._local._version else held.unit.regather(param)
        if self._aliases_shards:  # a world of one: the shard is the full tensor; keep only the order and count
            index = self._index.get(id(param._local))
            if index is not None:
                self._advance(index)
            self.gathers += 1
            return param._local
        index = self._index.get(id(param._local))
        if index is None:  # not a registered parameter (e.g. a derived ShardedParam): plain on-demand gather
            return gather_now(param._local, param._layout)
        self._advance(index)
        entry = self._entries.get(index)
        local = param._local
        if entry is not None and entry.version != local._version:
            self._drop(index)  # stale: the shard changed since this buffer was gathered
            entry = None
        if entry is None:
            entry = self._start_gather(index, async_op=False)
        elif entry.work is not None:
            self.prefetch_hits += 1
        if entry.work is not None:
            entry.work.wait()
            entry.work = None
        entry.users += 1
        self._prefetch()
        return entry.full

    def release(self, param: ShardedParam) -> None:
        if self._aliases_shards or (self.held and id(param._local) in self.held):
            return
        index = self._index.get(id(param._local))
        if index is None:
            return
        entry = self._entries.get(index)
        if entry is None:
            return
        entry.users -= 1
        if entry.users <= 0 and not self._needed_next(index):
            self._drop(index)

    def drop_cache(self) -> None:
        """Free every kept buffer (waits for in-flight prefetches first)."""
        self._drop_all()

    # ------------------------------------------------------------------ internals
    def _advance(self, index: int) -> None:
        if self._state is GatherState.RECORDING:
            self._recording.append(index)
            if len(self._recording) > _MAX_RECORDING_PER_PARAM * max(1, len(self._params)):
                self._recording = [index]  # no step boundary in sight: keep the bookkeeping bounded
            return
        if self._pos < len(self._order) and self._order[self._pos] == index:
            self._pos += 1
            return
        # The program asked for something else than the recorded order says: re-record the rest of the step.
        self.mismatches += 1
        expected = self._params[self._order[self._pos]]._name if self._pos < len(self._order) else "<end of order>"
        log.info("shardtensor: gather order changed at position %d (expected %s, got %s); re-recording",
                 self._pos, expected, self._params[index]._name)
        self._drain_prefetches()
        self._recording = self._order[: self._pos] + [index]
        self._to_state(GatherState.RECORDING)

    def _needed_next(self, index: int) -> bool:
        """Keep a released buffer for the next op that reads it (overlapped mode only: sequential mode holds one
        buffer per op, and the next use can be far, e.g. the tied embedding from the last op of forward across
        the loss to the first op of backward, where it would sit on the step's memory peak)."""
        return self._state is GatherState.REPLAYING and self._pos < len(self._order) and self._order[self._pos] == index \
            and self._overlapping()

    def _overlapping(self) -> bool:
        if self.mode is GatherMode.SEQUENTIAL or not self._communicates:
            return False
        if self.mode is GatherMode.AUTO:
            self.auto.sample(self._params[0]._local.device)  # applied at the next step, on every rank alike
            return not self.auto.pressure
        return True

    def _prefetch(self) -> None:
        if self._state is GatherState.RECORDING or not self._overlapping():
            return
        budget = self._budget() - sum(
            e.full.numel() * e.full.element_size() for e in self._entries.values() if e.users <= 0
        )
        seen = set()
        for index in self._order[self._pos :]:
            if index in seen:
                continue
            seen.add(index)
            if index in self._entries:
                continue
            layout = self._params[index]._layout
            nbytes = layout.gather_numel() * self._gather_itemsize(self._params[index])
            if nbytes > budget:
                break
            budget -= nbytes
            self._start_gather(index, async_op=True)
            self.prefetches += 1

    def _start_gather(self, index: int, *, async_op: bool) -> _Entry:
        param = self._params[index]
        if not async_op:
            self._evict_unused()
        local = param._local if self._shard_source is None else self._shard_for_gather(index, param)
        if self.param_dtype is not None and local.dtype != self.param_dtype and local.is_floating_point():
            local = local.to(self.param_dtype)
        with _comm.labelled(f"all-gather of {param._name!r}"):  # names the step if a rank dies or hangs
            result = param._layout.gather(local, async_op=async_op)
        full = result.buffer[: param._layout.shape[0]] if result.buffer.shape[0] != param._layout.shape[0] else result.buffer
        if full is param._local:
            full = param._local.view(param._local.shape)  # a distinct alias, so weakref accounting sees it
        entry = _Entry(full, result.work if async_op else None, param._local._version)
        self._entries[index] = entry
        self.gathers += 1
        self._alive_refs.append(weakref.ref(full))
        if len(self._alive_refs) > 2 * len(self._params) + 16:  # bounded without a step boundary too
            self._alive_refs = [r for r in self._alive_refs if r() is not None]
        self.max_alive = max(self.max_alive, len(self._entries))
        return entry

    def _shard_for_gather(self, index: int, param: ShardedParam) -> torch.Tensor:
        local = self._shard_source.shard_for_gather(index, param)
        upcoming = [] if self._state is GatherState.RECORDING else \
            [(i, self._params[i]) for i in self._order[self._pos : self._pos + _SOURCE_LOOKAHEAD] if i != index]
        self._shard_source.upcoming(upcoming)
        return local

    def _evict_unused(self) -> None:
        """Sequential mode's promise: before a new gather, nothing unused stays alive."""
        for index in [i for i, e in self._entries.items() if e.users <= 0 and e.work is None]:
            if self.mode is GatherMode.SEQUENTIAL or self.auto.pressure:
                self._drop(index)

    def _drop(self, index: int) -> None:
        entry = self._entries.pop(index, None)
        if entry is not None and entry.work is not None:
            entry.work.wait()  # every rank issued this collective: complete it before dropping

    def _drain_prefetches(self) -> None:
        for index in [i for i, e in self._entries.items() if e.work is not None]:
            self._drop(index)

    def _drop_all(self) -> None:
        for index in [i for i, e in self._entries.items() if e.users <= 0]:
            self._drop(index)
