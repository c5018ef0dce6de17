"""CPUAdam: AdamW whose state lives in CPU memory, stepped speculatively while backward runs, rolled back exactly.

Trade-offs:
  + optimizer state (fp32 master, exp_avg, exp_avg_sq: 12 bytes/param) leaves the accelerator;
  + with ``speculative=True`` each parameter steps on a CPU worker as soon as its gradient is final, so the step
    overlaps backward; clipping and inf/NaN are validated afterwards and undone by algebraic inversion;
  - speculation keeps a separate fp32 master and a gradient snapshot per parameter (8 bytes/param more on a
    CPU-only model), and a rollback costs a pass over the state (rare by design: see ``clip_patience``);
  - gradients must be final when the post-accumulate-grad hook fires.  See [Note: speculation rules].

[Note: speculation rules]
1. Parameters change only inside ``step()`` and ``rollback()``: a speculative step updates the host master and
   moments, never the model.  So a forward between backward and ``step()`` (the next micro-batch, an eval) sees
   the parameters it expects, and a speculation that turns out wrong is a host-only rollback.
2. A gradient is snapshotted when its hook fires (a device-to-pinned-host copy on CUDA, a memcpy on CPU); the
   worker steps from the snapshot, so later in-place changes to ``p.grad`` cannot corrupt the inversion.
3. Finiteness is checked per gradient before it is stepped: a non-finite gradient is never stepped, and no
   further parameter is stepped speculatively in that step; ``step()`` then rolls back and skips the step.
   Likewise, once the running sum of squared norms on this rank exceeds ``max_grad_norm**2``, clipping is
   certain and speculation stops for the step: the rollbacks it would cause are also the least accurate ones
   (an unclipped gradient far above the threshold swamps the moments; see [Note: rollback error]).
4. Each queued step carries the hyper-parameters of its own group and its step count, read when queued.  At
   ``step()``, a speculation whose group changed since (an LR scheduler stepped in between) is redone.
5. Gradient accumulation.  The hook fires once per backward; only the last micro-batch's gradient is final.
   Rule: a parameter speculates on its k-th hook of a step, where k is the number of hooks it received in the
   previous step (learned; 1 at first).  A hook beyond the k-th means more micro-batches than expected: that
   parameter's speculation is rolled back (from its snapshot) and it is stepped at ``step()``; k is relearned.
   Backward passes inside ``with opt.accumulating():`` never speculate nor count, so a loop that declares its
   non-final micro-batches never rolls back.  As a last guard, ``step()`` redoes any speculation whose
   gradient tensor changed since (data pointer or version counter).
6. Reductions the gradient still needs (a replicated parameter's all-reduce, the core's reduce-scatter) must
   run in post-accumulate-grad hooks registered *before* the optimizer is constructed: hooks run in order,
   and an all-reduce issued after backward is invisible to the version counter.
7. Clipping follows ``torch.nn.utils.clip_grad_norm_``: ``coef = max_norm / (norm + 1e-6)``, applied when < 1.
   A clipped step rolls back every speculation and redoes the step with clipped gradients.  After
   ``clip_patience`` clipped steps in a row, speculation pauses until a step does not clip.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from shardtensor import _comm

from ._host_memory import empty_host
from ._adam_math import Hyper, adamw_rollback_, adamw_step_, finite_checks, hyper_of, sq_norms

__all__ = ["CPUAdam", "SpeculationStats"]

_ONE = torch.tensor(1.0)  # step-count increment (torch.optim's fused path does the same)

_SHARDED_TYPE: Any = None


def _is_sharded(t: torch.Tensor) -> bool:
    """A ShardedParam (or its sharded grad): step its local dim-0 shard; its norm is summed across ranks.

    The import is lazy and optional so the optimizer works before (or without) ``shardtensor.tensor``.
    """
    global _SHARDED_TYPE
    if _SHARDED_TYPE is None:
        try:
            from shardtensor.tensor import ShardedParam  # noqa: PLC0415

            _SHARDED_TYPE = ShardedParam
        except Exception:  # noqa: BLE001 - core not there yet: fall back to duck typing
            _SHARDED_TYPE = False
    if _SHARDED_TYPE:
        return isinstance(t, _SHARDED_TYPE)
    return hasattr(t, "to_local")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_sharded(t) else t


@dataclass
class SpeculationStats:
    """Counters (cumulative).  ``*_steps`` count ``step()`` calls; ``*_params`` count parameter-steps."""

    steps: int = 0  # step() calls
    speculated_steps: int = 0  # steps in which at least one parameter stepped speculatively
    committed_steps: int = 0  # ... and every speculation stood
    rolled_back_steps: int = 0  # steps in which at least one speculation was rolled back
    clipped_steps: int = 0
    skipped_steps: int = 0  # inf/NaN gradient somewhere (on any rank): nothing applied
    paused_steps: int = 0  # steps with speculation paused after repeated clipping
    speculated_params: int = 0
    rolled_back_params: int = 0
    early_clip_halts: int = 0  # steps in which speculation stopped once clipping was certain
    user_rollbacks: int = 0  # rollback() calls


@dataclass(eq=False)
class _Slot:
    """Host-side home of one parameter (names say where data lives: ``host`` = CPU, ``local`` = this rank)."""

    param: torch.Tensor
    index: int  # position in param-group order: norm sums run in this order on every path
    group: dict
    sharded: bool
    device: torch.device  # where the parameter's local shard lives
    master_host: Optional[torch.Tensor]  # fp32 CPU; None when the parameter's own CPU fp32 storage is the master
    exp_avg: torch.Tensor  # fp32 CPU, local shape
    exp_avg_sq: torch.Tensor  # fp32 CPU, local shape
    step_t: torch.Tensor  # 0-d fp32 CPU (the layout torch's fused kernel wants)
    grad_host: Optional[torch.Tensor] = None  # fp32 CPU (pinned on CUDA): snapshot / conversion buffer
    grad_pinned: Optional[torch.Tensor] = None  # pinned, grad dtype, when that is not fp32 (CUDA only)
    stage_pinned: Optional[torch.Tensor] = None  # pinned, param dtype, for the H2D write-back of a non-fp32 param
    d2h_event: Any = None  # CUDA event of the snapshot copy
    # per-step speculation bookkeeping (reset by step())
    hooks: int = 0
    queued: bool = False  # a speculative job was submitted this step
    spec_hp: Optional[Hyper] = None  # set by the worker when the speculative step was applied
    grad_key: Optional[tuple] = None  # (data_ptr, _version) of the gradient that was snapshotted
    sumsq: Optional[float] = None

    def master(self) -> torch.Tensor:
        if self.master_host is not None:
            return self.master_host
        return _local(self.param) if self.sharded else self.param

    def grad_local(self) -> Optional[torch.Tensor]:
        g = self.param.grad
        if g is None or not self.sharded:
            return g  # a plain parameter's grad is plain
        if not _is_sharded(g):
            # See [Note: speculation rules] 6: the sharded grad must be in place; a full grad here is a bug upstream.
            raise AssertionError(
                f"ShardedParam #{self.index} has a non-sharded grad {type(g).__name__} {tuple(g.shape)=}: "
                "the core's reducer must set a sharded grad before the optimizer steps"
            )
        return _local(g)


@dataclass
class _LastStep:
    """What ``rollback()`` needs: the stepped slots, the gradients they used, and their hyper-parameters."""

    slots: list
    grads: list
    hps: list
    grad_keys: list = field(default_factory=list)


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t._version)


def _hypers(slots) -> list:
    """Each slot's hyper-parameters, read once per param group (hot: every step, every parameter)."""
    per_group: dict = {}
    out = []
    for s in slots:
        hp = per_group.get(id(s.group))
        if hp is None:
            hp = per_group[id(s.group)] = hyper_of(s.group)
        out.append(hp)
    return out


class CPUAdam(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with its state in CPU memory; see the module docstring.

    Args:
        params: parameters or param groups (each group may set ``lr``, ``betas``, ``eps``, ``weight_decay``).
            ``ShardedParam``s step their local shard; plain parameters are treated as replicated.
        lr: learning rate. (Default: 1e-3)
        betas: Adam's moment decay rates. (Default: (0.9, 0.999))
        eps: denominator term. (Default: 1e-8)
        weight_decay: decoupled weight decay, AdamW's. (Default: 0.01)
        max_grad_norm: clip the global gradient norm (all ranks) to this; None: no clipping. (Default: None)
        speculative: step each parameter on a CPU worker when its gradient is ready. (Default: True)
        skip_nonfinite: skip the whole step when a gradient (on any rank) holds inf/NaN; False gives torch's
            AdamW behaviour (NaN propagates) and saves the pass over the gradients that the check costs when no
            clipping needs the norm anyway. (Default: True)
        clip_patience: pause speculation after this many clipped steps in a row. (Default: 3)
        process_group: group over which sharded norms and the inf/NaN flag are reduced. (Default: None = world)
        timeout_s: longest wait for one worker job before raising. (Default: 300)
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        max_grad_norm: Optional[float] = None,
        speculative: bool = True,
        *,
        skip_nonfinite: bool = True,
        clip_patience: int = 3,
        process_group: Any = None,
        timeout_s: float = 300.0,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyper-parameters: {lr=} {betas=} {eps=} {weight_decay=}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive or None: {max_grad_norm=}")
        # Set before Optimizer.__init__, which calls our add_param_group.
        self.speculative = speculative
        self.max_grad_norm = max_grad_norm
        self.clip_patience = clip_patience
        self.skip_nonfinite = skip_nonfinite
        self.process_group = process_group
        self.timeout_s = timeout_s
        self.stats = SpeculationStats()
        self.last_grad_norm = math.nan  # global gradient norm of the last step (with max_grad_norm only)
        self._slots: dict[int, _Slot] = {}  # id(param) -> slot, created lazily (meta-device models materialise late)
        self._order: dict[int, int] = {}  # id(param) -> index
        self._groups_by_id: Optional[dict[int, dict]] = None
        self._hook_handles: list = []
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._futures: list[tuple[concurrent.futures.Future, _Slot]] = []
        self._halted = False  # a non-finite gradient was seen this step: no more speculation until step()
        self._spec_count = 0  # speculative steps applied this step (worker)
        self._spec_sumsq = 0.0  # worker's running sum of squared norms this step
        self._rolled_in_hooks = False  # a hook rolled back a speculation this step (rule 5)
        self._accumulating = False
        self._expected_hooks = 1
        self._clip_streak = 0
        self._last: Optional[_LastStep] = None
        self._pinned = torch.cuda.is_available()
        self._d2h_stream: Any = None  # side stream: snapshot copies overlap backward on the compute stream
        self._h2d_event: Any = None  # write-back of the last step: masters may not change before it completes
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ setup

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._groups_by_id = None
        for p in self.param_groups[-1]["params"]:
            if id(p) in self._order:
                continue
            self._order[id(p)] = len(self._order)
            if self.speculative and p.requires_grad:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _group_of(self, p: torch.Tensor) -> dict:
        if self._groups_by_id is None:
            self._groups_by_id = {id(q): g for g in self.param_groups for q in g["params"]}
        try:
            return self._groups_by_id[id(p)]
        except KeyError:
            raise AssertionError(f"parameter {tuple(p.shape)} is in no param group of this optimizer") from None

    def _empty_host(self, shape: torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # Pinned once per parameter, never per step: pinning (page-locking) costs more than the copy it speeds up.
        return empty_host(shape, dtype, pin_memory=self._pinned)

    def _slot(self, p: torch.Tensor) -> _Slot:
        slot = self._slots.get(id(p))
        if slot is not None:
            return slot
        sharded = _is_sharded(p)
        with torch.no_grad():
            local = _local(p).detach()
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = self._empty_host(local.shape).zero_()
                state["exp_avg_sq"] = self._empty_host(local.shape).zero_()
            # The parameter's own storage is the master when it already is CPU fp32 and nothing may observe the
            # master ahead of step() (rule 1 of [Note: speculation rules] forbids that under speculation).
            aliased = (
                not self.speculative and local.device.type == "cpu" and local.dtype == torch.float32
                and local.is_contiguous()
            )
            if not aliased and "master" not in state:
                master = self._empty_host(local.shape)
                master.copy_(local)
                state["master"] = master
            slot = _Slot(
                param=p, index=self._order[id(p)], group=self._group_of(p), sharded=sharded, device=local.device,
                master_host=None if aliased else state["master"], exp_avg=state["exp_avg"],
                exp_avg_sq=state["exp_avg_sq"], step_t=state["step"],
            )
        self._slots[id(p)] = slot
        return slot

    # ------------------------------------------------------------------ speculation (hook thread / worker)

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside do not speculate: declare the non-final micro-batches of an accumulation."""
        prev, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = prev

    def _may_speculate(self) -> bool:
        return self.speculative and not self._halted and not self._accumulating and not self._paused()

    def _check(self, grads: list[torch.Tensor]) -> list[float]:
        """Squared norms when clipping needs them; else only finiteness (0.0 / inf); else nothing (0.0)."""
        if self.max_grad_norm is not None:
            return sq_norms(grads)
        if self.skip_nonfinite:
            return finite_checks(grads)
        return [0.0] * len(grads)

    def _paused(self) -> bool:
        return self.max_grad_norm is not None and self._clip_streak >= self.clip_patience

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: snapshot the gradient and queue its speculative step."""
        self._last = None  # a new backward overwrites the snapshots rollback() would need
        if self._accumulating:
            return
        slot = self._slot(p)
        slot.hooks += 1
        if slot.queued:
            # More micro-batches than expected: the queued step used a partial gradient.  Undo it (FIFO worker:
            # it runs after the step it undoes); step() steps this parameter from its final gradient.
            slot.queued = False
            self._rolled_in_hooks = True
            self._submit(self._rollback_job, slot)
            return
        if not self._may_speculate() or slot.hooks != self._expected_hooks:
            return
        g = slot.grad_local()
        if g is None:
            return
        with torch.no_grad():
            self._snapshot(slot, g)
        slot.grad_key = _key(g)
        slot.queued = True
        hp = hyper_of(slot.group)
        t = int(slot.step_t.item()) + 1
        self._submit(self._speculate_job, slot, hp, t)

    def _snapshot(self, slot: _Slot, g: torch.Tensor) -> None:
        if slot.grad_host is None:
            slot.grad_host = self._empty_host(g.shape)
        if g.device.type == "cuda":
            if g.dtype != torch.float32 and slot.grad_pinned is None:
                slot.grad_pinned = self._empty_host(g.shape, g.dtype)
            dst = slot.grad_pinned if g.dtype != torch.float32 else slot.grad_host
            if self._d2h_stream is None:
                self._d2h_stream = torch.cuda.Stream(device=g.device)
            self._d2h_stream.wait_stream(torch.cuda.current_stream(g.device))
            with torch.cuda.stream(self._d2h_stream):
                dst.copy_(g, non_blocking=True)
                g.record_stream(self._d2h_stream)  # the caching allocator must not reuse g before the copy
                slot.d2h_event = torch.cuda.Event()
                slot.d2h_event.record(self._d2h_stream)
        else:
            slot.grad_host.copy_(g)

    def _submit(self, fn: Callable, slot: _Slot, *args: Any) -> None:
        if self._executor is None:
            # One worker: jobs of one parameter (step, then its rollback) run in submission order.
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu_adam")
        self._futures.append((self._executor.submit(fn, slot, *args), slot))

    def _host_grad_ready(self, slot: _Slot) -> torch.Tensor:
        """The snapshot, once its device-to-host copy landed (worker side)."""
        if slot.d2h_event is not None:
            slot.d2h_event.synchronize()
            slot.d2h_event = None
            if slot.grad_pinned is not None:
                slot.grad_host.copy_(slot.grad_pinned)
        return slot.grad_host

    def _wait_write_back(self) -> None:
        if self._h2d_event is not None:
            self._h2d_event.synchronize()  # the previous step's H2D reads the masters / staging buffers

    @torch.no_grad()
    def _speculate_job(self, slot: _Slot, hp: Hyper, t: int) -> None:
        g = self._host_grad_ready(slot)
        slot.sumsq = self._check([g])[0]
        if not math.isfinite(slot.sumsq):
            self._halted = True  # never step a non-finite gradient; nothing else speculates this step
            return
        if self._halted:
            return
        self._spec_sumsq += slot.sumsq
        if self.max_grad_norm is not None and self._spec_sumsq > self.max_grad_norm**2:
            # Clipping is already certain (this rank's part of the global sum of squares is a lower bound):
            # what we would step now would only be rolled back.  Rule 3's halt, for clipping.
            self._halted = True
            self.stats.early_clip_halts += 1
            return
        self._wait_write_back()
        slot.step_t.fill_(t)
        adamw_step_([slot.master()], [g], [slot.exp_avg], [slot.exp_avg_sq], [slot.step_t], hp)
        slot.spec_hp = hp
        self._spec_count += 1
        self.stats.speculated_params += 1

    @torch.no_grad()
    def _rollback_job(self, slot: _Slot) -> None:
        if slot.spec_hp is not None:
            adamw_rollback_([slot.master()], [slot.grad_host], [slot.exp_avg], [slot.exp_avg_sq], [slot.step_t],
                            slot.spec_hp)
            slot.spec_hp = None
            self.stats.rolled_back_params += 1
        slot.sumsq = None

    def _drain(self) -> None:
        """Wait for every submitted job (each wait is on a future we submitted, with a timeout)."""
        futures, self._futures = self._futures, []
        for fut, slot in futures:
            try:
                fut.result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError as e:
                raise RuntimeError(
                    f"rank {_comm.rank()}: CPUAdam worker job for parameter #{slot.index} "
                    f"{tuple(slot.param.shape)} did not finish in {self.timeout_s=}s"
                ) from e

    # ------------------------------------------------------------------ step

    def _host_grads(self, slots: list[_Slot]) -> list[torch.Tensor]:
        """CPU fp32 gradients of non-speculated slots: the grad itself when it is one, else a copy we own."""
        out = []
        cuda_copies = False
        for slot in slots:
            g = slot.grad_local()
            if g.is_cpu and g.dtype is torch.float32 and g.is_contiguous():
                out.append(g)
                continue
            if slot.grad_host is None:
                slot.grad_host = self._empty_host(g.shape)
            if g.device.type == "cuda" and g.dtype != torch.float32:
                if slot.grad_pinned is None:
                    slot.grad_pinned = self._empty_host(g.shape, g.dtype)
                slot.grad_pinned.copy_(g, non_blocking=True)
                cuda_copies = True
            else:
                slot.grad_host.copy_(g, non_blocking=g.device.type == "cuda")
                cuda_copies |= g.device.type == "cuda"
            out.append(slot.grad_host)
        if cuda_copies:
            torch.cuda.synchronize()  # one wait for every D2H copy above (a CPU-GPU sync point)
            for slot in slots:
                if slot.grad_pinned is not None and slot.device.type == "cuda" and slot.param.grad.dtype != torch.float32:
                    slot.grad_host.copy_(slot.grad_pinned)
        return out

    def _global_norm(self, slots: list[_Slot]) -> tuple[bool, float]:
        """(all finite on every rank, global L2 norm).  One all-reduce: [sharded sumsq, replicated sumsq, #nonfinite].

        Replicated contributions are averaged over ranks (identical when the grads are, as data parallelism makes
        them); whatever they are, every rank reaches the same decision.
        """
        if self.max_grad_norm is None and not self.skip_nonfinite:
            return True, math.nan  # nothing to validate: no collective either
        sharded = replicated = 0.0
        nonfinite = 0
        for slot in slots:  # param order: same summation order on every path
            if not math.isfinite(slot.sumsq):
                nonfinite += 1
            elif slot.sharded:
                sharded += slot.sumsq
            else:
                replicated += slot.sumsq
        buf = torch.tensor([sharded, replicated, float(nonfinite)], dtype=torch.float64)
        _comm.all_reduce(buf, self.process_group, op="sum")
        world = _comm.world_size(self.process_group)
        total = float(buf[0]) + float(buf[1]) / world
        return float(buf[2]) == 0 and math.isfinite(total), math.sqrt(total) if math.isfinite(total) else math.inf

    @torch.no_grad()
    def _step_batched(self, slots: list[_Slot], grads: list[torch.Tensor]) -> list[Hyper]:
        """Step ``slots`` with ``grads``, one fused call per param group; returns each slot's hyper-parameters."""
        self._wait_write_back()
        hps = _hypers(slots)
        by_group: dict[int, list[int]] = {}
        for i, s in enumerate(slots):
            by_group.setdefault(id(s.group), []).append(i)
        for idx in by_group.values():
            steps = [slots[i].step_t for i in idx]
            torch._foreach_add_(steps, _ONE, alpha=1.0)  # the tensor overload: 3x cheaper than a Python scalar
            adamw_step_([slots[i].master() for i in idx], [grads[i] for i in idx], [slots[i].exp_avg for i in idx],
                        [slots[i].exp_avg_sq for i in idx], steps, hps[idx[0]])
        return hps

    @staticmethod
    @torch.no_grad()
    def _rollback_batched(slots: list[_Slot], grads: list[torch.Tensor], hps: list[Hyper]) -> None:
        by_hp: dict[Hyper, list[int]] = {}
        for i, hp in enumerate(hps):
            by_hp.setdefault(hp, []).append(i)
        for hp, idx in by_hp.items():
            adamw_rollback_([slots[i].master() for i in idx], [grads[i] for i in idx],
                            [slots[i].exp_avg for i in idx], [slots[i].exp_avg_sq for i in idx],
                            [slots[i].step_t for i in idx], hp)

    @torch.no_grad()
    def _write_back(self, slots: list[_Slot]) -> None:
        """Copy updated masters into the parameters (asynchronously from pinned memory on CUDA)."""
        cuda = False
        for slot in slots:
            if slot.master_host is None:
                continue  # the parameter is its own master
            local = _local(slot.param)
            if local.device.type == "cuda":
                cuda = True
                src = slot.master_host
                if local.dtype != torch.float32:
                    if slot.stage_pinned is None:
                        slot.stage_pinned = self._empty_host(local.shape, local.dtype)
                    src = slot.stage_pinned.copy_(slot.master_host)  # cast on the CPU: half the bytes cross
                local.copy_(src, non_blocking=True)
            else:
                local.copy_(slot.master_host)
        if cuda:
            self._h2d_event = torch.cuda.Event()
            self._h2d_event.record()

    def _reset_step_bookkeeping(self, slots: Iterable[_Slot]) -> None:
        for slot in slots:
            slot.hooks = 0
            slot.queued = False
            slot.spec_hp = None
            slot.grad_key = None
            slot.sumsq = None
        self._halted = False
        self._spec_count = 0
        self._spec_sumsq = 0.0
        self._rolled_in_hooks = False

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Validate the speculative steps (global norm, finiteness), fix them up, step the rest, write back.

        Collective: every rank of ``process_group`` must call it (one all-reduce of three float64s).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._drain()
        stats = self.stats
        stats.steps += 1
        all_slots = [self._slot(p) for g in self.param_groups for p in g["params"]]
        slots = sorted((s for s in all_slots if s.param.grad is not None), key=lambda s: s.index)
        speculated = self._spec_count > 0
        rolled_back = self._rolled_in_hooks
        paused = self._paused()

        # Speculations redone whatever the norm says: the gradient changed since its snapshot (rule 5), or the
        # group's hyper-parameters did (rule 4).
        spec = [s for s in slots if s.spec_hp is not None]
        redo = [s for s in spec if _key(s.grad_local()) != s.grad_key or hyper_of(s.group) != s.spec_hp]
        if redo:
            self._undo_speculation(redo)
            spec = [s for s in spec if s.spec_hp is not None]
            rolled_back = True
        rest = [s for s in slots if s.spec_hp is None]
        rest_grads = self._host_grads(rest)
        for s, sq in zip(rest, self._check(rest_grads)):
            s.sumsq = sq
        finite, norm = self._global_norm(slots)
        clip = finite and self.max_grad_norm is not None and self.max_grad_norm / (norm + 1e-6) < 1.0

        grads = {id(s): s.grad_host for s in spec}
        grads.update({id(s): g for s, g in zip(rest, rest_grads)})
        if (not finite or clip) and spec:
            self._undo_speculation(spec)
            rolled_back = True
        if finite:
            to_step = slots if clip else rest
            step_grads = [grads[id(s)] for s in to_step]
            if clip:  # clip_grad_norm_'s rule and arithmetic
                torch._foreach_mul_(step_grads, self.max_grad_norm / (norm + 1e-6))
            step_hps = self._step_batched(to_step, step_grads)
            self._write_back(slots)  # committed speculations too: they updated only the host master
            used = [grads[id(s)] for s in slots]
            hps = step_hps if len(to_step) == len(slots) else _hypers(slots)  # to_step is slots or a subset
            self._last = _LastStep(slots, used, hps, [_key(g) for g in used])
        else:
            stats.skipped_steps += 1
            self._last = None

        if speculated:
            stats.speculated_steps += 1
            stats.committed_steps += not rolled_back
        stats.rolled_back_steps += rolled_back
        stats.clipped_steps += clip
        stats.paused_steps += paused
        if finite and self.max_grad_norm is not None:
            self._clip_streak = self._clip_streak + 1 if clip else 0  # rule 7
        hooks_seen = max((s.hooks for s in all_slots), default=0)
        if hooks_seen:
            self._expected_hooks = hooks_seen  # rule 5
        self._reset_step_bookkeeping(all_slots)
        self.last_grad_norm = norm if self.max_grad_norm is not None else math.nan  # only clipping computes it
        return loss

    def _undo_speculation(self, slots: list[_Slot]) -> None:
        self._rollback_batched(slots, [s.grad_host for s in slots], [s.spec_hp for s in slots])
        self.stats.rolled_back_params += len(slots)
        for s in slots:
            s.spec_hp = None

    # ------------------------------------------------------------------ rollback, zero_grad, state

    @torch.no_grad()
    def rollback(self) -> None:
        """Undo the last ``step()`` by algebraic inversion (no saved state); parameters are written back.

        Valid until the gradients it used change: the next backward, ``zero_grad()``, or an in-place change
        to a gradient (checked by version counter).  A skipped step (inf/NaN) applied nothing: nothing to undo.
        Error: a few ulps, measured in tests/test_cpu_adam.py and reported by the benchmark.
        """
        self._drain()
        last = self._last
        if last is None:
            raise RuntimeError(
                "CPUAdam.rollback(): no step to undo (none yet, skipped, already undone, or its gradients were "
                "released by zero_grad() / a new backward)"
            )
        changed = [s.index for s, g, k in zip(last.slots, last.grads, last.grad_keys) if _key(g) != k]
        if changed:
            raise RuntimeError(f"CPUAdam.rollback(): gradients of parameters {changed} changed since step()")
        self._rollback_batched(last.slots, last.grads, last.hps)
        self._write_back(last.slots)
        self._last = None
        self.stats.user_rollbacks += 1

    def _abandon_speculation(self) -> None:
        """Roll back speculative steps whose step() will not come (zero_grad() after backward, no step())."""
        self._drain()
        slots = [s for s in self._slots.values() if s.spec_hp is not None]
        if slots:
            self._undo_speculation(slots)
            self.stats.rolled_back_steps += 1
        self._reset_step_bookkeeping(self._slots.values())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also drops what ``rollback()`` would need, and undoes speculation that no ``step()`` will validate."""
        self._abandon_speculation()
        self._last = None
        super().zero_grad(set_to_none)

    def state_dict(self) -> dict:
        self._drain()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load, then re-home every state tensor on the CPU in fp32 (the base class casts to the param's device)."""
        self._abandon_speculation()
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            local = _local(p)
            for key in ("exp_avg", "exp_avg_sq", "master"):
                if key in state:
                    host = self._empty_host(local.shape)
                    host.copy_(state[key])
                    state[key] = host
            state["step"] = torch.tensor(float(state.get("step", 0)))
        self._slots.clear()
        self._groups_by_id = None
        self._last = None

    def close(self) -> None:
        """Remove the hooks and stop the worker (after waiting for its jobs)."""
        self._drain()
        for h in self._hook_handles:
            h.remove()
        self._hook_handles.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
