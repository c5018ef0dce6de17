"""CPUAdam's speculation lifecycle: the gradient hook, the worker jobs, and the phase they move through.

A step goes through ``SpecPhase`` states, each transition asserted (FSDP2's ``_assert_in_states`` style), so a
hook that fires inside ``step()`` or a ``step()`` that re-enters is a named error instead of silent corruption:

    IDLE --hook queues a job--> SPECULATING --worker: non-finite gradient / clipping certain--> HALTED
    IDLE | SPECULATING | HALTED --step()--> VALIDATING --step() done--> IDLE
    IDLE | SPECULATING | HALTED --zero_grad() / load_state_dict() (speculation abandoned)--> IDLE

The rules the jobs follow are the module docstring's [Note: speculation rules] in ``cpu_adam.py``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import math
import weakref
from typing import Any, Callable, Iterator, Optional

import torch

from shardtensor import _comm
from shardtensor.ops import adamw_checked_

from ._adam_math import Hyper, adamw_rollback_, adamw_step_, hyper_of
from ._slots import Slot, host_grad, stage_grad

__all__ = ["SpecPhase"]


class SpecPhase(enum.Enum):
    IDLE = "idle"  # no speculative step queued since the last step()
    SPECULATING = "speculating"  # hooks have queued speculative steps
    HALTED = "halted"  # a non-finite gradient, or clipping already certain: nothing more speculates this step
    VALIDATING = "validating"  # inside step(): speculations are validated, fixed up and committed


class SpeculationMixin:
    """The hook/worker half of ``CPUAdam`` (which provides ``_slot``, ``_check``, ``_store``, ``stats``...)."""

    _phase: SpecPhase

    def _init_speculation(self) -> None:
        self._phase = SpecPhase.IDLE
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._futures: list[tuple[concurrent.futures.Future, Slot]] = []
        self._spec_count = 0  # speculative steps applied this step (worker)
        self._spec_sumsq = 0.0  # worker's running sum of squared norms this step
        self._rolled_in_hooks = False  # a hook rolled back a speculation this step (rule 5)
        self._rewritten_after_hooks = False  # gradients change between their hooks and step() (rule 8)
        self._accumulating = False
        self._expected_hooks = 1
        self._d2h_stream: Any = None  # side stream: snapshot copies overlap backward on the compute stream
        self._hook_handles: list = []
        # An optimizer dropped without close() (replaced by a new one): its hooks must not keep it alive, stepping
        # a second, unused copy of the state at every backward.
        weakref.finalize(self, _remove_hooks, self._hook_handles)

    def _hook_speculation(self, p: torch.Tensor) -> None:
        """Register the gradient hook of ``p``, holding this optimizer weakly (see ``_init_speculation``)."""
        on_grad_ready = weakref.WeakMethod(self._on_grad_ready)

        def hook(param: torch.Tensor) -> None:
            optimizer = on_grad_ready()
            if optimizer is not None:
                optimizer(param)

        self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))

    def _assert_in_phase(self, *phases: SpecPhase) -> None:
        if self._phase not in phases:
            raise AssertionError(
                f"CPUAdam: expected phase {[p.value for p in phases]}, found {self._phase.value!r} (a backward "
                "inside step(), or step() re-entered from a hook?)"
            )

    def _to_phase(self, phase: SpecPhase) -> None:
        allowed = {
            SpecPhase.SPECULATING: (SpecPhase.IDLE, SpecPhase.SPECULATING),
            SpecPhase.HALTED: (SpecPhase.SPECULATING, SpecPhase.HALTED),
            SpecPhase.VALIDATING: (SpecPhase.IDLE, SpecPhase.SPECULATING, SpecPhase.HALTED),
            SpecPhase.IDLE: (SpecPhase.VALIDATING, SpecPhase.IDLE, SpecPhase.SPECULATING, SpecPhase.HALTED),
        }[phase]
        self._assert_in_phase(*allowed)
        self._phase = phase

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside do not speculate: declare the non-final micro-batches of an accumulation."""
        prev, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = prev

    def _may_speculate(self) -> bool:
        return (self.speculative and self._phase is not SpecPhase.HALTED and not self._accumulating
                and not self._paused())

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: snapshot the gradient and queue its speculative step."""
        self._assert_in_phase(SpecPhase.IDLE, SpecPhase.SPECULATING, SpecPhase.HALTED)
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
        if slot.hooks == self._expected_hooks and self._rewritten_after_hooks:  # rule 8: watch, do not speculate
            slot.watch_key = slot.grad_state()
        if not self._may_speculate() or slot.hooks != self._expected_hooks:
            return
        g = slot.grad_local()
        if g is None:
            return
        if g.device.type == "cuda" and self._d2h_stream is None:
            self._d2h_stream = torch.cuda.Stream(device=g.device)
        with torch.no_grad():
            stage_grad(slot, g, self._pinned, self._d2h_stream if g.device.type == "cuda" else None)
        slot.grad_key = slot.grad_state()
        slot.queued = True
        if self._phase is SpecPhase.IDLE:
            self._to_phase(SpecPhase.SPECULATING)
        self._submit(self._speculate_job, slot, hyper_of(slot.group), int(slot.step_t.item()) + 1)

    def _rewritten_since_hooks(self, slots: list) -> Optional[bool]:
        """Whether a gradient changed between its final hook and ``step()`` (rule 8): from the speculations'
        snapshots, or from the versions noted while paused; None where no hook noted anything."""
        noted = [(s.grad_key, s) for s in slots if s.spec_hp is not None or s.queued] + \
                [(s.watch_key, s) for s in slots if s.watch_key is not None]
        if not noted:
            return None
        return any(key != s.grad_state() for key, s in noted)

    def _submit(self, fn: Callable, slot: Slot, *args: Any) -> None:
        if self._executor is None:
            # One worker: jobs of one parameter (step, then its rollback) run in submission order.
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu_adam")
        self._futures.append((self._executor.submit(fn, slot, *args), slot))

    def _halt(self) -> None:
        if self._phase is SpecPhase.SPECULATING:
            self._to_phase(SpecPhase.HALTED)

    @torch.no_grad()
    def _speculate_job(self, slot: Slot, hp: Hyper, t: int) -> None:
        g = host_grad(slot)
        if self._checks_while_stepping():  # no norm needed: the check rides in the step (ops/_adamw_cpu)
            self._speculate_checked(slot, g, hp, t)
            return
        slot.sumsq = self._check([g])[0]
        if not math.isfinite(slot.sumsq):
            self._halt()  # never step a non-finite gradient; nothing else speculates this step
            return
        if self._phase is SpecPhase.HALTED:
            return
        self._spec_sumsq += slot.sumsq
        if self.max_grad_norm is not None and self._spec_sumsq > self.max_grad_norm**2:
            # Clipping is already certain (this rank's part of the global sum of squares is a lower bound):
            # what we would step now would only be rolled back.  Rule 3's halt, for clipping.
            self._halt()
            self.stats.early_clip_halts += 1
            return
        self._wait_write_back()
        with self._store.resident([slot.index]):
            slot.step_t.fill_(t)
            adamw_step_([slot.spec_master(self._pinned)], [g], [slot.exp_avg], [slot.exp_avg_sq], [slot.step_t], hp)
        self._speculated(slot, hp)

    def _speculated(self, slot: Slot, hp: Hyper) -> None:
        slot.spec_hp = hp
        self._spec_count += 1
        self.stats.speculated_params += 1

    def _speculate_checked(self, slot: Slot, g: torch.Tensor, hp: Hyper, t: int) -> None:
        """The speculative step with the inf/NaN check in the same pass; an inf/NaN undoes the elements it
        stepped (never the parameter itself: rule 1) and halts speculation, as the separate check would."""
        if self._phase is SpecPhase.HALTED:
            return
        self._wait_write_back()
        with self._store.resident([slot.index]):
            slot.step_t.fill_(t)
            args = ([slot.spec_master(self._pinned)], [g], [slot.exp_avg], [slot.exp_avg_sq], [slot.step_t])
            if adamw_checked_(*args, **hp._asdict())[0]:
                adamw_rollback_(*args, hp, nonfinite_untouched=True)
                slot.scratch_current = False
                slot.sumsq = math.inf
                self._halt()
                return
        slot.sumsq = 0.0
        self._speculated(slot, hp)

    @torch.no_grad()
    def _rollback_job(self, slot: Slot) -> None:
        if slot.spec_hp is not None:
            self._undo_speculation([slot])
        slot.sumsq = None

    def _undo_speculation(self, slots: list[Slot]) -> None:
        """Invert applied speculative steps (on the masters they updated, from the snapshots they used)."""
        masters = [s.master_host if s.master_host is not None else s.scratch for s in slots]
        self._rollback_batched(slots, [s.grad_host for s in slots], [s.spec_hp for s in slots], masters)
        self.stats.rolled_back_params += len(slots)
        for s in slots:
            s.spec_hp = None
            s.scratch_current = False  # the inversion is a few ulps off: refresh from the untouched parameter

    def _drain(self) -> None:
        """Wait for every submitted job (each with a timeout); then raise the first job's error, if any."""
        futures, self._futures = self._futures, []
        first: Optional[BaseException] = None
        for fut, slot in futures:
            try:
                fut.result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError:
                first = first or RuntimeError(
                    f"rank {_comm.rank()}: CPUAdam worker job for parameter #{slot.index} "
                    f"{tuple(slot.param.shape)} did not finish in {self.timeout_s=}s"
                )
            except Exception as e:  # noqa: BLE001 - re-raised below, after every other job has finished
                first = first or e
        if first is not None:
            raise first

    def _abandon_speculation(self) -> None:
        """Roll back speculative steps whose step() will not come (zero_grad() after backward, no step())."""
        self._drain()
        slots = [s for s in self._slots.values() if s.spec_hp is not None]
        if slots:
            self._undo_speculation(slots)
            self.stats.rolled_back_steps += 1
        self._end_speculation(self._slots.values())

    def _end_speculation(self, slots) -> None:
        for slot in slots:
            slot.reset_step()
        self._to_phase(SpecPhase.IDLE)
        self._spec_count = 0
        self._spec_sumsq = 0.0
        self._rolled_in_hooks = False


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()
