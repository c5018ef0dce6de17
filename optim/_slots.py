"""CPUAdam's per-parameter bookkeeping (``_Slot``), its counters, and device-to-host gradient staging.

Staging is written once here (``stage_grad`` issues the copy, ``host_grad`` waits for it and casts): the
speculative hook snapshots through it on a side stream, ``step()`` through it on the current stream.

Where a parameter's fp32 master lives (names say where data lives: ``host`` = CPU, ``local`` = this rank):
- a CPU fp32 contiguous parameter is its own master: ``step()`` updates it in place, with no write-back copy.
  A speculative step must not touch it (rule 1 of [Note: speculation rules]), so it steps ``scratch``, a copy
  refreshed from the parameter when stale, and a committed speculation is copied back;
- any other parameter (CUDA, bf16, non-contiguous) keeps a persistent fp32 ``master_host`` that every step
  updates and that is written back to the parameter.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Optional

import math

import torch

from shardtensor import _comm

from ._adam_math import Hyper, hyper_of

__all__ = ["SpeculationStats"]


def is_sharded(t: torch.Tensor) -> bool:
    """A ShardedParam (or its sharded grad): stepped as its local dim-0 shard, its norm summed across ranks.

    The import is lazy: the optimizer package imports before (and without) the core's tensor module.
    """
    try:
        from shardtensor.tensor import ShardedParam  # noqa: PLC0415
    except ImportError:  # core not importable: nothing can be sharded
        return False
    return isinstance(t, ShardedParam)


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_sharded(t) else t


def self_mastered(t: torch.Tensor) -> bool:
    """A CPU fp32 contiguous tensor can be its own fp32 master."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


@dataclass
class SpeculationStats:
    """Counters (cumulative).  ``*_steps`` count ``step()`` calls; ``*_params`` count parameter-steps."""

    steps: int = 0  # step() calls
    speculated_steps: int = 0  # steps in which at least one parameter stepped speculatively
    committed_steps: int = 0  # ... and every speculation stood
    rolled_back_steps: int = 0  # steps in which at least one speculation was rolled back
    clipped_steps: int = 0
    skipped_steps: int = 0  # inf/NaN gradient somewhere (on any rank): nothing applied
    paused_steps: int = 0  # steps with speculation paused (repeated clipping; gradients rewritten after hooks)
    speculated_params: int = 0
    rolled_back_params: int = 0
    early_clip_halts: int = 0  # steps in which speculation stopped once clipping was certain
    user_rollbacks: int = 0  # rollback() calls

    def record_step(self, speculated: bool, rolled_back: bool, clip: bool, paused: bool, skipped: bool) -> None:
        self.steps += 1
        self.skipped_steps += skipped
        if speculated:
            self.speculated_steps += 1
            self.committed_steps += not rolled_back
        self.rolled_back_steps += rolled_back
        self.clipped_steps += clip
        self.paused_steps += paused


@dataclass(eq=False)
class Slot:
    """Host-side home of one parameter; see the module docstring for where its master lives."""

    param: torch.Tensor
    index: int  # position in param-group order: norm sums run in this order on every path
    group: dict
    sharded: bool
    master_host: Optional[torch.Tensor]  # persistent fp32 CPU master; None: the parameter is its own
    exp_avg: torch.Tensor  # fp32 CPU, local shape
    exp_avg_sq: torch.Tensor  # fp32 CPU, local shape
    step_t: torch.Tensor  # 0-d fp32 CPU (the layout torch's fused kernel wants)
    scratch: Optional[torch.Tensor] = None  # speculative master of a self-mastered parameter
    scratch_current: bool = False  # scratch equals the parameter (or holds a speculation stepped from it)
    grad_host: Optional[torch.Tensor] = None  # fp32 CPU (pinned on CUDA): snapshot / conversion buffer
    grad_pinned: Optional[torch.Tensor] = None  # pinned, grad dtype, when that is not fp32 (CUDA only)
    stage_pinned: Optional[torch.Tensor] = None  # pinned, param dtype, for the H2D write-back of a non-fp32 param
    d2h_event: Any = None  # CUDA event of the staged copy
    pending_cast: bool = False  # the staged copy landed in grad_pinned and must be cast into grad_host
    # per-step speculation bookkeeping (reset by step())
    hooks: int = 0
    queued: bool = False  # a speculative job was submitted this step
    spec_hp: Optional[Hyper] = None  # set by the worker when the speculative step was applied
    grad_key: Optional[tuple] = None  # grad_state() of the gradient that was snapshotted
    watch_key: Optional[tuple] = None  # grad_state() at the final hook while speculation waits (see cpu_adam rule 8)
    sumsq: Optional[float] = None

    def local(self) -> torch.Tensor:
        return self.param.to_local() if self.sharded else self.param

    def master(self) -> torch.Tensor:
        """The fp32 master outside speculation (what ``step()`` and ``rollback()`` update)."""
        return self.master_host if self.master_host is not None else self.local()

    def spec_master(self, pin: bool = False) -> torch.Tensor:
        """The fp32 master a speculative step updates: never the parameter itself (rule 1)."""
        if self.master_host is not None:
            return self.master_host
        local = self.local()
        if self.scratch is None:
            self.scratch = torch.empty(local.shape, dtype=torch.float32, pin_memory=pin)
        if not self.scratch_current:
            self.scratch.copy_(local)
            self.scratch_current = True
        return self.scratch

    def grad_local(self) -> Optional[torch.Tensor]:
        g = self.param.grad
        if g is None or not self.sharded:
            return g  # a plain parameter's grad is plain
        if not is_sharded(g):
            # See [Note: speculation rules] 6: the sharded grad must be in place; a full grad here is a bug upstream.
            raise AssertionError(
                f"ShardedParam #{self.index} has a non-sharded grad {type(g).__name__} {tuple(g.shape)=}: "
                "the core's reducer must set a sharded grad before the optimizer steps"
            )
        return g.to_local()

    def grad_state(self) -> Optional[tuple]:
        """Identifies the current gradient and the version of its content, to tell whether it changed since a
        snapshot.  The local tensor's counter moves on every write, through the wrapper too (the core bumps it:
        [Note: writes through the wrapper are versioned on the shard]); a sharded gradient adds its wrapper's
        (id, version), so a new wrapper around the same rows also counts as a change."""
        g = self.param.grad
        if g is None:
            return None
        local = self.grad_local()
        key = grad_key(local)
        return key + (id(g), g._version) if self.sharded else key

    def reset_step(self) -> None:
        self.hooks = 0
        self.queued = False
        self.spec_hp = None
        self.grad_key = None
        self.watch_key = None
        self.sumsq = None


@dataclass
class LastStep:
    """What ``rollback()`` needs: the stepped slots, the gradients they used, and their hyper-parameters."""

    slots: list
    grads: list
    hps: list
    grad_keys: list = field(default_factory=list)


def grad_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t._version)  # torch's version counter: bumped by every in-place op on the gradient


def hypers(slots: list[Slot]) -> list[Hyper]:
    """Each slot's hyper-parameters, read once per param group (hot: every step, every parameter)."""
    per_group: dict = {}
    out = []
    for s in slots:
        hp = per_group.get(id(s.group))
        if hp is None:
            hp = per_group[id(s.group)] = hyper_of(s.group)
        out.append(hp)
    return out


def global_norm(slots: list[Slot], process_group: Any) -> tuple[bool, float]:
    """(all finite on every rank, global L2 norm) from each slot's ``sumsq``.  One all-reduce of three float64s:
    [sharded sumsq, replicated sumsq, #nonfinite].

    Replicated contributions are averaged over ranks (identical when the grads are, as data parallelism makes
    them); whatever they are, every rank reaches the same decision.
    """
    sharded = replicated = 0.0
    nonfinite = 0
    for slot in slots:  # param order: same summation order on every path
        if not math.isfinite(slot.sumsq):
            nonfinite += 1
        elif slot.sharded:
            sharded += slot.sumsq
        else:
            replicated += slot.sumsq
    world = _comm.world_size(process_group)
    if world > 1:
        buf = torch.tensor([sharded, replicated, float(nonfinite)], dtype=torch.float64)
        _comm.all_reduce(buf, process_group, op="sum", label="CPUAdam.step(): global gradient norm and inf/NaN count")
        sharded, replicated, nonfinite = float(buf[0]), float(buf[1]), float(buf[2])
    total = sharded + replicated / world
    return nonfinite == 0 and math.isfinite(total), math.sqrt(total) if math.isfinite(total) else math.inf


# ---------------------------------------------------------------------------------------------- staging
def stage_grad(slot: Slot, g: torch.Tensor, pin: bool, stream: Any = None) -> None:
    """Issue the copy of ``g`` into ``slot.grad_host`` (fp32 CPU).  On CUDA it is asynchronous (on ``stream`` when
    given, ordered after the current stream's work) and ``host_grad`` waits for it; on the CPU it is done."""
    if slot.grad_host is None:
        slot.grad_host = torch.empty(g.shape, dtype=torch.float32, pin_memory=pin)
    if g.device.type != "cuda":
        slot.grad_host.copy_(g)
        return
    dst = slot.grad_host
    slot.pending_cast = g.dtype != torch.float32
    if slot.pending_cast:  # copy in the gradient's dtype (fewer bytes cross), cast on the CPU
        if slot.grad_pinned is None:
            slot.grad_pinned = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
        dst = slot.grad_pinned
    ctx: Any = contextlib.nullcontext()
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(g.device))
        ctx = torch.cuda.stream(stream)
    with ctx:
        dst.copy_(g, non_blocking=True)
        if stream is not None:
            g.record_stream(stream)  # the caching allocator must not reuse g before the copy
        slot.d2h_event = torch.cuda.Event()
        slot.d2h_event.record()


def host_grad(slot: Slot) -> torch.Tensor:
    """The staged gradient, once its copy landed."""
    if slot.d2h_event is not None:
        slot.d2h_event.synchronize()
        slot.d2h_event = None
        if slot.pending_cast:
            slot.grad_host.copy_(slot.grad_pinned)
            slot.pending_cast = False
    return slot.grad_host
