"""``NVMeCPUAdam``: ``CPUAdam`` with its moments in an ``NVMeOffload`` (see ``nvme.py``)."""

from __future__ import annotations

import weakref
from typing import Any, Iterable

from shardtensor.optim import CPUAdam

from .nvme import NVMeOffload

__all__ = ["NVMeCPUAdam"]


class NVMeCPUAdam(CPUAdam):
    """``CPUAdam`` whose ``exp_avg`` / ``exp_avg_sq`` live in ``offload`` (files, within a resident budget).

    Same arguments as ``CPUAdam`` plus ``offload``; the same as ``CPUAdam(params, state_store=offload)``.  Steps
    run over chunks of parameters whose state fits half the budget, the next chunk read ahead while one steps;
    speculative steps (on CPUAdam's worker) make their one parameter's state resident for the step.  One
    ``NVMeOffload`` per optimizer (they may share a directory).
    """

    def __init__(self, params: Iterable, offload: NVMeOffload, **kwargs: Any):
        if not isinstance(offload, NVMeOffload):
            raise TypeError(f"NVMeCPUAdam: offload must be an NVMeOffload, got {type(offload).__name__}")
        _adopt(offload, self)
        self.offload = offload
        super().__init__(params, state_store=offload, **kwargs)


_OWNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # NVMeOffload -> weakref to its optimizer


def _adopt(offload: NVMeOffload, optimizer: NVMeCPUAdam) -> None:
    """An offload keys its units by parameter index: a second optimizer's parameter 0 met the first's ("unit 0 is
    already registered" at its first step, naming neither).  The state of an optimizer that was dropped goes."""
    previous = _OWNERS.get(offload)
    if previous is not None and previous() is not None:
        raise ValueError("NVMeCPUAdam: this NVMeOffload already holds the state of another NVMeCPUAdam (its units "
                         "are keyed by parameter index, so two optimizers' states would collide). Fix: give each "
                         "optimizer its own NVMeOffload(path, ...); they may share a directory.")
    if previous is not None:
        offload.unregister_all()
    _OWNERS[offload] = weakref.ref(optimizer)
