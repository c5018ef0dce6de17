"""CPUAdam: AdamW whose state lives in CPU memory, stepped speculatively while backward runs, rolled back exactly.

Modules: this one holds the optimizer (setup, ``step()``, ``rollback()``, state dicts); ``_speculation`` the
hook/worker half and its phase enum; ``_batched`` the batched step, its inverse and the write-back; ``_slots`` the
per-parameter bookkeeping and gradient staging; ``_adam_math`` the arithmetic; ``shardtensor.ops._adamw_cpu`` the
checked step's kernel; ``state_store`` where the moments live (host memory, or ``shardtensor.offload.NVMeOffload``).

Trade-offs:
  + optimizer state (fp32 master, exp_avg, exp_avg_sq: 12 bytes/param) leaves the accelerator;
  + with ``speculative=True`` each parameter steps on a CPU worker as soon as its gradient is final, so the step
    overlaps backward; clipping and inf/NaN are validated afterwards and undone by algebraic inversion;
  - speculation keeps a separate fp32 master and a gradient snapshot per parameter (8 bytes/param more on a
    CPU-only model, allocated on the first speculative step), and a rollback costs a pass over the state (rare
    by design: see ``clip_patience``);
  - gradients must be final when the post-accumulate-grad hook fires.  See [Note: speculation rules];
  + the inf/NaN check (``skip_nonfinite``) costs no read of its own: torch's fused kernel cannot make it (its
    ``found_inf`` only *skips* on a flag computed elsewhere), so it rides on the clipping norm or the speculative
    worker (during backward) where they run, and otherwise inside the step (``ops/_adamw_cpu``: torch's fused
    arithmetic, an element whose gradient is inf/NaN left untouched, the count from the same pass);
  - a step skipped for an inf/NaN the checked step only learns of afterwards (on another rank, or in a gradient no
    speculation saw) is undone algebraically, like a rolled-back speculation: p within a few ulps, m and v exact
    at step 1.  Where the kernel cannot be built (``adamw_cpu_kernel_status()``) the check is its own read of
    each gradient before the step, and nothing is stepped then.

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
8. Gradients rewritten between their hooks and ``step()`` (``torch.amp.GradScaler``'s unscale, a clip or a
   transform by hand): the speculations are redone (rule 5), and speculation pauses from the next step on,
   because undoing a step taken on a gradient 65536x too large (GradScaler's default scale) loses the moments
   (see [Note: rollback error]; the first step's undo is exact, its moments start at zero).  While paused the
   hooks still note each final gradient's version; a step whose gradients were not rewritten resumes it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional

import torch

from shardtensor.ops import adamw_cpu_kernel_status

from ._adam_math import finite_checks, hyper_of, refuse_variants, sq_norms
from ._batched import BatchedStepsMixin
from ._slots import LastStep, Slot, SpeculationStats, global_norm, grad_key, host_grad, hypers, is_sharded, \
    local_of, self_mastered, stage_grad
from ._speculation import SpecPhase, SpeculationMixin
from ._state_shards import as_shards, full_optimizer_state_for_torch_helpers, local_rows, snapshot
from .state_store import MOMENTS, HostStore, StateStore

__all__ = ["CPUAdam", "SpeculationStats"]


class CPUAdam(SpeculationMixin, BatchedStepsMixin, torch.optim.Optimizer):
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
        skip_nonfinite: skip the whole step when a gradient (on any rank) holds inf/NaN (see the module
            docstring for how exact the skip is); False gives torch's AdamW behaviour (NaN propagates).
            (Default: True)
        clip_patience: pause speculation after this many clipped steps in a row. (Default: 3)
        process_group: group over which sharded norms and the inf/NaN flag are reduced. (Default: None = world)
        timeout_s: longest wait for one worker job before raising. (Default: 300)
        state_store: where ``exp_avg`` / ``exp_avg_sq`` live (``state_store.StateStore``). (Default: host memory)
    """

    # Its state is this rank's rows as plain tensors (a full-shape plain state is another run's only where the
    # shard's shape differs: a one-row weight's shard has the full shape); read by shardtensor's step checks.
    holds_local_shard_state = True

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
        state_store: Optional[StateStore] = None,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyper-parameters: {lr=} {betas=} {eps=} {weight_decay=}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive or None: {max_grad_norm=}")
        if state_store is not None and not isinstance(state_store, StateStore):
            raise TypeError(f"CPUAdam: state_store must implement optim.state_store.StateStore, got "
                            f"{type(state_store).__name__}")
        # Set before Optimizer.__init__, which calls our add_param_group.
        self.speculative = speculative
        self.max_grad_norm = max_grad_norm
        self.clip_patience = clip_patience
        self.skip_nonfinite = skip_nonfinite
        self.process_group = process_group
        self.timeout_s = timeout_s
        self.stats = SpeculationStats()
        self.last_grad_norm = math.nan  # global gradient norm of the last step (with max_grad_norm only)
        self._pinned = torch.cuda.is_available()  # pinned host buffers: asynchronous device copies
        self._store: StateStore = state_store if state_store is not None else HostStore(self._pinned)
        self._slots: dict[int, Slot] = {}  # id(param) -> slot, created lazily (meta-device models materialise late)
        self._order: dict[int, int] = {}  # id(param) -> index
        self._groups_by_id: Optional[dict[int, dict]] = None
        self._clip_streak = 0
        self._last: Optional[LastStep] = None
        self._h2d_event: Any = None  # write-back of the last step: masters may not change before it completes
        self._init_speculation()
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    # ------------------------------------------------------------------ setup

    def add_param_group(self, param_group: dict) -> None:
        refuse_variants([param_group], "add_param_group")
        super().add_param_group(param_group)
        self._groups_by_id = None
        for p in self.param_groups[-1]["params"]:
            if id(p) in self._order:
                continue
            self._order[id(p)] = len(self._order)
            if self.speculative and p.requires_grad:
                self._hook_speculation(p)

    def _group_of(self, p: torch.Tensor) -> dict:
        if self._groups_by_id is None:
            self._groups_by_id = {id(q): g for g in self.param_groups for q in g["params"]}
        try:
            return self._groups_by_id[id(p)]
        except KeyError:
            raise AssertionError(f"parameter {tuple(p.shape)} is in no param group of this optimizer") from None

    def _slot(self, p: torch.Tensor) -> Slot:
        slot = self._slots.get(id(p))
        if slot is not None:
            return slot
        with torch.no_grad():
            local = local_of(p).detach()
            index = self._order[id(p)]
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = torch.tensor(0.0)
                state.update(self._store.new_moments(index, local.shape))
            own = self_mastered(local)  # see _slots: a CPU fp32 parameter is its own master
            if own:
                state.pop("master", None)
            elif "master" not in state:
                state["master"] = torch.empty(local.shape, dtype=torch.float32, pin_memory=self._pinned)
                state["master"].copy_(local)
            state = self.state[p] = self._store.track(index, state) or state  # (a store of old returns None)
            slot = Slot(param=p, index=index, group=self._group_of(p), sharded=is_sharded(p),
                        master_host=None if own else state["master"], exp_avg=state["exp_avg"],
                        exp_avg_sq=state["exp_avg_sq"], step_t=state["step"])
        self._slots[id(p)] = slot
        return slot

    def _check(self, grads: list[torch.Tensor]) -> list[float]:
        """Squared norms when clipping needs them; else only finiteness (0.0 / inf); else nothing (0.0)."""
        if self.max_grad_norm is not None:
            return sq_norms(grads)
        return finite_checks(grads) if self.skip_nonfinite else [0.0] * len(grads)

    def _paused(self) -> bool:
        clipping_streak = self.max_grad_norm is not None and self._clip_streak >= self.clip_patience
        return self._rewritten_after_hooks or clipping_streak

    # ------------------------------------------------------------------ step

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
        self._to_phase(SpecPhase.VALIDATING)
        speculated, paused = self._spec_count > 0, self._paused()
        all_slots = [self._slot(p) for g in self.param_groups for p in g["params"]]
        slots = sorted((s for s in all_slots if s.param.grad is not None), key=lambda s: s.index)
        rewritten = self._rewritten_since_hooks(slots)
        rolled_back = self._redo_changed_speculations(slots) or self._rolled_in_hooks
        spec = [s for s in slots if s.spec_hp is not None]
        rest = [s for s in slots if s.spec_hp is None]
        checked = self._checks_while_stepping()
        grads = self._host_grads(spec, rest, check=not checked)
        stepped = self._step_checked(rest, grads) if checked else []
        finite, norm = self._global_norm(slots)
        clip = finite and self.max_grad_norm is not None and self.max_grad_norm / (norm + 1e-6) < 1.0
        if spec and (not finite or clip):
            self._undo_speculation(spec)
            rolled_back = True
        if finite:
            to_step = slots if clip else ([] if stepped else rest)  # the checked step already applied rest
            self._apply(slots, to_step, grads, self.max_grad_norm / (norm + 1e-6) if clip else None, stepped)
        else:
            if stepped:  # inf/NaN here or on another rank: undo what the checked step applied
                self._rollback_batched(stepped, [grads[id(s)] for s in stepped], hypers(stepped),
                                       [s.master() for s in stepped], nonfinite_untouched=True)
            self._last = None
        self.stats.record_step(speculated, rolled_back, clip, paused, skipped=not finite)
        if finite and self.max_grad_norm is not None:
            self._clip_streak = self._clip_streak + 1 if clip else 0  # rule 7
        if rewritten is not None:
            self._rewritten_after_hooks = rewritten  # rule 8
        hooks_seen = max((s.hooks for s in all_slots), default=0)
        if hooks_seen:
            self._expected_hooks = hooks_seen  # rule 5
        self._end_speculation(all_slots)
        self.last_grad_norm = norm if self.max_grad_norm is not None else math.nan  # only clipping computes it
        self._store.end_step(self.process_group)  # raises, on every rank, what the store's I/O hit in this step
        return loss

    def _redo_changed_speculations(self, slots: list[Slot]) -> bool:
        """Undo speculations whatever the norm says: the gradient changed since its snapshot (rule 5), or the
        group's hyper-parameters did (rule 4).  Returns whether any was undone."""
        redo = [s for s in slots if s.spec_hp is not None
                and (s.grad_state() != s.grad_key or hyper_of(s.group) != s.spec_hp)]
        if redo:
            self._undo_speculation(redo)
        return bool(redo)

    def _host_grads(self, spec: list[Slot], rest: list[Slot], check: bool = True) -> dict[int, torch.Tensor]:
        """id(slot) -> CPU fp32 gradient: the snapshot of a speculation; for the rest the gradient itself when it
        is one, else a staged copy (all copies issued before the first wait).  Checks the rest (sumsq) unless
        ``check`` is False (the checked step will)."""
        out = {id(s): s.grad_host for s in spec}
        staged = []
        for s in rest:
            g = s.grad_local()
            if self_mastered(g):
                out[id(s)] = g
            else:
                stage_grad(s, g, self._pinned)
                staged.append(s)
        for s in staged:
            out[id(s)] = host_grad(s)
        if check:
            for s, sq in zip(rest, self._check([out[id(s)] for s in rest])):
                s.sumsq = sq
        return out

    def _checks_while_stepping(self) -> bool:
        """The inf/NaN check rides in the step itself (``ops/_adamw_cpu``): no clipping norm to ride on, and
        the compiled kernel is there (``adamw_cpu_kernel_status()``)."""
        return self.max_grad_norm is None and self.skip_nonfinite and adamw_cpu_kernel_status() == "ok"

    def _step_checked(self, rest: list[Slot], grads: dict) -> list[Slot]:
        """Step ``rest`` before the global verdict, each element only where its gradient is finite, and set
        each slot's ``sumsq`` to 0.0 or inf from the same pass; returns the slots stepped (to undo on a skip).

        Nothing is stepped when this rank already knows the step is skipped: the speculative worker found an
        inf/NaN in a gradient that has not changed since, so the skip stays exact (no step, no rollback).
        """
        if any(s.sumsq is not None and not math.isfinite(s.sumsq) and s.grad_state() == s.grad_key
               for s in rest):
            for s in rest:  # the verdict is known; the others' finiteness no longer matters
                s.sumsq = math.inf if s.sumsq is None else s.sumsq
            return []
        if not rest:
            return []
        _, bad = self._step_batched(rest, [grads[id(s)] for s in rest], checked=True)
        for s, n in zip(rest, bad):
            s.sumsq = 0.0 if n == 0 else math.inf
        return rest

    def _global_norm(self, slots: list[Slot]) -> tuple[bool, float]:
        if self.max_grad_norm is None and not self.skip_nonfinite:
            return True, math.nan  # nothing to validate: no collective either
        return global_norm(slots, self.process_group)

    def _apply(self, slots: list[Slot], to_step: list[Slot], grads: dict, coef: Optional[float],
               stepped_before: list[Slot]) -> None:
        """Step ``to_step`` (clipped by ``coef``), write every slot back, and remember what rollback() needs.
        Slots in neither ``to_step`` nor ``stepped_before`` (the checked step's) are committed speculations."""
        step_grads = [grads[id(s)] for s in to_step]
        if coef is not None:  # clip_grad_norm_'s rule and arithmetic
            torch._foreach_mul_(step_grads, coef)
        step_hps, _ = self._step_batched(to_step, step_grads) if to_step else ([], [])
        stepped = {id(s) for s in to_step} | {id(s) for s in stepped_before}
        self._write_back(slots, committed=[s for s in slots if id(s) not in stepped])
        used = [grads[id(s)] for s in slots]
        hps = step_hps if len(to_step) == len(slots) else hypers(slots)  # to_step is slots or a subset
        self._last = LastStep(slots, used, hps, [(grad_key(g), s.grad_state()) for g, s in zip(used, slots)])

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
        changed = [s.index for s, g, k in zip(last.slots, last.grads, last.grad_keys)
                   if (grad_key(g), s.grad_state()) != k]
        if changed:
            raise RuntimeError(f"CPUAdam.rollback(): gradients of parameters {changed} changed since step()")
        self._rollback_batched(last.slots, last.grads, last.hps, [s.master() for s in last.slots])
        for s in last.slots:
            s.scratch_current = False
        self._write_back(last.slots, committed=[])
        self._last = None
        self.stats.user_rollbacks += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also drops what ``rollback()`` would need, and undoes speculation that no ``step()`` will validate."""
        self._abandon_speculation()
        self._last = None
        super().zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """torch's state dict; moments the store may have swapped out are replaced by in-memory copies."""
        self._drain()
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for i, state in list(sd["state"].items()):
            slot = self._slots.get(id(params[i]))
            copies = self._store.export(slot.index) if slot is not None else None
            # A new dict (torch packs the live ones, which keep the store's tensors); copies where speculating.
            sd["state"][i] = as_shards((snapshot if self.speculative else dict)({**state, **(copies or {})}), params[i])
        return full_optimizer_state_for_torch_helpers(self, sd)  # torch's full_state_dict helpers: full tensors

    def load_state_dict(self, state_dict: dict) -> None:
        """Load; state re-homed on the CPU in fp32 from the given tensors (the base class casts to a bf16 param's)."""
        refuse_variants(state_dict["param_groups"], "load_state_dict")
        params = [p for g in self.param_groups for p in g["params"]]
        indices = [i for g in state_dict["param_groups"] for i in g["params"]]
        rows = local_rows(type(self).__name__, [(p, state_dict["state"].get(i, {})) for p, i in zip(params, indices)])
        given = {id(p): state for p, state in rows}
        self._abandon_speculation()
        state_dict = {**state_dict, "state": {**state_dict["state"], **{
            i: state for i, (_, state) in zip(indices, rows) if i in state_dict["state"]}}}
        super().load_state_dict(state_dict)  # (torch's checks first: a refused load leaves the store as it was)
        self._store.reset()
        for p, state in self.state.items():
            for key in (*MOMENTS, "master"):
                if key in state:
                    state[key] = torch.empty(local_of(p).shape, dtype=torch.float32, pin_memory=self._pinned).copy_(
                        given.get(id(p), {}).get(key, state[key]))
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
