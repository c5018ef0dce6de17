"""How CPUAdam's slots step: one fused call per param group and resident chunk of the state store, the inverse of
such a step, and the write-back of masters into parameters.  Split from ``cpu_adam`` (which decides *what* steps
and when) so that each module keeps one job; ``CPUAdam`` provides ``_store``, ``_pinned`` and ``_h2d_event``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from shardtensor.ops import adamw_checked_

from ._adam_math import Hyper, adamw_rollback_, adamw_step_
from ._slots import Slot, hypers

_ONE = torch.tensor(1.0)  # step-count increment (torch.optim's fused path does the same)


class BatchedStepsMixin:
    """The batched step, its inverse and the write-back (see the module docstring)."""

    def _wait_write_back(self) -> None:
        if self._h2d_event is not None:
            self._h2d_event.synchronize()  # the previous step's H2D reads the masters / staging buffers

    def _by_chunk(self, slots: list[Slot], key: Callable[[int], Any]) -> Iterable[list[int]]:
        """Positions in ``slots``, resident chunk by chunk (the store's plan), grouped by ``key(position)``."""
        pos = {s.index: i for i, s in enumerate(slots)}
        for keys in self._store.chunks([s.index for s in slots]):
            groups: dict[Any, list[int]] = {}
            for k in keys:
                groups.setdefault(key(pos[k]), []).append(pos[k])
            yield from groups.values()

    @torch.no_grad()
    def _step_batched(self, slots: list[Slot], grads: list[torch.Tensor],
                      checked: bool = False) -> tuple[list[Hyper], list[int]]:
        """Step ``slots`` with ``grads`` on their masters, one fused call per param group and resident chunk.
        ``checked``: only where the gradient is finite; also returns each slot's count of inf/NaN elements."""
        self._wait_write_back()
        hps = hypers(slots)
        bad = [0] * len(slots)
        for idx in self._by_chunk(slots, lambda i: id(slots[i].group)):
            steps = [slots[i].step_t for i in idx]
            if len(steps) <= 4:
                for t in steps:  # a short list: the foreach op's fixed cost (about 15 us) is the larger
                    t.add_(1.0)
            else:
                torch._foreach_add_(steps, _ONE, alpha=1.0)  # the tensor overload: 3x cheaper than a Python scalar
            lists = ([slots[i].master() for i in idx], [grads[i] for i in idx], [slots[i].exp_avg for i in idx],
                     [slots[i].exp_avg_sq for i in idx], steps)
            if checked:
                for i, n in zip(idx, adamw_checked_(*lists, **hps[idx[0]]._asdict())):
                    bad[i] = n
            else:
                adamw_step_(*lists, hps[idx[0]])
        for s in slots:
            s.scratch_current = False  # a self-mastered parameter moved; its speculative copy did not
        return hps, bad

    @torch.no_grad()
    def _rollback_batched(self, slots: list[Slot], grads: list[torch.Tensor], hps: list[Hyper],
                          masters: list[torch.Tensor], nonfinite_untouched: bool = False) -> None:
        """Invert steps of ``slots`` (which updated ``masters`` with ``grads``), one call per hyper-parameter set."""
        for idx in self._by_chunk(slots, lambda i: hps[i]):
            adamw_rollback_([masters[i] for i in idx], [grads[i] for i in idx], [slots[i].exp_avg for i in idx],
                            [slots[i].exp_avg_sq for i in idx], [slots[i].step_t for i in idx], hps[idx[0]],
                            nonfinite_untouched=nonfinite_untouched)
        for s in slots:
            s.scratch_current = False

    @torch.no_grad()
    def _write_back(self, slots: list[Slot], committed: list[Slot]) -> None:
        """Copy updated masters into the parameters (asynchronously from pinned memory on CUDA): every slot with
        a master of its own, and the committed speculations of self-mastered ones."""
        cuda = False
        for slot in slots:
            if slot.master_host is None:
                continue
            local = slot.local()
            src = slot.master_host
            if local.device.type == "cuda":
                cuda = True
                if local.dtype != torch.float32:
                    if slot.stage_pinned is None:
                        slot.stage_pinned = torch.empty(local.shape, dtype=local.dtype, pin_memory=self._pinned)
                    src = slot.stage_pinned.copy_(src)  # cast on the CPU: half the bytes cross
            local.copy_(src, non_blocking=local.device.type == "cuda")
        for slot in committed:
            if slot.master_host is None:
                slot.local().copy_(slot.scratch)  # scratch and parameter are equal again (scratch_current)
        if cuda:
            self._h2d_event = torch.cuda.Event()
            self._h2d_event.record()
